"""Speculative decoding at temperature > 0: draft by sampling, verify by the
speculative-sampling rule (model/sampling.py), so the output is distributed as plain
sampling from the target.

The same loop as the greedy `spec_decode.speculative_generate` (one drafter block from the
committed context, one target forward over it, the target's cache cropped or restored to
what was kept); only the choice of tokens differs: drafts are drawn from the drafter's
processed distribution q, and acceptance is random. tau is then what a server running at
that temperature would see. A seeded `torch.Generator` makes a run repeatable.
"""
from __future__ import annotations

import torch

from . import sampling
from .drafter import DFlashDrafter
from .prompt_lookup import PromptLookup
from .spec_decode import DecodeResult, _TargetRunner, draft_source


@torch.no_grad()
def speculative_sample(target, drafter: DFlashDrafter | PromptLookup, prompt: list[int], *, max_new_tokens: int,
                       temperature: float, top_p: float = 1.0, top_k: int = 0,
                       eos_ids: set[int] = frozenset(), mode: str = "auto",
                       generator: torch.Generator | None = None, stop=None) -> DecodeResult:
    """``drafter``: a DFlash drafter, or `PromptLookup` whose proposal is a point mass (q =
    one-hot: accepted with probability p(x)). ``stop`` (a threading.Event): set, return
    after the current verify step."""
    source = draft_source(drafter, target)
    B = source.block_size
    runner = _TargetRunner(target, source.layer_ids, mode, max_pending=B)

    def dist(logits):  # on the CPU: the generator and the rule's host reads live there
        return sampling.probs(logits.float().cpu(), temperature, top_p, top_k)

    logits, new_feats = runner.forward_logits(prompt)
    runner.commit(prompt, len(prompt))
    out = [int(sampling.draw(dist(logits[-1]), generator))]
    acceptance: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in eos_ids and not (stop is not None and stop.is_set()):
        anchor = out[-1]
        draft, q = source.sample(runner.seq, anchor, new_feats, dist, generator)
        block = [anchor] + draft
        logits, feats = runner.forward_logits(block)
        accepted, nxt = sampling.accept_block(draft, dist(logits), q, generator)
        runner.commit(block, accepted + 1)
        new_feats = None if feats is None else feats[: accepted + 1]
        acceptance.append(accepted + 1)
        for t in draft[:accepted] + [nxt]:  # stop exactly where plain sampling would
            out.append(t)
            if len(out) >= max_new_tokens or t in eos_ids:
                break
    return DecodeResult(tokens=out[:max_new_tokens], acceptance=acceptance)
