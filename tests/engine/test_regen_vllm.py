"""`data.regen_engine: vllm` (issue 39): vLLM writes the replies HF's greedy generate writes,
token for token, from the same prompt ids, stopping where HF stops (after the first
end-of-sequence id, that id kept). One engine start: tiny-qwen3 at float32.

A random tiny target seldom emits its eos, so the stop is exercised with an extra stop id:
a token HF's own reply to one prompt emits mid-reply joins the target's eos ids, for both
engines (what `_eos_ids` reads: the generation config)."""
from __future__ import annotations

import time

N_CONVS, NEW, PROMPT = 6, 24, 48


def test_vllm_regenerates_what_hf_regenerates_token_for_token():
    from dflash.data import dataset as data_mod
    from dflash.model.target import load_target
    from dflash.config import load_config
    from dflash.prep.prepare import vllm_regenerator
    from dflash.prep.regenerate import regenerate

    target, tok = load_target("tiny-qwen3")
    convs = data_mod.load_conversations(None, limit=N_CONVS, seed=0)
    free = regenerate(target, tok, convs, max_new_tokens=NEW, max_prompt_len=PROMPT)
    replies = [c[-1]["token_ids"] for c in free]
    assert all(len(r) == NEW for r in replies), [len(r) for r in replies]  # no eos: the stop is ours
    # a stop id first met mid-reply (the random target's greedy replies mostly repeat one
    # token; on this data the third reply turns to another at position 21)
    r, k = next(((r, k) for r, rep in enumerate(replies) for k in range(1, NEW) if rep[k] not in rep[:k]), (0, 0))
    stop = replies[r][k]
    target.generation_config.eos_token_id = [tok.eos_token_id, stop]
    hf = [c[-1]["token_ids"] for c in regenerate(target, tok, convs, max_new_tokens=NEW, max_prompt_len=PROMPT)]
    assert k > 0 and len(hf[r]) == k + 1 and hf[r][-1] == stop  # HF stopped after it, kept it

    cfg = load_config(None, [], **{"model.target": "tiny-qwen3", "data.regen_engine": "vllm"})
    t0 = time.perf_counter()
    ours = [c[-1]["token_ids"] for c in regenerate(target, tok, convs, max_new_tokens=NEW, max_prompt_len=PROMPT,
                                                   engine=vllm_regenerator(cfg, target))]
    print(f"\nvLLM regeneration of {len(convs)} prompts: {time.perf_counter() - t0:.1f} s (engine start included)")
    for i, (a, b) in enumerate(zip(hf, ours)):
        assert a == b, f"prompt {i}: {divergence(target, tok, convs[i], a, b)}"
    print(f"equal: {sum(map(len, hf))} tokens over {len(hf)} replies; lengths {[len(r) for r in hf]}")


def test_vllm_regenerates_smollm2_as_hf_does():
    """A real target (SmolLM2-135M, fp32): 8 ShareGPT prompts, 32 new tokens, its own eos. The
    demo's whole data (265 prompts x 96 tokens) was equal too: bench/regen_engines.py."""
    from dflash.config import load_config
    from dflash.data import dataset as data_mod
    from dflash.model.target import load_target
    from dflash.prep.prepare import vllm_regenerator
    from dflash.prep.regenerate import regenerate

    target, tok = load_target("smollm2")
    convs = data_mod.load_conversations(None, limit=8, seed=0)
    hf = [c[-1]["token_ids"] for c in regenerate(target, tok, convs, max_new_tokens=32, max_prompt_len=PROMPT)]
    cfg = load_config(None, [], **{"model.target": "smollm2", "data.regen_engine": "vllm"})
    ours = [c[-1]["token_ids"] for c in regenerate(target, tok, convs, max_new_tokens=32, max_prompt_len=PROMPT,
                                                   engine=vllm_regenerator(cfg, target))]
    for i, (a, b) in enumerate(zip(hf, ours)):
        assert a == b, f"prompt {i}: {divergence(target, tok, convs[i], a, b)}"


def divergence(target, tok, conv, a: list[int], b: list[int]) -> str:
    """Where two replies part: the first differing position and the target's logit gap there
    between HF's token and vLLM's (a near-tie tips either way; a large gap is a bug)."""
    import torch

    from dflash.data.dataset import truncated_prompt

    k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    if k == min(len(a), len(b)):
        return f"one reply stops first: lengths {len(a)} vs {len(b)} (HF {a}, vLLM {b})"
    ids = truncated_prompt(tok, conv, PROMPT)[1] + a[:k]
    with torch.no_grad():
        logits = target(torch.tensor([ids])).logits[0, -1].float()
    return (f"first difference at reply position {k}: HF {a[k]} (logit {logits[a[k]]:.6f}) vs vLLM {b[k]} "
            f"(logit {logits[b[k]]:.6f}), gap {float(logits[a[k]] - logits[b[k]]):.3g}")
