"""The drafter's training loss, in one module: what a step minimises and what it reports.

Here, in model/ (not run/): the loss is a function of the drafter's logits, the labels and
the target's distribution, no more; it needs nothing of the run (workers, channels,
placement), and model/ is where the networks it scores live. Each drafter family's forward
(model/drafter.py, dflash2.py, dspark.py) calls `training_loss` once per step, through
model/objective.py's `slot_loss`, and adds its own terms, defined here too: DFlash2's selector
CE (weighted by `selector_loss`), DSpark's L1 distance and acceptance (`l1_per_slot`). The loss names (`LOSSES`, `WEIGHTINGS`) and
`needs_target_distribution` are config.py's: config validates `train.loss` with them and
must stay importable without torch (and below model/ in the import floors), so this module
reads them from there rather than the other way round.

Every loss is per scored slot (a block's slots 1..B-1 at each anchor), then weighted and
normalised as the paper's is: ``sum(w * l) / sum(w)``, with w = the slot's weight x the
label's loss mask x the anchor's validity.

- CE, ``train.loss=ce``: cross-entropy on the target's greedy token (the label) at every
  scored slot (DFlash paper, Eq. 4).
- The decay weights, ``train.loss_weights=decay``: w_k = exp(-(k-1)/gamma) for slot k >= 1
  (DFlash paper; gamma = `train.loss_gamma`, 0: by block size, 7 at block 16).
  `weighted_block_loss` is the paper's loss, CE with the decay, computed as it always was
  (its loss histories are guarded bit for bit: tests/integration/test_loss_guard.py);
  `block_loss` computes every other (loss, weighting) pair.
- KL, ``train.loss=kl``: forward KL(p || q) from the target's next-token distribution p at
  the slot's position to the drafter's q (vLLM speculators' `kl`, EAGLE-style
  distillation). p comes from the target's lm_head on its last hidden state (carried beside
  the fused features, or read from a capture as top-k log-probs); with
  ``train.kl_topk=k`` it is kept as its k most likely tokens plus one bucket for the rest of
  the mass ("tail"): the KL between the two distributions coarsened to those k+1 outcomes,
  a lower bound of the full KL that equals it when the top-k holds all the mass.
- LK, ``train.loss=lk``: the LK hybrid loss (Samarin et al., arXiv 2602.23881): with
  alpha = sum_v min(p_v, q_v), the probability that a sampled draft token is accepted,
  loss = lam * KL + (1 - lam) * (1 - alpha), lam = exp(-eta * alpha) with alpha detached:
  KL's dense gradient while the two barely overlap, acceptance itself once they do.
- D-PACE, ``train.loss_weights=dpace`` (the default; Wu et al., arXiv 2605.18810). The
  expected number of accepted drafts of a block is E = sum_i prod_{l<=i} q_l, q_l the
  drafter's probability of slot l's label; its derivative with respect to log q_k is
  sum_{i>=k} prod_{l<=i} q_l. Slot k's weight is that derivative, with q smoothed to
  s = (1 - a) q + a (a = `train.dpace_alpha`; an untrained drafter's q ~ 0 would otherwise
  zero every slot past the first) and held constant (no gradient through the weights).
  Slots whose label is masked pass through (s = 1) and weigh 0. The weights follow the
  drafter as it learns: a block's later slots gain weight once its early ones are right.
- Accuracy (reported, not trained on): the decay-weighted share of slots whose argmax is
  the label, whatever the loss and weights, so accuracies compare across losses.
- DFlash2's selector (model/dflash2.py, SpecForge's `dflash2_selector_loss_alpha`): its
  per-slot k-way CE, weighted as the paper's loss is (decay x mask), times
  `train.selector_loss_alpha`, added to the loss.
- DSpark (model/dspark.py; arXiv 2607.05147, NeMo's and speculators' recipes): per slot, on the
  logits with the Markov bias of the true previous token, `train.dspark_ce_alpha` x CE +
  `train.dspark_tv_alpha` x the L1 distance sum_v |p_v - q_v| to the target's distribution
  (`l1_per_slot`, over the same buckets as the KL when the target is kept as its top-k), weighted
  by `train.loss_weights`; with a confidence head, `train.dspark_confidence_alpha` x the BCE of
  its per-slot estimate against the acceptance sum_v min(p_v, q_v) = 1 - L1 / 2, decay-weighted.

With ``train.loss_vocab`` (the loss over a vocabulary subset V', model/loss_vocab.py) the
drafter's q lives on V' only. The KL's buckets are then the top-k tokens that are in V'
plus one bucket for everything else: the target's mass on tokens outside V' goes into its
tail, compared with the drafter's mass on V' outside the top-k. With ``kl_topk=0`` (the
full distribution) the target's mass outside V' is dropped (the drafter has none there).

Everything returns device tensors: no host reads (run/step.py's contract).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import LOSSES, WEIGHTINGS, needs_target_distribution

__all__ = ["LOSSES", "WEIGHTINGS", "needs_target_distribution", "decay_weights", "slot_weights",
           "accuracy", "weighted_block_loss", "SlotTargets", "target_slot_dist", "sparse_targets",
           "kl_per_slot", "lk_per_slot", "l1_per_slot", "dpace_weights", "block_loss", "training_loss", "selector_loss",
           "feature_ids", "SlotTerms", "per_slot", "slot_terms", "reduce_terms", "is_papers"]


# -- the weights -----------------------------------------------------------------------------
def decay_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """The paper's fixed decay: w_k = exp(-(k-1)/gamma) for slot k >= 1; slot 0 (the anchor
    itself) has weight 0. gamma None: 7 at block 16, 5 at 10, 4 at 8, else B / 2.3."""
    if gamma is None:
        gamma = {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2.3))
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def slot_weights(decay: torch.Tensor, label_mask: torch.Tensor, anchor_valid: torch.Tensor) -> torch.Tensor:
    """w [B, A, K] = decay [K] x the label's loss mask [B, A, K] x the anchor's validity [B, A]."""
    return decay[None, None, :] * label_mask * anchor_valid[..., None]


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


# -- accuracy (once, for every loss) --------------------------------------------------------
def accuracy(logits: torch.Tensor, labels: torch.Tensor, w_decay: torch.Tensor) -> torch.Tensor:
    """The decay-weighted share of slots whose argmax is the label: sum(w [argmax = label]) / sum(w)."""
    return ((logits.argmax(-1) == labels).float() * w_decay).sum() / w_decay.sum().clamp_min(1e-6)


# -- CE with the decay: the paper's loss ----------------------------------------------------
def weighted_block_loss(logits, labels, anchor_valid, label_mask, weights):
    """sum(w * CE) / sum(w); w = decay weight of the slot x loss mask of the label token.
    logits [B, A, K, V]; labels / label_mask [B, A, K]; weights [K] for slots 1..Bk-1.
    Returns (loss, acc) as device scalars, without host syncs: acc is the weighted share of
    slots whose argmax is the label (same weights as the loss)."""
    w = slot_weights(weights.to(logits.device), label_mask, anchor_valid)
    ce = F.cross_entropy(logits.float().flatten(0, 2), labels.flatten(), reduction="none").view_as(w)
    loss = (w * ce).sum() / w.sum().clamp_min(1e-6)
    return loss, accuracy(logits, labels, w)


# -- the target's distribution at each slot (KL, LK) ------------------------------------------
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


def _flat(tgt: SlotTargets) -> SlotTargets:
    k = tgt.logp.shape[-1]
    flat = lambda t: None if t is None else t.reshape(-1, k)  # noqa: E731
    return SlotTargets(flat(tgt.logp), flat(tgt.cols), flat(tgt.present))


# -- KL ---------------------------------------------------------------------------------------
def _kl_from_terms(p, logp, logq, tail) -> torch.Tensor:
    """sum_buckets p (log p - log q) [+ p_rest (log p_rest - log q_rest)]; 0 where p = 0."""
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


# -- LK ---------------------------------------------------------------------------------------
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


# -- the L1 distance (DSpark) ------------------------------------------------------------------
def l1_per_slot(logits: torch.Tensor, tgt: SlotTargets) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum_v |p_v - q_v|, sum_v min(p_v, q_v)) per slot: logits [..., V'] -> two [...]. Over the
    buckets the KL uses (the target's top-k and a tail, or every column); the second, the
    probability that a draft sampled from q is accepted against p, is 1 - the first / 2."""
    lead = logits.shape[:-1]
    p, _, q, _, tail = _bucket_terms(logits.reshape(-1, logits.shape[-1]), _flat(tgt))
    l1, alpha = (p - q).abs().sum(-1), torch.minimum(p, q).sum(-1)
    if tail is not None:
        q_rest = tail[1].exp()
        l1, alpha = l1 + (tail[0] - q_rest).abs(), alpha + torch.minimum(tail[0], q_rest)
    return l1.view(lead), alpha.view(lead)


