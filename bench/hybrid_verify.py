"""Eval time on a hybrid (Gated-DeltaNet) target: snapshot/restore of the linear-attention
states (one verify = O(block)) against re-running the committed sequence (O(length)).

Both paths decode the same ShareGPT prompts with the same drafter; the outputs must be
identical token for token. Prints the two wall times and their ratio (goal on the CPU:
>= 3x); last line is one JSON object.

    .venv/bin/python bench/hybrid_verify.py [--prompts 4] [--max-new-tokens 96] [--block 16]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="tiny-qwen3.5")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--max-prompt-len", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch

    from dflash import data as data_mod
    from dflash import target as T
    from dflash.drafter import DFlashDrafter, DrafterConfig
    from dflash.spec_decode import cache_mode, speculative_generate

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    model, tok = T.load_target(a.target, seed=a.seed)
    L = T.num_layers(model)
    cfg = DrafterConfig.from_target(model.config, target_layer_ids=T.default_layer_ids(L, 3),
                                    vocab_size=model.get_input_embeddings().weight.shape[0], mask_token_id=16,
                                    block_size=a.block)
    torch.manual_seed(a.seed)
    drafter = DFlashDrafter(cfg).eval()  # untrained: mostly rejected drafts, a restore every step
    convs = data_mod.load_conversations(None, limit=4 * a.prompts, seed=a.seed)
    prompts = data_mod.prompts_for_eval(tok, convs, max_prompt_len=a.max_prompt_len)[: a.prompts]
    eos = {tok.eos_token_id}

    def run(mode):
        outs, steps = [], 0
        t0 = time.perf_counter()
        for p in prompts:
            r = speculative_generate(model, drafter, p, max_new_tokens=a.max_new_tokens, eos_ids=eos, mode=mode)
            outs.append(r.tokens)
            steps += len(r.acceptance)
        return time.perf_counter() - t0, outs, steps

    run("snapshot")  # warm-up (first calls are ~10x slower), excluded from the timing
    fast_s, fast, steps = run("snapshot")
    slow_s, slow, _ = run("rerun")
    res = {"target": a.target, "auto_mode": cache_mode(model), "prompts": len(prompts),
           "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": a.max_new_tokens, "block_size": a.block,
           "verify_steps": steps, "snapshot_s": round(fast_s, 3), "rerun_s": round(slow_s, 3),
           "ratio": round(slow_s / fast_s, 2), "identical": fast == slow}
    print(f"hybrid verify on {a.target}: snapshot {fast_s:.2f} s, re-run {slow_s:.2f} s -> "
          f"{res['ratio']:.2f}x faster over {steps} verify steps; identical output: {res['identical']}")
    print(json.dumps(res))
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
