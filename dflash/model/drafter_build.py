"""The drafter a run builds for its target: geometry from the target's config, the mask
token from its tokenizer, optionally decoder layers from the target's own."""
from __future__ import annotations

import torch

from ..config import Config
from . import target as target_mod
from .drafter import DFlashDrafter, DrafterConfig


def drafter_config(cfg: Config, target, tokenizer, layer_ids) -> DrafterConfig:
    """The drafter this run builds for this target: also what a resumed checkpoint must match."""
    vocab_rows = target.get_input_embeddings().weight.shape[0]
    mask_id, _ = target_mod.choose_mask_token_id(tokenizer, vocab_rows)
    return DrafterConfig.from_target(
        target.config, target_layer_ids=layer_ids, mask_token_id=mask_id, vocab_size=vocab_rows,
        num_hidden_layers=cfg.model.num_layers, block_size=cfg.model.block_size, target=cfg.model.target,
        copy_head=cfg.model.copy_head)


def build_drafter(cfg: Config, target, tokenizer, layer_ids) -> DFlashDrafter:
    dcfg = drafter_config(cfg, target, tokenizer, layer_ids)
    torch.manual_seed(cfg.train.seed)
    drafter = DFlashDrafter(dcfg)
    if cfg.model.drafter_init == "target":
        from .drafter_init import init_from_target
        init_from_target(drafter, target)
    return drafter
