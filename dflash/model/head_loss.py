"""The lm_head and the per-slot loss chunk by chunk, never the full-vocabulary logits at once
(`train.loss_chunk`).

At the recipe's size the scored slots' logits are 4 x 512 x 15 rows x 151,936 columns: 18.7 G
values, ~75 GB in fp32, written by the forward and read again by the backward. Here the head
runs over ``chunk`` rows at a time and each chunk's logits live only while that chunk is
computed. The trick (Liger-Kernel's fused linear cross-entropy, and torch 2.13's chunked
`F.linear_cross_entropy`): the gradient is computed in the forward, chunk by chunk, while the
chunk's logits exist. Every per-slot loss here (CE, KL, LK) depends on its own row's logits
only, so d per_row / d h_row = (d per_row / d logits_row) @ W is known in the forward for any
weighting that comes later: the backward scales the saved [rows, H] gradient by the upstream
gradient of each row (the D-PACE or decay weight over their sum). Two head products per step,
as the full-logits path has (forward, and the backward's product with W), none repeated.

Why our own: Liger-Kernel's and Apple's cut-cross-entropy fuse CE on hard labels (Triton,
CUDA only; Liger's ``reduction="none"`` gradient was wrong in 0.6: linkedin/Liger-Kernel#968)
and torch's chunked `linear_cross_entropy` (torch >= 2.13; the device has 2.11) is CE too: none
computes the KL over the target's top-k plus a tail bucket, LK, or the per-slot weights D-PACE
derives from the forward. This is plain torch (the CPU twin and the GPU path are one code) and
reuses model/losses.py's per-slot definitions on each chunk, so the numbers are the same ones:
the loss equal to the full-logits path's to fp32 rounding (bit for bit when one chunk holds
every row), gradients to rounding (tests/unit/test_head_loss.py).

Not for a copy head (it mixes probabilities over the whole row and trains a gate on the slot's
hidden state) nor DFlash2 (its selector reads each slot's top-k logits): those keep the
full-logits path (model/objective.py decides). `model.draft_vocab` does not enter the training
loss at all (only drafting reads it); `train.loss_vocab` does: the head is then its rows
(RowsHead), and the chunks run over those columns.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .losses import SlotTargets, SlotTerms, per_slot


def head_weight(head) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight [V', H], bias [V'] or None) of an nn.Linear lm_head or a loss-vocabulary RowsHead."""
    if hasattr(head, "weight_and_bias"):
        return head.weight_and_bias()
    return head.weight, getattr(head, "bias", None)


class _ChunkedHeadLoss(torch.autograd.Function):
    """per [N] = loss(h @ W.T + b) row by row, in chunks; aux outputs label_logq and hit
    (no gradient). Backward: grad_h = grad_per[:, None] * g, g computed in the forward."""

    @staticmethod
    def forward(ctx, h, weight, bias, labels, tgt_logp, tgt_cols, tgt_present, loss, need_label_logq, lk_eta,
                chunk):
        N = h.shape[0]
        per = h.new_empty(N, dtype=torch.float32)
        logq = h.new_empty(N, dtype=torch.float32) if need_label_logq else None
        hit = torch.empty(N, dtype=torch.bool, device=h.device)
        grad = torch.empty_like(h)
        # the full-logits path runs the head under the drafter's autocast (the frozen head's
        # dtype) and the loss outside it: the same here, explicitly
        with torch.autocast(h.device.type, enabled=False):
            for r0 in range(0, N, chunk):
                r1 = min(N, r0 + chunk)
                with torch.enable_grad():
                    z = F.linear(h[r0:r1].to(weight.dtype), weight, bias).detach().requires_grad_(True)
                    tgt = None
                    if tgt_logp is not None:
                        tgt = SlotTargets(tgt_logp[r0:r1], None if tgt_cols is None else tgt_cols[r0:r1],
                                          None if tgt_present is None else tgt_present[r0:r1])
                    p, lq = per_slot(z, labels[r0:r1], loss=loss, need_label_logq=need_label_logq, targets=tgt,
                                     lk_eta=lk_eta)
                    # each row's loss reads its own row only: the gradient of the sum is every row's own
                    (dz,) = torch.autograd.grad(p.sum(), z)
                per[r0:r1] = p.detach()
                if logq is not None:
                    logq[r0:r1] = lq.detach()
                hit[r0:r1] = z.detach().argmax(-1) == labels[r0:r1]
                grad[r0:r1] = (dz.to(weight.dtype) @ weight).to(h.dtype)
                del z, dz, p, lq
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(hit)
        if logq is not None:
            ctx.mark_non_differentiable(logq)
        return per, logq, hit

    @staticmethod
    def backward(ctx, grad_per, _grad_logq, _grad_hit):
        (grad,) = ctx.saved_tensors
        grad_h = (grad_per[:, None] * grad.float()).to(grad.dtype)
        return grad_h, None, None, None, None, None, None, None, None, None, None


def chunked_terms(hidden: torch.Tensor, head, labels: torch.Tensor, *, loss: str = "ce", weighting: str = "decay",
                  targets: SlotTargets | None = None, lk_eta: float = 3.0, chunk: int = 4096) -> SlotTerms:
    """SlotTerms of the slots' final hidden states ``hidden`` [B, A, K, H] through ``head``
    (the lm_head or a RowsHead; its columns are what ``labels`` [B, A, K] and ``targets``
    index), ``chunk`` rows at a time. Equal to `losses.slot_terms(head(hidden), ...)`."""
    lead = labels.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    weight, bias = head_weight(head)
    tgt_logp = tgt_cols = tgt_present = None
    if targets is not None:
        k = targets.logp.shape[-1]
        tgt_logp = targets.logp.reshape(-1, k)
        tgt_cols = None if targets.cols is None else targets.cols.reshape(-1, k)
        tgt_present = None if targets.present is None else targets.present.reshape(-1, k)
    per, logq, hit = _ChunkedHeadLoss.apply(h, weight.detach(), None if bias is None else bias.detach(),
                                            labels.reshape(-1), tgt_logp, tgt_cols, tgt_present, loss,
                                            weighting == "dpace", lk_eta, max(1, int(chunk)))
    return SlotTerms(per.view(lead), None if logq is None else logq.view(lead), hit.view(lead))
