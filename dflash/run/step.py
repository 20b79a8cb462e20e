"""One training step of the drafter, with its loss and its learning-rate schedule, free of
host reads of device tensors:

    drafter_forward (anchors, one-pass block forward, loss) -> backward -> optimizer_step
    (clip, AdamW, cosine schedule)

Loss, accuracy and grad norm come back as device tensors and are read later:
`DeferredScalars`, at the end, copies them to the host without stalling the loop.

The losses beyond the paper's (`train.loss`, `train.loss_weights`), below `TrainStep`:

Every loss here is per scored slot (a block's slots 1..B-1 at each anchor), then weighted
and normalised as the paper's is: ``sum(w * l) / sum(w)``. The paper's loss, CE on the
target's greedy token with the fixed decay (`train.loss_weights=decay`), stays
`drafter.weighted_block_loss` untouched (its loss histories are guarded bit for bit); this
module adds the rest, D-PACE (the default weights) among them:

- ``train.loss=kl``: forward KL(p || q) from the target's next-token distribution p at the
  slot's position to the drafter's q. p comes from the target's lm_head on its last hidden
  state (carried beside the fused features, or read from a capture as top-k log-probs);
  with ``train.kl_topk=k`` it is kept as its k most likely tokens plus one bucket for the
  rest of the mass ("tail"): the KL between the two distributions coarsened to those k+1
  outcomes, a lower bound of the full KL that equals it when the top-k holds all the mass.
- ``train.loss=lk``: the LK hybrid loss (Samarin et al., arXiv 2602.23881): with
  alpha = sum_v min(p_v, q_v), the probability that a sampled draft token is accepted,
  loss = lam * KL + (1 - lam) * (1 - alpha), lam = exp(-eta * alpha) with alpha detached:
  KL's dense gradient while the two barely overlap, acceptance itself once they do.
- ``train.loss_weights=dpace``: D-PACE (Wu et al., arXiv 2605.18810). The expected number
  of accepted drafts of a block is E = sum_i prod_{l<=i} q_l, q_l the drafter's probability
  of slot l's label; its derivative with respect to log q_k is sum_{i>=k} prod_{l<=i} q_l.
  Slot k's weight is that derivative, with q smoothed to s = (1 - a) q + a (a =
  `train.dpace_alpha`; an untrained drafter's q ~ 0 would otherwise zero every slot past
  the first) and held constant (no gradient through the weights). Slots whose label is
  masked pass through (s = 1) and weigh 0. The weights follow the drafter as it learns:
  a block's later slots gain weight once its early ones are right.

With ``train.loss_vocab`` (the loss over a vocabulary subset V', model/loss_vocab.py) the
drafter's q lives on V' only. The KL's buckets are then the top-k tokens that are in V'
plus one bucket for everything else: the target's mass on tokens outside V' goes into its
tail, compared with the drafter's mass on V' outside the top-k. With ``kl_topk=0`` (the
full distribution) the target's mass outside V' is dropped (the drafter has none there).

The learning-rate schedule, at the end, is the DFlash recipe's: linear warm-up, then cosine to
zero. A LambdaLR over this function rather than torch's SequentialLR(LinearLR, CosineAnnealingLR):
those compute each factor from the previous one (chainable form), which drifts from the
closed form in the last bits (measured: 189 of 200 steps' rates differ, by up to 7e-19, at lr
6e-4 with 8 warm-up steps); the guard tests keep loss histories bit for bit.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import MAX_SEED, TrainConfig, needs_target_distribution
from ..data.batch import Batch
from ..model.drafter import DFlashDrafter, compute_precision, loss_weights, sample_anchors, weighted_block_loss
from ..model.loss_vocab import RowsHead, batch_vocab, frequent_tokens


class TrainStep:
    """Owns the trainable drafter, its optimizer and LR schedule on one device, and counts
    the optimizer steps taken (`step`). Takes the `train` section and the block size."""

    def __init__(self, train: TrainConfig, block_size: int, drafter: DFlashDrafter, embed, lm_head, device,
                 ddp=None):
        self.train, self.block_size, self.device = train, block_size, torch.device(device)
        self.drafter = drafter
        self.model = ddp or drafter  # what forward/backward go through (DDP wrapper or not)
        self.embed, self.lm_head = embed, lm_head
        params = [p for p in drafter.parameters() if p.requires_grad]
        # a parameter may ask for a multiple of the learning rate (`lr_scale`: the copy head's
        # bias, model/copy_head.py); the schedule scales every group alike
        scales = sorted({getattr(p, "lr_scale", 1.0) for p in params})
        groups = [{"params": [p for p in params if getattr(p, "lr_scale", 1.0) == sc], "lr": train.lr * sc}
                  for sc in scales]
        # fused AdamW: one kernel, and it honours `found_inf` on the device (see optimizer_step)
        self.opt = torch.optim.AdamW(groups, lr=train.lr, betas=(0.9, 0.95),
                                     weight_decay=train.weight_decay, fused=True)
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, cosine_with_warmup(max(1, train.steps), train.warmup_ratio))
        self.weights = loss_weights(block_size, train.loss_gamma or None).to(self.device)[1:]
        self.step = 0
        self.loss_vocab = None   # train.loss_vocab: the frequent token ids (see use_loss_vocab)
        # the paper's loss, CE + the fixed decay, kept as it always was (tests/integration/test_loss_guard.py)
        self.paper_loss = train.loss == "ce" and train.loss_weights == "decay"
        self.target_dist = needs_target_distribution(train.loss)

    def use_loss_vocab(self, samples) -> None:
        """With `train.loss_vocab=K`, score the loss over the K most frequent tokens of these
        (training) samples plus each batch's own tokens (model/loss_vocab.py)."""
        if self.train.loss_vocab:
            self.loss_vocab = frequent_tokens(samples, self.train.loss_vocab)

    def forward(self, features: torch.Tensor, batch: Batch):
        """drafter_forward: returns (loss, accuracy) device tensors. With train.loss=kl|lk the
        features end with the target's last hidden state (`feature_ids` below),
        unless the batch brings its top-k distribution from a capture."""
        last = None
        if self.target_dist and batch.kl_topk is None:
            n = self.drafter.fc.in_features
            features, last = features[..., :n], features[..., n:]
        ids = batch.input_ids.to(self.device, non_blocking=True)
        lm = batch.loss_mask.to(self.device, non_blocking=True)
        # anchors depend only on (seed, batch id): the same whichever worker or loop runs it
        # (wrapped into torch's seed range as config.derived_seed does; inline, so that a step
        # reads through no more files than it must: tests/integration/test_step_files.py)
        g = torch.Generator().manual_seed((self.train.seed * 1_000_003 + batch.index) % (MAX_SEED + 1))
        anchors, valid = sample_anchors(batch.loss_mask, self.train.num_anchors,
                                        self.block_size, generator=g)
        anchors, valid = anchors.to(self.device, non_blocking=True), valid.to(self.device, non_blocking=True)
        head = self.lm_head
        if self.loss_vocab is not None:
            head = RowsHead(self.lm_head, batch_vocab(self.loss_vocab, batch.input_ids).to(self.device,
                                                                                          non_blocking=True))
        # fp32 master weights; the drafter autocasts to the frozen embedding's dtype itself
        logits, labels = self.model(features, ids, anchors, valid, self.embed, head)
        if head is not self.lm_head:
            labels = head.to_subset(labels)
        Bk = self.block_size
        pos = anchors[..., None] + torch.arange(1, Bk, device=self.device)
        label_mask = torch.gather(lm, 1, pos.clamp(max=ids.shape[1] - 1).view(ids.shape[0], -1)).view_as(pos)
        if self.paper_loss:
            loss, acc = weighted_block_loss(logits, labels, valid, label_mask.float(), self.weights)
        else:
            targets = self.slot_targets(last, batch, anchors, head) if self.target_dist else None
            t = self.train
            loss, acc = block_loss(logits, labels, valid, label_mask.float(), self.weights, loss=t.loss,
                                   weighting=t.loss_weights, targets=targets, dpace_alpha=t.dpace_alpha,
                                   lk_eta=t.lk_eta)
        return self.add_selector_loss(loss, valid, label_mask), acc

    def add_selector_loss(self, loss, valid, label_mask):
        """DFlash2 (model/dflash2.py): + alpha x the selector's k-way CE, weighted per slot as
        the paper's loss is (decay x loss mask); a DFlash drafter's loss is returned as it is."""
        ce = getattr(self.drafter, "selector_ce", None)
        if ce is None:
            return loss
        self.drafter.selector_ce = None  # taken: the module holds no graph between steps (deepcopy, memory)
        w = self.weights[None, None, :] * label_mask.float() * valid[..., None]
        return loss + self.train.selector_loss_alpha * (w * ce).sum() / w.sum().clamp_min(1e-6)

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

    def backward(self, loss: torch.Tensor):
        loss.backward()

    def optimizer_step(self, loss: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, then update only when loss and grad norm are finite — decided on the device
        (no host read): fused AdamW skips the whole update (weights, moments, step count)
        when `found_inf` is set, the mechanism GradScaler uses. The LR schedule advances."""
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        gnorm = torch.nn.utils.clip_grad_norm_(params, self.train.grad_clip)
        finite = torch.isfinite(loss) & torch.isfinite(gnorm)
        self.opt.found_inf = (~finite).to(torch.float32)
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return gnorm.detach(), ~finite

    def state(self) -> dict:
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(), "step": self.step,
                "torch_rng": torch.get_rng_state()}

    def load_state(self, st: dict):
        self.opt.load_state_dict(st["optimizer"])
        self.sched.load_state_dict(st["scheduler"])
        self.step = st["step"]
        torch.set_rng_state(st["torch_rng"])


# -- the losses --------------------------------------------------------------------------
LOSSES = ("ce", "kl", "lk")
WEIGHTINGS = ("decay", "dpace")


@dataclass
class SlotTargets:
    """The target's distribution at every scored slot, on the drafter's logit columns.

    ``logp`` [..., k]: log-probabilities of the columns ``cols`` [..., k] (long), of which
    only ``present`` [..., k] (bool) are real (a top-k token outside the loss vocabulary is
    not). ``cols is None``: dense, ``logp`` holds every column of the drafter's logits."""
    logp: torch.Tensor
    cols: torch.Tensor | None = None
    present: torch.Tensor | None = None


def target_slot_dist(target_logp: torch.Tensor, topk: int, rows_ids: torch.Tensor | None) -> SlotTargets:
    """The target's full log-softmax rows [..., V] -> what the loss compares against:
    its top-k (k > 0) or all of it, moved onto the drafter's columns (the loss vocabulary
    ``rows_ids``, sorted ids, when one is in use)."""
    if topk > 0:
        logp, ids = target_logp.topk(min(topk, target_logp.shape[-1]), dim=-1)
        return sparse_targets(logp, ids, rows_ids)
    if rows_ids is not None:
        return SlotTargets(target_logp.index_select(-1, rows_ids.to(target_logp.device)))
    return SlotTargets(target_logp)


def sparse_targets(logp: torch.Tensor, ids: torch.Tensor, rows_ids: torch.Tensor | None) -> SlotTargets:
    """Top-k (log-prob, vocabulary id) pairs -> SlotTargets on the drafter's columns."""
    ids = ids.long()
    if rows_ids is None:
        return SlotTargets(logp.float(), ids, torch.ones_like(ids, dtype=torch.bool))
    rows_ids = rows_ids.to(ids.device)
    pos = torch.searchsorted(rows_ids, ids.contiguous()).clamp(max=rows_ids.numel() - 1)
    return SlotTargets(logp.float(), pos, rows_ids[pos] == ids)


def _bucket_terms(logits: torch.Tensor, tgt: SlotTargets):
    """Per slot row: (p, log p, q, log q) over the explicit buckets [N, k], and the tail
    (p_rest, log q_rest) [N] (None for a dense target: no tail). logits [N, V']."""
    logq = F.log_softmax(logits.float(), dim=-1)
    if tgt.cols is None:
        logp = tgt.logp.float()
        return logp.exp(), logp, logq.exp(), logq, None
    present = tgt.present
    logp = torch.where(present, tgt.logp.float(), torch.full_like(tgt.logp, float("-inf"), dtype=torch.float32))
    p = logp.exp()
    cols = torch.where(present, tgt.cols, torch.full_like(tgt.cols, logq.shape[-1]))  # absent: a dummy column
    logq_pad = torch.cat([logq, logq.new_full((logq.shape[0], 1), float("-inf"))], dim=-1)
    logq_k = torch.gather(logq_pad, -1, cols)
    covered = torch.zeros_like(logq_pad, dtype=torch.bool).scatter_(-1, cols, True)[:, :-1]
    # a finite fill: a logsumexp over -inf alone has a NaN gradient, even multiplied by 0
    logq_rest = torch.logsumexp(logq.masked_fill(covered, -1e30), dim=-1)
    # no tail where the buckets cover every column (then the drafter has no mass left to compare)
    p_rest = torch.where(covered.all(-1), torch.zeros_like(logq_rest), (1.0 - p.sum(-1)).clamp_min(0.0))
    return p, logp, logq_k.exp(), logq_k, (p_rest, logq_rest)


def _kl_from_terms(p, logp, logq, tail) -> torch.Tensor:
    kl = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)
    if tail is not None:
        p_rest, logq_rest = tail
        # p_rest log(p_rest / q_rest); 0 where p_rest = 0; the drafter never puts exactly 0 on a bucket
        kl = kl + torch.where(p_rest > 0, p_rest * (torch.log(p_rest.clamp_min(1e-30)) - logq_rest),
                              torch.zeros_like(p_rest))
    return kl


