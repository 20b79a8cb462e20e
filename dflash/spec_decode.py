"""Draft-then-verify speculative decoding with a DFlash drafter (greedy, lossless).

One step: the drafter fills a block [anchor, MASK x (B-1)] from the context features of
every committed token before the anchor; the target verifies the whole block in one
forward; we keep the longest prefix the target agrees with plus the target's bonus
token. Acceptance length of the step = accepted drafts + 1 (so 1..B).

The target keeps its KV cache across steps (cropped back after a partial accept). Targets
whose cache cannot be cropped (hybrid linear-attention layers keep a recurrent state)
re-run the committed sequence instead: slower, same tokens.
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from .drafter import DFlashDrafter


@dataclass
class DecodeResult:
    tokens: list[int]
    acceptance: list[int] = field(default_factory=list)  # per verify step, 1..B

    @property
    def tau(self) -> float:
        return sum(self.acceptance) / max(1, len(self.acceptance))


def _features(out, layer_ids):
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


@functools.lru_cache(maxsize=None)
def _cache_arg(model_cls) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x: use what this one takes."""
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def _cache_kw(target, cache) -> dict:
    return {_cache_arg(type(target)): cache}


def _make_cache(target):
    try:
        cache = DynamicCache(config=target.config)
    except TypeError:
        cache = DynamicCache()
    return cache if getattr(cache, "is_croppable", True) else None


class _TargetRunner:
    """Target forwards that return (next-token argmax ids, features) for new tokens only."""

    def __init__(self, target, layer_ids):
        self.target, self.layer_ids = target, layer_ids
        self.cache = _make_cache(target)
        self.seq: list[int] = []  # tokens whose target forward is committed

    def forward(self, new_tokens: list[int]):
        dev = self.target.device
        if self.cache is not None:
            ids = torch.tensor([new_tokens], device=dev)
            out = self.target(input_ids=ids, **_cache_kw(self.target, self.cache), use_cache=True,
                              output_hidden_states=True)
            return out.logits[0].argmax(-1), _features(out, self.layer_ids)[0]
        ids = torch.tensor([self.seq + new_tokens], device=dev)
        out = self.target(input_ids=ids, use_cache=False, output_hidden_states=True)
        n = len(new_tokens)
        return out.logits[0, -n:].argmax(-1), _features(out, self.layer_ids)[0, -n:]

    def commit(self, tokens: list[int], kept: int):
        """tokens were forwarded; only the first `kept` of them stay in the sequence."""
        self.seq.extend(tokens[:kept])
        if self.cache is not None:
            extra = self.cache.get_seq_length() - len(self.seq)
            if extra > 0:  # transformers 5 crops by a negative count of tokens to drop
                self.cache.crop(-extra)


@torch.no_grad()
def speculative_generate(target, drafter: DFlashDrafter, prompt: list[int], *, max_new_tokens: int,
                         eos_ids: set[int] = frozenset()) -> DecodeResult:
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    layer_ids = drafter.cfg.target_layer_ids
    B = drafter.cfg.block_size
    runner = _TargetRunner(target, layer_ids)

    preds, feats = runner.forward(prompt)
    runner.commit(prompt, len(prompt))
    ctx_feats = feats  # features of committed positions 0..n-1
    out: list[int] = [int(preds[-1])]
    acceptance: list[int] = []
    while len(out) < max_new_tokens and out[-1] not in eos_ids:
        n = len(runner.seq)
        anchor = out[-1]
        ctx = drafter.fuse(ctx_feats[None].to(next(drafter.parameters()).dtype))
        ctx_kv = drafter.context_kv(ctx, torch.arange(n, device=ctx.device)[None])
        draft = drafter.draft(torch.tensor([anchor], device=ctx.device), n, ctx_kv, embed, lm_head)[0].tolist()
        block = [anchor] + draft
        preds, feats = runner.forward(block)
        preds = preds.tolist()
        accepted = 0
        while accepted < B - 1 and draft[accepted] == preds[accepted]:
            accepted += 1
        runner.commit(block, accepted + 1)
        ctx_feats = torch.cat([ctx_feats, feats[: accepted + 1]], dim=0)
        new = draft[:accepted] + [preds[accepted]]
        acceptance.append(accepted + 1)
        for t in new:  # stop exactly where plain greedy decoding would
            out.append(t)
            if len(out) >= max_new_tokens or t in eos_ids:
                break
    return DecodeResult(tokens=out[:max_new_tokens], acceptance=acceptance)


@torch.no_grad()
def greedy_generate(target, prompt: list[int], *, max_new_tokens: int, eos_ids: set[int] = frozenset()) -> list[int]:
    """The target's own greedy output, one token at a time: the losslessness reference."""
    runner = _TargetRunner(target, [])
    out: list[int] = []
    new = list(prompt)
    while len(out) < max_new_tokens:
        dev = target.device
        if runner.cache is not None:
            logits = target(input_ids=torch.tensor([new], device=dev), **_cache_kw(target, runner.cache),
                            use_cache=True).logits
        else:
            logits = target(input_ids=torch.tensor([runner.seq + new], device=dev), use_cache=False).logits
        runner.seq.extend(new)
        t = int(logits[0, -1].argmax())
        out.append(t)
        if t in eos_ids:
            break
        new = [t]
    return out
