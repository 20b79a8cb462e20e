"""What a training step minimises, and every input it is computed from, in one place:
``DraftLoss(features, batch) -> (loss, accuracy)``; run/step.py then only runs the backward and
the optimizer. The batch's scored slots (`Slots`: anchors, labels, head, the target's
distribution) are built here, for every family alike; the loss itself is the family's forward,
nanoGPT's ``model(X, Y) -> loss``: ``drafter(features, slots, objective) -> (loss, accuracy,
metrics)`` (DFlash: model/drafter.py, DFlash2: model/dflash2.py, DSpark: model/dspark.py), which
is what DDP wraps. The per-slot loss they share is `slot_loss` (model/losses.py `training_loss`)
or, chunk by chunk, `chunked_loss` (model/head_loss.py).

    anchors       up to `train.num_anchors` per sequence, from a generator seeded by
                  (train.seed, batch id): the same whichever worker or loop runs the batch
                  (`sample_anchors`, `anchor_generator`)
    forward       the drafter's one pass over every anchored block (model/drafter.py)
    labels        slot k of the block at p drafts token p+k (`slot_labels`); it counts where
                  the loss mask is set at p+k (`slot_label_mask`)
    head          the target's lm_head, or its rows of the loss vocabulary (`train.loss_vocab`,
                  model/loss_vocab.py), over every scored slot at once or chunk by chunk
                  (`train.loss_chunk`, model/head_loss.py)
    targets       the target's distribution at each slot, for KL and LK (`slot_targets`)
    weights, loss the per-slot loss, the decay or D-PACE weights, the normalisation
                  (model/losses.py); a family's own terms (DFlash2's selector, DSpark's L1
                  distance and confidence BCE) in its forward

Everything stays on the device: no host reads (run/step.py's contract).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import derived_seed, needs_target_distribution
from ..data.batch import Batch
from . import head_loss
from .drafter import DFlashDrafter, compute_precision
from .loss_vocab import RowsHead, batch_vocab, frequent_tokens
from .losses import SlotTargets, decay_weights, reduce_terms, sparse_targets, target_slot_dist, training_loss

# `train.loss_chunk=0` (auto) on CUDA: rows per chunk. A chunk holds its logits ~4 times over (bf16, the fp32
# copy, the log-softmax, the gradient): 4096 x 151,936 x ~16 B = ~10 GB, while 4096-row products keep the GPU busy
CUDA_LOSS_CHUNK = 4096


def anchor_generator(seed: int, batch_index: int) -> torch.Generator:
    """The anchors' generator of a batch: seeded by (seed, batch id) only."""
    return torch.Generator().manual_seed(derived_seed(seed * 1_000_003, batch_index))


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, block_size: int, generator=None):
    """Per sequence, up to num_anchors positions p with loss_mask[p] and loss_mask[p+1] set
    and p <= S - block_size. Returns (anchors [B, A] long, valid [B, A] bool).
    Random scores + topk keep it on-device (no host sync, works for any batch)."""
    Bsz, S = loss_mask.shape
    dev = loss_mask.device
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    last = S - block_size
    if last >= 0:
        ok[:, : last + 1] = (loss_mask[:, : last + 1] > 0) & (loss_mask[:, 1 : last + 2] > 0)
    scores = torch.rand(loss_mask.shape, generator=generator, device="cpu").to(dev)
    scores = torch.where(ok, scores, torch.full_like(scores, -1.0))
    A = min(num_anchors, S)
    top, idx = scores.topk(A, dim=1)
    valid = top >= 0
    anchors = torch.where(valid, idx, torch.zeros_like(idx))
    # sorted anchors make traces/debugging readable; validity travels with them
    order = torch.argsort(torch.where(valid, anchors, torch.full_like(anchors, S + 1)), dim=1)
    return torch.gather(anchors, 1, order), torch.gather(valid, 1, order)


