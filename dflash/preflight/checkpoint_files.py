"""What dflash writes (checkpoint, export and capture dirs), in one place, without torch:

- the names of its files (WRITTEN, EXPORT_WRITTEN) and the bounds any drafter config must
  keep (BOUNDS, bounds_error), whoever wrote it;
- reading a checkpoint back: the CLI checks one here before torch loads (one line and exit 2
  in milliseconds for a missing, corrupt or mismatched one); nothing here unpickles anything;
- writing: what dflash writes is readable by others (plain_modes), and only what it wrote is
  ever removed, by the same list of names (a user's file placed in `checkpoint/` is kept).
  The CLI tidies a run dir with it before torch loads; the writers in checkpoint/ use it too.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from .. import family
from ..errors import UserError
from .inputs import (MAX_JSON_FILE_BYTES, NotRegularFile, SafetensorsHeaderError, open_regular, read_json_object,
                     read_safetensors_header)
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
# the k the engine's verdict measured fastest for the weights beside it (engine/kchoice.py): an export
# writes none, and a new export removes the old one's
SERVING_K = "serving_k.json"
EXPORT_WRITTEN = (CONFIG, WEIGHTS, "README.md", EVAL_PROMPTS, EVAL_SETTINGS, EXPORT_MARKER, SERVING_K)  # what `dflash export` writes


# What a drafter may be, whoever wrote its config: checked before any module is built, so a
# crafted config.json (100000 layers, intermediate_size 1e12, zero heads) is one line, not
# an allocation of hundreds of GB. Generous: the largest targets (hidden 16384, 128 heads,
# intermediate 53248, vocabularies of 262k) fit with room; the published drafters have 1-8
# layers and blocks of 8-16.
BOUNDS = {"hidden_size": (1, 65536), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
          "head_dim": (2, 1024), "intermediate_size": (1, 1 << 20), "vocab_size": (1, 1 << 23),
          "num_hidden_layers": family.DRAFTER_LAYERS, "block_size": family.BLOCK_SIZES}
MAX_PARAMETERS = 20_000_000_000   # a drafter larger than this is not a drafter (the paper's: ~1 B for 8B)
# config.RANGES takes these for model.* too: one bound, whether a value comes from a config or a drafter dir.
# A sliding window past any context a target has is a typo (or a crafted config), not a window.
MAX_SLIDING_WINDOW = 1 << 24
COPY_MAX_NGRAM = 3  # model/prompt_lookup.py MAX_NGRAM: the copy head's bias has a column per match length


def parameter_count(fields: dict) -> int:
    """The drafter's trainable parameters from its config alone: DrafterLayer x n, fc, the
    norms, its family's own parts (family/: DFlash2's convolutions and selector, DSpark's
    heads), a copy head. (A draft vocabulary's head is a frozen buffer, not a parameter:
    `training_bytes` counts it.)"""
    h, nh, nkv, hd = (fields[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim"))
    layer = h * nh * hd * 2 + h * nkv * hd * 2 + 3 * h * fields["intermediate_size"] + 2 * h + 2 * hd
    copy = (fields["block_size"] - 1) * (COPY_MAX_NGRAM + 1) + h if fields.get("copy_head") else 0
    return fields["num_hidden_layers"] * layer + len(fields["target_layer_ids"]) * h * h + 2 * h + copy \
        + family.of(fields).parameters(fields)


def training_bytes(fields: dict) -> int:
    """What training a drafter of this config holds at the least, from the config alone: every
    parameter in float32 (the master weights, in whatever dtype the target computes), its
    gradient and AdamW's two moments (16 bytes a parameter), plus a draft vocabulary's frozen
    head and ids (float32 rows, int64 ids). Activations, the target and DDP's buckets come on top."""
    dv = int(fields.get("draft_vocab_size") or 0)
    return 16 * parameter_count(fields) + dv * (4 * fields["hidden_size"] + 8)


