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
"""
from __future__ import annotations

import json
from pathlib import Path

FORMAT = "dflash-features"
VERSION = 1
INDEX = "index.json"
TARGET_DIR = "target"
SHARD_GLOB = "shard-r*-*.safetensors"
PART_GLOB = "index-r*.json"   # one rank's shard list, before rank 0 merges them
WRITTEN = (INDEX, SHARD_GLOB, PART_GLOB, f"{TARGET_DIR}/*")  # what --overwrite may remove


class FeaturesError(ValueError):
    """A features dir that cannot be used: one line naming it and what is wrong (exit 2)."""


def read_index(path: str) -> dict:
    """The index of a finished capture, or one line saying why not."""
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
        idx = json.loads(f.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise FeaturesError(f"{where}: {INDEX} is unreadable ({type(e).__name__})") from None
    if not isinstance(idx, dict) or idx.get("format") != FORMAT:
        raise FeaturesError(f"{where}: {INDEX} is not a dflash features index (format {FORMAT!r} expected)")
    if idx.get("version") != VERSION:
        raise FeaturesError(f"{where}: index version {idx.get('version')!r}; this dflash reads version {VERSION}")
    missing = [s["file"] for s in idx.get("shards", []) if not (p / s["file"]).is_file()]
    if missing:
        raise FeaturesError(f"{where}: {len(missing)} shard(s) listed in {INDEX} are missing "
                            f"({', '.join(missing[:3])})")
    if not (p / TARGET_DIR / "config.json").is_file():
        raise FeaturesError(f"{where}: no {TARGET_DIR}/config.json (the target's config, written by capture)")
    return idx


def mismatch(idx: dict, *, target: str | None, layer_ids: list[int] | None) -> str | None:
    """Why a run's explicit settings do not fit the captured features (None: they fit)."""
    key = idx["key"]
    if target and target != key["target"]:
        return f"captured for target {key['target']!r}, the run asks for {target!r}"
    if layer_ids and list(layer_ids) != list(key["layer_ids"]):
        return f"captured layers {key['layer_ids']}, the run asks for model.target_layer_ids={list(layer_ids)}"
    return None
