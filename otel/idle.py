"""Idle attribution: split each worker's wall time into busy and idle-by-cause.

Input is what any stage tracer has: per worker, stage intervals (name, start_ns, end_ns,
attributes). The worker's wall time (first start to last end, optionally clipped to a
window) is tiled, without gaps or overlaps, into segments:

- a stage named in `stage_causes` (or matching a `pattern_causes` regex) is idle with that
  cause for its whole length (e.g. a queue get is the consumer waiting);
- a stage in `carve_inside` is busy except for a numeric attribute's worth of seconds at
  its end, which is idle (e.g. `blocked_s` of an enqueue is back-pressure);
- a gap between stages is `gap_cause` ("host": Python, launch overhead), except that a
  stage in `carve_before` claims up to an attribute's worth of the gap just before it
  (e.g. `data_wait_s`: the worker waited for its input before starting);
- other stages are busy when in `busy` (or when `busy` is None), else `unknown_cause`.

Everything is integer nanoseconds, so busy + sum(idle) == wall exactly. Overlapping
intervals on one worker (nested stages, clock jitter) are clipped to the part after the
previous interval's end: time is counted once, first come first served.

Two entry points over the same state machine: `attribute_idle(spans)` (offline, a list of
span dicts) and `IdleAccumulator` (online, fed record by record; see its docstring).
This module knows stage *names* only as default data; callers pass their own rules.
"""
from __future__ import annotations

import heapq
import re
from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Mapping, Optional

BUSY = "busy"


@dataclass(frozen=True)
class IdleRules:
    """The mapping from stages to causes: plain data, override any field. The defaults know
    no pipeline: every stage is busy, gaps are host time, sync-like names are `sync`; a
    pipeline passes its own rules (dflash: dflash/analysis/idle_rules.py)."""
    # the pipeline's idle causes in the order its reports show them, each reported (as 0)
    # even when it never occurs; causes the fields below produce follow, in field order
    causes: tuple = ()
    stage_causes: Mapping[str, str] = field(default_factory=dict)
    # (regex searched in the lower-cased stage name, cause); first match wins
    pattern_causes: tuple = (
        (r"(?<![a-z])(sync\w*|all_?reduce|all_?gather|reduce_?scatter|barrier)", "sync"),)
    # stage -> (attribute holding idle seconds at the end of the stage, cause)
    carve_inside: Mapping[str, tuple] = field(default_factory=dict)
    # stage -> (attribute holding idle seconds right before the stage, cause)
    carve_before: Mapping[str, tuple] = field(default_factory=dict)
    # compute stages; None: every stage not mapped to a cause is busy
    busy: Optional[frozenset] = None
    ignore: frozenset = frozenset()                    # markers, not time spent
    gap_cause: str = "host"
    unknown_cause: str = "other"

    def all_causes(self) -> tuple:
        """Every cause these rules can produce, the given `causes` first (stable report columns)."""
        extra = [*self.stage_causes.values(), *(c for _, c in self.pattern_causes),
                 *(c for _, c in self.carve_inside.values()),
                 *(c for _, c in self.carve_before.values()), self.gap_cause, self.unknown_cause]
        return tuple(dict.fromkeys((*self.causes, *extra)))


DEFAULT_RULES = IdleRules()


def _ns(attrs, key) -> int:
    v = attrs.get(key) if attrs else None
    try:
        return max(0, int(round(float(v) * 1e9))) if v is not None else 0
    except (TypeError, ValueError, OverflowError):  # inf from a hand-edited file: no wait
        return 0


class _Classifier:
    """Stage name -> how its time counts, cached (names repeat millions of times)."""

    def __init__(self, rules: IdleRules):
        self.r = rules
        self._pat = [(re.compile(p), c) for p, c in rules.pattern_causes]
        self._cache: dict = {}

    def __call__(self, name: str) -> str:
        c = self._cache.get(name)
        if c is None:
            r = self.r
            c = r.stage_causes.get(name)
            if c is None:
                low = name.lower()
                c = next((cause for p, cause in self._pat if p.search(low)), None)
            if c is None:
                c = BUSY if r.busy is None or name in r.busy else r.unknown_cause
            self._cache[name] = c
        return c


class _Worker:
    """One worker's cursor and totals. `commit` takes intervals in start order."""
    __slots__ = ("cursor", "lo", "hi", "busy", "idle", "late")

    def __init__(self):
        self.cursor = None      # end of the last committed interval (unclipped)
        self.lo = self.hi = None  # extent of the counted (window-clipped) segments
        self.busy = 0
        self.idle: dict = {}
        self.late = 0           # intervals that arrived after their time was counted

    def commit(self, cls: _Classifier, name, start, end, attrs, window, out, ref=None):
        r = cls.r
        if end < start:
            start, end = end, start
        segs = []
        before = r.carve_before.get(name)
        if self.cursor is None:
            # the first stage's carved wait is the worker's first idle time
            self.cursor = start - (_ns(attrs, before[0]) if before else 0)
        if end <= self.cursor:
            self.late += 1
            return
        if start < self.cursor:
            start = self.cursor
        elif start > self.cursor or before:
            w = min(_ns(attrs, before[0]), start - self.cursor) if before else 0
            if start - w > self.cursor:
                segs.append((self.cursor, start - w, r.gap_cause))
            if w:
                segs.append((start - w, start, before[1]))
        kind = cls(name)
        inside = r.carve_inside.get(name)
        if kind == BUSY and inside:
            b = min(_ns(attrs, inside[0]), end - start)
            if end - b > start:
                segs.append((start, end - b, BUSY))
            if b:
                segs.append((end - b, end, inside[1]))
        else:
            segs.append((start, end, kind))
        self.cursor = end
        for t0, t1, c in segs:
            if window is not None:
                t0, t1 = max(t0, window[0]), min(t1, window[1])
                if t1 <= t0:
                    continue
            # segments tile time contiguously, so wall = hi - lo = their sum
            if self.lo is None:
                self.lo = t0
            self.hi = t1
            if c == BUSY:
                self.busy += t1 - t0
            else:
                self.idle[c] = self.idle.get(c, 0) + t1 - t0
            if out is not None:
                out.append((t0, t1, c, name, ref))

    def totals(self, causes) -> dict:
        wall = (self.hi - self.lo) if self.lo is not None else 0
        idle_ns = {c: self.idle.get(c, 0) for c in causes}
        for c, v in self.idle.items():
            idle_ns.setdefault(c, v)
        return {"busy_s": self.busy / 1e9, "idle_s": {c: v / 1e9 for c, v in idle_ns.items()},
                "wall_s": wall / 1e9, "busy_fraction": self.busy / wall if wall else 0.0,
                "busy_ns": self.busy, "idle_ns": idle_ns, "wall_ns": wall,
                "start_ns": self.lo, "end_ns": self.hi}


