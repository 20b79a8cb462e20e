"""Conversations -> (optionally target-regenerated) training samples + held-out prompts.

Regeneration lets the target write the assistant turns itself: a drafter must learn the
*target's* distribution, and for tiny random targets ShareGPT's human text has nothing
to do with what they predict. Regenerated conversations are cached on disk, keyed by
everything that determines them, so a second run skips the generation.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass

import torch

from ..config import Config
from ..data import dataset as data_mod
from ..inputs import cache_dir
from .regenerate import regenerate


@dataclass
class Prepared:
    samples: list            # data.Sample, training split
    eval_convs: list         # held-out conversations (prompts for eval)
    regenerated: bool
    features: dict | None = None  # token ids -> target features kept by regeneration (see _regen_cached)


def should_regenerate(cfg: Config) -> bool:
    if cfg.data.regenerate == "auto":
        return cfg.model.target.startswith("tiny-")
    return cfg.data.regenerate == "on"


def split(cfg: Config, counts: dict | None = None):
    convs = data_mod.load_conversations(cfg.data.path or None, limit=cfg.data.num_conversations,
                                        seed=cfg.train.seed, counts=counts)
    return data_mod.split_heldout(convs, eval_fraction=cfg.data.eval_fraction, seed=cfg.train.seed)


def _regen_cached(cfg: Config, target, tokenizer, convs, device, layer_ids=None) -> tuple[list, dict | None]:
    """Regenerated conversations, from the disk cache when there; with ``layer_ids`` also the
    target features regeneration captured on the way (`train.feature_cache`: the first epoch
    then needs no target forward). Features are cached beside the replies, so a second run
    gets both; replies cached without features (an older run) come back with None."""
    arch = hashlib.sha256(target.config.to_json_string().encode()).hexdigest()
    key = json.dumps({"target": cfg.model.target, "target_seed": cfg.model.target_seed, "arch": arch,
                      "convs": hashlib.sha256(json.dumps(convs).encode()).hexdigest(),
                      "new": cfg.data.regen_max_new_tokens, "prompt": cfg.data.regen_max_prompt_len,
                      "v": 1}, sort_keys=True)
    path = cache_dir() / "regenerated" / (hashlib.sha256(key.encode()).hexdigest()[:24] + ".json")
    fpath = None
    if layer_ids:
        fkey = json.dumps({"replies": path.name, "layers": list(layer_ids), "dtype": str(target.dtype),
                           "attn": getattr(target.config, "_attn_implementation", None), "v": 1})
        fpath = path.with_name(path.stem + "-features-" + hashlib.sha256(fkey.encode()).hexdigest()[:12] + ".pt")
    if path.is_file():
        feats = torch.load(fpath, weights_only=True) if fpath is not None and fpath.is_file() else None
        return json.loads(path.read_text()), feats
    print(f"regenerating {len(convs)} responses with the target (cached for next time)", file=sys.stderr)
    # prompts are sorted by length inside regenerate(), so a batch carries little padding;
    # a GPU wants wide batches (one generate() step costs about the same for 1 or 64 rows)
    bs = cfg.data.regen_batch_size or (64 if str(device).startswith("cuda") else 16)
    feats = {} if layer_ids else None
    out = regenerate(target, tokenizer, convs, max_new_tokens=cfg.data.regen_max_new_tokens,
                     max_prompt_len=cfg.data.regen_max_prompt_len, device=device, batch_size=bs,
                     layer_ids=layer_ids, features=feats)
    path.parent.mkdir(parents=True, exist_ok=True)
    if feats:  # written first: a reader that finds the replies also finds their features
        tmp = fpath.with_suffix(f".tmp{os.getpid()}")
        torch.save(feats, tmp)
        os.replace(tmp, fpath)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, path)
    return out, feats


def prepare(cfg: Config, target, tokenizer, device="cpu", layer_ids=None) -> Prepared:
    """Training samples and held-out prompts. ``layer_ids`` (with `train.feature_cache` and a
    target whose selected layers can be captured) asks regeneration to keep their features."""
    from ..model.layer_capture import can_capture

    counts: dict = {}  # records dropped by reason, samples cut: reported once, below
    train_convs, eval_convs = split(cfg, counts)
    counts["held_out"] = len(eval_convs)
    regen = should_regenerate(cfg)
    feats = None
    if regen:
        keep = layer_ids if cfg.train.feature_cache and layer_ids and can_capture(target, layer_ids) else None
        train_convs, feats = _regen_cached(cfg, target, tokenizer, train_convs, device, keep)
    samples = data_mod.build_samples(tokenizer, train_convs, max_len=cfg.data.max_len,
                                     min_loss_tokens=2 * cfg.model.block_size, counts=counts)
    report = data_mod.data_report(counts, max_len=cfg.data.max_len, samples=len(samples))
    if not samples:  # bad input is one line: the counts go into it
        raise data_mod.DatasetError(
            f"no training samples left after filtering (need >= {2 * cfg.model.block_size} response tokens "
            f"within data.max_len={cfg.data.max_len}); raise data.num_conversations or data.max_len ({report})")
    print(report, file=sys.stderr)
    return Prepared(samples=samples, eval_convs=eval_convs, regenerated=regen, features=feats)