def bounds_error(fields: dict, where: str) -> str | None:
    """One line naming the first field of a drafter config that no drafter can have, or None.
    A field that is absent is not judged here (the loader names a config that lacks one)."""
    for key, (lo, hi) in BOUNDS.items():
        v = fields.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
            return f"{where}: {key}={v!r}: expected an integer in [{lo}, {hi}]"
    if any(fields.get(k) is None for k in (*BOUNDS, "target_layer_ids", "mask_token_id")):
        return None
    if fields["num_attention_heads"] % fields["num_key_value_heads"]:
        return (f"{where}: num_attention_heads={fields['num_attention_heads']} is not a multiple of "
                f"num_key_value_heads={fields['num_key_value_heads']}")
    if fields["head_dim"] % 2:
        return f"{where}: head_dim={fields['head_dim']}: expected an even number (rotary embedding)"
    ids = fields.get("target_layer_ids")
    if not isinstance(ids, list) or not 1 <= len(ids) <= 256 or \
            any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < 4096 for i in ids):
        return f"{where}: target_layer_ids={str(ids)[:80]}: expected 1-256 layer ids in [0, 4096)"
    mask = fields.get("mask_token_id")
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < fields["vocab_size"]:
        return f"{where}: mask_token_id={mask!r}: expected an id in [0, vocab_size={fields['vocab_size']})"
    dv = fields.get("draft_vocab_size")
    if dv is not None and (isinstance(dv, bool) or not isinstance(dv, int) or not 0 <= dv < fields["vocab_size"]):
        return (f"{where}: draft_vocab_size={dv!r}: expected an integer in [0, vocab_size={fields['vocab_size']}) "
                f"(0: the full vocabulary)")
    for key, lo, hi in (("rms_norm_eps", 0.0, 0.1), ("rope_theta", 0.0, 1e12)):
        v = fields.get(key, lo + 1e-6)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo < v <= hi:
            return f"{where}: {key}={v!r}: expected a finite number in ({lo:g}, {hi:g}]"
    arch = fields.get("arch", family.DEFAULT)
    if arch not in family.NAMES:
        return f"{where}: arch={arch!r}: expected {', '.join(family.NAMES)}"
    err = family.get(arch).fields_error(fields, where)  # its own fields, by its own bounds (absent: not judged)
    if err:
        return err
    win = fields.get("sliding_window", 0)
    if isinstance(win, bool) or not isinstance(win, int) or not 0 <= win <= MAX_SLIDING_WINDOW:
        return f"{where}: sliding_window={win!r}: expected an integer in [0, {MAX_SLIDING_WINDOW}] (0: no sliding layers)"
    n = parameter_count(fields)
    if n > MAX_PARAMETERS:
        return f"{where}: the config describes a drafter of {n:,} parameters (at most {MAX_PARAMETERS:,} accepted)"
    dv = fields.get("draft_vocab_size") or 0
    if isinstance(dv, bool) or not isinstance(dv, int) or not 0 <= dv <= fields["vocab_size"]:
        return f"{where}: draft_vocab_size={dv!r}: expected an integer in [1, vocab_size={fields['vocab_size']}]"
    return None


# -- reading a checkpoint back --------------------------------------------------------------
class CheckpointError(UserError):
    """A checkpoint that cannot be used: one line naming it and what is wrong (exit 2)."""


def resolve(path: str | os.PathLike) -> Path:
    """The checkpoint dir to read: the path itself, or the `.old` left by an interrupted swap."""
    p = Path(path).expanduser()
    if (p / CONFIG).is_file():
        return p
    if not str(path).strip():
        raise CheckpointError(f"checkpoint {str(path)!r}: an empty path (expected a directory with {CONFIG})")
    named = p if p.name else p.absolute()  # ".", "/": the dir they name (the root has no .old beside it)
    old = named.with_name(named.name + ".old") if named.name else None
    if old is not None and (old / CONFIG).is_file():
        return old
    if (p / CONFIG).exists():  # a FIFO or a device: never opened (a FIFO blocks the reader forever)
        raise CheckpointError(f"checkpoint {str(path)!r}: {CONFIG} is not a regular file (a FIFO, a device, a socket "
                              f"or a directory)")
    if p.is_file():
        raise CheckpointError(f"checkpoint {str(path)!r}: is a file (expected a directory with {CONFIG})")
    raise CheckpointError(f"checkpoint {str(path)!r}: no {CONFIG} there (expected RUN/checkpoint from dflash "
                          f"train, or a DFlash drafter dir such as dflash export writes)")


