"""The start-up section of `dflash stalls`: where the time before the first step went, read
from the run's own trace (dflash/phases.py: a root span per command, a process span per rank,
their phases as children).

- before the first step, per rank: from the rank's start to its first stage span, and the
  phases that filled it (the top-level ones: loading, data, regeneration, ...);
- the longest phase of the run (any rank, any depth);
- the first collective (a phase marked `collective`: joining the ranks, a broadcast): the
  rank that reached it last is the one every other rank waited for, and how long each did.

Spans from a run dir's files or Jaeger (stalls.py loads both the same way).
"""
from __future__ import annotations

from collections import defaultdict

KIND = "otel.kind"


def _rank(span) -> int:
    a, res = span.get("attributes") or {}, span.get("resource") or {}
    try:
        return int(a.get("rank", res.get("rank", 0)))
    except (TypeError, ValueError, OverflowError):
        return 0


def _s(ns: int) -> float:
    return ns / 1e9


def startup(spans: list[dict]) -> dict | None:
    """The start-up report, or None when the spans hold no run trace (an older run)."""
    run = [s for s in spans if (s.get("attributes") or {}).get(KIND) in ("run", "process", "phase")]
    if not run:
        return None
    tops = {s["span_id"]: s for s in run if s["attributes"][KIND] in ("run", "process")}
    root = next((s for s in run if s["attributes"][KIND] == "run"), None)
    phases = [s for s in run if s["attributes"][KIND] == "phase"]
    by_rank_start: dict[int, int] = {}
    for s in tops.values():  # a rank's start: its process span (or the root: a single process)
        r = _rank(s)
        if s["attributes"][KIND] == "process" or r not in by_rank_start:
            by_rank_start[r] = s["start_ns"]
    for s in phases:  # a rank whose process span is missing (killed): its earliest phase
        r = _rank(s)
        by_rank_start[r] = min(by_rank_start.get(r, s["start_ns"]), s["start_ns"])
    t0 = min(by_rank_start.values())
    first_step: dict[int, int] = {}
    for s in spans:
        a = s.get("attributes") or {}
        # a step's stage; a checkpoint's spans (the final save of a run of 0 steps too) are no step
        if a.get("worker") is not None and not a.get(KIND) and not s["name"].startswith("checkpoint"):
            r = _rank(s)
            first_step[r] = min(first_step.get(r, s["start_ns"]), s["start_ns"])
    # a rank's top-level phases: under its root or process span, or under one that was never
    # written (a SIGKILL, the OOM killer: those spans end with the process, their phases are on disk)
    phase_ids = {s["span_id"] for s in phases}
    ranks = []
    for r in sorted(by_rank_start):
        start = by_rank_start[r]
        until = first_step.get(r)
        top_level = [s for s in phases if _rank(s) == r and s.get("parent_span_id") not in phase_ids]
        before = [s for s in top_level if until is None or s["start_ns"] < until]
        by_phase: dict[str, float] = defaultdict(float)
        for s in before:
            by_phase[s["name"]] += _s(min(s["end_ns"], until or s["end_ns"]) - s["start_ns"])
        ranks.append({"rank": r, "start_s": _s(start - t0), "first_step_s": _s(until - start) if until else None,
                      "phases": dict(sorted(by_phase.items(), key=lambda kv: -kv[1]))})
    longest = max(phases, key=lambda s: s["end_ns"] - s["start_ns"], default=None)
    out = {"trace_id": (root or next(iter(tops.values()), phases[0] if phases else {})).get("trace_id"),
           "command": root["name"] if root else None,
           "wall_s": _s(root["end_ns"] - root["start_ns"]) if root else None,
           "root_missing": root is None,  # still running, or killed before it ended (SIGKILL, out of memory)
           "ranks": ranks,
           "longest_phase": {"phase": longest["name"], "rank": _rank(longest),
                             "seconds": _s(longest["end_ns"] - longest["start_ns"]),
                             "failed": (longest.get("status") or {}).get("code") == 2} if longest else None,
           "first_collective": _first_collective(phases),
           "failed": [{"phase": s["name"], "rank": _rank(s), "error": _error_of(s)} for s in phases
                      if (s.get("status") or {}).get("code") == 2]}
    return out


