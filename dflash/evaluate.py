"""Acceptance length (tau) of a drafter on held-out prompts, with a losslessness check."""
from __future__ import annotations

import time

from tqdm import tqdm

from . import data as data_mod
from .spec_decode import greedy_generate, speculative_generate


def evaluate(target, drafter, tokenizer, convs, *, prompts: int, max_new_tokens: int,
             max_prompt_len: int, check_lossless: bool = True, progress: bool = True) -> dict:
    ids = data_mod.prompts_for_eval(tokenizer, convs, max_prompt_len=max_prompt_len)[:prompts]
    gen_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    eos = set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    eos = {t for t in eos | {tokenizer.eos_token_id} if t is not None}
    B = drafter.cfg.block_size
    hist = [0] * (B + 1)
    taus, lossless, mismatches = [], True, 0
    t0 = time.perf_counter()
    drafter.eval()
    for prompt in tqdm(ids, desc="eval", disable=not progress, leave=False):
        res = speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, eos_ids=eos)
        if res.acceptance:
            taus.append(res.tau)
        for a in res.acceptance:
            hist[a] += 1
        if check_lossless:
            ref = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, eos_ids=eos)
            if ref != res.tokens:
                lossless, mismatches = False, mismatches + 1
    return {
        "acceptance_length": round(sum(taus) / max(1, len(taus)), 4),
        "block_size": B,
        "prompts": len(ids),
        "histogram": {str(k): hist[k] for k in range(1, B + 1)},
        "lossless": lossless if check_lossless else None,
        "lossless_mismatches": mismatches,
        "max_new_tokens": max_new_tokens,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
