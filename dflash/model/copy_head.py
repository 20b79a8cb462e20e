"""`model.copy_head`: let the drafter copy from its context, with a weight it learns.

A greedy target repeats itself: SmolLM2-135M's regenerated replies loop so much that
drafting "what followed the last time these tokens appeared" (prompt lookup) alone gives
tau 1.78 at block 4 (bench/demo_ceiling.py), while a drafter trained for minutes on CPU
reaches ~1.45 and mostly on *other* positions. A DFlash drafter has to learn that copy
as a two-hop attention pattern per slot, which a few hundred replies do not teach.

The copy head hands it the match instead, pointer-generator style (See et al., 2017):
for an anchor at p it finds the latest j < p whose last n tokens (n <= 3, longest first)
equal those ending at p, and proposes token j+k for draft slot k (only tokens up to p
are known, so j+k <= p). The slot's distribution becomes a mixture,
    P = (1 - c) * softmax(drafter's logits) + c * [the proposal],
with the copy weight c = sigmoid(learned bias per (slot, match length) + a learned linear
read of the slot's hidden state). Mixing probabilities, not logits, lets a trusted copy win
over a confident drafter, and the hidden-state term lets the drafter say when it knows
better. c starts near 0 (an untrained drafter barely copies); training sets it.

Everything is tensor ops on the device (no host sync); training, the acceptance estimate
and decoding run the same code, so eval measures what training optimised.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# the proposal rule is prompt lookup's, in one place for the baseline and the copy head
from .prompt_lookup import MAX_NGRAM
from .prompt_lookup import candidates as copy_candidates

# The bias trains at this multiple of the learning rate (an optimizer param group, see
# TrainStep, run/step.py): Adam moves a parameter by about lr a step, and the copy weight's logit has
# to travel several units within a few hundred steps at lr ~1e-3. A larger learning rate
# rather than a scaled parameter keeps its gradient, and so the gradient-norm clip, fair.
BIAS_LR_SCALE = 16.0
PRIOR = -6.0   # the copy weight's logit at the start: c = 0.25%


class CopyHead(nn.Module):
    def __init__(self, span: int, hidden_size: int, max_n: int = MAX_NGRAM):
        super().__init__()
        self.span, self.max_n = span, max_n
        # bias[k, n]: draft slot k+1, match length n (row 0 unused: no match, no proposal)
        self.bias = nn.Parameter(torch.zeros(span, max_n + 1))
        self.bias.lr_scale = BIAS_LR_SCALE
        self.gate = nn.Linear(hidden_size, 1, bias=False)
        nn.init.zeros_(self.gate.weight)  # no say for the hidden state until training gives it one

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor, ids: torch.Tensor, anchors: torch.Tensor,
                columns=None) -> torch.Tensor:
        """logits [B, A, span, V] and the slots' final hidden [B, A, span, H] -> log-probabilities
        of the mixture, [B, A, span, V] in float32 (cross-entropy and argmax read them as logits).
        `columns` maps token ids to logit columns (a RowsHead's subset); None: identity."""
        cand, n, ok = copy_candidates(ids, anchors, self.span, self.max_n)
        col = (cand if columns is None else columns(cand))[..., None]
        # bias[k, n] by a gather (its backward is a scatter-add: no sort, no host sync on CUDA)
        row = torch.arange(self.span, device=ids.device) * (self.max_n + 1)
        idx = row + n[..., None]
        t = self.bias.flatten().gather(0, idx.flatten()).view_as(idx) + PRIOR
        t = t + self.gate(hidden.to(self.gate.weight.dtype))[..., 0]
        t = torch.where(ok, t, torch.full_like(t, -1e4))      # no proposal: weight ~0
        out = logits.float().log_softmax(-1) + F.logsigmoid(-t)[..., None]   # log((1 - c) p)
        mixed = torch.logaddexp(torch.gather(out, -1, col), F.logsigmoid(t)[..., None])
        return out.scatter(-1, col, mixed)
