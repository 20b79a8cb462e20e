"""Acceptance length (tau) of a drafter on held-out prompts, with a losslessness check.

"Lossless" means: for every prompt, the speculative output equals the target's own greedy
decode computed by the same target object (same dtype, device and cache implementation;
see spec_decode). In float32 that holds exactly. In bf16 a near-tie in the target's logits
can flip a token between the block-verify forward and the one-token reference forward,
so instead of a bare False we report how many prompts diverged, where each first
diverged, and the reference's top-1/top-2 logit margin there.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm

from ..data import dataset as data_mod
from .spec_decode import first_divergence, greedy_generate, speculative_generate
from .spec_sample import speculative_sample


def describe_lossless(res: dict) -> str:
    """One phrase for the console: 'lossless=True' or where the outputs diverged."""
    if res.get("lossless") is None:
        if res.get("temperature"):
            return "lossless=not checked per prompt at T>0 (a distribution property; see tests)"
        return "lossless=not checked"
    if res["lossless"]:
        return "lossless=True"
    firsts = ", ".join(f"prompt {d['prompt']} at token {d['position']} (margin {d['margin']:.3g})"
                       for d in res.get("lossless_divergences", [])[:3])
    return f"lossless=False: {res['lossless_divergent_prompts']}/{res['prompts']} prompts diverged; first: {firsts}"


def evaluate(target, drafter, tokenizer, convs, *, prompts: int, max_new_tokens: int,
             max_prompt_len: int, check_lossless: bool = True, progress: bool = True,
             stop=None, mode: str = "auto", keep_outputs: bool = False, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, seed: int = 0, prompt_ids: list | None = None) -> dict:
    """`stop` (a threading.Event): when set, finish the current prompt and return what was
    measured so far, marked ``interrupted`` (a preempted job must exit within its grace period).

    temperature > 0 samples (model/spec_sample.py; prompt i draws from a generator seeded
    seed + i); "lossless" is then a property of the output distribution, which tests check,
    not a per-prompt comparison: it is reported as not checked. `prompt_ids` replaces the
    prompts taken from `convs` (a replayed eval)."""
    ids = prompt_ids if prompt_ids is not None else \
        data_mod.prompts_for_eval(tokenizer, convs, max_prompt_len=max_prompt_len)[:prompts]
    sampled = temperature > 0
    check_lossless = check_lossless and not sampled
    gen_eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    eos = set(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    eos = {t for t in eos | {tokenizer.eos_token_id} if t is not None}
    B = drafter.cfg.block_size
    hist = [0] * (B + 1)
    taus, divergences, done, outputs, replay = [], [], 0, [], []
    decode_s, generated = 0.0, 0
    t0 = time.perf_counter()
    drafter.eval()
    for i, prompt in enumerate(tqdm(ids, desc="eval", disable=not progress, leave=False)):
        if stop is not None and stop.is_set():
            break
        t1 = time.perf_counter()
        if sampled:
            res = speculative_sample(target, drafter, prompt, max_new_tokens=max_new_tokens, eos_ids=eos, mode=mode,
                                     temperature=temperature, top_p=top_p, top_k=top_k,
                                     generator=torch.Generator().manual_seed(seed + i), stop=stop)
        else:
            res = speculative_generate(target, drafter, prompt, max_new_tokens=max_new_tokens, eos_ids=eos, mode=mode,
                                       stop=stop)
        decode_s += time.perf_counter() - t1
        margins: list = []
        ref = greedy_generate(target, prompt, max_new_tokens=max_new_tokens, eos_ids=eos, mode=mode,
                              margins=margins, stop=stop) if check_lossless else None
        if stop is not None and stop.is_set():
            break  # a prompt cut short is not counted: every figure below is over whole prompts
        generated += len(res.tokens)
        outputs.append(res.tokens)
        # enough for any other decoder to replay this prompt and compare step by step
        replay.append({"prompt_ids": list(prompt), "acceptance_lengths": list(res.acceptance),
                       "output_ids": list(res.tokens)})
        if res.acceptance:
            taus.append(res.tau)
        for a in res.acceptance:
            hist[a] += 1
        if ref is not None:
            pos = first_divergence(ref, res.tokens)
            if pos is not None:
                margin = margins[pos] if pos < len(margins) else float("nan")
                divergences.append({"prompt": i, "position": pos, "margin": round(margin, 6)})
        done += 1
    extra = {"outputs": outputs} if keep_outputs else {}
    return extra | {
        "acceptance_length": round(sum(taus) / max(1, len(taus)), 4),
        "per_prompt": [round(t, 4) for t in taus],  # the spread says how noisy a few prompts are
        "block_size": B,
        "prompts": done,
        "histogram": {str(k): hist[k] for k in range(1, B + 1)},
        "lossless": (not divergences) if check_lossless and done else None,
        "lossless_divergent_prompts": len(divergences),
        "lossless_mismatches": len(divergences),  # older name of the same count
        "lossless_divergences": divergences,      # [{prompt, position (first differing token), margin}]
        "dtype": str(target.dtype).removeprefix("torch."),
        "max_new_tokens": max_new_tokens,
        "temperature": temperature, "top_p": top_p, "top_k": top_k,
        "tokens_per_s": round(generated / decode_s, 2) if decode_s > 0 else None,  # decoding only
        "per_prompt_steps": replay,  # [{prompt_ids, acceptance_lengths (accepted + 1 per step), output_ids}]
        "stop_token_ids": sorted(eos),
        "interrupted": bool(stop is not None and stop.is_set()),
        "wall_s": round(time.perf_counter() - t0, 2),
    }