def kl_per_slot(logits: torch.Tensor, tgt: SlotTargets) -> torch.Tensor:
    """Forward KL(p || q) per slot: logits [..., V'] -> [...]."""
    lead = logits.shape[:-1]
    p, logp, _, logq, tail = _bucket_terms(logits.reshape(-1, logits.shape[-1]), _flat(tgt))
    return _kl_from_terms(p, logp, logq, tail).view(lead)


def lk_per_slot(logits: torch.Tensor, tgt: SlotTargets, eta: float) -> torch.Tensor:
    """The LK hybrid loss per slot: lam * KL + (1 - lam) * (1 - alpha), lam = exp(-eta * alpha),
    alpha = sum over buckets of min(p, q), detached in lam."""
    lead = logits.shape[:-1]
    p, logp, q, logq, tail = _bucket_terms(logits.reshape(-1, logits.shape[-1]), _flat(tgt))
    kl = _kl_from_terms(p, logp, logq, tail)
    alpha = torch.minimum(p, q).sum(-1)
    if tail is not None:
        alpha = alpha + torch.minimum(tail[0], tail[1].exp())
    lam = torch.exp(-eta * alpha.detach())
    return (lam * kl + (1.0 - lam) * (1.0 - alpha)).view(lead)


def _flat(tgt: SlotTargets) -> SlotTargets:
    k = tgt.logp.shape[-1]
    flat = lambda t: None if t is None else t.reshape(-1, k)  # noqa: E731
    return SlotTargets(flat(tgt.logp), flat(tgt.cols), flat(tgt.present))


