"""What a checkpoint directory holds, read without torch.

The CLI checks a checkpoint here before torch loads (one line and exit 2 in milliseconds
for a missing, corrupt or mismatched one), and the writer uses the same list of names to
remove only what dflash itself wrote (a user's file placed in `checkpoint/` is never
deleted). Nothing here unpickles anything.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from .inputs import read_json_object
from .layer_ids import default_layer_ids

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
STATE_TENSORS = "training_state.safetensors"   # optimizer moments, RNG state (no pickle)
STATE_TREE = "training_state.json"             # the structure around them, and plain values
LEGACY_STATE = "training_state.pt"             # earlier versions: read with torch's weights_only loader
TRAINER_STATE = "trainer_state.json"           # step, tokens, loss history (human readable)
WRITTEN = (CONFIG, WEIGHTS, STATE_TENSORS, STATE_TREE, LEGACY_STATE, TRAINER_STATE)
# an export carries its run's held-out eval prompts (a file `dflash eval --prompts-from` reads) and
# the eval settings they were scored with: `dflash eval --checkpoint EXPORT` scores it on them
EVAL_PROMPTS, EVAL_SETTINGS = "eval_prompts.jsonl", "eval_settings.json"
EXPORT_WRITTEN = (CONFIG, WEIGHTS, "README.md", EVAL_PROMPTS, EVAL_SETTINGS)  # what `dflash export` writes into its dir


class CheckpointError(ValueError):
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


def check_safetensors(f: Path) -> None:
    """A safetensors file is whole: its header parses and every tensor's bytes are there.
    A truncated copy (an interrupted download or scp) is caught here, not by a traceback
    from deep inside the loader."""
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("shorter than its header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError("header runs past the end of the file")
            header = json.loads(fh.read(n))
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: no {f.name}") from None
    except (OSError, ValueError, struct.error) as e:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} is corrupt ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} is corrupt (header is not an object)")
    end = max((v["data_offsets"][1] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} is truncated "
                              f"({size} bytes, its header needs {8 + n + end})")


def check_readable(path: str | os.PathLike) -> tuple[Path, dict]:
    """(resolved dir, its config) of a checkpoint whose files are whole; torch-free."""
    p = resolve(path)
    raw = read_config(p)
    check_safetensors(p / WEIGHTS)
    return p, raw


# -- removing only what dflash wrote ---------------------------------------------------------
def foreign_entries(d: Path, written=WRITTEN) -> list[str]:
    """Entries of a checkpoint (or export) dir that dflash did not write there."""
    try:
        return sorted(e.name for e in d.iterdir() if e.name not in written)
    except OSError:
        return []


def remove_written(d: Path, written=WRITTEN) -> Path | None:
    """Delete the files dflash writes into a checkpoint (or export) dir, then the dir if that
    empties it. Anything else is kept: the dir is renamed aside (returned), never deleted."""
    if not d.is_dir():
        return None
    for name in written:
        try:
            (d / name).unlink()
        except FileNotFoundError:
            pass
    try:
        d.rmdir()
        return None
    except OSError:  # not empty: a file dflash did not write
        kept = d.with_name(f"{d.name}.kept-{os.getpid()}")
        n = 0
        while kept.exists():
            n += 1
            kept = d.with_name(f"{d.name}.kept-{os.getpid()}-{n}")
        os.replace(d, kept)
        return kept


def clean_stale_temps(dst: Path) -> list[Path]:
    """Temp dirs a killed save left beside `dst` (`.checkpoint.tmp-*`, a whole checkpoint
    each). Only called under the run dir's lock, so no other save can be writing them."""
    removed = []
    for t in dst.parent.glob(f".{dst.name}.tmp-*"):
        if t.is_dir() and not foreign_entries(t):
            remove_written(t)
            removed.append(t)
    return removed


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
    try:  # the same local model dir, moved or named another way
        return pa.resolve() == pb.resolve() or \
            (pa / CONFIG).read_bytes() == (pb / CONFIG).read_bytes()
    except OSError:
        return False
