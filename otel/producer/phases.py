"""The run's own trace: one root span for the whole command and its phases as children
(loading, data, evals, export, ...), beside the per-key traces of the hot path.

Phases are few (tens to thousands a run, not thousands a second), so this is plain
Python with a lock, kept apart from the hot path (otel/producer/hot_path.py), which it
never touches. A phase is a span with ids chosen here, in the process that runs it:
- its trace is the run's: the trace id of a W3C `traceparent` handed down (the
  `TRACEPARENT` variable, as a parent process or a job runner sets it), else one derived
  from the run id, so that every process of a run (ranks that join late too) lands in it;
- the run's root span has a span id derived from the run id as well: one process emits it
  (`run_root`), every other process of the run hangs its own process span under it;
- a phase's parent is the innermost phase open on its thread, else the innermost one open
  on the thread that made this trace (a worker thread started during a phase lands in it),
  else the process span or the root.
Children started by a phase get `traceparent()` in their environment, so their spans join.

Finished phases go to the background thread as records (`take()`), which ships them with
the next batch: the exporter side turns them into spans (otel/exporter/span_builder.py,
`phase_spans`). Open phases are live metrics (`observations()`): seconds since each began,
and its progress where the phase reports one (`PhaseSpan.progress`). `table()` is the
short table printed once at the end: each phase's seconds and share of the run's wall.

A phase record: (name, t0_ns, t1_ns, trace_id, span_id, parent_id, attrs, events, error)
with perf_counter_ns times, as stage records have (otel/records.py).
"""
from __future__ import annotations

import os
import random
import re
import threading
import time
import traceback

from otel.api import name_exception
from otel.trace_ids import root_span_id_for, trace_id_for

# version-trace id-parent id-flags; a later version may append "-..." fields (W3C: parse the four)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_rng = random.Random()  # span ids: unique within a trace is all that matters (as span_builder's)

# phase record fields
NAME, T0, T1, TRACE_ID, SPAN_ID, PARENT_ID, ATTRS, EVENTS, ERROR = range(9)
# the attribute that tells run spans from stage spans (the stage histogram and the idle
# attribution leave them out; readers use it to find a run's phases)
KIND_ATTRIBUTE = "otel.kind"


def parse_traceparent(value: str | None) -> tuple[int, int] | None:
    """(trace id, parent span id) of a W3C traceparent, or None when absent or malformed
    (ids of all zeros are invalid, as the spec says)."""
    m = _TRACEPARENT.match((value or "").strip().lower())
    if not m or m.group(1) == "ff" or (m.group(1) == "00" and m.group(5)):  # ff: invalid; 00 has exactly four
        return None
    trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
    return (trace_id, span_id) if trace_id and span_id else None


def format_traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def _value(done):
    return done() if callable(done) else done


def _span_id() -> int:
    return _rng.getrandbits(64) or 1


