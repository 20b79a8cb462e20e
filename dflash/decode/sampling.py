"""Sampling at temperature > 0, and the speculative-sampling rule that keeps it lossless.

The rule (Leviathan et al. 2023; Chen et al. 2023), per draft slot in order:
accept draft token x with probability min(1, p(x) / q(x)), p the target's distribution at
that position and q the drafter's; at the first rejection, sample the replacement from
normalize(max(0, p - q)) and stop; when every draft is accepted, sample the bonus token
from the target's distribution after the block. The output is then distributed exactly
as plain sampling from p. A draft taken by argmax is the point mass q = onehot(x).

p and q are both the *processed* distributions (temperature, then top-k, then top-p), as
the engines that serve DFlash and the reference code apply them.
"""
from __future__ import annotations

import torch


def probs(logits: torch.Tensor, temperature: float, top_p: float = 1.0, top_k: int = 0) -> torch.Tensor:
    """Sampling distribution (float32, last dim) of logits under temperature, top-k, top-p."""
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        sorted_p, order = p.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it included)
        keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
        p = torch.zeros_like(p).scatter(-1, order, sorted_p * keep)
        p = p / p.sum(-1, keepdim=True)
    return p


def draw(p: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of p ([..., V]) -> [...] long."""
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(p.shape[:-1])


def accept_block(draft: list[int], p: torch.Tensor, q: torch.Tensor | None,
                 generator: torch.Generator | None = None) -> tuple[int, int]:
    """The speculative-sampling rule over one verified block.

    draft: the K drafted tokens; p [K + 1, V]: the target's distributions at each draft
    slot and after the last; q [K, V]: the drafter's at each slot, or None for argmax
    drafts (a point mass on each draft token). Returns (accepted drafts, the next token:
    the replacement at the first rejection, or the bonus when all K are accepted)."""
    u = torch.rand(len(draft), generator=generator)
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        if u[i] * qx < px:  # u < p/q without dividing by a q of 0
            continue
        residual = p[i].clone()
        if q is None:
            residual[x] = 0.0
        else:
            residual = (residual - q[i]).clamp_min(0.0)
        total = float(residual.sum())
        # total is 0 only when p == q (then no rejection happens but by rounding): p itself is exact
        residual = residual / total if total > 0 else p[i]
        return i, int(draw(residual, generator))
    return len(draft), int(draw(p[len(draft)], generator))
