"""`dflash train --features FEATS`: what set-up does instead of loading the target and
preparing the data. The samples come from the capture (in the order training would have
prepared them), the target is only its embedding and lm_head (head_only.py), and every
batch carries its features, read from the shards in the `data_load` stage."""
from __future__ import annotations

import sys

import torch

from ..config import Config
from ..data import chat_template
from ..model import target as target_mod
from .feature_index import TARGET_DIR, read_index
from .feature_shards import FeatureStore
from .head_only import load_head_only


class FeatureSide:
    """A target worker's stand-in under --features: where its rows go, and their shape."""

    def __init__(self, config, device, dtype):
        self.config, self.device, self.dtype = config, torch.device(device), dtype


def open_capture(cfg: Config, *, device, dtype):
    """(head-only target, tokenizer, store, the features' dtype)."""
    from transformers import AutoConfig

    index = read_index(cfg.data.features)
    store = FeatureStore(cfg.data.features, index)
    key = index["key"]
    print(f"training from features {cfg.data.features}: {index['samples']} samples, {index['tokens']} tokens of "
          f"{key['target']} layers {key['layer_ids']} ({key['dtype']}); no target forward", file=sys.stderr)
    config = target_mod.from_pretrained(AutoConfig, store.path / TARGET_DIR,
                                        f"features {cfg.data.features}: {TARGET_DIR}/")
    init_for = None
    if cfg.model.drafter_init == "target":  # the layers the drafter starts from, read from the target's files
        init_for = (list(key["layer_ids"]), cfg.model.num_layers)
    target = load_head_only(cfg.model.target, config, device=device, dtype=dtype, seed=cfg.model.target_seed,
                            init_for=init_for)
    print(f"target {cfg.model.target}: {target.note}", file=sys.stderr)
    tok = target_mod.load_tokenizer(cfg.model.target)
    chat_template.configure_from(tok, cfg.data)  # the mask-token probe renders with it, as online
    return target, tok, store, getattr(torch, index["key"]["dtype"])


def training_samples(cfg: Config, store: FeatureStore) -> list:
    """The capture's samples, filtered as prepare() filters for this run's block size (a
    capture for a larger block size kept fewer: said once)."""
    need = 2 * cfg.model.block_size
    had = store.index["data"]["min_loss_tokens"]
    if had > need:
        print(f"features: captured for >= {had} loss tokens per sample; this run (block size "
              f"{cfg.model.block_size}) would also take samples with {need}..{had - 1}: capture again to have them",
              file=sys.stderr)
    samples = [s for s in store.samples() if s.loss_tokens >= need]
    if not samples:
        raise ValueError(f"features {store.path}: no sample has >= {need} loss tokens (2 x model.block_size)")
    from ..prep.prepare import first_samples
    return first_samples(samples, cfg.data.max_samples)


def feature_sides(target, devices, dtype) -> list[FeatureSide]:
    """One stand-in per target worker: it reads, it runs nothing."""
    return [FeatureSide(target.config, torch.device(d), dtype) for d in devices]
