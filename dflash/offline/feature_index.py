"""A features dir's `index.json`, read and checked without torch.

    FEATS/index.json                 what was captured: the key (target, layer ids, dtype,
                                     data), sizes, and the shard list
    FEATS/shard-r{R}-{K}.safetensors features [T, F], input_ids [T], loss_mask [T],
                                     offsets [n+1], sample [n] (the sample's position in
                                     the prepared training set)
    FEATS/target/                    the target's config.json and tokenizer, so training
                                     needs nothing of the target but its embedding and lm_head

The index is written last, by rank 0 once every rank's shards are on disk: a dir without
one is a capture that did not finish, and is refused in one line.

Features dirs travel between people, so nothing in one is trusted before it is checked, and
all of it is checked here, without torch: the index's size, depth and every field training
reads; each shard it names must stay inside FEATS (`../run/checkpoint/model.safetensors`,
`/etc/passwd` are refused before they are opened); each shard's safetensors header must
describe its bytes, hold exactly the five tensors with the dtypes and shapes above, offsets
that rise from 0 to its row count, and sample positions that are new and in range. Each
failure is one line (FeaturesError, exit 2), never a traceback halfway through training.
"""
from __future__ import annotations

import array
import re
import sys
from pathlib import Path

from ..preflight.inputs import SafetensorsHeaderError, inside, read_json_object, read_safetensors_header

FORMAT = "dflash-features"
VERSION = 1
INDEX = "index.json"
TARGET_DIR = "target"
SHARD_GLOB = "shard-r*-*.safetensors"
PART_GLOB = "index-r*.json"   # one rank's shard list, before rank 0 merges them
WRITTEN = (INDEX, SHARD_GLOB, PART_GLOB, f"{TARGET_DIR}/*")  # what --overwrite may remove


class FeaturesError(ValueError):
    """A features dir that cannot be used: one line naming it and what is wrong (exit 2)."""


def read_index(path: str, *, check_shards: bool = True) -> dict:
    """The index of a finished capture, checked with every shard it names (see the module
    docstring), or one line saying why not."""
    p = Path(path).expanduser()
    where = f"--features {path}"
    if not p.is_dir():
        raise FeaturesError(f"{where}: not a directory (expected what dflash capture --out wrote)")
    f = p / INDEX
    if not f.is_file():
        parts = sorted(x.name for x in p.glob(SHARD_GLOB))
        why = (f"{len(parts)} shard(s) but no {INDEX}: the capture did not finish; continue it with "
               "dflash capture ... --resume"
               if parts else f"no {INDEX} (expected what dflash capture --out wrote)")
        raise FeaturesError(f"{where}: {why}")
    try:
        idx = read_json_object(f, where, FeaturesError)
    except FeaturesError as e:
        raise FeaturesError(str(e).replace(" is not readable JSON", " is unreadable")) from None
    if idx.get("format") != FORMAT:
        raise FeaturesError(f"{where}: {INDEX} is not a dflash features index (format {FORMAT!r} expected)")
    if idx.get("version") != VERSION:
        raise FeaturesError(f"{where}: index version {str(idx.get('version'))[:40]!r}; this dflash reads version "
                            f"{VERSION}")
    _check_fields(idx, where)
    files = [inside(p, s["file"], f"{where}: {INDEX}", FeaturesError) for s in idx["shards"]]  # before any is opened
    missing = [s["file"] for s, x in zip(idx["shards"], files) if not x.is_file()]
    if missing:
        raise FeaturesError(f"{where}: {len(missing)} shard(s) listed in {INDEX} are missing "
                            f"({', '.join(m[:80] for m in missing[:3])})")
    if len(set(files)) != len(files):
        raise FeaturesError(f"{where}: {INDEX} lists a shard twice")
    if not (p / TARGET_DIR / "config.json").is_file():
        raise FeaturesError(f"{where}: no {TARGET_DIR}/config.json (the target's config, written by capture)")
    read_json_object(p / TARGET_DIR / "config.json", f"{where}: {TARGET_DIR}", FeaturesError)
    if check_shards:
        seen: set = set()
        for entry, x in zip(idx["shards"], files):
            shard = read_shard(x, where, feature_dim=idx["feature_dim"], dtype=idx["key"]["dtype"])
            if (shard["samples"], shard["tokens"]) != (entry["samples"], entry["tokens"]):
                raise FeaturesError(f"{where}: {x.name} holds {shard['samples']} samples, {shard['tokens']} tokens; "
                                    f"{INDEX} says {entry['samples']}, {entry['tokens']}")
            check_positions(shard, seen, idx["samples"], where)
        if len(seen) != idx["samples"]:
            raise FeaturesError(f"{where}: the shards hold {len(seen)} samples, {INDEX} says {idx['samples']}; "
                                "capture again")
    return idx