def at_slots(x: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """x [B, S] read at the scored slots' positions p+1 .. p+Bk-1 of every anchor p: [B, A, Bk-1]
    (positions past the end clamp to the last; the anchor rule keeps p + Bk - 1 inside)."""
    Bsz, S = x.shape
    pos = (anchors[..., None] + torch.arange(1, block_size, device=anchors.device)).clamp(max=S - 1)
    return torch.gather(x, 1, pos.view(Bsz, -1)).view_as(pos)


def slot_labels(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """The labels [B, A, Bk-1]: slot k of the block at p drafts token p+k."""
    return at_slots(input_ids, anchors, block_size)


def slot_label_mask(loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Which slots count [B, A, Bk-1] (float): the loss mask at the slot's label."""
    return at_slots(loss_mask, anchors, block_size).float()


def loss_chunk_rows(setting: int, device: torch.device) -> int:
    """`train.loss_chunk` -> rows per chunk, 0 for the full-logits path: > 0 as given, < 0
    never; 0 (auto) chunks on CUDA, where the full logits are the step's largest tensors, and
    not on the CPU, whose loss histories stay what they were bit for bit
    (tests/integration/test_loss_guard.py) and whose demo gains nothing (docs/measurements.md)."""
    if setting > 0:
        return setting
    return CUDA_LOSS_CHUNK if setting == 0 and device.type == "cuda" else 0


@dataclass
class Slots:
    """One batch's scored slots, on the device: what a family's forward reads beside the features.
    ``labels`` / ``label_mask`` [B, A, Bk-1]: slot k of the block at anchor p drafts token p+k,
    counted where the loss mask is set there; ``head``: the target's lm_head or its rows of the
    loss vocabulary, ``cols`` the labels' columns of its logits; ``targets``: the target's
    distribution at each slot on those columns (None when the loss reads none)."""
    ids: torch.Tensor
    anchors: torch.Tensor
    valid: torch.Tensor
    labels: torch.Tensor
    label_mask: torch.Tensor
    head: torch.nn.Module
    cols: torch.Tensor
    targets: SlotTargets | None = None


class DraftLoss:
    """The loss of one batch for the drafter on one device: ``self(features, batch) -> (loss,
    acc)`` device scalars. ``model`` is what the forward goes through (a DDP wrapper or the
    drafter itself); ``embed`` and ``lm_head`` are the target's, frozen."""

    def __init__(self, train, block_size: int, drafter: DFlashDrafter, embed, lm_head, device, model=None):
        self.train, self.block_size, self.device = train, block_size, torch.device(device)
        self.drafter, self.model = drafter, model or drafter
        self.embed, self.lm_head = embed, lm_head
        # the fixed decay of slots 1..B-1: the paper's weights, and always the accuracy's
        self.weights = decay_weights(block_size, train.loss_gamma or None).to(self.device)[1:]
        self.loss_vocab = None   # train.loss_vocab: the frequent token ids (see use_loss_vocab)
        self.target_dist = needs_target_distribution(train.loss, drafter.cfg.arch)
        self.chunk = loss_chunk_rows(train.loss_chunk, self.device)
        self.metrics: dict = {}  # the last batch's family metrics (device scalars; DSpark's terms)
        drafter.attention = train.attention

    def use_loss_vocab(self, samples) -> None:
        """With `train.loss_vocab=K`, score the loss over the K most frequent tokens of these
        (training) samples plus each batch's own tokens (model/loss_vocab.py)."""
        if self.train.loss_vocab:
            self.loss_vocab = frequent_tokens(samples, self.train.loss_vocab)

    def chunked(self) -> bool:
        """Whether the head runs chunk by chunk (model/head_loss.py): asked for, and the drafter
        reads nothing of the full logits itself (no copy head; not a family whose own terms read
        them: family/ `reads_full_logits`, DFlash2's selector, DSpark's Markov head)."""
        from .. import family
        return self.chunk > 0 and not self.drafter.copying and not family.of(self.drafter.cfg).reads_full_logits

    def slot_loss(self, logits, slots: Slots):
        """The per-slot loss `train.loss` names over the slots' logits [B, A, Bk-1, V'], weighted and
        normalised (model/losses.py `training_loss`): (loss, accuracy) device scalars."""
        return training_loss(logits, slots.cols, slots.valid, slots.label_mask, self.weights, self.train,
                             slots.targets)

    def chunked_loss(self, hidden, slots: Slots):
        """`slot_loss` from the slots' final hidden states, the head applied chunk by chunk
        (model/head_loss.py): never the whole [rows x vocabulary] logits at once."""
        t = self.train
        terms = head_loss.chunked_terms(hidden, slots.head, slots.cols, chunk=self.chunk, loss=t.loss,
                                        weighting=t.loss_weights, targets=slots.targets, lk_eta=t.lk_eta)
        return reduce_terms(terms, slots.valid, slots.label_mask, self.weights, weighting=t.loss_weights,
                            dpace_alpha=t.dpace_alpha)

    def __call__(self, features: torch.Tensor, batch: Batch):
        """(loss, accuracy) of the batch. With train.loss=kl|lk the features end with the
        target's last hidden state (model/losses.py `feature_ids`), unless the batch brings
        its top-k distribution from a capture."""
        last = None
        if self.target_dist and batch.kl_topk is None:
            n = self.drafter.fc.in_features
            features, last = features[..., :n], features[..., n:]
        dev, train, Bk = self.device, self.train, self.block_size
        ids = batch.input_ids.to(dev, non_blocking=True)
        lm = batch.loss_mask.to(dev, non_blocking=True)
        anchors, valid = sample_anchors(batch.loss_mask, train.num_anchors, Bk,
                                        generator=anchor_generator(train.seed, batch.index))
        anchors, valid = anchors.to(dev, non_blocking=True), valid.to(dev, non_blocking=True)
        labels, label_mask = slot_labels(ids, anchors, Bk), slot_label_mask(lm, anchors, Bk)
        head = self.lm_head
        if self.loss_vocab is not None:
            head = RowsHead(self.lm_head, batch_vocab(self.loss_vocab, batch.input_ids).to(dev, non_blocking=True))
        cols = head.to_subset(labels) if head is not self.lm_head else labels  # the labels' logit columns
        targets = self.slot_targets(last, batch, anchors, head) if self.target_dist else None
        slots = Slots(ids, anchors, valid, labels, label_mask, head, cols, targets)
        # the family's forward (through DDP when wrapped): fp32 master weights, the drafter autocasts
        # to the frozen embedding's dtype itself
        loss, acc, self.metrics = self.model(features, slots, self)
        return loss, acc

    def slot_targets(self, last, batch: Batch, anchors, head):
        """The target's next-token distribution for every slot (slot k of the block at p is
        token p+k, which the target predicts from position p+k-1), on the loss's columns:
        from its lm_head on the carried last hidden state ``last`` [B, S, H], or from the
        batch's captured top-k."""
        Bsz, A = anchors.shape
        K = self.block_size - 1
        S = batch.input_ids.shape[1]
        prev = (anchors[..., None] + torch.arange(K, device=self.device)).clamp(max=S - 1).view(Bsz, -1)
        rows_ids = head.ids if isinstance(head, RowsHead) else None

        def at(x):  # [B, S, C] -> [B, A, K, C] at the slots' predicting positions
            x = x.to(self.device, non_blocking=True)
            return torch.gather(x, 1, prev[..., None].expand(-1, -1, x.shape[-1])).view(Bsz, A, K, -1)

        if batch.kl_topk is not None:
            logp, tok = batch.kl_topk
            k = self.train.kl_topk or logp.shape[-1]
            return sparse_targets(at(logp[..., :k]).float(), at(tok[..., :k]), rows_ids)
        with torch.no_grad(), compute_precision(self.embed.weight):
            h = at(last).to(self.embed.weight.dtype)
            tl = self.lm_head(h.reshape(-1, h.shape[-1]))
        logp = torch.log_softmax(tl.float(), dim=-1).view(Bsz, A, K, -1)
        return target_slot_dist(logp, self.train.kl_topk, rows_ids)
