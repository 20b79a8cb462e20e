"""The OpenTelemetry SDK side: turns shipped raw records into SDK spans and metric points
and exports them with the SDK's own exporters, chosen from the standard OTEL_* variables.

Runs in the exporter subprocess ("process" mode) or in the training process's background
thread ("thread" mode), fed by otel.exporter.consumer.BatchConsumer. Spans wait in a bounded queue,
one shipped batch per entry, and every span exporter has a lane of its own (its queue and
thread): a slow or dead collector never holds up the file sink beside it
(`OTEL_TRACES_EXPORTER=otlp,file`). A network lane sends what has queued up to `export_chunk`
spans a request (a slow collector gets fewer, larger requests, not one per batch). A slow
or dead collector drops (and counts) spans instead of growing memory, and the counts are
committed batch by batch once every lane is done with it, so `status()` always says exactly
which batches are finished (`done_seq`) and what became of their spans.

Span accounting (every span ends in exactly one of these):
  exported                   kept by a span exporter (with several: by the one that kept the
                             most of its batch; each exporter's own counts are under "exporters")
  dropped.collector_down     every exporter refused it, or the export queue was full
  dropped.write_failed       a file exporter could not write it (disk full, I/O error)
  dropped.shutdown_timeout   still queued for a network exporter when the shutdown bound ran out
Local sinks (file, console) are always drained completely at shutdown: the bound is for a
collector that does not answer, not for writing files.
"""
from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.metrics import Observation
from opentelemetry.trace import Link, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode

from otel.config import ExportConfig
from otel.exporter import env_headers, filesink
from otel.exporter.nvml import GpuSampler
from otel.env_values import number_from_env
from otel.exporter_choice import LOCAL_EXPORTERS, endpoint_env_error, env, selected_exporters

# 0.1 ms .. 10 s, 1-2.5-5 steps: resolves both a kernel launch and a slow batch.
STAGE_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SCOPE = InstrumentationScope("otel", "0.1.0")
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_VALID = (str, bool, int, float)


class _OncePerMinute(logging.Filter):
    """A dead collector makes the SDK exporters log every retry; keep the first of each
    kind per minute (our health counters carry the totals)."""

    def __init__(self):
        super().__init__()
        self._last: dict = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg)[:40])
        now = time.monotonic()
        if now - self._last.get(key, -1e9) < 60:
            return False
        self._last[key] = now
        return True


_NOISY_LOGGERS = (
    "opentelemetry.exporter.otlp.proto.grpc.exporter",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    "opentelemetry.exporter.otlp.proto.http.metric_exporter",
    "opentelemetry.exporter.otlp.proto.http._common",
    "opentelemetry.sdk.metrics._internal.export",
)


def quiet_exporter_logs() -> None:
    f = _OncePerMinute()
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(x, _OncePerMinute) for x in logger.filters):
            logger.addFilter(f)


_env = env


def _clean(attrs: dict) -> dict:
    """Attribute values the OTLP encoder accepts; anything else becomes its str()."""
    out = {}
    for k, v in attrs.items():
        if v is None:
            continue
        if isinstance(v, _VALID):
            out[k] = v
        elif isinstance(v, (list, tuple)) and all(isinstance(x, _VALID) for x in v):
            out[k] = list(v)
        else:
            out[k] = str(v)
    return out


_PROTOCOLS = ("grpc", "http/protobuf")  # what the Python SDK's exporters speak (no http/json)
_said_protocol: set = set()


def _protocol(signal: str) -> str:
    got = _env(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL",
               default="http/protobuf")
    if got not in _PROTOCOLS:
        if got not in _said_protocol:
            _said_protocol.add(got)
            print(f"otel: OTLP protocol {got!r} is not one this exporter speaks ({', '.join(_PROTOCOLS)}): "
                  "sending http/protobuf", file=sys.stderr)
        return "http/protobuf"
    return got


