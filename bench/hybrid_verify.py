"""Eval time on a hybrid (Gated-DeltaNet) target: the cached path (snapshot/restore of the
linear-attention states, one verify = O(block); on the CPU the lm_head only for the rows
the acceptance test reads, see dflash/model/lazy_logits.py) against re-running the
committed sequence with every row's logits (O(length)), the path every hybrid eval took
before.

Two figures, same ShareGPT prompts, same (untrained: mostly rejected, so a restore every
step) drafter; outputs must be identical token for token:
- eval: what `dflash eval` does per prompt, speculative decode plus the target's greedy
  reference (which re-ran the sequence for every token on the old path, and now decodes
  through the cache) — the issue's goal, >= 3x on the CPU;
- speculative decode alone.
The ratio grows with the length (the old path is O(length) per forward). On the CPU a
short sequence's forward is mostly fixed cost: profiled on tiny-qwen3.5 (one thread), a
16-token cached verify was ~70 ms, ~30 of it the lm_head over the 16 rows (now ~1 row when
the first draft is rejected) and ~10 the four Gated-DeltaNet layers' torch chunk rule
(~2.6 ms a call for 1 to 64 tokens; the recurrent rule is slower from ~8 tokens on, so it
is not used for blocks), and the drafter's own step (~35 ms) is the same on both paths.
Measured (one thread, shared machine): eval 1.82x at 44-58-token prompts + 32 new tokens,
3.63x at 256 + 64, 5.66x at 512 + 96 (docs/measurements.md). With flash-linear-attention on
a GPU the cost follows the length. `--compare-full-logits` also times the cached path with
every row's logits (lazy_logits off) in the same rotation; `--threads 1` steadies the
figures on a shared machine. Last line: one JSON object.

    .venv/bin/python bench/hybrid_verify.py [--prompts 3] [--max-new-tokens 48] [--block 16]
        [--max-prompt-len 128] [--min-prompt-tokens 0] [--threads N] [--compare-full-logits]
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
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--max-prompt-len", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--min-prompt-tokens", type=int, default=0, help="only prompts at least this long")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-full-logits", action="store_true",
                    help="also time the cached path with every row's logits (lazy_logits off), in the same rotation")
    ap.add_argument("--threads", type=int, default=0,
                    help="torch CPU threads (default min(4, cores)); 1 steadies the figures on a shared machine")
    a = ap.parse_args()

    import torch

    from dflash.data import dataset as data_mod
    from dflash.decode.spec_decode import cache_mode, greedy_generate, speculative_generate
    from dflash.model import lazy_logits
    from dflash.model import target as T
    from dflash.model.drafter import DFlashDrafter, DrafterConfig

    torch.set_num_threads(a.threads or max(1, min(4, os.cpu_count() or 1)))
    model, tok = T.load_target(a.target, seed=a.seed)
    L = T.num_layers(model)
    cfg = DrafterConfig.from_target(model.config, target_layer_ids=T.default_layer_ids(L, 3),
                                    vocab_size=model.get_input_embeddings().weight.shape[0], mask_token_id=16,
                                    block_size=a.block)
    torch.manual_seed(a.seed)
    drafter = DFlashDrafter(cfg).eval()  # untrained: mostly rejected drafts, a restore every step
    pool = data_mod.load_conversations(None, limit=max(12, 8 * a.prompts), seed=a.seed)
    lens = data_mod.prompts_for_eval(tok, pool, max_prompt_len=a.max_prompt_len)
    prompts = [p for p in lens if len(p) >= a.min_prompt_tokens][: a.prompts]
    eos = {tok.eos_token_id}

    def timed(mode, p):
        lazy_logits.ENABLED = mode != "snapshot-full"
        mode = mode.replace("-full", "")
        t0 = time.perf_counter()
        r = speculative_generate(model, drafter, p, max_new_tokens=a.max_new_tokens, eos_ids=eos, mode=mode)
        t1 = time.perf_counter()
        ref = greedy_generate(model, p, max_new_tokens=a.max_new_tokens, eos_ids=eos, mode=mode)
        return t1 - t0, time.perf_counter() - t1, r, ref

    timed("snapshot", prompts[0])  # warm-up (first calls are ~10x slower), excluded from the timing
    modes = ("snapshot", "rerun") + (("snapshot-full",) if a.compare_full_logits else ())
    dec, ref_s = dict.fromkeys(modes, 0.0), dict.fromkeys(modes, 0.0)
    outs, lossless, steps = {m: [] for m in modes}, {m: True for m in modes}, 0
    for i, p in enumerate(prompts):  # modes rotate per prompt: a shared machine's drift hits all
        for mode in modes[i % len(modes):] + modes[:i % len(modes)]:
            d, g, r, ref = timed(mode, p)
            dec[mode] += d
            ref_s[mode] += g
            outs[mode].append(r.tokens)
            lossless[mode] &= r.tokens == ref
            steps += len(r.acceptance) if mode == "snapshot" else 0
    ev = {m: dec[m] + ref_s[m] for m in modes}
    res = {"target": a.target, "auto_mode": cache_mode(model), "prompts": len(prompts),
           "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": a.max_new_tokens, "block_size": a.block,
           "verify_steps": steps,
           "decode_snapshot_s": round(dec["snapshot"], 3), "decode_rerun_s": round(dec["rerun"], 3),
           "decode_ratio": round(dec["rerun"] / dec["snapshot"], 2),
           "eval_snapshot_s": round(ev["snapshot"], 3), "eval_rerun_s": round(ev["rerun"], 3),
           "eval_ratio": round(ev["rerun"] / ev["snapshot"], 2),
           "identical": all(outs[m] == outs["rerun"] for m in modes), "lossless": [lossless[m] for m in modes]}
    if a.compare_full_logits:  # the cached path as it was before lazy_logits
        res.update(decode_snapshot_full_logits_s=round(dec["snapshot-full"], 3),
                   eval_snapshot_full_logits_s=round(ev["snapshot-full"], 3),
                   eval_ratio_full_logits=round(ev["rerun"] / ev["snapshot-full"], 2))
    print(f"hybrid eval on {a.target} (speculative decode + greedy reference, {len(prompts)} prompts): "
          f"snapshot {ev['snapshot']:.2f} s, re-run {ev['rerun']:.2f} s -> {res['eval_ratio']:.2f}x faster")
    print(f"speculative decode alone: snapshot {dec['snapshot']:.2f} s, re-run {dec['rerun']:.2f} s -> "
          f"{res['decode_ratio']:.2f}x over {steps} verify steps; identical output: {res['identical']}")
    if a.compare_full_logits:
        print(f"cached path with every row's logits: eval {ev['snapshot-full']:.2f} s -> "
              f"{res['eval_ratio_full_logits']:.2f}x; decode {dec['snapshot-full']:.2f} s")
    print(json.dumps(res))
    return 0 if res["identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