def read_config(path: Path) -> dict:
    """`config.json` as a dict, or one line saying why not (shape_error)."""
    raw = read_json_object(path / CONFIG, f"checkpoint {str(path)!r}", CheckpointError)
    err = shape_error(raw)
    if err:
        raise CheckpointError(f"checkpoint {str(path)!r}: config.json: {err}")
    return raw


RUN_SECTIONS = ("model", "data", "train", "eval", "pipeline", "telemetry")  # config.Config's sections


def shape_error(raw: dict) -> str | None:
    """The first top-level field of a drafter's config.json whose JSON type no reader can use
    (`"architectures": 5`, `"layer_types": "sliding_attention"`, a `dflash_run` that is not a
    run's config), or None: named once, before any reader indexes into it. The run config's
    values, field by field, are config.run_config_error's (a floor above this one)."""
    for key in ("architectures", "layer_types"):
        v = raw.get(key)
        if v is not None and (not isinstance(v, list) or not all(isinstance(x, str) for x in v)):
            return f"{key}={str(v)[:80]}: expected a list of names"
    if raw.get("target") is not None and not isinstance(raw["target"], str):
        return f"target={str(raw['target'])[:80]}: expected the target's name or path"
    run = raw.get("dflash_run")
    if run is not None and not isinstance(run, dict):
        return f"dflash_run={str(run)[:60]!r}: expected a mapping (the run's config)"
    for section in RUN_SECTIONS:
        v = (run or {}).get(section)
        if v is not None and not isinstance(v, dict):
            return f"dflash_run.{section}={str(v)[:60]!r}: expected a mapping"
    target = ((run or {}).get("model") or {}).get("target")
    if target is not None and not isinstance(target, str):
        return f"dflash_run.model.target={str(target)[:80]!r}: expected a string"
    return None


# what a training checkpoint's config.json always holds (DrafterConfig.to_dict): absent, a
# reader would build the default in its place (block 16 for a drafter trained at 8)
CHECKPOINT_REQUIRED = (*BOUNDS, "target_layer_ids", "mask_token_id")


def check_safetensors(f: Path, *, values: bool = False) -> dict:
    """A safetensors file is a regular file (a FIFO would block its reader forever), whole,
    and its header tells the truth (inputs.read_safetensors_header: known dtypes, shapes that
    match their offsets, offsets that tile the data, the data ending where the file does). A
    truncated copy (an interrupted download or scp) or a crafted header is one line here, not
    a traceback from deep inside the loader. ``values``: every float in it is finite too
    (`nonfinite`). Returns the tensors' ``{name: (dtype, shape, (begin, end))}``."""
    try:
        tensors, _, start = read_safetensors_header(f)
        bad = nonfinite(f, tensors, start) if values else None
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: no {f.name}") from None
    except SafetensorsHeaderError as e:
        why = "is truncated" if str(e).startswith("truncated") else "is corrupt"
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} {why} ({e})") from None
    except NotRegularFile as e:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} is {e}") from None
    except OSError as e:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name} is unreadable ({e.strerror or e})") from None
    if bad:
        raise CheckpointError(f"checkpoint {str(f.parent)!r}: {f.name}: {bad} (a diverged or damaged drafter: "
                              f"nothing to evaluate, serve or train from)")
    return tensors


# NaN and Inf are the values whose exponent bits are all set (Inf: a zero mantissa): read from
# the bits, bf16 needs no torch. dtype -> (unsigned view, exponent mask, mantissa mask)
_FLOAT_BITS = {"F64": ("<u8", 0x7FF0000000000000, 0x000FFFFFFFFFFFFF), "F32": ("<u4", 0x7F800000, 0x007FFFFF),
               "F16": ("<u2", 0x7C00, 0x03FF), "BF16": ("<u2", 0x7F80, 0x007F)}
_CHUNK_BYTES = 16 << 20       # what is read at a time: memory stays bounded whatever a tensor's size
_FINITE_FILES: set = set()    # (device, inode, size, mtime) of files read whole and found finite, this process


