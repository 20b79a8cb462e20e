"""`train.feature_cache`: every training sequence's target features kept after its first
forward (the target is frozen), so later epochs skip the target. For small data sets that
fit (the demo: ~120 sequences x 160 tokens x 3 layers, ~130 MB).

The run owns one cache per target replica (`replica(device)`): a hit must come back on
the replica's device, as a forward's output would.
"""
from __future__ import annotations

import torch

from ..data.batch import Batch


class FeatureCache:
    def __init__(self, layer_ids, device="cpu"):
        self.layer_ids = tuple(layer_ids)
        self.device = torch.device(device)
        self._rows: dict = {}

    def __len__(self) -> int:
        return len(self._rows)

    def _key(self, ids: torch.Tensor) -> tuple:
        """One sequence's key: the layers and the int64 token ids."""
        return self.layer_ids, ids.to(torch.long).numpy().tobytes()

    def assemble(self, batch: Batch) -> torch.Tensor | None:
        """[B, S, F] from kept rows when every sequence of the batch is kept (padding rows
        zero, which is what pack/unpack hand the drafter anyway); else None."""
        rows = [self._rows.get(self._key(batch.input_ids[i, :n])) for i, n in enumerate(batch.lengths)]
        if any(r is None for r in rows):
            return None
        out = rows[0].new_zeros(len(rows), batch.padded_len, rows[0].shape[-1])
        for i, r in enumerate(rows):
            out[i, :r.shape[0]] = r
        return out

    def keep(self, batch: Batch, feats: torch.Tensor) -> None:
        for i, n in enumerate(batch.lengths):
            self._rows.setdefault(self._key(batch.input_ids[i, :n]), feats[i, :n].clone())

    def preload(self, features: dict, max_len: int) -> int:
        """Seed with features regeneration kept (token-id tuple -> [len, n*H]), cut to
        `data.max_len` as the samples are. Returns how many went in."""
        for ids, rows in (features or {}).items():
            self._rows.setdefault(self._key(torch.tensor(ids[:max_len])), rows[:max_len].to(self.device))
        return len(features or {})

    def replica(self, device) -> "FeatureCache":
        """The same rows on another device, for another target replica."""
        other = FeatureCache(self.layer_ids, device)
        other._rows = {k: v.to(other.device) for k, v in self._rows.items()}
        return other
