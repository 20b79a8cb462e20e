"""How often the verdict's intervals hold the true ratio: a Monte Carlo check of
engine/pairing.interval (over the timed prompts and their rounds) and pairing.steps_interval
(over every held-out prompt, from the timed ones' time per forward pass), at a nominal 95%.

Synthetic verdicts shaped like the demo's: 16 held-out prompts (the demo's until 2026-12-08;
`--held-out 64` for its 64 since), the first 6 timed over 2 rounds; replies of 96 tokens (a fifth shorter); the drafter's tau per prompt skewed over
1.0-1.8; 40 ms a pass without speculation, 46 with the drafter; a prefill overhead of 50-200
ms a request. Regimes: a quiet host (1% jitter a request) and a noisy one (15%), a per-prompt
cost spread, a drift the pair of requests shares, and a cost per pass that moves with tau
(where the first-order model behind steps_interval is wrong). The truth is the ratio of the
expected times over the prompts' population (2M prompts, no jitter).

    .venv/bin/python bench/verdict_coverage.py                       # every regime, 1000 verdicts, ~1 min
    .venv/bin/python bench/verdict_coverage.py --sims 300 --regimes quiet,noisy
    .venv/bin/python bench/verdict_coverage.py --held-out 64                # the demos' held-out set since 2026-12-08

Prints a row per regime and interval: coverage, mean half-width, mean bias; the last line is
one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

N, P, R = 16, 6, 2
C_NONE, C_DRAFT = 0.040, 0.046  # s per forward pass

REGIMES = {
    "quiet": {"jitter": 0.01},
    "noisy": {"jitter": 0.15},
    "quiet+cost3%": {"jitter": 0.01, "cost_sd": 0.03},
    "noisy+cost3%": {"jitter": 0.15, "cost_sd": 0.03},
    "quiet+cost10%": {"jitter": 0.01, "cost_sd": 0.10},
    "drift20+jitter5": {"jitter": 0.05, "drift": 0.20, "cost_sd": 0.03},
    "cost+10%/tau": {"jitter": 0.01, "cost_sd": 0.03, "tau_cost": 0.10},
    "cost-10%/tau": {"jitter": 0.01, "cost_sd": 0.03, "tau_cost": -0.10},
    "cost+30%/tau": {"jitter": 0.01, "cost_sd": 0.03, "tau_cost": 0.30},
}


def prompts(rng, n: int, reg: dict):
    """Per prompt: passes without speculation and with the drafter, and each one's seconds."""
    import numpy as np

    L = np.where(rng.random(n) < 0.8, 96, rng.integers(20, 97, n))
    tau = 1.0 + 0.8 * rng.beta(1.5, 3.5, n)
    x_none = L.astype(float)
    x_draft = np.maximum(1, np.round(L / tau))
    prefill = 0.05 + 0.15 * rng.random(n)
    sd = reg.get("cost_sd", 0.0)
    g_none = np.exp(rng.normal(0, sd, n)) if sd else np.ones(n)
    g_draft = (np.exp(rng.normal(0, sd, n)) if sd else np.ones(n)) * (1 + reg.get("tau_cost", 0.0) * (tau - 1) / 0.8)
    return x_none, x_draft, prefill + C_NONE * g_none * x_none, prefill + C_DRAFT * g_draft * x_draft


def truth(reg: dict) -> float:
    import numpy as np

    _, _, t_none, t_draft = prompts(np.random.default_rng(12345), 2_000_000, reg)
    return float(t_none.mean() / t_draft.mean())


def verdict(rng, reg: dict):
    """One synthetic verdict: timed seconds [prompt][round] of both methods, passes on all N."""
    import numpy as np

    x_none, x_draft, t_none, t_draft = prompts(rng, N, reg)
    s, drift = reg["jitter"], reg.get("drift", 0.0)

    def jitter():
        return np.exp(rng.normal(0, s, (P, R)) - s * s / 2)
    shared = np.exp(rng.normal(0, drift, (P, R)) - drift ** 2 / 2) if drift else np.ones((P, R))
    return ((t_none[:P, None] * shared * jitter()).tolist(), (t_draft[:P, None] * shared * jitter()).tolist(),
            x_none.tolist(), x_draft.tolist())


