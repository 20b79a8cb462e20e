"""`train.loss_vocab`: score the training loss over part of the vocabulary.

On the CPU the frozen lm_head is most of a drafter step: every scored slot is a row of a
[rows x 49,152] product, then a 49k-wide log-softmax, both again in the backward. With
``train.loss_vocab=K`` the loss's softmax runs over the K tokens most frequent in the
training samples plus every token of the batch itself, so each label is in the set and the
tokens a context-copying drafter would confuse it with are too (a sampled softmax with a
fixed candidate set). Drafting (eval, the acceptance estimate) keeps the whole vocabulary.
The set is built on the host from the batch's host-side ids: no device sync.
"""
from __future__ import annotations

import numpy as np

import torch
import torch.nn.functional as F
from torch import nn


def frequent_tokens(samples, k: int, exactly: bool = False) -> torch.Tensor:
    """The ``k`` most frequent token ids over the samples' tokens (ties: smaller id first).
    ``exactly``: always ``k`` ids, the unseen smallest ids filling in when the samples hold
    fewer distinct tokens (a draft vocabulary is a fixed-size head; a small data set has
    fewer distinct tokens than it)."""
    ids, counts = np.unique(np.concatenate([s.ids for s in samples]), return_counts=True)
    top = ids[np.lexsort((ids, -counts))[:k]]  # by count, descending; ties by id
    if exactly and len(top) < k:
        unseen = np.setdiff1d(np.arange(k + len(top)), top)[: k - len(top)]
        top = np.concatenate([top, unseen])
    return torch.tensor(np.sort(top), dtype=torch.long)


def batch_vocab(frequent: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Sorted ids: the frequent set plus every id of the (host) batch."""
    return torch.unique(torch.cat([frequent, input_ids.flatten().cpu()]))


class RowsHead(nn.Module):
    """The frozen lm_head restricted to the rows ``ids`` (sorted): logits over that subset."""

    def __init__(self, lm_head: nn.Module, ids: torch.Tensor):
        super().__init__()
        self.lm_head, self.ids = lm_head, ids

    def weight_and_bias(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The subset's rows of the head's weight (and bias): what the chunked loss reads (head_loss.py)."""
        bias = getattr(self.lm_head, "bias", None)
        return self.lm_head.weight.index_select(0, self.ids), None if bias is None else bias.index_select(0, self.ids)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, *self.weight_and_bias())

    def to_subset(self, labels: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary label ids -> positions in the subset (every label is in it)."""
        return torch.searchsorted(self.ids, labels.contiguous())