class IdleAccumulator:
    """Online idle attribution, fed one stage record at a time from any thread's stream.

        acc = IdleAccumulator()                    # rules=, window=, reorder_ns=
        acc.feed("target0", "model_forward", t0_ns, t1_ns, {"data_wait_s": 0.01})
        acc.snapshot()   # {"target0": {"busy_s", "idle_s": {cause: s}, "wall_s",
                         #              "busy_fraction", "busy_ns", "idle_ns", "wall_ns", ...}}

    Records may arrive out of start order (nested stages exit first; a telemetry thread
    drains per-thread buffers). Each worker keeps a small heap and commits a record once
    a record ending `reorder_ns` after its start has been seen on the same worker (or
    `snapshot`'s `now_ns` says so, or on `flush`). So a record may arrive after records
    that ended up to `reorder_ns` later than it did; later still, it is clipped (counted in
    `late_records`) and its time stays with the cause already given to it. Totals are cumulative and only grow, which is what a
    monotonic counter per (worker, cause) needs; not thread-safe: one feeder thread.
    `segments=True` keeps every committed segment (t0, t1, cause|"busy", stage, ref) per
    worker (ref: whatever was passed to feed, e.g. the span) for pictures; off by default so a long run stays O(workers) in memory.
    """

    def __init__(self, rules: IdleRules = DEFAULT_RULES, window=None, reorder_ns: int = 1_000_000_000,
                 segments: bool = False):
        self.rules = rules
        self.window = window
        self.reorder_ns = reorder_ns
        self._cls = _Classifier(rules)
        self._causes = rules.all_causes()
        self._workers: dict = {}
        self._pending: dict = {}     # worker -> heap of (start, seq, name, end, attrs)
        self._newest: dict = {}      # worker -> largest end seen
        self._seq = 0
        self.segments: Optional[dict] = {} if segments else None

    def feed(self, worker: Hashable, name: str, start_ns: int, end_ns: int,
             attrs: Optional[Mapping] = None, ref=None):
        if name in self.rules.ignore:
            return
        heap = self._pending.setdefault(worker, [])
        self._seq += 1
        heapq.heappush(heap, (start_ns, self._seq, name, end_ns, attrs, ref))
        if end_ns > self._newest.get(worker, end_ns - 1):
            self._newest[worker] = end_ns
        self._commit(worker, self._newest[worker] - self.reorder_ns)

    def _commit(self, worker, upto):
        heap = self._pending.get(worker)
        if not heap:
            return
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        out = None
        if self.segments is not None:
            out = self.segments.setdefault(worker, [])
        while heap and (upto is None or heap[0][0] <= upto):
            start, _, name, end, attrs, ref = heapq.heappop(heap)
            w.commit(self._cls, name, start, end, attrs, self.window, out, ref)

    def flush(self, now_ns: Optional[int] = None) -> None:
        """Commit pending records: all of them, or those starting before now_ns - reorder_ns."""
        for worker in list(self._pending):
            self._commit(worker, None if now_ns is None else now_ns - self.reorder_ns)

    def snapshot(self, now_ns: Optional[int] = None, flush: bool = False) -> dict:
        if flush or now_ns is not None:
            self.flush(None if flush else now_ns)
        return {wk: w.totals(self._causes) for wk, w in self._workers.items()}

    @property
    def late_records(self) -> int:
        return sum(w.late for w in self._workers.values())


def _default_worker(span):
    return (span.get("attributes") or {}).get("worker")


def attribute_idle(spans: Iterable[Mapping], rules: IdleRules = DEFAULT_RULES, window=None,
                   worker_of: Callable = _default_worker, segments: bool = False):
    """Offline: span dicts (name, start_ns, end_ns, attributes) -> snapshot dict as above.
    Spans whose `worker_of` is None (roots, markers) are skipped. With segments=True
    returns (snapshot, {worker: [(t0, t1, cause|"busy", stage, span), ...]})."""
    acc = IdleAccumulator(rules, window=window, reorder_ns=0, segments=segments)
    keyed = [(worker_of(s), s) for s in spans]
    keyed = sorted(((k, s) for k, s in keyed if k is not None),
                   key=lambda ks: (ks[1]["start_ns"], ks[1]["end_ns"]))
    for k, s in keyed:
        acc.feed(k, s["name"], s["start_ns"], s["end_ns"], s.get("attributes"), ref=s if segments else None)
    snap = acc.snapshot(flush=True)
    return (snap, acc.segments) if segments else snap