def run(name: str, reg: dict, sims: int, resamples: int) -> dict:
    import numpy as np

    from dflash.engine.pairing import interval, steps_interval

    true = truth(reg)
    rng = np.random.default_rng(1)
    got = {k: {"covered": 0, "half_widths": [], "points": []} for k in ("interval", "steps_interval")}
    for i in range(sims):
        tn, td, xn, xd = verdict(rng, reg)
        for k, iv in (("interval", interval(tn, td, resamples=resamples, seed=i)),
                      ("steps_interval", steps_interval(tn, td, xn, xd, resamples=resamples, seed=i))):
            got[k]["covered"] += iv["low"] <= true <= iv["high"]
            got[k]["half_widths"].append(iv["half_width"])
            got[k]["points"].append(iv["point"])
    return {"truth": round(true, 4)} | {k: {"coverage": round(g["covered"] / sims, 3),
                                            "half_width": round(float(np.mean(g["half_widths"])), 4),
                                            "bias": round(float(np.mean(g["points"])) - true, 4)}
                                        for k, g in got.items()}


def main() -> int:
    global N, P, R  # the verdict's shape, for verdict() below
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sims", type=int, default=1000, help="synthetic verdicts per regime (default 1000)")
    ap.add_argument("--resamples", type=int, default=400, help="bootstrap draws per interval (the verdict's: 2000)")
    ap.add_argument("--regimes", default=",".join(REGIMES), help=f"a comma list of {', '.join(REGIMES)}")
    ap.add_argument("--held-out", type=int, default=N, help=f"held-out prompts (default {N}, the demo's until 2026-12-08; 64 since)")
    ap.add_argument("--timed", type=int, default=P, help=f"the first of them timed (default {P})")
    ap.add_argument("--rounds", type=int, default=R, help=f"rounds per timed prompt (default {R})")
    a = ap.parse_args()
    names = [n.strip() for n in a.regimes.split(",")]
    for what, ok, want in (("--sims", a.sims >= 10, "an integer >= 10"),
                           ("--resamples", a.resamples >= 100, "an integer >= 100"),
                           ("--timed", a.timed >= 2, "an integer >= 2"),
                           ("--held-out", a.held_out >= a.timed, f"an integer >= --timed ({a.timed})"),
                           ("--rounds", a.rounds >= 1, "an integer >= 1"),
                           ("--regimes", all(n in REGIMES for n in names) and names,
                            f"a comma list of {', '.join(REGIMES)}")):
        if not ok:
            print(f"verdict_coverage.py: {what}={getattr(a, what[2:].replace('-', '_'))!r}: expected {want}", file=sys.stderr)
            return 2
    N, P, R = a.held_out, a.timed, a.rounds
    out = {"sims": a.sims, "resamples": a.resamples, "nominal": 0.95, "held_out": N, "timed": P, "rounds": R,
           "regimes": {}}
    print(f"{'regime':18s} {'interval':15s} coverage  half-width  bias    ({a.sims} verdicts x {a.resamples} draws; "
          f"{N} held-out prompts, {P} timed x {R} rounds)")
    for name in names:
        t0 = time.monotonic()
        r = out["regimes"][name] = run(name, REGIMES[name], a.sims, a.resamples)
        for k in ("interval", "steps_interval"):
            print(f"{name:18s} {k:15s} {r[k]['coverage']:.3f}     {r[k]['half_width']:.4f}      "
                  f"{r[k]['bias']:+.4f}" + (f"  ({time.monotonic() - t0:.0f} s)" if k == "steps_interval" else ""),
                  flush=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
