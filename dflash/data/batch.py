"""`Batch`: a tokenized batch on the host, built once by `dataset.batches` (collate), with
the id every stage's span and the anchor sampling use."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    index: int                 # global batch id: the trace key, and the anchors' seed
    input_ids: torch.Tensor    # [B, S] right-padded
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    lengths: list[int]         # valid tokens per sequence (host ints: packing needs no sync)
    features: torch.Tensor | None = None  # [B, S, F] read from a capture by data_load (train --features)
    kl_topk: tuple | None = None          # (log-probs [B, S, k], token ids [B, S, k]): the target's top-k
                                          # next-token distribution at each position, from a capture (train.loss=kl)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_len(self) -> int:
        return int(self.input_ids.shape[1])
