"""Greedy verify on the CPU: the target's lm_head only for the rows the acceptance test reads.

Why: on the CPU a small target's verify forward is dominated by its lm_head, not by the
layers. Profiled on tiny-qwen3.5 (hidden 256, vocab 49152, one thread): a cached 16-token
verify costs ~70 ms, of which ~30 ms is the 16 x 49152 x 256 lm_head product and ~10 ms
the four Gated-DeltaNet layers' chunk rule (transformers' torch fallback: ~2.6 ms per call
for 1 to 64 tokens; its recurrent rule is cheaper only below ~8 tokens, so routing a
16-token block to it would be slower). The greedy acceptance test stops at the first draft
the target disagrees with, and the prefill reads only its last position; so we take the
decoder's final hidden states and project rows on demand: the first row read alone, then,
if the test reads on, every remaining row in one product. One row costs ~1/4 of sixteen
(a 1-row product is bound by reading the weight), so a rejected first draft saves ~3/4
of the lm_head and a fully accepted block costs one extra 1-row product.

On an accelerator the lm_head is memory-bound (one weight read for 1 or 16 rows) and a
second product adds a launch and a host sync, so there every row is computed at once, as
before. Only for causal LMs whose logits are exactly lm_head(decoder output): no final
soft-capping or logit scaling (argmax-invariant in exact arithmetic, not in rounding).

Exactness: each row's logits are lm_head(hidden row) in the target's dtype, the same
product as a 1-token decode step's (the greedy reference), so the acceptance decisions are
the ones the full block's logits give up to the product's rounding; ``evaluate`` checks
the output against the greedy reference as before.
"""
from __future__ import annotations

import torch

ENABLED = True  # off: every row at once, as before (bench/hybrid_verify.py --compare-full-logits)

# config fields that put something between lm_head and the logits (gemma2/3, cohere, granite)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def supported(target) -> bool:
    """Whether a target's greedy verify may project its hidden states lazily (see above)."""
    if not ENABLED or target.device.type != "cpu":
        return False
    cfg = target.config
    if any(getattr(cfg, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return False
    try:
        decoder, head = target.get_decoder(), target.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return False
    return decoder is not None and decoder is not target and isinstance(head, torch.nn.Linear)


class LazyArgmax:
    """argmax(lm_head(hidden[i])) for the rows of ``hidden`` [n, H], each computed when first
    read: the first row read alone, all the rows not yet computed on the next miss."""

    def __init__(self, hidden: torch.Tensor, lm_head: torch.nn.Module):
        self.hidden, self.lm_head = hidden, lm_head
        self._ids: list[int | None] = [None] * hidden.shape[0]
        self.rows_computed = 0

    def __len__(self) -> int:
        return len(self._ids)

    def _fill(self, rows: list[int]) -> None:
        ids = self.lm_head(self.hidden[rows]).argmax(-1).tolist()
        for r, t in zip(rows, ids):
            self._ids[r] = t
        self.rows_computed += len(rows)

    def __getitem__(self, i: int) -> int:
        i = range(len(self._ids))[i]  # negative indices, and IndexError past the end
        if self._ids[i] is None:
            self._fill([i] if self.rows_computed == 0 else [r for r, t in enumerate(self._ids) if t is None])
        return self._ids[i]

    def tolist(self) -> list[int]:
        missing = [r for r, t in enumerate(self._ids) if t is None]
        if missing:
            self._fill(missing)
        return list(self._ids)