def _error(exc) -> tuple:
    if isinstance(exc, KeyboardInterrupt):  # Ctrl-C, or a SIGTERM the program turned into one
        return (type(exc).__name__, str(exc) or "interrupted", "")
    return (type(exc).__name__, str(exc), "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))


class PhaseSpan:
    """`with tel.phase("load target", target=name) as ph:` ... `ph.set(...)`, `ph.event(...)`,
    `ph.progress(done, total)`, `ph.traceparent` for a child process. An exception leaving
    it marks the span with the error (a Ctrl-C or a signal too) and goes on."""

    __slots__ = ("_trace", "name", "attrs", "events", "span_id", "parent_id", "t0", "t1", "done", "total",
                 "depth", "_stack")

    def __init__(self, trace: "RunTrace", name: str, parent: int | None, attrs: dict):
        self._trace, self.name, self.attrs = trace, str(name), attrs
        self.events: list = []
        self.span_id, self.parent_id = _span_id(), parent
        self.t0 = self.t1 = None
        self.done = self.total = None
        self.depth = 0
        self._stack = None

    def __enter__(self) -> "PhaseSpan":
        self._trace._open(self)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            name_exception(exc, self.name)
        self._trace._close(self, _error(exc) if exc is not None else None)
        return False

    def set(self, **attrs) -> None:
        self.attrs.update(attrs)

    def event(self, name: str, **attrs) -> None:
        self.events.append((name, time.perf_counter_ns(), attrs))

    def progress(self, done, total=None) -> None:
        """How far a long phase is (replies done of N): a live metric, and the span's last
        `progress.done` / `progress.total` attributes. ``done`` may be a function, read only
        when the gauge is observed (a step counter: nothing paid per step)."""
        self.done = done
        if total is not None:
            self.total = total

    @property
    def traceparent(self) -> str:
        return format_traceparent(self._trace.trace_id, self.span_id)


class RunTrace:
    """The run trace of one process (see the module doc). ``root_name``: the root span's
    name (`dflash train`); ``run_root``: this process emits the root (one process per run);
    ``process_span``: the name of this process's own span under the root (other ranks,
    and every rank of a multi-process run; None: phases hang from the root directly);
    ``start_ns``: perf_counter_ns when the run began in this process (default: now);
    ``always``: emit the root (and process) span even when no phase was recorded (a
    pipeline that never uses phases gets no extra span otherwise)."""

    def __init__(self, run_id: str, root_name: str, *, run_root: bool = True, process_span: str | None = None,
                 traceparent: str | None = None, start_ns: int | None = None, attrs: dict | None = None,
                 always: bool = True):
        handed = parse_traceparent(traceparent if traceparent is not None else os.environ.get("TRACEPARENT"))
        self.trace_id = handed[0] if handed else trace_id_for(run_id, "run", 0)
        self.root_id = root_span_id_for(run_id, "run", 0)
        self.root_parent = handed[1] if handed else 0
        self.root_name, self.run_root = root_name, run_root
        self.root_attrs = {KIND_ATTRIBUTE: "run", **(attrs or {})}
        self.process_name = process_span
        self.process_id = _span_id() if process_span else None
        self.start_ns = start_ns if start_ns is not None else time.perf_counter_ns()
        self.end_ns = None
        self._lock = threading.Lock()
        self._tls = threading.local()
        self._home: list = []                # the creating thread's stack: the fallback parent
        self._tls.stack = self._home
        self._open_phases: list[PhaseSpan] = []
        self._records: list = []             # finished, not yet shipped
        self.finished: list = []             # (name, depth, t0, t1, error) for the table
        self._recorded_depth: dict = {}      # span id -> depth of phases recorded after the fact
        self.error = None
        self.always = always

    # ------------------------------------------------------------------ ids
    @property
    def top_id(self) -> int:
        """Where phases without an open parent hang: the process span, else the root."""
        return self.process_id or self.root_id

    def current_id(self) -> int:
        stack = self._stack()
        if stack:
            return stack[-1].span_id
        if self._home:
            return self._home[-1].span_id
        return self.top_id

    def traceparent(self) -> str:
        """The W3C traceparent of the innermost open phase (this thread's, else the run's):
        what a child process started now is handed."""
        return format_traceparent(self.trace_id, self.current_id())

    def _stack(self) -> list:
        try:
            return self._tls.stack
        except AttributeError:
            self._tls.stack = []
            return self._tls.stack

    # ------------------------------------------------------------------ phases
    def phase(self, name: str, parent: PhaseSpan | int | None = None, **attrs) -> PhaseSpan:
        pid = parent.span_id if isinstance(parent, PhaseSpan) else parent
        return PhaseSpan(self, name, pid, {KIND_ATTRIBUTE: "phase", **attrs})

    def _open(self, ph: PhaseSpan) -> None:
        stack = self._stack()
        if ph.parent_id is None:
            ph.parent_id = self.current_id()
        ph.depth = self._depth_of(ph.parent_id) + 1
        ph._stack = stack
        ph.t0 = time.perf_counter_ns()
        with self._lock:
            self._open_phases.append(ph)
        stack.append(ph)

    def _depth_of(self, span_id: int) -> int:
        with self._lock:
            for p in self._open_phases:
                if p.span_id == span_id:
                    return p.depth
            return self._recorded_depth.get(span_id, 0)

    def _close(self, ph: PhaseSpan, error) -> None:
        ph.t1 = time.perf_counter_ns()
        stack = ph._stack
        if stack and stack[-1] is ph:
            stack.pop()
        elif ph in stack:  # closed out of order: never leave it open
            stack.remove(ph)
        if ph.done is not None:
            ph.attrs["progress.done"] = _value(ph.done)
            if ph.total is not None:
                ph.attrs["progress.total"] = ph.total
        with self._lock:
            if ph in self._open_phases:
                self._open_phases.remove(ph)
            self._finish(ph.name, ph.t0, ph.t1, ph.span_id, ph.parent_id, ph.attrs, ph.events, error, ph.depth)

    def record(self, name: str, t0_ns: int, t1_ns: int, parent: PhaseSpan | int | None = None, error=None,
               **attrs) -> int:
        """A phase that already happened (perf_counter_ns times of this process): before this
        trace existed, or in a child process that timed itself. Returns its span id (a parent
        for more such phases)."""
        pid = parent.span_id if isinstance(parent, PhaseSpan) else parent
        if pid is None:
            pid = self.current_id()
        sid = _span_id()
        with self._lock:
            depth = next((p.depth for p in self._open_phases if p.span_id == pid),
                         self._recorded_depth.get(pid, 0)) + 1
            self._recorded_depth[sid] = depth
            self._finish(name, int(t0_ns), int(max(t1_ns, t0_ns)), sid, pid, {KIND_ATTRIBUTE: "phase", **attrs},
                         [], error, depth)
        return sid

    def _finish(self, name, t0, t1, span_id, parent_id, attrs, events, error, depth) -> None:
        # lock held
        self._records.append((name, t0, t1, self.trace_id, span_id, parent_id, attrs, events or None, error))
        self.finished.append((name, depth, t0, t1, error))

    def take(self) -> list:
        """The finished phases not shipped yet (the background thread's cycle)."""
        with self._lock:
            out, self._records = self._records, []
        return out

    def end(self, error=None) -> None:
        """Close what is still open (marked with ``error``: a signal, a crash) and the run's
        own spans: the process span and, in the process that emits it, the root. Once."""
        with self._lock:
            if self.end_ns is not None:
                return
            still = list(reversed(self._open_phases))
        for ph in still:  # innermost first: a crash or a signal ended them all
            self._close(ph, error or ("Unfinished", "the run ended while this phase was open", ""))
        now = time.perf_counter_ns()
        with self._lock:
            self.end_ns, self.error = now, error
            if not (self.always or self.finished):
                return
            # a phase recorded after the fact may have begun before this trace was made
            self.start_ns = min([self.start_ns] + [r[2] for r in self.finished])
            if self.process_id:
                self._records.append((self.process_name, self.start_ns, now, self.trace_id, self.process_id,
                                      self.root_id, {KIND_ATTRIBUTE: "process", **self.root_attrs_common()}, None,
                                      error))
            if self.run_root:
                self._records.append((self.root_name, self.start_ns, now, self.trace_id, self.root_id,
                                      self.root_parent, dict(self.root_attrs), None, error))

    def root_attrs_common(self) -> dict:
        return {k: v for k, v in self.root_attrs.items() if k != KIND_ATTRIBUTE}

    # ------------------------------------------------------------------ live metrics and the table
    def observations(self) -> tuple[list, list]:
        """(elapsed, progress): [(seconds since the phase began, {"phase": name})] for every
        open phase, [(done / total, {"phase": name})] for those that report a total. Phases of
        one name open at once (worker threads' batches) are one point, the longest-open one's:
        points with equal attributes would overwrite each other, and the oldest is the one to see."""
        now = time.perf_counter_ns()
        with self._lock:
            open_ = sorted(self._open_phases, key=lambda p: p.t0)
        oldest = {}
        for p in open_:
            oldest.setdefault(p.name, p)
        elapsed = [((now - p.t0) / 1e9, {"phase": name}) for name, p in oldest.items()]
        progress = []
        for p in oldest.values():
            if p.done is not None and p.total:
                try:
                    progress.append((_value(p.done) / p.total, {"phase": p.name}))
                except Exception:  # noqa: BLE001 -- a progress function that fails reports nothing
                    pass
        return elapsed, progress

    def rows(self, max_depth: int = 2) -> list[dict]:
        """The finished phases by name down to ``max_depth``, repeated ones together (a
        regeneration's batches): name, depth, count, seconds, failed, in order of first start.
        The seconds are the wall the repeats cover: ones that overlap (engines started side by
        side) count their shared time once, so no share exceeds the wall."""
        with self._lock:
            done = sorted(self.finished, key=lambda r: r[2])
        rows: dict = {}
        reached: dict = {}  # (depth, name) -> the latest end so far
        for name, depth, t0, t1, error in done:
            if depth > max_depth:
                continue
            key = (depth, name)
            r = rows.setdefault(key, {"phase": name, "depth": depth, "count": 0, "seconds": 0.0, "failed": 0})
            r["count"] += 1
            r["seconds"] += max(0, t1 - max(t0, reached.get(key, t0))) / 1e9
            reached[key] = max(reached.get(key, t1), t1)
            r["failed"] += error is not None
        return list(rows.values())

    def wall_s(self) -> float:
        return ((self.end_ns or time.perf_counter_ns()) - self.start_ns) / 1e9

    def table(self, title: str, max_depth: int = 2) -> str:
        wall = self.wall_s()
        lines = [f"{title}: {wall:.1f} s", f"  {'phase':<40}{'seconds':>10}{'share':>8}"]
        for r in self.rows(max_depth):
            label = "  " * (r["depth"] - 1) + r["phase"] + (f" x{r['count']}" if r["count"] > 1 else "")
            mark = "  (failed)" if r["failed"] else ""
            lines.append(f"  {label[:40]:<40}{r['seconds']:>10.1f}{r['seconds'] / wall if wall else 0:>8.1%}{mark}")
        return "\n".join(lines)