def coverage(spans: list[dict], t0_ns: int, t1_ns: int) -> dict:
    """How much of a wall [t0, t1] (a process's, timed from outside) the run's trace covers: the
    union of the root span's direct children (its phases) over that wall, the longest stretch
    outside them, and the root's own span against the wall (what starts before it or ends
    after it is dark)."""
    root = next(s for s in spans if (s.get("attributes") or {}).get(KIND) == "run")
    kids = sorted((s for s in spans if s.get("parent_span_id") == root["span_id"]), key=lambda s: s["start_ns"])
    covered, reached, gap, gap_at = 0, t0_ns, 0, t0_ns
    for s in kids:
        a, b = max(s["start_ns"], reached), min(s["end_ns"], t1_ns)
        if a - reached > gap:
            gap, gap_at = a - reached, reached
        if b > a:
            covered += b - a
        reached = max(reached, s["end_ns"])
    if t1_ns - reached > gap:
        gap, gap_at = t1_ns - reached, reached
    return {"wall_s": _s(t1_ns - t0_ns), "share": covered / (t1_ns - t0_ns), "longest_gap_s": _s(gap),
            "longest_gap_at_s": _s(gap_at - t0_ns), "root_starts_after_s": _s(root["start_ns"] - t0_ns),
            "root_ends_before_s": _s(t1_ns - root["end_ns"]), "phases": len(kids)}


def _error_of(span) -> str:
    for e in span.get("events") or []:
        if e.get("name") == "exception":
            a = e.get("attributes") or {}
            return f"{a.get('exception.type', '')}: {a.get('exception.message', '')}".strip(": ")
    return ""


def _first_collective(phases) -> dict | None:
    """The earliest collective phase: who arrived last, and every other rank's wait for it."""
    coll = [s for s in phases if (s.get("attributes") or {}).get("collective")]
    if not coll:
        return None
    name = min(coll, key=lambda s: s["start_ns"])["name"]
    arrivals: dict[int, int] = {}
    for s in coll:
        if s["name"] == name:
            r = _rank(s)
            arrivals[r] = min(arrivals.get(r, s["start_ns"]), s["start_ns"])
    last = max(arrivals, key=arrivals.get)
    return {"phase": name, "ranks": len(arrivals), "last_rank": last,
            "waits_s": {r: _s(arrivals[last] - t) for r, t in sorted(arrivals.items()) if r != last}}


def format_startup(rep: dict | None) -> list[str]:
    if not rep:
        return []
    lines = ["", f"start-up (the run's own trace {rep['trace_id']}"
                 + (f", {rep['command']} {rep['wall_s']:.1f}s end to end" if rep.get("wall_s") else "") + ")"]
    if rep.get("root_missing"):
        lines.append("  the run's root span is not in the trace: the run is still going, or ended without closing "
                     "it (SIGKILL, the out-of-memory killer), or a --jaeger query's --limit left it out; what "
                     "follows is read from the phases on hand")
    for r in rep["ranks"]:
        first = f"first step after {r['first_step_s']:.2f}s" if r["first_step_s"] is not None else "no step"
        parts = ", ".join(f"{k} {v:.2f}s" for k, v in list(r["phases"].items())[:6])
        lines.append(f"  rank {r['rank']:<3} started at +{r['start_s']:.2f}s, {first}: {parts or '-'}")
    lp = rep.get("longest_phase")
    if lp:
        lines.append(f"  longest phase: {lp['phase']} on rank {lp['rank']}, {lp['seconds']:.2f}s"
                     + (" (failed)" if lp["failed"] else ""))
    fc = rep.get("first_collective")
    if fc and fc["ranks"] > 1:
        waits = ", ".join(f"rank {r} {w:.2f}s" for r, w in fc["waits_s"].items())
        lines.append(f"  first collective ({fc['phase']}): the ranks waited for rank {fc['last_rank']} "
                     f"(the last to arrive): {waits}")
    for f in rep.get("failed") or []:
        lines.append(f"  failed: {f['phase']} on rank {f['rank']}: {f['error']}")
    return lines
