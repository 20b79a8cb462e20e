"""The record tuples the hot path writes and the exporter side reads, with named field
indices.

Plain tuples, not NamedTuples: building a NamedTuple goes through a Python-level
`__new__`, which costs the worker about as much again as the whole `tel.stage` append
(bench/otel/hot_path.py prints both). So the fields are named here, once, and every reader
indexes with these constants.

A stage record (what `with tel.stage(...)` appends):
  (name, t0_ns, t1_ns, trace_key, links, attrs, extra, events, cuda, error)
- t0_ns / t1_ns: `perf_counter_ns` readings; `Telemetry.epoch_offset_ns` maps them to
  epoch time.
- cuda: the (start, end, device) CUDA event pair on the training process; the background
  thread replaces it with the device duration in seconds (or None) before shipping.
- error: None, or (exception type name, message, formatted stack trace).

A metric point (what `tel.add` / `tel.record` append): (kind, name, value, attrs).
"""
from __future__ import annotations

NAME, T0, T1, TRACE, LINKS, ATTRS, EXTRA, EVENTS, CUDA, ERROR = range(10)
DEVICE_S = CUDA          # after the background thread resolved the events
STAGE_FIELDS = 10

# metric points
KIND, POINT_NAME, VALUE, POINT_ATTRS = range(4)
ADD, RECORD = 1, 2
