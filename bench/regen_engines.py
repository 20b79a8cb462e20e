"""HF vs vLLM regeneration (data.regen_engine) on a config's training replies: are they the
same tokens, and where not, why (issue 39).

Both engines regenerate the same prompts through the run's own path (prep/prepare.py: the
shard cache, so HF's replies already on disk from a run are read back, not redone); vLLM runs
in .venv-vllm (`make vllm`). For each reply that differs, the target itself (unbatched, no
padding, the config's dtype) is asked at the first differing position: the logit gap between
HF's token and vLLM's there. A gap near zero is a near-tie that either engine may tip (HF
batches left-padded rows, vLLM its own kernels); a large one would be a bug.

    .venv/bin/python bench/regen_engines.py --config configs/demo.yaml

Prints a summary; the last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE, as dflash train's --set")
    ap.add_argument("--limit", type=int, default=0, help="only the first N training conversations (0: all)")
    a = ap.parse_args()

    import torch

    from dflash.config import load_config, resolve_dtype
    from dflash.data.dataset import truncated_prompt
    from dflash.model.target import load_target
    from dflash.prep.prepare import _regen_cached, split

    cfg_hf = load_config(a.config, [*a.set, "data.regen_engine=hf"])
    cfg_vllm = load_config(a.config, [*a.set, "data.regen_engine=vllm"])
    dtype = resolve_dtype(cfg_hf, "cpu")
    target, tok = load_target(cfg_hf.model.target, dtype=dtype, seed=cfg_hf.model.target_seed)
    convs, _ = split(cfg_hf)
    if a.limit:
        convs = convs[:a.limit]
    times = {}
    out = {}
    for name, cfg in (("hf", cfg_hf), ("vllm", cfg_vllm)):
        t0 = time.perf_counter()
        out[name] = [c[-1]["token_ids"] for c in _regen_cached(cfg, target, tok, convs, "cpu")[0]]
        times[name] = round(time.perf_counter() - t0, 1)

    new, plen = cfg_hf.data.regen_max_new_tokens, cfg_hf.data.regen_max_prompt_len
    rows, seen = [], set()
    for conv, h, v in zip(convs, out["hf"], out["vllm"]):
        ids = truncated_prompt(tok, conv, plen)[1]
        if tuple(ids) in seen:  # a prompt that occurs twice is generated once
            continue
        seen.add(tuple(ids))
        if h == v:
            rows.append({"equal": True, "len": len(h)})
            continue
        k = next((k for k, (x, y) in enumerate(zip(h, v)) if x != y), min(len(h), len(v)))
        row = {"equal": False, "len_hf": len(h), "len_vllm": len(v), "first_diff": k}
        if k < min(len(h), len(v)):
            with torch.no_grad():
                logits = target(torch.tensor([ids + h[:k]])).logits[0, -1].float()
            top = int(logits.argmax())
            row |= {"gap": float(logits[h[k]] - logits[v[k]]), "unbatched_argmax_is": (
                "hf" if top == h[k] else "vllm" if top == v[k] else "neither")}
        rows.append(row)

    eq = [r for r in rows if r["equal"]]
    diff = [r for r in rows if not r["equal"]]
    gaps = [abs(r["gap"]) for r in diff if "gap" in r]
    toks_equal = sum(r["len"] for r in eq) + sum(r["first_diff"] for r in diff)
    toks_all = sum(r["len"] for r in eq) + sum(r["len_hf"] for r in diff)
    print(f"\n{a.config}: {cfg_hf.model.target} at {str(dtype).removeprefix('torch.')}, {len(rows)} distinct prompts, "
          f"up to {new} new tokens")
    print(f"time: HF {times['hf']} s, vLLM {times['vllm']} s (engine start included; a cached side is a read)")
    print(f"replies equal token for token: {len(eq)} / {len(rows)}; tokens before the first difference: "
          f"{toks_equal} / {toks_all} ({100 * toks_equal / max(toks_all, 1):.2f}%)")
    if diff:
        firsts = sorted(r["first_diff"] for r in diff)
        print(f"differing replies: first difference at positions {firsts}")
        if gaps:
            print(f"HF-vs-vLLM logit gap at that position (unbatched target): median {statistics.median(gaps):.3g}, "
                  f"max {max(gaps):.3g}; the unbatched argmax there is HF's token in "
                  f"{sum(r.get('unbatched_argmax_is') == 'hf' for r in diff)}, vLLM's in "
                  f"{sum(r.get('unbatched_argmax_is') == 'vllm' for r in diff)}")
    print(json.dumps({"config": a.config, "target": cfg_hf.model.target, "dtype": str(dtype), "prompts": len(rows),
                      "equal": len(eq), "tokens_equal": toks_equal, "tokens": toks_all, "seconds": times,
                      "differing": diff}))


if __name__ == "__main__":
    main()