def nonfinite(f: Path, tensors: dict, data_start: int) -> str | None:
    """"tensor NAME holds N NaN and M Inf of its K values" for the first float tensor of a
    safetensors file (its checked header: ``tensors``, ``data_start``) that holds any, else
    None. Streamed in chunks of 16 MiB; a file found finite is not read again by this process
    (eval reads a dir's files when it inspects and when it loads it) until it changes."""
    import numpy as np

    with open_regular(f) as fh:
        st = os.fstat(fh.fileno())
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if key in _FINITE_FILES:
            return None
        buf = bytearray(_CHUNK_BYTES)
        for name, (dtype, _, (begin, end)) in sorted(tensors.items(), key=lambda kv: kv[1][2]):
            if dtype not in _FLOAT_BITS:
                continue
            view, exp, mant = _FLOAT_BITS[dtype]
            nan = inf = 0
            fh.seek(data_start + begin)
            left = end - begin
            while left:
                n = fh.readinto(memoryview(buf)[:min(left, _CHUNK_BYTES)])
                if not n:  # the file shrank under us: the loader would fail on it as well
                    raise SafetensorsHeaderError(f"truncated while reading tensor {name[:80]!r}")
                left -= n
                u = np.frombuffer(buf, dtype=view, count=n // np.dtype(view).itemsize)
                special = (u & exp) == exp
                if special.any():
                    k = int(np.count_nonzero(special & ((u & mant) != 0)))
                    nan, inf = nan + k, inf + int(np.count_nonzero(special)) - k
            if nan or inf:
                count = (end - begin) // np.dtype(view).itemsize
                return f"tensor {name[:80]!r} holds {nan} NaN and {inf} Inf of its {count} values"
        _FINITE_FILES.add(key)
    return None


def token_ids(f: Path, name: str, *, offsets: bool) -> tuple[int, int, int, int] | None:
    """A draft vocabulary's target token ids, from its I64 or I32 tensor ``name`` in a checked
    safetensors file: ``(lowest, its draft id, highest, its draft id)``, None when it is empty.
    ``offsets``: stored as EAGLE-3's `d2t` (target id = draft id + d2t[draft id]), else the ids
    themselves (ours)."""
    import numpy as np

    tensors, _, start = read_safetensors_header(f)
    dtype, _, (begin, end) = tensors[name]
    with open_regular(f) as fh:
        fh.seek(start + begin)
        ids = np.frombuffer(fh.read(end - begin), dtype={"I64": "<i8", "I32": "<i4"}[dtype]).astype(np.int64)
    if offsets:
        ids = ids + np.arange(len(ids), dtype=np.int64)
    if not len(ids):
        return None
    lo, hi = int(ids.argmin()), int(ids.argmax())
    return int(ids[lo]), lo, int(ids[hi]), hi


def check_drafter_bounds(path, raw: dict) -> None:
    """A checkpoint config.json that no drafter can have (100000 layers, zero heads, a
    trillion-wide MLP): one line before anything is built (BOUNDS)."""
    missing = [k for k in CHECKPOINT_REQUIRED if raw.get(k) is None]
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r}: config.json lacks {', '.join(missing)} (a dflash train "
                              f"checkpoint writes every field of its drafter)")
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
            if ours in seen:  # two files (or two names) for one weight: which one a loader keeps is its order's luck
                first = getattr(seen[ours][0], "name", seen[ours][0])
                return (f"{fname}: tensor {k!r} is a second copy of {seen[ours][1]!r} in {first}: a drafter "
                        f"holds each weight once")
            seen[ours] = (fname, k)
    missing = sorted(set(want) - set(seen))
    if missing:
        return (f"weights missing for this config: {', '.join(missing[:4])}"
                + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    return None


def training_state_error(path: str | os.PathLike, steps: int) -> str | None:
    """What a resume of the checkpoint at ``path`` cannot start from, read from its
    training_state.json's skeleton (torch-free), or None: a step that is not a whole number
    in [0, train.steps] (a -3 or a 4.5 hung the prefetch worker for ever; past train.steps
    nothing is trained and the record says otherwise), and the parts every resume loads
    (optimizer, scheduler, torch_rng), each of the kind the file format writes. An older
    checkpoint's pickle (LEGACY_STATE) is judged when it is loaded."""
    p = resolve(path)
    if not (p / STATE_TREE).is_file():
        return None
    tree = read_json_object(p / STATE_TREE, f"checkpoint {str(path)!r}", CheckpointError)
    where = f"checkpoint {str(path)!r}: {STATE_TREE}"
    for key, kind in (("optimizer", "a mapping"), ("scheduler", "a mapping"), ("torch_rng", "a tensor")):
        v = tree.get(key)
        if not isinstance(v, dict) or (kind == "a tensor") != (set(v) == {"__tensor__"}):
            return f"{where}: {key}={str(v)[:60]}: expected {kind} (the file was edited or is not dflash's)"
    step = tree.get("step")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"{where}: step={step!r}: expected a whole number of steps >= 0 (the file was edited)"
    if step > steps:
        return (f"the checkpoint is at step {step:,}, past train.steps={steps:,}: give --steps above {step:,} "
                f"to train on from it (or evaluate it: dflash eval --checkpoint {str(path)!r})")
    return None


def check_readable(path: str | os.PathLike) -> tuple[Path, dict]:
    """(resolved dir, its config) of a checkpoint whose files are whole; torch-free."""
    p = resolve(path)
    raw = read_config(p)
    check_drafter_bounds(path, raw)
    check_safetensors(p / WEIGHTS, values=True)
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
    arch = ckpt_config.get("arch") or family.DEFAULT  # a checkpoint without "arch" is a DFlash one
    if arch != model_cfg.arch:
        return f"model.arch: the checkpoint is a {arch} drafter, this run builds a {model_cfg.arch} one"
    own = family.get(arch).drafter_fields(model_cfg)
    vocab, asked_dv = ckpt_config.get("vocab_size"), model_cfg.draft_vocab
    draft_vocab = 0 if isinstance(vocab, int) and asked_dv >= vocab else asked_dv  # model/build.py's rule
    # every field the drafter is built from, its shape's or not: one the checkpoint has and the
    # run would change (a sliding window, a multiplier, a draft vocabulary) would be recorded as
    # the run's while the resumed drafter keeps the checkpoint's
    pairs = [("model.block_size", ckpt_config.get("block_size"), model_cfg.block_size),
             *((f"model.{k}", ckpt_config.get(k), v) for k, v in own.items()),
             ("model.num_layers", ckpt_config.get("num_hidden_layers"), model_cfg.num_layers),
             ("model.copy_head", ckpt_config.get("copy_head", False), model_cfg.copy_head),
             ("model.layer_types", list(ckpt_config.get("layer_types") or []), list(model_cfg.layer_types)),
             ("model.sliding_window", ckpt_config.get("sliding_window") or 0, model_cfg.sliding_window),
             ("model.draft_vocab", ckpt_config.get("draft_vocab_size") or 0, draft_vocab)]
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


# -- what dflash writes is readable by others ----------------------------------------------
def umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status; elsewhere the
    set-and-restore dance, which is only racy against another thread creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def plain_modes(root: Path) -> None:
    """Give what was written under private temp names (mkdtemp: 0700, safetensors: 0600) the
    modes a plain write has under the user's umask (0755 / 0644 under 022), so a serving
    engine or a colleague running as another user can read an export, a checkpoint or a
    capture. Walks ``root`` (a dir or one file); never follows links."""
    mask = umask()
    paths = [root] if root.is_file() else [root, *root.rglob("*")]
    for q in paths:
        if q.is_symlink():
            continue
        os.chmod(q, (0o777 if q.is_dir() else 0o666) & ~mask)


# -- removing only what dflash wrote ---------------------------------------------------------
def foreign_entries(d: Path, written=WRITTEN) -> list[str]:
    """Entries of a checkpoint (or export) dir that dflash did not write there."""
    try:
        return sorted(e.name for e in d.iterdir() if e.name not in written)
    except OSError:
        return []


def remove_written(d: Path, written=WRITTEN) -> Path | None:
    """Delete the files dflash writes into a checkpoint (or export) dir, then the dir if that
    empties it. Anything else is kept: the dir is renamed aside (returned), never deleted.
    A link in the dir's place is removed as a link: what it points to is never touched."""
    if d.is_symlink():
        d.unlink()
        return None
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
        if t.is_symlink():  # never ours: a save makes a real dir (mkdtemp)
            t.unlink()
            removed.append(t)
        elif t.is_dir() and not foreign_entries(t):
            remove_written(t)
            removed.append(t)
    return removed
