"""Prompt lookup (n-gram drafting): draft what followed the last time the context's
latest tokens appeared. No model, no training: the free baseline every drafter is measured
against (SGLang and vLLM both offer it), and the proposal rule of the copy head
(model/copy_head.py).

The rule, for an anchor (the newest committed token) at position p of `ids`:
- find the latest j < p whose last n tokens equal the last n tokens ending at p, trying
  n = 3, then 2, then 1 (longest first: a longer match predicts better; latest among equals:
  a greedy target that loops repeats its most recent loop);
- propose ids[j+1], ids[j+2], ... up to `length` tokens, but only tokens that are known at p
  (j + k <= p): drafting never reads the tokens being drafted;
- no match: no proposal (the verify step is a plain decode step, acceptance 1).

Why this rule: it needs nothing but the ids; it is the copy head's rule, so the baseline and
a copy head propose alike; the most recent occurrence follows where the text is now (a
greedy target that loops repeats its latest loop); and under greedy decoding its acceptance
follows from the target's output alone (a proposal is accepted up to its first token that
differs), so a test checks it independently. vLLM's n-gram drafter matches alike (longest
n-gram up to prompt_lookup_max) but takes the earliest occurrence: on a loop whose period P
is shorter than the block, the latest occurrence can only propose P known tokens where the
earliest proposes a full block. SGLang's keeps a trie of recent n-grams.

Two forms of the one rule, checked against each other (tests/unit/test_copy_head.py):
`propose` for decoding (host lists, one anchor) and `candidates` for training batches
(tensors on the device, every anchor at once, no host sync).
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_NGRAM = 3
METHOD = "prompt_lookup"
RULE = ("the tokens that followed the latest earlier occurrence of the context's last n tokens, "
        f"n = {MAX_NGRAM} down to 1 (longest match first, then latest), known tokens only")


def propose(ids: list[int], length: int, max_n: int = MAX_NGRAM, *, earliest: bool = False) -> list[int]:
    """Prompt lookup's proposal for the anchor ids[-1]: at most `length` tokens. ``earliest``:
    vLLM's n-gram drafter's tie-break (the earliest occurrence of the longest match), which the
    engine's verdict counts ngram's steps with (engine/verdict.py)."""
    p = len(ids) - 1
    if p < 1 or length < 1:
        return []
    best_n, best_j = 0, -1
    for j in (range(p) if earliest else range(p - 1, -1, -1)):  # the first j with the longest match wins
        n = 0
        while n < max_n and n <= j and ids[j - n] == ids[p - n]:
            n += 1
        if n > best_n:
            best_n, best_j = n, j
            if n == max_n:
                break
    if best_n == 0:
        return []
    return ids[best_j + 1:min(best_j + 1 + length, p + 1)]


def accepted_on_output(prompt: list[int], out: list[int], *, max_new_tokens: int, block_size: int,
                       eos: set, proposer=None) -> list[int]:
    """accepted + 1 per verify step of prompt lookup decoding ``prompt`` greedily, from the
    target's greedy output ``out`` alone (continued a block past ``max_new_tokens``, as the last
    step may accept that far): a proposal is accepted up to its first token ``out`` does not
    have. The steps `speculative_generate` takes with PromptLookup: the first token comes from
    the prompt's forward, the last step counts whole, an end-of-sequence token ends it.
    ``proposer(ids, k)``: another lookup rule (bench/lookup_from_outputs.py: vLLM's tie-break)."""
    proposer = proposer or propose
    got, c = [], 1
    while c < max_new_tokens and c <= len(out) and out[c - 1] not in eos:
        proposal = proposer(prompt + out[:c], block_size - 1)
        m = 0
        while m < len(proposal) and c + m < len(out) and proposal[m] == out[c + m]:
            m += 1
        got.append(m + 1)
        kept = out[c:c + m + 1]
        c += m + 1
        if any(t in eos for t in kept):
            break
    return got


@dataclass
class PromptLookup:
    """The baseline as a drafter the speculative loops accept (decode/spec_decode.py,
    greedy and sampled): `block_size - 1` proposed tokens at most per verify step, taken
    as a deterministic draft (a point mass: at T > 0 the speculative-sampling rule accepts
    a token x with probability p(x), and the output stays distributed as the target's)."""
    block_size: int
    max_n: int = MAX_NGRAM
    method: str = METHOD

    def propose(self, ids: list[int]) -> list[int]:
        return propose(ids, self.block_size - 1, self.max_n)

    def eval(self):  # evaluate() puts a drafter in eval mode; nothing to do here
        return self


def candidates(ids, anchors, span: int, max_n: int = MAX_NGRAM):
    """The rule for many anchors at once. ids [B, S]; anchors [B, A] (positions p).
    Returns (cand [B, A, span] token ids, n [B, A] match length 0..max_n, ok [B, A, span]
    whether slot k has a proposal): slot k's proposal is cand[..., k] where ok."""
    import torch

    B, S = ids.shape
    j = torch.arange(S, device=ids.device)
    run = torch.ones(B, anchors.shape[1], S, dtype=torch.bool, device=ids.device)
    length = torch.zeros(B, anchors.shape[1], S, dtype=torch.long, device=ids.device)
    for m in range(max_n):
        at_anchor = torch.gather(ids, 1, (anchors - m).clamp(min=0))           # token p-m
        at_j = ids[:, (j - m).clamp(min=0)]                                     # token j-m
        same = (at_anchor[..., None] == at_j[:, None, :]) & (anchors >= m)[..., None] & (j >= m)
        run = run & same
        length = length + run.long()
    length = length * (j < anchors[..., None])                                  # strictly earlier
    best = (length * S + j).argmax(-1)                                          # longest, then latest
    n = torch.gather(length, 2, best[..., None])[..., 0]
    cpos = best[..., None] + torch.arange(1, span + 1, device=ids.device)
    cand = torch.gather(ids, 1, cpos.clamp(max=S - 1).view(B, -1)).view_as(cpos)
    ok = (n[..., None] > 0) & (cpos <= anchors[..., None])
    return cand, n, ok
