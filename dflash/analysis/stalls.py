"""`dflash stalls`: why was a worker idle? Busy fraction and idle by cause per worker, the
stages of a typical step, and the longest stalls with the trace ids to open in Jaeger.

Spans come from the run's file sink (every rank's traces.jsonl) or from a Jaeger query
API; both become otel.read_spans-style dicts. The attribution itself is
otel.idle with the default rules (they name this pipeline's stages).
"""
from __future__ import annotations

import math
import statistics
import sys
import time
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

from otel import read_spans
from otel import BUSY, attribute_idle

from .idle_rules import DFLASH_RULES

from ..errors import ConfigError
from ..preflight.inputs import json_loads

# The prefetcher runs ahead by design, and the checkpoint writer waits for the next save: their
# waits are not device idle, so they are kept out of the top-stalls list (their busy fraction
# is still reported).
NOT_STALLS = frozenset({"prefetch", "checkpoint_writer"})
JAEGER_MAX_BYTES = 1 << 30  # one query's answer, read whole
MAX_S = 1e8  # seconds: a window or a lookback beyond three years names no run


# ------------------------------------------------------------------ loading

def load_run(run_dir) -> list[dict]:
    """All ranks' spans of a run directory; ConfigError (one line, exit 2) if there are none."""
    run = Path(run_dir)
    if run.is_file() and run.name == "traces.jsonl":  # a span file itself: read as given
        found = [run]
    elif not run.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory" if not run.exists() else
                          f"{run_dir}: not a directory (expected a run directory, a --telemetry-dir or a traces.jsonl)")
    else:
        found = sorted((run / "telemetry").rglob("traces.jsonl")) if (run / "telemetry").is_dir() else []
    if not found and run.is_dir() and not (run / "telemetry").exists():  # a --telemetry-dir itself (eval, serve, export)
        found = sorted(f for f in (run / "traces.jsonl", *run.glob("rank*/traces.jsonl")) if f.exists())
    files = [f for f in found if f.is_file()]  # a FIFO would hang the read, a dir is no file
    for f in found:
        if f not in files:
            print(f"dflash: {f}: not a regular file, skipped", file=sys.stderr)
    if not files:
        raise ConfigError(f"{run_dir}: no telemetry (expected {run}/telemetry/traces.jsonl or "
                          f"telemetry/rank*/traces.jsonl; was the run made with --no-telemetry, or did its spans go to a "
                          f"collector alone (OTEL_TRACES_EXPORTER=otlp)? `dflash stalls --jaeger URL` reads them there)")
    spans = []
    for f in files:
        skipped: list = []
        got = read_spans(str(f), skipped)
        usable = [s for s in got if _usable(s)]
        spans += usable
        if skipped:  # said once per file, never silently: the answer below lacks these spans
            print(f"dflash: {f}: skipped {len(skipped)} unreadable line(s) (first: line {skipped[0]})",
                  file=sys.stderr)
        if len(usable) < len(got):
            print(f"dflash: {f}: skipped {len(got) - len(usable)} span(s) with unusable attributes (worker, rank, "
                  "run id, batch id, blocked_s or sync_s)", file=sys.stderr)
    if not spans:
        raise ConfigError(f"{run_dir}: telemetry holds no spans")
    # the exporter's fallback re-sends what a dead exporter process had not acknowledged (at least
    # once): a span may be in the file twice
    return list({(s["trace_id"], s["span_id"]): s for s in spans}.values())


def _usable(span) -> bool:
    """A span whose attributes the analysis can use: a rank that is an integer (a stage's or a
    phase's), a run id and role that can key a table, a batch id that is a number or a name,
    and the seconds the analysis carves out of a stage (balance.py) as finite numbers. A
    hand-edited or foreign file may hold anything there."""
    from .balance import CARVED

    try:
        worker_of(span)
        a, res = span.get("attributes") or {}, span.get("resource") or {}
        rank = a.get("rank", res.get("rank", 0))
        if isinstance(rank, float) and not rank.is_integer() or isinstance(rank, (list, dict)):
            return False
        int(rank)
        hash(res.get("run.id"))
        hash(res.get("role"))
        batch = a.get("batch_id")
        if batch is not None and (isinstance(batch, bool) or not isinstance(batch, (int, str))):
            return False
        for key in CARVED:
            v = a.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)):
                return False
        return 0 <= span["start_ns"] <= span["end_ns"]
    except (TypeError, ValueError, OverflowError, AttributeError):
        return False


