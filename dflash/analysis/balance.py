"""The balance answer: at which target:drafter ratio would neither side idle?

From measured per-batch stage times (spans of any run, one process or many ranks):
- target work per batch  = data_load (when a target rank loads its own batches)
  + model_forward + pack_hidden + cpu_copy_enqueue, less the time blocked on credits or
  a full queue (`blocked_s`: waiting, not work);
- drafter work per batch = drafter_forward + backward + optimizer_step, less the DDP
  all-reduce wait (`sync_s`).
Medians per stage, so warm-up and one-off stalls do not move the answer.

One target worker makes 1/T_t batches per second, one drafter 1/T_d; a layout of N
target and M drafter workers runs at min(N/T_t, M/T_d), and the side with spare
capacity idles the rest. Neither idles at N/M = T_t/T_d.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

TARGET_STAGES = ("data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue")
DRAFTER_STAGES = ("drafter_forward", "backward", "optimizer_step")
_CARVE = {"cpu_copy_enqueue": "blocked_s", "backward": "sync_s"}
CARVED = frozenset(_CARVE.values())  # attributes stalls.load checks are finite numbers


def _role(worker: str) -> str | None:
    return "target" if worker.startswith("target") else "drafter" if worker.startswith("drafter") else None


def measure(spans) -> dict | None:
    """Per-batch work of each role and the worker counts of the run; None without both roles."""
    per_stage: dict = defaultdict(list)
    workers: dict = defaultdict(set)
    for s in spans:
        a = s.get("attributes") or {}
        w = a.get("worker")
        role = _role(str(w)) if w is not None else None
        if role is None:
            continue
        rank = a.get("rank", (s.get("resource") or {}).get("rank", 0))
        workers[role].add((rank, w))
        if s["name"] in (TARGET_STAGES if role == "target" else DRAFTER_STAGES):
            d = (s["end_ns"] - s["start_ns"]) / 1e9
            carve = _CARVE.get(s["name"])
            if carve:
                d -= float(a.get(carve) or 0.0)
            per_stage[(role, s["name"])].append(max(0.0, d))
    if not workers["target"] or not workers["drafter"]:
        return None
    t = sum(statistics.median(v) for (r, _), v in per_stage.items() if r == "target")
    d = sum(statistics.median(v) for (r, _), v in per_stage.items() if r == "drafter")
    if t <= 0 or d <= 0:
        return None
    return {"target_s_per_batch": t, "drafter_s_per_batch": d,
            "targets": len(workers["target"]), "drafters": len(workers["drafter"])}


def answer(m: dict) -> dict:
    """The balanced ratio, what the current layout loses, and the best split of its ranks."""
    t, d, n, k = m["target_s_per_batch"], m["drafter_s_per_batch"], m["targets"], m["drafters"]
    supply, demand = n / t, k / d                      # batches/s either side could do
    rate = min(supply, demand)
    idle_side = "drafter" if supply < demand else "target" if demand < supply else None
    total = n + k
    best = max(((a, total - a) for a in range(1, total)), key=lambda p: (min(p[0] / t, p[1] / d), -p[0]))
    best_rate = min(best[0] / t, best[1] / d)
    return {
        "target_s_per_batch": round(t, 6), "drafter_s_per_batch": round(d, 6),
        "balanced_targets_per_drafter": round(t / d, 3),
        "layout": {"targets": n, "drafters": k},
        "batches_per_s": round(rate, 4),
        "idle_side": idle_side,
        # share of the idle side's capacity that waits on the other side
        "idle_fraction": round(1 - rate / max(supply, demand), 4),
        "best_split": {"targets": best[0], "drafters": best[1], "batches_per_s": round(best_rate, 4),
                       "speedup": round(best_rate / rate, 3)},
    }


def balance(spans) -> dict | None:
    m = measure(spans)
    return answer(m) if m else None


def format_balance(b: dict | None) -> list[str]:
    if not b:
        return ["", "balance: needs spans of both target and drafter workers"]
    n, k = b["layout"]["targets"], b["layout"]["drafters"]
    lines = ["", "balance (from median per-batch stage times)",
             f"  target work {b['target_s_per_batch'] * 1e3:.1f} ms/batch, drafter work "
             f"{b['drafter_s_per_batch'] * 1e3:.1f} ms/batch -> neither side idles at "
             f"{b['balanced_targets_per_drafter']:.2f} target workers per drafter worker",
             f"  this layout ({n} target : {k} drafter) runs at {b['batches_per_s']:.3f} batches/s"]
    if b["idle_side"]:
        lines.append(f"  the {b['idle_side']} side idles {b['idle_fraction']:.0%} of its capacity "
                     f"waiting for the other")
    bs = b["best_split"]
    if (bs["targets"], bs["drafters"]) != (n, k):
        lines.append(f"  best split of these {n + k} workers: target:{bs['targets']},drafter:{bs['drafters']} "
                     f"-> {bs['batches_per_s']:.3f} batches/s ({bs['speedup']:.2f}x)")
    else:
        lines.append("  this is already the best split of these workers")
    return lines