# -- every other (loss, weighting) pair --------------------------------------------------------
@dataclass
class SlotTerms:
    """What the weighting and the normalisation read of each scored slot [B, A, K]: the
    per-slot loss ``per`` (with its gradient), the drafter's log-probability of the label
    ``label_logq`` (detached; D-PACE's weights read it, None when nothing does) and ``hit``
    (argmax = label, for the accuracy). From the full logits (`slot_terms`) or the head
    chunk by chunk (model/head_loss.py): the same numbers either way."""
    per: torch.Tensor
    label_logq: torch.Tensor | None
    hit: torch.Tensor


def per_slot(logits: torch.Tensor, labels: torch.Tensor, *, loss: str, need_label_logq: bool,
             targets: SlotTargets | None, lk_eta: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-slot loss [...], the label's log-probability [...] when needed, else None) from
    logits [..., V'] and labels [...]: the one definition both heads use."""
    label_logq = None
    if loss == "ce" or need_label_logq:
        lsm = F.log_softmax(logits.float(), dim=-1)
        label_logq = torch.gather(lsm, -1, labels[..., None]).squeeze(-1)
    if loss == "ce":
        per = -label_logq
    elif loss == "kl":
        per = kl_per_slot(logits, targets)
    else:
        per = lk_per_slot(logits, targets, lk_eta)
    return per, label_logq


def slot_terms(logits, labels, *, loss: str = "ce", weighting: str = "decay", targets: SlotTargets | None = None,
               lk_eta: float = 3.0) -> SlotTerms:
    """SlotTerms from the full logits [B, A, K, V']."""
    per, label_logq = per_slot(logits, labels, loss=loss, need_label_logq=weighting == "dpace", targets=targets,
                               lk_eta=lk_eta)
    return SlotTerms(per, None if label_logq is None else label_logq.detach(), logits.argmax(-1) == labels)


def reduce_terms(terms: SlotTerms, anchor_valid, label_mask, decay, *, weighting: str = "decay",
                 dpace_alpha: float = 0.5):
    """sum(w * l) / sum(w) and the decay-weighted accuracy from SlotTerms: (loss, acc)."""
    mask = label_mask * anchor_valid[..., None]
    w_decay = decay.to(terms.per.device)[None, None, :] * mask
    w = dpace_weights(terms.label_logq, mask, dpace_alpha) if weighting == "dpace" else w_decay
    value = (w * terms.per).sum() / w.sum().clamp_min(1e-6)
    acc = (terms.hit.float() * w_decay).sum() / w_decay.sum().clamp_min(1e-6)
    return value, acc


def block_loss(logits, labels, anchor_valid, label_mask, decay, *, loss: str = "ce", weighting: str = "decay",
               targets: SlotTargets | None = None, dpace_alpha: float = 0.5, lk_eta: float = 3.0):
    """The loss for every (loss, weighting) pair but the paper's (`weighted_block_loss`).

    logits [B, A, K, V']; labels / label_mask [B, A, K]; decay [K]: the fixed decay weights,
    used for weighting="decay" and always for the reported accuracy (so accuracies compare
    across losses). Returns (loss, acc) device scalars, no host sync."""
    check_names(loss, weighting)
    terms = slot_terms(logits, labels, loss=loss, weighting=weighting, targets=targets, lk_eta=lk_eta)
    return reduce_terms(terms, anchor_valid, label_mask, decay, weighting=weighting, dpace_alpha=dpace_alpha)


def check_names(loss: str, weighting: str) -> None:
    if loss not in LOSSES or weighting not in WEIGHTINGS:
        raise ValueError(f"unknown loss {loss!r} / weighting {weighting!r}: expected {LOSSES} / {WEIGHTINGS}")


def is_papers(train) -> bool:
    """CE with the fixed decay: the paper's loss, computed by `weighted_block_loss` as it always was."""
    return train.loss == "ce" and train.loss_weights == "decay"


def training_loss(logits, labels, anchor_valid, label_mask, decay, train, targets: SlotTargets | None = None):
    """The loss the `train` section asks for: (loss, acc) device scalars. CE with the decay is
    the paper's (`weighted_block_loss`, as it always was); the rest go through `block_loss`."""
    if is_papers(train):
        return weighted_block_loss(logits, labels, anchor_valid, label_mask, decay)
    return block_loss(logits, labels, anchor_valid, label_mask, decay, loss=train.loss,
                      weighting=train.loss_weights, targets=targets, dpace_alpha=train.dpace_alpha,
                      lk_eta=train.lk_eta)


# -- DFlash2's selector ------------------------------------------------------------------------
def selector_loss(selector_ce: torch.Tensor, decay: torch.Tensor, label_mask: torch.Tensor,
                  anchor_valid: torch.Tensor, alpha: float) -> torch.Tensor:
    """DFlash2's selector term, added to the loss: alpha x its per-slot k-way CE [B, A, K]
    (model/dflash2.py), weighted as the paper's loss is: alpha sum(w * CE) / sum(w),
    w = decay x loss mask x anchor validity, alpha = `train.selector_loss_alpha`."""
    w = decay[None, None, :] * label_mask.float() * anchor_valid[..., None]
    return alpha * (w * selector_ce).sum() / w.sum().clamp_min(1e-6)


# -- what the loss needs from the target ---------------------------------------------------------
def feature_ids(train_cfg, layer_ids, from_capture: bool, arch: str = "dflash") -> list[int]:
    """What the target side hands the drafter per token: the fused layers' features, and,
    when the loss needs the target's distribution (`train.loss`, or the drafter family ``arch``'s
    own loss) and no capture brings it (a capture keeps top-k log-probs instead), the target's
    last hidden state (`target.FINAL`) after them."""
    from .target import FINAL

    if needs_target_distribution(train_cfg.loss, arch) and not from_capture:
        return list(layer_ids) + [FINAL]
    return list(layer_ids)