def _jaeger_value(tag):
    v, t = tag.get("value"), tag.get("type", "string")
    if t == "int64":
        return int(v)
    if t == "float64":
        return float(v)
    if t == "bool":
        return v if isinstance(v, bool) else str(v).lower() == "true"
    return v


# Tags Jaeger adds when it translates OTLP; they are not span attributes.
_JAEGER_INTERNAL = frozenset({"span.kind", "internal.span.format", "otel.status_code",
                              "otel.status_description", "otel.scope.name", "otel.scope.version",
                              "otel.library.name", "otel.library.version", "error"})


def _tags(tags) -> dict:
    return {t["key"]: _jaeger_value(t) for t in tags or [] if t["key"] not in _JAEGER_INTERNAL}


def jaeger_to_spans(doc: dict, skipped: list | None = None) -> list[dict]:
    """Jaeger query API JSON ({"data": [trace, ...]}) -> read_spans-style span dicts. A span
    that is not Jaeger's format (a tag "12.5" typed int64, a start of Infinity) is left out
    and, with ``skipped``, counted there; the rest are read, as the file reader does."""
    out = []
    for trace in doc.get("data") or []:
        procs = {}
        for pid, p in (trace.get("processes") or {}).items():
            try:
                procs[pid] = {**_tags(p.get("tags")), "service.name": p.get("serviceName")}
            except _JAEGER_MALFORMED:
                procs[pid] = {"service.name": p.get("serviceName") if isinstance(p, dict) else None}
        for sp in trace.get("spans") or []:
            try:
                out.append(_jaeger_span(sp, procs))
            except _JAEGER_MALFORMED:
                if skipped is not None:
                    skipped.append(sp.get("spanID") if isinstance(sp, dict) else None)
    return out


_JAEGER_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, OverflowError)


def _jaeger_span(sp: dict, procs: dict) -> dict:
    """One Jaeger span as a read_spans-style dict; raises on what is not Jaeger's format."""
    refs = sp.get("references") or []
    parent = next((r["spanID"] for r in refs if r.get("refType") == "CHILD_OF"), "")
    start = int(sp["startTime"]) * 1000
    tags = {t["key"]: t for t in sp.get("tags") or []}
    status = {"code": 2} if _jaeger_value(tags.get("error", {"value": False, "type": "bool"})) else {}
    events = []
    for log in sp.get("logs") or []:
        fields = _tags(log.get("fields"))
        events.append({"name": fields.pop("event", "log"), "time_ns": int(log["timestamp"]) * 1000,
                       "attributes": fields})
    if start < 0 or int(sp["duration"]) < 0:
        raise ValueError("a span before 1970 or of negative duration")
    return {
        "name": sp["operationName"],
        "trace_id": sp["traceID"].zfill(32), "span_id": sp["spanID"].zfill(16),
        "parent_span_id": parent.zfill(16) if parent else "",
        "start_ns": start, "end_ns": start + int(sp["duration"]) * 1000,
        "attributes": _tags(sp.get("tags")), "events": events,
        "links": [{"trace_id": r["traceID"].zfill(32), "span_id": r["spanID"].zfill(16), "attributes": {}}
                  for r in refs if r.get("refType") == "FOLLOWS_FROM"],
        "status": status, "resource": dict(procs.get(sp.get("processID"), {})),
    }