def _check_fields(idx: dict, where: str) -> None:
    """Every field training reads has the type it expects (one line naming the first that does not)."""
    def bad(field, expected):
        raise FeaturesError(f"{where}: {INDEX} is malformed ({field}: expected {expected})")

    def count(v):
        return type(v) is int and v >= 0

    key, data, shards = idx.get("key"), idx.get("data"), idx.get("shards")
    if not isinstance(key, dict):
        bad("key", "an object")
    if not isinstance(key.get("target"), str) or not key["target"]:
        bad("key.target", "a target name")
    if not count(key.get("target_seed")):
        bad("key.target_seed", "an integer >= 0")
    ids = key.get("layer_ids")
    if not isinstance(ids, list) or not ids or not all(count(i) for i in ids):
        bad("key.layer_ids", "a list of layer indices")
    if key.get("dtype") not in FEATURE_DTYPES:
        bad("key.dtype", " or ".join(FEATURE_DTYPES))
    for k in ("samples", "tokens", "feature_dim"):
        if not count(idx.get(k)):
            bad(k, "an integer >= 0")
    if idx["feature_dim"] < 1:
        bad("feature_dim", "an integer >= 1")
    if not isinstance(data, dict) or not count(data.get("max_len")) or not count(data.get("min_loss_tokens")):
        bad("data", "an object with max_len and min_loss_tokens")
    if not isinstance(shards, list) or not all(isinstance(x, dict) and isinstance(x.get("file"), str) and
                                               count(x.get("samples")) and count(x.get("tokens")) for x in shards):
        bad("shards", "a list of {file, samples, tokens}")


# the index's dtype -> the safetensors dtype of its features
FEATURE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_SHARD_TENSORS = {"input_ids": "I32", "loss_mask": "U8", "offsets": "I64", "sample": "I64"}
_SHARD_NAME = re.compile(r"shard-r(\d+)-(\d+)\.safetensors")