def _timeout(export_timeout_s: float, signal: str = "traces") -> float:
    """OTEL_EXPORTER_OTLP_{TRACES,METRICS}_TIMEOUT, else OTEL_EXPORTER_OTLP_TIMEOUT, in seconds as the
    Python SDK reads them (its docs; the spec says milliseconds), never above ``export_timeout_s``:
    the SDK default (10 s) is longer than our shutdown bound."""
    name = next((n for n in (f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT")
                 if os.environ.get(n, "").strip()), "OTEL_EXPORTER_OTLP_TIMEOUT")
    return min(number_from_env(name, export_timeout_s, unit="seconds, as the Python SDK reads it"), export_timeout_s)


def _build_each(kind, names, make, notes):
    """make(name) for each configured name; one that fails (a bad endpoint, a taken
    Prometheus port) is reported once and skipped, never taking the exporter process down."""
    out = []
    for name in names:
        try:
            built = make(name)
        except Exception as e:
            built = None
            notes.append(f"{kind} exporter {name!r} unavailable: {e if isinstance(e, ValueError) else repr(e)}")
            print(f"otel: {notes[-1]}", file=sys.stderr)
        if built is not None:
            out.append(built)
    return out


def make_span_exporters(names, file_dir, export_timeout_s, notes) -> list[tuple[str, object]]:
    """(name, exporter) for each configured span exporter that could be built."""
    built = []

    def make(name):
        exp = _make_span_exporter(name, file_dir, export_timeout_s)
        if exp is not None:
            built.append((name, exp))
        return exp
    _build_each("traces", names, make, notes)
    return built


class _Lane:
    """One span exporter, its queue of entries and its thread."""

    def __init__(self, name: str, exp):
        self.name, self.exp = name, exp
        self.network = name not in LOCAL_EXPORTERS
        self.queue: deque = deque()
        self.backlog = 0                   # spans in its queue
        self.current: list | None = None   # the entries its export call is working on
        self.abandoned = False             # the shutdown bound ran out: it sends nothing more
        self.thread = None


def _checked_endpoint(signal: str) -> None:
    """A malformed OTLP endpoint is named now, once, and its exporter skipped (_build_each),
    rather than failing every export after with the SDK's own words, the URL in them."""
    err = endpoint_env_error(signal, _protocol(signal))
    if err:
        raise ValueError(err)


def _make_span_exporter(name, file_dir, export_timeout_s):
    if name == "otlp":
        _checked_endpoint("traces")
        if _protocol("traces") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return env_headers.own_headers_only(OTLPSpanExporter(timeout=_timeout(export_timeout_s)), "traces")
    if name == "file":
        return filesink.FileSpanExporter(file_dir) if file_dir else None
    if name == "console":
        return ConsoleSpanExporter(out=sys.stderr)
    raise ValueError("unknown exporter name")


def make_metric_readers(names, file_dir, interval_s, export_timeout_s, notes):
    return _build_each("metrics", names,
                       lambda n: _make_metric_reader(n, file_dir, interval_s, export_timeout_s), notes)


def _make_metric_reader(name, file_dir, interval_s, export_timeout_s):
    if name == "prometheus":
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server
        host = _env("OTEL_EXPORTER_PROMETHEUS_HOST", default="localhost")
        port = int(number_from_env("OTEL_EXPORTER_PROMETHEUS_PORT", 9464, lo=0, lo_open=False, hi=65535, integer=True))
        start_http_server(port=port, addr=host)
        return PrometheusMetricReader()
    if name == "otlp":
        _checked_endpoint("metrics")
        if _protocol("metrics") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        exporter = env_headers.own_headers_only(OTLPMetricExporter(timeout=_timeout(export_timeout_s, "metrics")),
                                                "metrics")
        if exporter is None:
            return None
    elif name == "file":
        if not file_dir:
            return None
        exporter = filesink.FileMetricExporter(file_dir)
    elif name == "console":
        exporter = ConsoleMetricExporter(out=sys.stderr)
    else:
        raise ValueError("unknown exporter name")
    return PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1000.0,
                                         export_timeout_millis=_timeout(export_timeout_s, "metrics") * 1000.0)