def load_jaeger(url: str, service: str = "dflash", limit: int = 1000, lookback_h: float = 48.0,
                timeout_s: float = 30.0) -> list[dict]:
    base = url.rstrip("/")
    if not base.endswith("/api/traces"):
        base += "/api/traces"
    # explicit range: the query service's default lookback is shorter than a training run
    end_us = time.time_ns() // 1000
    q = urllib.parse.urlencode({"service": service, "limit": limit,
                                "start": end_us - int(lookback_h * 3600e6), "end": end_us})
    try:
        body = _read_bounded(f"{base}?{q}", timeout_s)
        doc = json_loads(body)  # nested too deeply: a ValueError too
    except (OSError, ValueError) as e:
        raise ConfigError(f"--jaeger {url}: cannot read traces: {str(e)[:300]}") from None
    skipped: list = []
    try:
        got = jaeger_to_spans(doc, skipped)
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:  # not {"data": [...]} at all
        raise ConfigError(f"--jaeger {url}: the answer is not Jaeger's trace JSON ({type(e).__name__}: "
                          f"{str(e)[:100]})") from None
    spans = [s for s in got if _usable(s)]
    if skipped or len(spans) < len(got):  # said, never silent: the answer below lacks these spans
        print(f"dflash: --jaeger {url}: skipped {len(skipped) + len(got) - len(spans)} span(s) that are not "
              f"Jaeger's format or have unusable attributes", file=sys.stderr)
    if not spans:
        raise ConfigError(f"--jaeger {url}: no traces for service {service!r}")
    return spans