def dpace_weights(label_logq: torch.Tensor, mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE weights [..., K] for slots 1..K of each block (module docstring), from the
    drafter's log-probability of each slot's label ``label_logq`` and the scored-slot
    ``mask``; no gradient flows through them."""
    with torch.no_grad():
        m = mask.float()
        s = (1.0 - alpha) * label_logq.float().exp() + alpha
        s = torch.where(m > 0, s, torch.ones_like(s))
        prefix = torch.cumprod(s, dim=-1)                       # prod_{l<=i} s_l
        suffix = torch.flip(torch.cumsum(torch.flip(prefix * m, [-1]), -1), [-1])  # sum_{i>=k}
        return suffix * m


def block_loss(logits, labels, anchor_valid, label_mask, decay, *, loss: str = "ce", weighting: str = "decay",
               targets: SlotTargets | None = None, dpace_alpha: float = 0.5, lk_eta: float = 3.0):
    """The loss for every (loss, weighting) pair but the paper's (drafter.weighted_block_loss).

    logits [B, A, K, V']; labels / label_mask [B, A, K]; decay [K]: the fixed decay weights,
    used for weighting="decay" and always for the reported accuracy (so accuracies compare
    across losses). Returns (loss, acc) device scalars, no host sync."""
    mask = label_mask * anchor_valid[..., None]
    w_decay = decay.to(logits.device)[None, None, :] * mask
    label_logq = None
    if loss == "ce" or weighting == "dpace":
        lsm = F.log_softmax(logits.float(), dim=-1)
        label_logq = torch.gather(lsm, -1, labels[..., None]).squeeze(-1)
    if loss == "ce":
        per = -label_logq
    elif loss == "kl":
        per = kl_per_slot(logits, targets)
    elif loss == "lk":
        per = lk_per_slot(logits, targets, lk_eta)
    else:
        raise ValueError(f"unknown loss {loss!r}")
    w = dpace_weights(label_logq, mask, dpace_alpha) if weighting == "dpace" else w_decay
    value = (w * per).sum() / w.sum().clamp_min(1e-6)
    acc = ((logits.argmax(-1) == labels).float() * w_decay).sum() / w_decay.sum().clamp_min(1e-6)
    return value, acc


def feature_ids(train_cfg, layer_ids, from_capture: bool) -> list[int]:
    """What the target side hands the drafter per token: the fused layers' features, and,
    when the loss needs the target's distribution and no capture brings it (a capture keeps
    top-k log-probs instead), the target's last hidden state (`target.FINAL`) after them."""
    from ..model.target import FINAL

    if needs_target_distribution(train_cfg.loss) and not from_capture:
        return list(layer_ids) + [FINAL]
    return list(layer_ids)


# -- the learning-rate schedule ----------------------------------------------------------
def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warm = max(1, int(round(total_steps * warmup_ratio)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = (step - warm) / max(1, total_steps - warm)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))
    return f


# -- reading the step's scalars back ------------------------------------------------------
class DeferredScalars:
    """Read device scalars (loss, accuracy, grad norm) without stalling the loop.

    `put` starts a non-blocking copy into pinned host memory and records a CUDA event;
    `ready` returns, in step order, the values whose copies have finished (event.query(),
    never synchronize). On CPU the values are there at once. The training loop calls `put`
    after every optimizer step (one tiny copy: the exact loss trajectory and the non-finite
    steps) and never waits for the answer; only `drain_blocking`, at a save or the end of
    the run, waits.
    """

    def __init__(self):
        self._pending: deque = deque()

    def put(self, step: int, **tensors: torch.Tensor) -> None:
        names = list(tensors)
        vals = torch.stack([t.detach().float().reshape(()) for t in tensors.values()])
        host, ev = self._start_copy(vals)
        self._pending.append((step, names, host, ev))

    @staticmethod
    def _start_copy(vals: torch.Tensor):
        """(host tensor, event that marks the copy done, or None when it already is)."""
        if not vals.is_cuda:
            return vals, None
        host = torch.empty(vals.shape, dtype=vals.dtype, pin_memory=True)
        host.copy_(vals, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(vals.device))  # the copy's device, not the current one
        return host, ev

    def ready(self) -> list[tuple[int, dict]]:
        out = []
        while self._pending and (self._pending[0][3] is None or self._pending[0][3].query()):
            step, names, host, _ = self._pending.popleft()
            out.append((step, dict(zip(names, host.tolist()))))
        return out

    def drain_blocking(self) -> list[tuple[int, dict]]:
        """End of run only: wait for what is left."""
        for *_, ev in self._pending:
            if ev is not None:
                ev.synchronize()
        return self.ready()