class ExportPipeline:
    def __init__(self, config: ExportConfig):
        quiet_exporter_logs()
        self.config = config
        self.stage_metric = config.stage_metric
        self.metric_attributes = tuple(config.metric_attributes or ())
        self.max_queue = int(config.max_queue)
        self.chunk = int(config.export_chunk)
        export_timeout_s = float(config.export_timeout_s)
        file_dir = config.file_dir

        # The one parse of OTEL_RESOURCE_ATTRIBUTES (and OTEL_SERVICE_NAME): the SDK's
        # Resource.create merges them; the attributes given in code win.
        self.resource = Resource.create({**config.resource_attributes, "service.name": config.service_name})
        self.notes: list[str] = []
        for note in env_headers.sanitize():  # before any OTLP exporter reads them
            self.notes.append(note)
            print(f"otel: {note}", file=sys.stderr)
        span_names = selected_exporters("traces", file_dir)
        self.lanes: list[_Lane] = []
        self.span_exporters: list = []

        # committed batch by batch (see the module docstring); guarded by _cv
        # roots_queued: the run's own spans and the per-key roots of batches not yet committed (a
        # lane may have exported them already: the health line counts them as recorded and queued)
        self.counts = {"done_seq": 0, "spans_done": 0, "roots": 0, "roots_queued": 0, "spans_exported": 0,
                       "export_failures": 0, "buffer_full": 0,
                       "dropped": {"collector_down": 0, "write_failed": 0, "shutdown_timeout": 0,
                                   "no_exporter": 0}}
        # entries [seq, spans, dropped_at_enqueue, n_parent, n_roots] by id(entry), until every lane is done
        # with them: (entry, its lanes' results {id(lane): (spans kept, failure reason or None)})
        self._open: dict[int, tuple[list, dict]] = {}
        self._queued_spans = 0
        self._max_seq = 0
        self.exporter_counts = {lane.name: {"exported": 0, "dropped": {}} for lane in self.lanes}
        self._cv = threading.Condition()
        self._closing = False
        self._gauge_values: dict[str, list] = {}
        self._gauge_callbacks: dict[str, object] = {}
        self._instruments: dict[str, object] = {}
        self._declared: dict[str, tuple] = {}
        self.metric_errors = 0

        readers = make_metric_readers(selected_exporters("metrics", file_dir),
                                      file_dir, float(config.metric_export_interval_s),
                                      export_timeout_s, self.notes)
        self.meter_provider = MeterProvider(
            resource=self.resource, metric_readers=readers, shutdown_on_exit=False,
            views=[View(instrument_name=self.stage_metric,
                        aggregation=ExplicitBucketHistogramAggregation(STAGE_BUCKETS_S))])
        self.meter = self.meter_provider.get_meter("otel", "0.1.0")
        self.stage_hist = self.meter.create_histogram(
            self.stage_metric, unit="s", description="Duration of a pipeline stage (clock=host|device).")
        self._health_counters()

        self.gpu = None
        if config.gpu_devices is not None:
            self.gpu = GpuSampler(config.gpu_devices, float(config.gpu_interval_s)).start()
            if not self.gpu.available:
                self.notes.append(f"GPU telemetry unavailable: {self.gpu.reason}")
            for name, (unit, desc) in self.gpu.gauge_specs().items():
                self.meter.create_observable_gauge(name, [self._gpu_callback(name)], unit=unit, description=desc)

        for name, exp in make_span_exporters(span_names, file_dir, export_timeout_s, self.notes):
            self.add_span_exporter(name, exp)

    def add_span_exporter(self, name: str, exp) -> None:
        """A span exporter on a lane of its own (its queue and thread); ``name`` in
        LOCAL_EXPORTERS makes it a local sink, drained whole at shutdown. Before any span is
        queued (an open batch waits for the lanes there were), one per name."""
        lane = _Lane(name, exp)
        with self._cv:
            if self._open or name in self.exporter_counts:
                raise ValueError(f"span exporter {name!r}: add each exporter once, before any span is queued")
            self.lanes.append(lane)
            self.span_exporters.append(exp)
            self.exporter_counts[name] = {"exported": 0, "dropped": {}}
        lane.thread = threading.Thread(target=self._export_loop, args=(lane,), name=f"otel-span-export-{name}",
                                       daemon=True)
        lane.thread.start()

    # ------------------------------------------------------------ metrics
    def _health_counters(self):
        def dropped(st):
            return st["buffer_full"] + sum(st["dropped"].values())

        for name, get, desc in (
            ("otel.spans.recorded", lambda st: st["buffer_full"] + st["spans_done"] + st["roots"],
             "Spans recorded (stages and synthesized root spans) in finished batches."),
            ("otel.spans.exported", lambda st: st["spans_exported"], "Spans accepted by the trace exporters."),
            ("otel.spans.dropped", dropped, "Spans dropped (full buffers, dead collector, shutdown bound)."),
            ("otel.export.failures", lambda st: st["export_failures"], "Failed span export calls."),
        ):
            self.meter.create_observable_counter(
                name, [lambda options, get=get: [Observation(get(self.status()))]], unit="1", description=desc)

    def _gpu_callback(self, name):
        def cb(options):
            return [Observation(v, a) for v, a in self.gpu.observations().get(name, [])]
        return cb

    def _gauge_callback(self, name):
        def cb(options):
            fn = self._gauge_callbacks.get(name)
            points = fn() if fn is not None else self._gauge_values.get(name, [])
            return [Observation(v, _clean(dict(a or {}))) for v, a in points]
        return cb

    def declare(self, specs: dict) -> None:
        """name -> (kind, unit, description); gauges get their values from set_gauges()."""
        for name, (kind, unit, desc) in specs.items():
            if kind == "gauge":
                if name not in self._instruments:
                    self._instruments[name] = self.meter.create_observable_gauge(
                        name, [self._gauge_callback(name)], unit=unit, description=desc)
            else:
                self._declared[name] = (kind, unit, desc)

    def observable_gauge(self, name, callback, unit="1", description="") -> None:
        """A gauge computed on this side (callback() -> [(value, attrs)])."""
        self._gauge_callbacks[name] = callback
        self.declare({name: ("gauge", unit, description)})

    def set_gauges(self, values: dict) -> None:
        for name, points in values.items():
            self._gauge_values[name] = [(v, _clean(a)) for v, a in points]

    def _instrument(self, name: str, default_kind: str):
        inst = self._instruments.get(name)
        if inst is None:
            kind, unit, desc = self._declared.get(name, (default_kind, "1", ""))
            create = {"counter": self.meter.create_counter,
                      "updown": self.meter.create_up_down_counter,
                      "histogram": self.meter.create_histogram}[kind]
            inst = self._instruments[name] = create(name, unit=unit, description=desc)
        return inst

    def metric_point(self, name, default_kind, value, attrs) -> None:
        try:
            inst = self._instrument(name, default_kind)
            if default_kind == "histogram":
                inst.record(value, _clean(attrs))
            else:
                inst.add(value, _clean(attrs))
        except Exception as e:  # e.g. tel.record on a name declared as a counter
            self.metric_errors += 1
            if self.metric_errors == 1:
                msg = f"metric {name!r}: {type(e).__name__}: {e}"
                self.notes.append(msg)
                print(f"otel: {msg} (further metric errors are only counted)", file=sys.stderr)

    # ------------------------------------------------------------ spans
    def enqueue(self, seq: int, spans: list, n_parent: int, n_roots: int, buffer_full: int = 0) -> None:
        """Queue one shipped batch's spans (n_parent stage records + n_roots synthesized
        roots). buffer_full: the training process's running total of records it dropped."""
        built = self.build_spans(spans)
        with self._cv:
            self.counts["roots_queued"] += n_roots
            self.counts["buffer_full"] = max(self.counts["buffer_full"], buffer_full)
            # the bound holds what the local sinks have still to write (a network lane beside them
            # keeps its own half and sheds beyond it); without a local sink, everything queued
            local = [lane for lane in self.lanes if not lane.network]
            used = max((lane.backlog + sum(len(e[1]) for e in lane.current or ()) for lane in local),
                       default=self._queued_spans)
            room = max(self.max_queue - used, 0)
            self._max_seq = max(self._max_seq, seq)
            dropped = max(len(built) - room, 0)
            if dropped:
                built = built[:room]
            entry = [seq, built, dropped, n_parent, n_roots]
            self._queued_spans += len(built)
            if not self.lanes:  # nothing takes them: never "exported"
                self._queued_spans -= len(built)
                self._commit(entry, 0, {"no_exporter": len(built)} if built else {}, 0)
            else:
                self._open[id(entry)] = (entry, {})  # alive while open: its id is its key
                local = any(not lane.network for lane in self.lanes)
                for lane in self.lanes:
                    if dropped:  # cut before any lane saw them
                        c = self.exporter_counts[lane.name]["dropped"]
                        c["collector_down"] = c.get("collector_down", 0) + dropped
                    if lane.abandoned:  # past the shutdown bound: nothing more for the network
                        self._lane_done(lane, entry, 0, "shutdown_timeout")
                        continue
                    lane.queue.append(entry)
                    lane.backlog += len(built)
                    # beside a local sink a network lane keeps half the bound and sheds its oldest
                    # beyond it: a slow or dead collector never holds the batches the files are
                    # done with (nor, through them, the queue's room or the parent's backlog)
                    while local and lane.network and lane.backlog > self.max_queue // 2 and len(lane.queue) > 1:
                        old = lane.queue.popleft()
                        lane.backlog -= len(old[1])
                        self._lane_done(lane, old, 0, "collector_down")
            self._cv.notify_all()

    def build_spans(self, spans: list) -> list:
        """Span tuples (otel.exporter.span_builder) -> SDK ReadableSpans; records the stage
        duration histogram on the way."""
        resource, hist, mattrs = self.resource, self.stage_hist, self.metric_attributes
        built = []
        for (name, trace_id, span_id, parent_id, start, end, attrs, events, links, error, device_s) in spans:
            ctx = SpanContext(trace_id, span_id, False, _SAMPLED)
            parent = SpanContext(trace_id, parent_id, False, _SAMPLED) if parent_id else None
            built.append(ReadableSpan(
                name, ctx, parent, resource, _clean(attrs),
                [Event(n, _clean(a), t) for n, t, a in events] if events else (),
                [Link(SpanContext(t, s, False, _SAMPLED)) for t, s in links] if links else (),
                SpanKind.INTERNAL, None,
                Status(StatusCode.ERROR, f"{error[0]}: {error[1]}") if error else Status(StatusCode.UNSET),
                start, end, _SCOPE))
            if attrs.get("otel.root") or attrs.get("otel.kind"):
                continue  # synthesized per-key roots and the run's own spans are not stages
            m = {"stage": name, "clock": "host"}
            for k in mattrs:
                v = attrs.get(k)
                if v is not None:
                    m[k] = v if isinstance(v, _VALID) else str(v)
            hist.record((end - start) / 1e9, m)
            if device_s is not None:
                m["clock"] = "device"
                hist.record(device_s, m)
        return built

    def _commit(self, entry, exported: int, failed: dict, timed_out: int) -> None:
        """Caller holds _cv. The entry's spans are all accounted for now. failed: drop
        reason -> spans (an exporter says its reason by a `drop_reason` attribute)."""
        seq, spans, dropped_at_enqueue, n_parent, n_roots = entry
        c = self.counts
        # every batch up to done_seq is finished: entries commit out of order across lanes (a network
        # lane sheds a newer one while an older one is in its export call), so not past an open one
        first_open = min((e[0] for e, _ in self._open.values()), default=self._max_seq + 1)
        c["done_seq"] = max(c["done_seq"], first_open - 1)
        c["spans_done"] += n_parent
        c["roots"] += n_roots
        c["roots_queued"] -= n_roots
        c["spans_exported"] += exported
        c["dropped"]["collector_down"] += dropped_at_enqueue
        for reason, n in failed.items():
            c["dropped"][reason] += n
        c["dropped"]["shutdown_timeout"] += timed_out

    def _export_loop(self, lane: "_Lane"):
        while True:
            with self._cv:
                while not lane.queue and not self._closing:
                    self._cv.wait()
                if not lane.queue:
                    return
                # a network lane takes what has queued up, to a chunk's worth (at least one entry)
                take = [lane.queue.popleft()]
                n = len(take[0][1])
                while lane.network and lane.queue and n + len(lane.queue[0][1]) <= self.chunk:
                    n += len(lane.queue[0][1])
                    take.append(lane.queue.popleft())
                lane.backlog -= n
                lane.current = take
            spans = [sp for e in take for sp in e[1]]
            ok = [True] * len(spans)
            reason = None
            for i in range(0, len(spans), self.chunk):
                if lane.abandoned:
                    ok[i:] = [False] * (len(spans) - i)
                    reason = reason or "shutdown_timeout"
                    break
                try:
                    result = lane.exp.export(spans[i:i + self.chunk])
                except Exception:
                    result = SpanExportResult.FAILURE
                if result is not SpanExportResult.SUCCESS:
                    ok[i:i + self.chunk] = [False] * len(spans[i:i + self.chunk])
                    reason = reason or getattr(lane.exp, "drop_reason", "collector_down")
                    with self._cv:
                        self.counts["export_failures"] += 1
            with self._cv:
                if lane.current is take:  # else the shutdown bound already settled them (_give_up)
                    lane.current = None
                    at = 0
                    for e in take:
                        kept = sum(ok[at:at + len(e[1])])
                        at += len(e[1])
                        self._lane_done(lane, e, kept, reason if kept < len(e[1]) else None)
                self._cv.notify_all()

    def _lane_done(self, lane: "_Lane", entry, kept: int, reason) -> None:
        """Caller holds _cv. One lane is done with one entry; the entry is committed once all are."""
        c = self.exporter_counts[lane.name]
        c["exported"] += kept
        if kept < len(entry[1]):
            c["dropped"][reason] = c["dropped"].get(reason, 0) + len(entry[1]) - kept
        key = id(entry)
        if key not in self._open:
            return
        results = self._open[key][1]
        results[id(lane)] = (kept, reason, not lane.network)
        if len(results) < len(self.lanes):
            return
        del self._open[key]
        self._queued_spans -= len(entry[1])
        # the lane that kept the most (a local sink on a tie: its reason, write_failed say, is the one to tell)
        best = max(results.values(), key=lambda r: (r[0], r[2]))
        lost = len(entry[1]) - best[0]
        why = best[1] or next((r[1] for r in results.values() if r[1]), "collector_down")
        timed_out = lost if why == "shutdown_timeout" else 0
        self._commit(entry, best[0], {why: lost} if lost and not timed_out else {}, timed_out)

    def _give_up(self, lanes) -> None:
        """Caller holds _cv. The shutdown bound ran out for ``lanes`` (network ones): what they
        still hold, queued or in a call that has not returned, is settled as shutdown_timeout
        for them; a call that returns later changes nothing."""
        for lane in lanes:
            lane.abandoned = True
            pending, lane.current = list(lane.current or []) + list(lane.queue), None
            lane.queue.clear()
            lane.backlog = 0
            for e in pending:
                self._lane_done(lane, e, 0, "shutdown_timeout")

    def _wait_idle(self, deadline, lanes=None) -> bool:
        lanes = self.lanes if lanes is None else lanes
        with self._cv:
            self._cv.notify_all()
            while any(lane.queue or lane.current is not None for lane in lanes):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def flush(self, timeout_s: float) -> bool:
        """Export queued spans and collect metrics once, within the bound."""
        deadline = time.monotonic() + timeout_s
        if not self._wait_idle(deadline):
            return False
        left = max(deadline - time.monotonic(), 0.01)
        return bool(self.meter_provider.force_flush(timeout_millis=left * 1000))

    def shutdown(self, network_timeout_s: float) -> None:
        """Local sinks: export everything, however long it takes. A network exporter: wait
        up to the bound, then count what is left for it as dropped (shutdown_timeout)."""
        deadline = time.monotonic() + network_timeout_s
        network = [lane for lane in self.lanes if lane.network]
        if network and not self._wait_idle(deadline, network):
            with self._cv:
                self._give_up(network)
        self._wait_idle(None, [lane for lane in self.lanes if not lane.network])
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        if self.gpu is not None:
            self.gpu.stop()
        for exp in self.span_exporters:  # also aborts an OTLP exporter's retry backoff
            try:
                exp.shutdown()
            except Exception:
                pass
        # the metrics' last export: what the network bound leaves, or all of it when every span sink is local
        left = max(deadline - time.monotonic(), 0.05) if network else network_timeout_s
        try:
            self.meter_provider.shutdown(timeout_millis=max(left, 0.05) * 1000)
        except Exception:
            pass

    def status(self) -> dict:
        with self._cv:
            s = {**self.counts, "dropped": dict(self.counts["dropped"])}
        s["exporters"] = {n: {"exported": c["exported"], "dropped": dict(c["dropped"])}
                          for n, c in self.exporter_counts.items()} if len(self.lanes) > 1 else {}
        s["notes"] = list(self.notes)
        if self.metric_errors:
            s["metric_errors"] = self.metric_errors
        return s

    def final_status(self) -> dict:
        """After shutdown(): an export call still hanging past the bound cannot finish
        before this process moves on; its spans count as shutdown_timeout."""
        with self._cv:
            self._give_up([lane for lane in self.lanes if lane.current is not None or lane.queue])
        return self.status()