def _read_bounded(url: str, timeout_s: float) -> bytes:
    """The answer's body, at most JAEGER_MAX_BYTES, within ``timeout_s`` in all: the socket's
    timeout bounds each read, so a server that sends a byte a second would hold it for ever."""
    deadline = time.monotonic() + timeout_s
    chunks, size = [], 0
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no whole answer within {timeout_s:g} s ({size:,} bytes read)")
            chunk = r.read1(1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            size += len(chunk)
            if size > JAEGER_MAX_BYTES:
                raise ValueError(f"the answer is over {JAEGER_MAX_BYTES >> 20} MiB; ask for fewer traces (--limit)")


def select_run(spans: list[dict], run_id: str | None = None, steps: bool = False) -> tuple[str | None, list[dict]]:
    """Spans of one run: `run_id`, else the most recent one (a resumed run directory or a
    Jaeger backend can hold several; an `export --telemetry-dir RUN/telemetry` adds its own),
    said on stderr with the others, so a report is never of another run than the reader thinks.
    ``steps``: the most recent one with training steps, when one has them (what a timeline draws)."""
    by_run = defaultdict(list)
    for s in spans:
        by_run[s.get("resource", {}).get("run.id")].append(s)
    if run_id is not None:
        if run_id not in by_run:
            raise ConfigError(f"--run-id {run_id}: not found (runs: {', '.join(map(str, by_run))})")
        return run_id, by_run[run_id]
    stepped = [r for r in by_run if any(worker_of(s) is not None for s in by_run[r])] if steps else []
    rid = max(stepped or by_run, key=lambda r: max(s["end_ns"] for s in by_run[r]))
    if len(by_run) > 1:
        others = sorted((r for r in by_run if r != rid), key=lambda r: -max(s["end_ns"] for s in by_run[r]))
        shown = ", ".join(f"{r} ({_command(by_run[r])})" for r in others[:5]) + (", ..." if len(others) > 5 else "")
        which = "the latest with training steps" if stepped else "the latest"
        print(f"dflash: {len(by_run)} runs in this source: reporting {which}, {rid} ({_command(by_run[rid])}); "
              f"the others: {shown} (choose with --run-id)", file=sys.stderr)
    return rid, by_run[rid]


def _command(spans) -> str:
    """What a run was: its root span's name (`dflash train`, `dflash export`, ...), else its workers'."""
    roots = [s["name"] for s in spans if not s.get("parent_span_id") and str(s.get("name", "")).startswith("dflash")]
    if roots:
        return roots[0]
    return "training steps" if any(worker_of(s) is not None for s in spans) else "no root span"


# ------------------------------------------------------------------ analysis

def worker_of(span):
    """(rank, worker) for stage spans; None for roots and anything not run by a worker."""
    a = span.get("attributes") or {}
    w = a.get("worker")
    if w is None:
        return None
    rank = a.get("rank", (span.get("resource") or {}).get("rank", 0))
    return (int(rank), str(w))


def worker_order(key):
    """Pipeline order: rank, then prefetch -> targets -> drafters -> anything else."""
    kind = next((i for i, p in enumerate(("prefetch", "target", "drafter")) if key[1].startswith(p)), 3)
    return (key[0], kind, key[1])


def role_of(span) -> str:
    """target | drafter | other: the rank's role (a layout's resource attribute), else the
    worker's kind (the single-process pipeline's threads)."""
    role = (span.get("resource") or {}).get("role")
    if role:
        return str(role)
    w = str((span.get("attributes") or {}).get("worker", ""))
    return "target" if w.startswith("target") else "drafter" if w.startswith("drafter") else "other"


def worker_label(key) -> str:
    return f"rank{key[0]}/{key[1]}"


def parse_window(text: str | None):
    """'START:END' seconds from run start (either side may be empty) -> (start, end) or None."""
    if not text:
        return None
    try:
        a, b = text.split(":")
        lo = float(a) if a.strip() else 0.0
        hi = float(b) if b.strip() else float("inf")
    except ValueError:
        raise ConfigError(f"--window {text}: expected START:END in seconds, e.g. 1.5:4") from None
    if not (math.isfinite(lo) and (math.isfinite(hi) or not b.strip())) or max(lo, hi if b.strip() else 0) > MAX_S:
        raise ConfigError(f"--window {text}: expected START:END in seconds below {MAX_S:g} (leave END empty for "
                          "the run's end)")
    if lo < 0 or hi <= lo:
        raise ConfigError(f"--window {text}: expected 0 <= START < END")
    return lo, hi


def check_window(spans, window) -> None:
    """One line when ``window`` starts after the run's last span: an empty window would read
    as every worker idle (stalls) or draw nothing (timeline)."""
    if not window:
        return
    t0 = run_start_ns(spans)
    wall = (max(s["end_ns"] for s in spans) - t0) / 1e9
    if window[0] >= wall:
        raise ConfigError(f"--window {window[0]:g}:{'' if window[1] == float('inf') else f'{window[1]:g}'}: "
                          f"starts after the run's last span ({wall:.2f} s from its start); expected a start "
                          f"below {wall:.2f}")


def _in_window(spans, win):
    """The spans of the traces (a batch's stages share one) whose first span starts inside ``win``
    (window_ns's): whole batches, never one cut in half; all of them without a window."""
    if win is None:
        return spans
    first: dict = {}
    for s in spans:
        first[s["trace_id"]] = min(first.get(s["trace_id"], s["start_ns"]), s["start_ns"])
    return [s for s in spans if win[0] <= first[s["trace_id"]] < win[1]]


def run_start_ns(spans) -> int:
    return min(s["start_ns"] for s in spans if worker_of(s) is not None)


def window_ns(spans, window):
    if window is None:
        return None
    t0 = run_start_ns(spans)
    hi = t0 + int(window[1] * 1e9) if window[1] != float("inf") else max(s["end_ns"] for s in spans)
    return t0 + int(window[0] * 1e9), hi


def attribute(spans, window=None, rules=DFLASH_RULES):
    """(per-worker snapshot, per-worker segments) over the run or a window (seconds)."""
    return attribute_idle(spans, rules, window=window_ns(spans, window), worker_of=worker_of, segments=True)


def _typical_step(spans, t0):
    traces = defaultdict(list)
    for s in spans:
        if worker_of(s) is not None and "batch_id" in s["attributes"]:
            traces[s["trace_id"]].append(s)
    traces = {t: ss for t, ss in traces.items() if len(ss) > 1}
    if not traces:
        return None
    dur = {t: max(s["end_ns"] for s in ss) - min(s["start_ns"] for s in ss) for t, ss in traces.items()}
    order = sorted(dur, key=lambda t: (dur[t], t))
    tid = order[(len(order) - 1) // 2]           # the (lower) median
    ss = sorted(traces[tid], key=lambda s: (s["start_ns"], s["end_ns"]))
    begin = ss[0]["start_ns"]
    stages, reached = [], begin
    for s in ss:
        stages.append({"stage": s["name"], "worker": worker_label(worker_of(s)),
                       "offset_s": (s["start_ns"] - begin) / 1e9,
                       "duration_s": (s["end_ns"] - s["start_ns"]) / 1e9,
                       # time the batch sat between its previous stage and this one
                       "wait_before_s": max(0, s["start_ns"] - reached) / 1e9})
        reached = max(reached, s["end_ns"])
    return {"trace_id": tid, "batch_id": ss[0]["attributes"].get("batch_id"), "traces": len(order),
            "duration_s": dur[tid] / 1e9, "start_s": (begin - t0) / 1e9,
            "median_duration_s": statistics.median(dur.values()) / 1e9, "stages": stages}


def _top_stalls(segments, t0, top):
    out = []
    for key, segs in segments.items():
        if key[1] in NOT_STALLS:
            continue
        for a, b, cause, stage, span in segs:
            if cause == BUSY:
                continue
            out.append({"trace_id": span["trace_id"], "worker": key[1], "rank": key[0], "cause": cause,
                        "duration_s": (b - a) / 1e9, "stage": stage,
                        "batch_id": span["attributes"].get("batch_id"), "start_s": (a - t0) / 1e9})
    out.sort(key=lambda x: -x["duration_s"])
    return out[:top]


def analyze(spans, top: int = 10, window=None, rules=DFLASH_RULES, run_id=None, source="") -> dict:
    from .startup import startup

    start = startup(spans)
    if not any(worker_of(s) is not None for s in spans):  # stopped before its first step: the start-up alone
        return {"run_id": run_id, "source": source, "ranks": len((start or {}).get("ranks") or []), "by_role": {},
                "balance": None, "window_s": None, "wall_s": (start or {}).get("wall_s") or 0.0, "workers": [],
                "critical_path": None, "top_stalls": [], "startup": start}
    check_window(spans, window)
    t0 = run_start_ns(spans)
    snap, segments = attribute(spans, window, rules)
    roles = {}
    for s in spans:
        k = worker_of(s)
        if k is not None and k not in roles:
            roles[k] = role_of(s) if not k[1].startswith(("prefetch", "checkpoint")) else "other"
    workers = []
    for key in sorted(snap, key=worker_order):
        d = snap[key]
        idle = {c: v for c, v in d["idle_s"].items()}
        top_cause = max(idle, key=idle.get) if any(idle.values()) else None
        workers.append({"worker": key[1], "rank": key[0], "label": worker_label(key), "role": roles.get(key, "other"),
                        "busy_fraction": d["busy_fraction"], "busy_s": d["busy_s"], "wall_s": d["wall_s"],
                        "idle_s": idle, "top_idle_cause": top_cause})
    ranks = {w["rank"] for w in workers}
    from .balance import balance
    inside = _in_window(spans, window_ns(spans, window))  # the per-batch figures: the window's batches
    return {"run_id": run_id, "source": source, "ranks": len(ranks), "by_role": _by_role(workers),
            "balance": balance(inside),
            # JSON has no infinity: an open end is null
            "window_s": [window[0], window[1] if math.isfinite(window[1]) else None] if window else None,
            "wall_s": (max(s["end_ns"] for s in spans) - t0) / 1e9,
            "workers": workers, "critical_path": _typical_step(inside, t0),
            "top_stalls": _top_stalls(segments, t0, top), "startup": start}


def _by_role(workers) -> dict:
    """Busy fraction and idle seconds by cause, summed over the workers of each role."""
    out: dict = {}
    for w in workers:
        if w["role"] == "other":
            continue
        r = out.setdefault(w["role"], {"workers": 0, "busy_s": 0.0, "wall_s": 0.0, "idle_s": defaultdict(float)})
        r["workers"] += 1
        r["busy_s"] += w["busy_s"]
        r["wall_s"] += w["wall_s"]
        for c, v in w["idle_s"].items():
            r["idle_s"][c] += v
    for r in out.values():
        r["busy_fraction"] = r["busy_s"] / r["wall_s"] if r["wall_s"] else 0.0
        r["idle_s"] = dict(r["idle_s"])
    return out


# ------------------------------------------------------------------ text

def _ms(s: float) -> str:
    return f"{s * 1e3:8.1f}ms" if s < 10 else f"{s:8.2f}s "


def format_report(rep: dict) -> str:
    lines = [f"dflash stalls: run {rep['run_id']} ({rep['source']}), {rep['ranks']} rank(s), "
             f"{len(rep['workers'])} workers, {rep['wall_s']:.2f}s"
             + (f", window {rep['window_s'][0]:g}:{'' if rep['window_s'][1] is None else format(rep['window_s'][1], 'g')}s"
                if rep["window_s"] else "")]
    from .startup import format_startup
    if not rep["workers"]:  # stopped before its first step: the start-up is the whole story
        return "\n".join(lines + ["", "no training step in this run: its start-up alone"]
                         + format_startup(rep.get("startup")))
    W = max([16] + [len(w["label"]) + 2 for w in rep["workers"]])  # a long worker name keeps its gap
    causes = [c for c in DFLASH_RULES.all_causes() if any(w["idle_s"].get(c) for w in rep["workers"])]
    lines += ["", "idle time by cause (seconds)",
              f"  {'worker':<{W}}{'busy':>7}{'wall':>9}" + "".join(f"{c:>12}" for c in causes) + "   top idle cause"]
    for w in rep["workers"]:
        lines.append(f"  {w['label']:<{W}}{w['busy_fraction']:>7.1%}{w['wall_s']:>9.3f}"
                     + "".join(f"{w['idle_s'].get(c, 0):>12.3f}" for c in causes)
                     + (f"   {top} ({w['idle_s'][top] / w['wall_s']:.0%} of wall)"
                        if (top := w["top_idle_cause"]) and w["wall_s"] else "   -"))
    if len(rep.get("by_role") or {}) > 1:
        lines += ["", "by role (all ranks of the role together)"]
        for role, r in sorted(rep["by_role"].items(), key=lambda kv: kv[0] != "target"):
            top = max(r["idle_s"], key=r["idle_s"].get) if any(r["idle_s"].values()) else None
            lines.append(f"  {role:<8}{r['workers']:>3} worker(s)  busy {r['busy_fraction']:>6.1%}"
                         + (f"   top idle cause: {top} ({r['idle_s'][top]:.3f}s)" if top else ""))
    from .balance import format_balance
    lines += format_balance(rep.get("balance"))
    cp = rep["critical_path"]
    if cp:
        lines += ["", f"typical step: batch {cp['batch_id']}, {cp['duration_s'] * 1e3:.1f} ms end to end "
                      f"(median of {cp['traces']} batch traces), trace {cp['trace_id']}",
                  f"  {'offset':>10}{'duration':>11}{'waited':>11}  {'worker':<{W}}stage"]
        for s in cp["stages"]:
            lines.append(f"  {'+' + format(s['offset_s'] * 1e3, '.1f') + 'ms':>10}{_ms(s['duration_s']):>11}"
                         f"{_ms(s['wait_before_s']) if s['wait_before_s'] >= 1e-4 else '':>11}"
                         f"  {s['worker']:<{W}}{s['stage']}")
    lines += ["", "top stalls (open the trace id in Jaeger)",
              f"  {'duration':>10}  {'cause':<12}{'worker':<{W}}{'stage':<18}{'batch':>6}{'at':>9}  trace id"]
    for s in rep["top_stalls"]:
        where = s["stage"] if s["cause"] not in ("host", "data_wait") else f"before {s['stage']}"
        lines.append(f"  {_ms(s['duration_s']):>10}  {s['cause']:<12}{worker_label((s['rank'], s['worker'])):<{W}}"
                     f"{where:<18}{s['batch_id'] if s['batch_id'] is not None else '-':>6}"
                     f"{s['start_s']:>8.2f}s  {s['trace_id']}")
    if not rep["top_stalls"]:
        lines.append("  (none)")
    lines += format_startup(rep.get("startup"))
    return "\n".join(lines)


def load(run_dir=None, jaeger=None, service="dflash", limit=1000, run_id=None, lookback_h=48.0, steps=False):
    """(run_id, spans, source) from a run directory or a Jaeger query API (``steps``: see select_run)."""
    if jaeger:
        spans, source = load_jaeger(jaeger, service, limit, lookback_h), f"jaeger {jaeger}"
    else:
        spans, source = load_run(run_dir), f"{run_dir}"
    rid, spans = select_run(spans, run_id, steps)
    if not any(worker_of(s) is not None or (s.get("attributes") or {}).get("otel.kind") for s in spans):
        raise ConfigError(f"{source}: no stage spans (spans without a worker attribute only)")
    return rid, spans, source
