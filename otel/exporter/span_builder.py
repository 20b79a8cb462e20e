"""Raw stage records -> span tuples with ids and epoch times, plus one synthesized root
span per trace key. Runs on the SDK side (exporter process or thread-mode pipeline), so
the training process only ships raw records.

Stage record (as shipped): see otel/records.py; perf_counter_ns times, the CUDA event
pair replaced by the device duration; `epoch_offset_ns` maps them to epoch time.
Span tuple: (name, trace_id, span_id, parent_id, start_ns, end_ns, attrs, events, links,
error, device_s); error is None or (type, message, stack trace), which becomes the
span's ERROR status and an `exception` event (OpenTelemetry's exception conventions).
"""
from __future__ import annotations

import time
from operator import itemgetter

from otel.trace_ids import KeyIds, random_span_id, random_trace_id
from otel.records import ATTRS, DEVICE_S, ERROR, EVENTS, EXTRA, LINKS, NAME, T0, T1, TRACE

# a stage record's fields by their names in otel/records.py, in the order unpacked below
_FIELDS = itemgetter(NAME, T0, T1, TRACE, LINKS, ATTRS, EXTRA, EVENTS, DEVICE_S, ERROR)

ROOT_IDLE_S = 5.0          # a key's root span is emitted once no stage saw it for this long
_EMITTED_ROOTS_MAX = 100_000


class SpanBuilder:
    def __init__(self, run_id: str, epoch_offset_ns: int, emit_roots: bool = True, run_link=None):
        self.key_ids = KeyIds(run_id)
        self.run_links = [tuple(run_link)] if run_link else None  # a root span's link to the run's root
        self.emit_roots = emit_roots  # several processes sharing keys: only one emits the roots
        self.off = epoch_offset_ns
        self._open_roots: dict = {}     # key -> [min_t0, max_t1, last_seen_monotonic]
        self._emitted_roots: set = set()
        self.roots_emitted = 0

    def build(self, records, final: bool = False) -> list:
        off, key_ids, roots, emitted = self.off, self.key_ids, self._open_roots, self._emitted_roots
        now = time.monotonic()
        out = []
        for name, t0, t1, key, links, attrs, extra, events, device_s, error in map(_FIELDS, records):
            if extra:
                attrs.update(extra)  # attrs is the stage call's own kwargs dict
            if device_s is not None:
                attrs["device.duration_s"] = device_s
            if key is not None:
                trace_id, parent_id = key_ids(key)
                root = roots.get(key)
                if root is not None:
                    if t0 < root[0]:
                        root[0] = t0
                    if t1 > root[1]:
                        root[1] = t1
                    root[2] = now
                elif key not in emitted and self.emit_roots:
                    roots[key] = [t0, t1, now]
            else:
                trace_id, parent_id = random_trace_id(), 0
            if error is not None:
                events = list(events or ()) + [("exception", t1, {
                    "exception.type": error[0], "exception.message": error[1],
                    "exception.stacktrace": error[2]})]
            out.append((name, trace_id, random_span_id(), parent_id, t0 + off, t1 + off, attrs,
                        [(n, t + off, a) for n, t, a in events] if events else None,
                        [key_ids(tuple(k)) for k in links] if links else None,
                        error, device_s))
        self._emit_roots(out, final, now)
        return out

    def _emit_roots(self, out, final, now):
        """One root span per key (per process), spanning the stages seen for it, with the
        deterministic span id that stages parent to and links point at."""
        if not self._open_roots:
            return
        for key in [k for k, r in self._open_roots.items() if final or now - r[2] >= ROOT_IDLE_S]:
            t0, t1, _ = self._open_roots.pop(key)
            trace_id, root_id = self.key_ids(key)
            kind, key_id = key
            out.append((f"{kind} {key_id}", trace_id, root_id, 0, t0 + self.off, t1 + self.off,
                        {f"{kind}.id": key_id, "otel.root": True}, None, self.run_links, None, None))
            self.roots_emitted += 1
            if len(self._emitted_roots) >= _EMITTED_ROOTS_MAX:
                self._emitted_roots.clear()
            self._emitted_roots.add(key)


def phase_spans(records, epoch_offset_ns: int) -> list:
    """The run trace's finished phases (otel/producer/phases.py records, ids chosen by the
    process that ran them) -> span tuples, epoch times."""
    off = epoch_offset_ns
    out = []
    for name, t0, t1, trace_id, span_id, parent_id, attrs, events, error in records:
        if error is not None:
            events = list(events or ()) + [("exception", t1, {
                "exception.type": error[0], "exception.message": error[1], "exception.stacktrace": error[2]})]
        out.append((name, trace_id, span_id, parent_id, t0 + off, t1 + off, attrs,
                    [(n, t + off, a) for n, t, a in events] if events else None, None, error, None))
    return out