def read_shard(f: Path, where: str, *, feature_dim: int | None = None, dtype: str | None = None) -> dict:
    """One shard, checked without torch: its header tells the truth (inputs.read_safetensors_header),
    it holds exactly features [T, F], input_ids [T] int32, loss_mask [T] uint8, offsets [n+1]
    int64 rising from 0 to T, sample [n] int64 (distinct, >= 0), and for a KL capture kl_logp
    [T, k] float16 with kl_ids [T, k] int32. Returns what the index keeps
    of it plus ``rank``, ``number``, ``capture`` (its capture id, None if written before ids)
    and ``positions``. One line (FeaturesError) for anything else."""
    name = f"{where}: {f.name}"
    try:
        tensors, meta, start = read_safetensors_header(f)
    except SafetensorsHeaderError as e:
        raise FeaturesError(f"{name} is not a whole shard ({e})") from None
    except OSError as e:
        raise FeaturesError(f"{name} is unreadable ({e.strerror or e})") from None
    kl = {"kl_logp", "kl_ids"} & set(tensors)  # train.loss=kl captures: the target's top-k per token
    if set(tensors) - kl != {"features", *_SHARD_TENSORS} or kl and len(kl) != 2:
        raise FeaturesError(f"{name} is not a features shard (tensors {sorted(tensors)[:8]}; expected features, "
                            f"{', '.join(_SHARD_TENSORS)}, and kl_logp with kl_ids or neither)")
    for t, want in _SHARD_TENSORS.items():
        if tensors[t][0] != want or len(tensors[t][1]) != 1:
            raise FeaturesError(f"{name}: {t} is {tensors[t][0]} {list(tensors[t][1])}, expected a 1-d {want}")
    fdt, fshape, _ = tensors["features"]
    want_f = FEATURE_DTYPES.get(dtype) if dtype else None
    if len(fshape) != 2 or fdt not in FEATURE_DTYPES.values() or (want_f and fdt != want_f) \
            or (feature_dim is not None and fshape[1] != feature_dim):
        raise FeaturesError(f"{name}: features is {fdt} {list(fshape)}, expected [tokens, "
                            f"{feature_dim or 'F'}] of {want_f or 'a float dtype'}")
    T, n = fshape[0], tensors["sample"][1][0]
    if tensors["input_ids"][1][0] != T or tensors["loss_mask"][1][0] != T or tensors["offsets"][1][0] != n + 1:
        raise FeaturesError(f"{name}: shapes disagree (features {T} rows, input_ids {tensors['input_ids'][1][0]}, "
                            f"loss_mask {tensors['loss_mask'][1][0]}, offsets {tensors['offsets'][1][0]} for "
                            f"{n} samples)")
    if kl:
        (ldt, lshape, _), (idt, ishape, _) = tensors["kl_logp"], tensors["kl_ids"]
        if ldt != "F16" or idt != "I32" or len(lshape) != 2 or list(lshape) != list(ishape) or lshape[0] != T:
            raise FeaturesError(f"{name}: kl_logp {ldt} {list(lshape)} / kl_ids {idt} {list(ishape)}, expected "
                                f"[{T}, k] of F16 / I32")
    offsets, positions = _int64s(f, start, tensors["offsets"][2]), _int64s(f, start, tensors["sample"][2])
    if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise FeaturesError(f"{name}: offsets do not rise from 0 to its {T} rows")
    if any(x < 0 for x in positions) or len(set(positions)) != n:
        raise FeaturesError(f"{name}: sample positions are negative or repeated")
    m = _SHARD_NAME.fullmatch(f.name)
    return {"file": f.name, "samples": n, "tokens": T, "bytes": f.stat().st_size,
            "rank": int(m[1]) if m else 0, "number": int(m[2]) if m else 0, "capture": meta.get("capture"),
            "positions": list(positions)}


def _int64s(f: Path, start: int, span: tuple[int, int]) -> array.array:
    a = array.array("q")
    with open(f, "rb") as fh:
        fh.seek(start + span[0])
        a.frombytes(fh.read(span[1] - span[0]))
    if sys.byteorder != "little":
        a.byteswap()
    return a


def check_positions(shard: dict, seen: set, samples: int | None, where: str) -> None:
    """A shard's sample positions are in range (``< samples`` when known) and in no other shard
    (``seen``: the positions of the shards checked before; updated)."""
    pos = shard["positions"]
    if samples is not None and pos and max(pos) >= samples:
        raise FeaturesError(f"{where}: {shard['file']} holds sample position {max(pos)}, but there are only "
                            f"{samples} samples")
    if not seen.isdisjoint(pos):
        raise FeaturesError(f"{where}: {shard['file']} holds samples another shard holds too")
    seen.update(pos)


def mismatch(idx: dict, *, target: str | None, layer_ids: list[int] | None) -> str | None:
    """Why a run's explicit settings do not fit the captured features (None: they fit)."""
    key = idx["key"]
    if target and target != key["target"]:
        return f"captured for target {key['target']!r}, the run asks for {target!r}"
    if layer_ids and list(layer_ids) != list(key["layer_ids"]):
        return f"captured layers {key['layer_ids']}, the run asks for model.target_layer_ids={list(layer_ids)}"
    return None


def shards_on_disk(out: Path, where: str = "--resume") -> list[dict]:
    """Every whole shard in ``out`` (temp files are not shards), as the index lists them,
    plus ``rank``, ``number``, ``capture`` (its capture_id, None if written before ids)
    and ``positions`` (the samples it holds). Each is checked as training would check it
    (feature_index.read_shard, torch-free), and no sample may be in two of them: a crafted or
    damaged shard is one line (FeaturesError) before anything is captured."""
    found, seen = [], set()
    for f in sorted(Path(out).glob(SHARD_GLOB)):
        if not _SHARD_NAME.fullmatch(f.name):
            continue
        shard = read_shard(inside(out, f.name, where, FeaturesError), where)  # a symlink out of FEATS: refused
        check_positions(shard, seen, None, where)
        found.append(shard)
    return found
