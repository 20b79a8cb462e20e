"""How wide would the verdict's interval be with more, shorter prompts? A simulation on a
run's own decoded prompts, so a design is chosen before an engine spends minutes on it.

Issue 55 asks for a half-width of 0.05 within the demo's ~4 minutes of verdict. The interval
is wide because the ratio differs from prompt to prompt (docs/serving.md), and only more
prompts narrow it; shorter replies let more prompts into the same seconds but make each one's
ratio noisier. This puts numbers on that trade-off without an engine: from RUN/summary.json,

- each held-out prompt's decoded steps (our decoder's accepted + 1 per verify step,
  `eval_after.per_prompt_steps`: greedy, so exactly the engine's steps for the drafter) and
  its greedy output (so prompt lookup's steps follow from it alone: model/prompt_lookup.py,
  vLLM's ngram up to its earliest-vs-latest match rule);
- the engine's measured cost of a step per method (`engine.methods.*.cost_per_step_ms.step`,
  the profiler window of the run's verdict) and a fixed prefill per request;

it prices each prompt cut to L tokens for none, ngram and the drafter, and gives per L the
per-prompt spread of each ratio (its influence on the ratio of totals), the prompts that fit
in the budget (every engine once per prompt), and the half-width they would give
(1.96 x spread / sqrt(prompts)). The spread is estimated from the run's held-out prompts: a guide
to the design, not a measured interval.

    .venv/bin/python bench/verdict_design.py --run runs/demo [--budget-s 256] [--lengths 16,24,32,48,64,96]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PREFILL_S = 0.1  # per request, every method alike (the prompts are <= 64 tokens)


def steps_for(lengths: list[int], tokens: int) -> int:
    """Verify steps until ``tokens`` tokens are out, from accepted + 1 per step."""
    done = n = 0
    for a in lengths:
        if done >= tokens:
            break
        done, n = done + a, n + 1
    return n


def spread(base: list[float], other: list[float]) -> tuple[float, float]:
    """The ratio of totals (other's speed over base's) and the SD of each prompt's influence on it."""
    r = sum(base) / sum(other)
    mean_other = statistics.mean(other)
    return r, statistics.stdev([(b - r * o) / mean_other for b, o in zip(base, other)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", default=str(ROOT / "runs" / "demo"))
    ap.add_argument("--budget-s", type=float, default=256.0, help="seconds of requests (the demo's verdict: ~256)")
    ap.add_argument("--lengths", default="16,24,32,48,64,96")
    a = ap.parse_args()
    try:
        lengths = [int(x) for x in a.lengths.split(",")]
        assert lengths and min(lengths) >= 1 and 0 < a.budget_s < 1e7  # inf and nan: not a budget
        s = json.loads((Path(a.run) / "summary.json").read_text())
        steps, block = s["eval_after"]["per_prompt_steps"], s["eval_after"]["block_size"]
        cost = {k: m["cost_per_step_ms"]["step"] / 1e3 for k, m in s["engine"]["methods"].items()
                if "step" in (m.get("cost_per_step_ms") or {})}
        drafter = next(k for k in cost if k not in ("none", "ngram"))
        assert "none" in cost and "ngram" in cost and len(steps) >= 3
        assert all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in cost.values())
        assert isinstance(block, int) and not isinstance(block, bool) and block >= 2
        for r in steps:  # each prompt's ids and our steps, whole: the drafter's steps cover its output
            assert all(isinstance(r[f], list) and all(isinstance(x, int) for x in r[f])
                       for f in ("prompt_ids", "output_ids", "acceptance_lengths"))
            assert sum(r["acceptance_lengths"]) >= len(r["output_ids"]) - 1
        assert max(lengths) <= max(len(r["output_ids"]) for r in steps)  # no row for tokens never decoded
    except (OSError, KeyError, ValueError, TypeError, AttributeError, AssertionError, StopIteration):
        print(f"verdict_design: --run {a.run} --lengths {a.lengths} --budget-s {a.budget_s}: expected a train --eval "
              "run with an engine verdict (summary.json), lengths >= 1 and no longer than its outputs, and a "
              "budget > 0", file=sys.stderr)
        sys.exit(2)
    from dflash.model.prompt_lookup import accepted_on_output, propose

    print(f"{len(steps)} prompts of {Path(a.run)}; cost per step (s): "
          + ", ".join(f"{k} {v:.4f}" for k, v in cost.items()) + f"; budget {a.budget_s:.0f} s of requests")
    rows = []
    for L in lengths:
        t = {"none": [], "ngram": [], "drafter": []}
        for r in steps:
            out = r["output_ids"][:L]
            n = len(out)
            lookup = accepted_on_output(r["prompt_ids"], out, max_new_tokens=n, block_size=block, eos=set(),
                                        proposer=lambda ids, k: propose(ids, k, earliest=True))  # vLLM's ngram rule
            t["none"].append(PREFILL_S + n * cost["none"])
            t["ngram"].append(PREFILL_S + steps_for(lookup, n) * cost["ngram"])
            t["drafter"].append(PREFILL_S + steps_for(r["acceptance_lengths"], n) * cost[drafter])
        fit = a.budget_s / sum(statistics.mean(v) for v in t.values())
        row = {"tokens": L, "prompts_in_budget": round(fit)}
        if fit < 3:  # a budget that fits fewer than 3 prompts decides nothing (engine/pairing.MIN_PROMPTS)
            print(f"{L:4d} tokens: {fit:.1f} prompts fit: too few to decide anything")
            rows.append(row)
            continue
        for base in ("none", "ngram"):
            ratio, sd = spread(t[base], t["drafter"])
            row[f"vs_{base}"] = {"ratio": round(ratio, 3), "spread": round(sd, 3),
                                 "half_width": round(1.96 * sd / math.sqrt(fit), 3)}
        rows.append(row)
        print(f"{L:4d} tokens: {row['prompts_in_budget']:3d} prompts fit; vs none {row['vs_none']['ratio']:.3f}x "
              f"+-{row['vs_none']['half_width']:.3f}; vs ngram {row['vs_ngram']['ratio']:.3f}x "
              f"+-{row['vs_ngram']['half_width']:.3f}")
    print(json.dumps({"run": a.run, "budget_s": a.budget_s, "rows": rows}))


if __name__ == "__main__":
    main()
