"""What a checkpoint directory holds, read without torch.

The CLI checks a checkpoint here before torch loads (one line and exit 2 in milliseconds
for a missing, corrupt or mismatched one), and the writer uses the same list of names to
remove only what dflash itself wrote (a user's file placed in `checkpoint/` is never
deleted). Nothing here unpickles anything.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..errors import UserError
from .inputs import MAX_JSON_FILE_BYTES, SafetensorsHeaderError, read_json_object, read_safetensors_header
from .layer_ids import default_layer_ids

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
STATE_TENSORS = "training_state.safetensors"   # optimizer moments, RNG state (no pickle)
STATE_TREE = "training_state.json"             # the structure around them, and plain values
LEGACY_STATE = "training_state.pt"             # earlier versions: read with torch's weights_only loader
TRAINER_STATE = "trainer_state.json"           # step, tokens, loss history (human readable)
WRITTEN = (CONFIG, WEIGHTS, STATE_TENSORS, STATE_TREE, LEGACY_STATE, TRAINER_STATE)
EXPORT_MARKER = ".dflash-export"               # says that dflash export wrote the dir (and may replace it)
# an export carries its run's held-out eval prompts (a file `dflash eval --prompts-from` reads) and
# the eval settings they were scored with: `dflash eval --checkpoint EXPORT` scores it on them
EVAL_PROMPTS, EVAL_SETTINGS = "eval_prompts.jsonl", "eval_settings.json"
EXPORT_WRITTEN = (CONFIG, WEIGHTS, "README.md", EVAL_PROMPTS, EVAL_SETTINGS, EXPORT_MARKER)  # what `dflash export` writes


class CheckpointError(UserError):
    """A checkpoint that cannot be used: one line naming it and what is wrong (exit 2)."""


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint dir to read: the path itself, or the `.old` left by an interrupted swap."""
    p = Path(path).expanduser()
    if (p / CONFIG).is_file():
        return p
    old = p.with_name(p.name + ".old")
    if (old / CONFIG).is_file():
        return old
    if p.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: is a file (expected a directory with {CONFIG})")
    raise CheckpointError(f"checkpoint {str(path)!r}: no {CONFIG} there (expected RUN/checkpoint from dflash "
                          f"train, or a DFlash drafter dir such as dflash export writes)")


def read_config(path: Path) -> dict:
    """`config.json` as a dict, or one line saying why not."""
    return read_json_object(path / CONFIG, f"checkpoint {str(path)!r}", CheckpointError)


def check_safetensors(f: Path) -> dict:
    """A safetensors file is whole and its header tells the truth (inputs.read_safetensors_header:
    known dtypes, shapes that match their offsets, offsets that tile the data, the data ending
    where the file does). A truncated copy (an interrupted download or scp) or a crafted header
    is one line here, not a traceback from deep inside the loader. Returns the tensors'
    ``{name: (dtype, shape, (begin, end))}``."""
    try:
        tensors, _, _ = read_safetensors_header(f)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: no {f.name}") from None
    except SafetensorsHeaderError as e:
        why = "is truncated" if str(e).startswith("truncated") else "is corrupt"
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} {why} ({e})") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} is unreadable ({e.strerror or e})") from None
    return tensors


def check_drafter_bounds(path, raw: dict) -> None:
    """A checkpoint config.json that no drafter can have (100000 layers, zero heads, a
    trillion-wide MLP): one line before anything is built (checkpoint/export_format.BOUNDS)."""
    from ..checkpoint.export_format import bounds_error

    err = bounds_error(raw, f"checkpoint {str(path)!r}: config.json")
    if err:
        raise CheckpointError(err)


_FLOAT_DTYPES = ("F32", "F16", "BF16")
_INDEX_TENSORS = ("draft_ids",)   # a draft vocabulary's token ids (d2t in the served format): integers


def header_mismatch(want: dict, headers: dict, rename=lambda k: k) -> str | None:
    """The first way safetensors headers ({file: check_safetensors(file)}) do not hold exactly the tensors
    ``want`` ({our name: shape}) in a float dtype; None when they do. ``rename`` maps a file's
    name to ours (None: a tensor a reader may ship and we drop, e.g. the target's lm_head)."""
    seen = {}
    for fname, header in headers.items():
        for k, (dtype, shape, _) in header.items():
            try:
                ours = rename(k)
            except ValueError as e:  # the format's own name check (FormatError)
                return f"{fname}: {e}"
            if ours is None:
                continue
            if ours not in want:
                return f"{fname}: tensor {k!r} is not part of the drafter its config describes"
            if dtype not in _FLOAT_DTYPES and not (ours in _INDEX_TENSORS and dtype in ("I64", "I32")):
                return f"{fname}: tensor {k!r} has dtype {dtype!r} (expected one of {', '.join(_FLOAT_DTYPES)})"
            if tuple(shape) != want[ours]:
                return f"{fname}: tensor {k!r} has shape {list(shape)}; its config implies {list(want[ours])}"
            seen[ours] = k
    missing = sorted(set(want) - set(seen))
    if missing:
        return (f"weights missing for this config: {', '.join(missing[:4])}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    return None


def check_readable(path: str | os.PathLike) -> tuple[Path, dict]:
    """(resolved dir, its config) of a checkpoint whose files are whole; torch-free."""
    p = resolve(path)
    raw = read_config(p)
    check_drafter_bounds(path, raw)
    check_safetensors(p / WEIGHTS)
    return p, raw


# -- does a checkpoint fit the run that wants to resume from it? --------------------------
def resume_mismatch(ckpt_config: dict, model_cfg, target_layers: int | None) -> str | None:
    """The first field in which the checkpoint differs from what this run would build, as
    one phrase; None when they agree. ``model_cfg``: the run's ModelConfig."""
    run_model = (ckpt_config.get("dflash_run") or {}).get("model") or {}
    trained_for = run_model.get("target", ckpt_config.get("target"))
    if trained_for is not None and not _same_target(trained_for, model_cfg.target):
        return (f"model.target: the checkpoint was trained for target {trained_for!r}, this run names "
                f"{model_cfg.target!r}")
    if trained_for is not None and trained_for.startswith("tiny-") and \
            run_model.get("target_seed", model_cfg.target_seed) != model_cfg.target_seed:
        return (f"model.target_seed: the checkpoint's target has seed {run_model.get('target_seed')}, "
                f"this run's {model_cfg.target_seed}")
    pairs = [("model.block_size", ckpt_config.get("block_size"), model_cfg.block_size),
             ("model.num_layers", ckpt_config.get("num_hidden_layers"), model_cfg.num_layers),
             ("model.copy_head", ckpt_config.get("copy_head", False), model_cfg.copy_head)]
    ids = model_cfg.target_layer_ids
    if not ids and target_layers is not None:
        ids = default_layer_ids(target_layers, model_cfg.num_target_layers)
    if ids:
        pairs.append(("model.target_layer_ids", ckpt_config.get("target_layer_ids"), list(ids)))
    for key, theirs, ours in pairs:
        if theirs is not None and theirs != ours:
            return f"{key}: the checkpoint has {theirs!r}, this run {ours!r}"
    return None


def _same_target(a: str, b: str) -> bool:
    if a == b:
        return True
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    try:  # the same local model dir, moved or named another way (configs compared only when of a sane size)
        return pa.resolve() == pb.resolve() or \
            max((pa / CONFIG).stat().st_size, (pb / CONFIG).stat().st_size) <= MAX_JSON_FILE_BYTES and \
            (pa / CONFIG).read_bytes() == (pb / CONFIG).read_bytes()
    except OSError:
        return False
