"""Conversations -> (optionally target-regenerated) training samples + held-out prompts.

Regeneration lets the target write the assistant turns itself: a drafter must learn the
*target's* distribution, and for tiny random targets ShareGPT's human text has nothing
to do with what they predict. Replies are cached on disk batch by batch (regen_cache.py),
keyed by everything that determines them, so a second run skips the generation and a
killed one resumes; under torchrun the target ranks share the work (regen_shard.py).
``data.regenerate: off`` trains on the data set's replies as they are (all turns).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from ..config import Config, regenerates
from ..data import dataset as data_mod
from ..data.prompt_sets import user_turn_keys
from ..preflight.inputs import cache_dir
from .regen_cache import RegenCache
from .regen_shard import SOLO, Shard
from .regenerate import regenerate


@dataclass
class Prepared:
    samples: list            # data.Sample, training split
    eval_convs: list         # held-out conversations (prompts for eval)
    regenerated: bool
    features: dict | None = None  # token ids -> target features kept by regeneration (see _regen_cached)
    counts: dict = field(default_factory=dict)  # regeneration: regenerated / cached / total / seconds
    data_counts: dict = field(default_factory=dict)  # records read, conversations, dropped by reason, cut

    def span_attributes(self) -> dict:
        """What the `prepare_data` phase carries (train's and capture's alike): samples, held-out
        prompts, regeneration's counts (regen.*) and the data's (data.records_read, a count per
        drop reason, ...)."""
        return {"samples": len(self.samples), "held_out": len(self.eval_convs),
                **{f"regen.{k}": v for k, v in (self.counts or {}).items() if isinstance(v, (int, float))},
                **{f"data.{k}": v for k, v in (self.data_counts or {}).items() if isinstance(v, int)}}


def first_samples(samples: list, max_samples: int) -> list:
    """`data.max_samples`: the first N prepared samples (all for 0), said once when it cuts."""
    if max_samples and len(samples) > max_samples:
        print(f"data: training on the first {max_samples} of {len(samples)} samples (data.max_samples)",
              file=sys.stderr)
        return samples[:max_samples]
    return samples


def split(cfg: Config, counts: dict | None = None):
    convs = data_mod.load_conversations(cfg.data.path or None, limit=cfg.data.num_conversations,
                                        seed=cfg.train.seed, counts=counts)
    # a conversation that repeats a held-out prompt (ShareGPT holds many) stays out of training:
    # a drafter trained on the target's reply to an eval prompt scores what it memorised
    return data_mod.split_heldout(convs, eval_fraction=cfg.data.eval_fraction, seed=cfg.train.seed,
                                  key=user_turn_keys, counts=counts)


def _regen_cached(cfg: Config, target, tokenizer, convs, device, layer_ids=None, shard: Shard = SOLO,
                  counts: dict | None = None) -> tuple[list | None, dict | None]:
    """Regenerated conversations through the shard cache (`regen_cache.py`): replies already on
    disk are read, the rest generated (by this rank's shard under torchrun) and written batch by
    batch, so a killed run resumes where it stopped. With ``layer_ids`` also the target features
    regeneration captured on the way (`train.feature_cache`: the first epoch then needs no
    target forward); cached replies bring theirs where this cache kept them. None on a rank
    that is not the shard's gather destination."""
    cache = RegenCache.for_target(cache_dir() / "regenerated", cfg, target, layer_ids)
    # a GPU wants wide batches (one generate() step costs about the same for 1 or 64 rows)
    bs = cfg.data.regen_batch_size or (64 if str(device).startswith("cuda") else 16)
    import torch  # loaded by now (the target is)
    # auto: on a CPU one worker per compute thread, at most 8 (each holds a batch's KV cache)
    workers = cfg.data.regen_workers or (min(8, torch.get_num_threads()) if str(device) == "cpu" else 1)
    engine = vllm_regenerator(cfg, target) if cfg.data.regen_engine == "vllm" else None
    feats = {} if layer_ids and engine is None else None
    out = regenerate(target, tokenizer, convs, max_new_tokens=cfg.data.regen_max_new_tokens,
                     max_prompt_len=cfg.data.regen_max_prompt_len, device=device, batch_size=bs, workers=workers,
                     layer_ids=layer_ids, features=feats, cache=cache, shard=shard, counts=counts, engine=engine)
    return out, feats


def vllm_regenerator(cfg: Config, target):
    """`data.regen_engine: vllm`: the replies from vLLM (engine/pipeline.py), the target's
    weights at its dtype, the HF path's prompts, length and end-of-sequence ids."""
    from ..engine import pipeline

    dtype = str(getattr(target, "dtype", "float32")).removeprefix("torch.")

    def gen(prompts, max_new_tokens, eos):
        return pipeline.replies(cfg.model.target, cfg.model.target_seed, prompts, max_new_tokens=max_new_tokens,
                                stop_ids=eos, dtype=dtype)
    return gen


def prepare(cfg: Config, target, tokenizer, device="cpu", layer_ids=None, shard: Shard = SOLO,
            split_convs=None) -> Prepared | None:
    """Training samples and held-out prompts. ``layer_ids`` (with `train.feature_cache` and a
    target whose selected layers can be captured) asks regeneration to keep their features.
    Under torchrun ``shard`` says this rank's part of the regeneration and ``split_convs`` the
    (train, eval) conversations another rank read; None on a rank whose replies went to the
    shard's gather destination."""
    from ..model.features import can_capture

    data_counts: dict = {}  # records dropped by reason, samples cut: reported once, below
    train_convs, eval_convs = split_convs if split_convs is not None else split(cfg, data_counts)
    data_counts["held_out"] = len(eval_convs)
    regen = regenerates(cfg)
    feats, counts = None, {}  # counts: the regeneration's
    if regen:
        keep = layer_ids if cfg.train.feature_cache and layer_ids and can_capture(target, layer_ids) else None
        train_convs, feats = _regen_cached(cfg, target, tokenizer, train_convs, device, keep, shard, counts)
        if train_convs is None:
            return None
    samples = data_mod.build_samples(tokenizer, train_convs, max_len=cfg.data.max_len,
                                     min_loss_tokens=2 * cfg.model.block_size, counts=data_counts,
                                     long=cfg.data.long_samples)
    samples = first_samples(samples, cfg.data.max_samples)
    report = data_mod.data_report(data_counts, max_len=cfg.data.max_len, samples=len(samples))
    if not samples:  # bad input is one line: the counts go into it
        raise data_mod.DatasetError(
            f"no training samples left after filtering (need >= {2 * cfg.model.block_size} response tokens "
            f"within data.max_len={cfg.data.max_len}); raise data.num_conversations or data.max_len ({report})")
    print(report, file=sys.stderr)
    return Prepared(samples=samples, eval_convs=eval_convs, regenerated=regen, features=feats, counts=counts,
                    data_counts=data_counts)
