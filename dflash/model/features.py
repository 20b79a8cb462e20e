"""The target side of a step: one forward capturing the selected layers (model_forward),
then only the valid tokens kept (pack_hidden); the drafter side unpacks them.

Nothing here reads a device tensor on the host: lengths are host ints carried by the batch.
"""
from __future__ import annotations

import torch

from ..data.batch import Batch
from . import target as target_mod


def target_features(target, batch: Batch, layer_ids, device, cache=None) -> torch.Tensor:
    """model_forward: one target forward, selected layers concatenated: [B, S, n*H].

    ``cache`` (a FeatureCache, `train.feature_cache`): a batch whose sequences were all seen
    before is assembled from it without a forward (the target is frozen), and a forward's
    rows are kept for next time. A batch that carries captured features (``dflash train
    --features``: data_load read them from disk) needs no forward: they go to the device."""
    if batch.features is not None:
        return batch.features.to(device, non_blocking=True)
    if cache is not None:
        hit = cache.assemble(batch)
        if hit is not None:
            return hit
    ids = batch.input_ids.to(device, non_blocking=True)
    am = batch.attention_mask.to(device, non_blocking=True)
    feats = target_mod.capture_hidden(target, ids, am, layer_ids)
    if cache is not None:
        cache.keep(batch, feats)
    return feats


def pack(features: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """pack_hidden: keep valid tokens only -> [sum(lengths), n*H]; host ints, no nonzero()."""
    return torch.cat([features[i, :n] for i, n in enumerate(lengths)], dim=0)


def unpack(packed: torch.Tensor, lengths: list[int], padded_len: int) -> torch.Tensor:
    out = packed.new_zeros(len(lengths), padded_len, packed.shape[-1])
    start = 0
    for i, n in enumerate(lengths):
        out[i, :n] = packed[start:start + n]
        start += n
    return out


def replicate_target(target, device):
    """A frozen copy of the target on another device (one per extra target worker)."""
    import copy

    return copy.deepcopy(target).to(device)
