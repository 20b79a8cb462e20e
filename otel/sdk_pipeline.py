"""The OpenTelemetry SDK side: turns shipped raw records into SDK spans and metric points
and exports them with the SDK's own exporters, chosen from the standard OTEL_* variables.

Runs in the exporter subprocess ("process" mode) or in the training process's background
thread ("thread" mode). Its input is a batch dict built by otel.background:
  {"raw": [raw stage records], "adds": [...], "records": [...], "gauges": {...},
   "instruments": {...}, "health": {...}, "final": bool}
Spans wait in a bounded queue for a dedicated export thread: a slow or dead collector
drops (and counts) spans instead of growing memory.
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

from otel import filesink
from otel.nvml import GpuSampler
from otel.span_builder import SpanBuilder

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


def _env(*names, default=None):
    for n in names:
        v = os.environ.get(n)
        if v:
            return v.strip()
    return default


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


def selected_exporters(signal: str, file_dir) -> list[str]:
    """OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER, defaulting to otlp when an endpoint is
    configured, else the file sink when a directory was given, else nothing."""
    env = _env(f"OTEL_{signal.upper()}_EXPORTER")
    if env:
        names = [n.strip().lower() for n in env.split(",") if n.strip()]
        return [n for n in names if n != "none"]
    if _env("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"):
        return ["otlp"]
    return ["file"] if file_dir else []


def _protocol(signal: str) -> str:
    return _env(f"OTEL_EXPORTER_OTLP_{signal.upper()}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL",
                default="http/protobuf")


def _timeout(export_timeout_s: float) -> float:
    # the SDK default (10 s) is longer than our shutdown bound; never wait longer than asked
    env = _env("OTEL_EXPORTER_OTLP_TIMEOUT")
    return min(float(env), export_timeout_s) if env else export_timeout_s


def _build_each(kind, names, make, notes):
    """make(name) for each configured name; one that fails (a bad endpoint, a taken
    Prometheus port) is reported once and skipped, never taking the exporter process down."""
    out = []
    for name in names:
        try:
            built = make(name)
        except Exception as e:
            built = None
            notes.append(f"{kind} exporter {name!r} unavailable: {e!r}")
            print(f"otel: {notes[-1]}", file=sys.stderr)
        if built is not None:
            out.append(built)
    return out


def make_span_exporters(names, file_dir, export_timeout_s, notes):
    return _build_each("traces", names, lambda n: _make_span_exporter(n, file_dir, export_timeout_s), notes)


def _make_span_exporter(name, file_dir, export_timeout_s):
    if name == "otlp":
        if _protocol("traces") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        return OTLPSpanExporter(timeout=_timeout(export_timeout_s))
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
        port = int(_env("OTEL_EXPORTER_PROMETHEUS_PORT", default="9464"))
        start_http_server(port=port, addr=host)
        return PrometheusMetricReader()
    if name == "otlp":
        if _protocol("metrics") == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        exporter = OTLPMetricExporter(timeout=_timeout(export_timeout_s))
    elif name == "file":
        if not file_dir:
            return None
        exporter = filesink.FileMetricExporter(file_dir)
    elif name == "console":
        exporter = ConsoleMetricExporter(out=sys.stderr)
    else:
        raise ValueError("unknown exporter name")
    return PeriodicExportingMetricReader(exporter, export_interval_millis=interval_s * 1000.0,
                                         export_timeout_millis=_timeout(export_timeout_s) * 1000.0)


class ExportPipeline:
    def __init__(self, config: dict):
        quiet_exporter_logs()
        self.config = config
        self.stage_metric = config["stage_metric"]
        self.metric_attributes = tuple(config.get("metric_attributes") or ())
        self.max_queue = int(config.get("max_queue", 65536))
        self.chunk = int(config.get("export_chunk", 512))
        export_timeout_s = float(config.get("export_timeout_s", 5.0))
        file_dir = config.get("file_dir")

        # Resource.create merges OTEL_RESOURCE_ATTRIBUTES; explicit attributes win.
        self.resource = Resource.create({**config.get("resource_attributes", {}),
                                         "service.name": config["service_name"]})
        self.notes: list[str] = []
        self.span_exporters = make_span_exporters(
            selected_exporters("traces", file_dir), file_dir, export_timeout_s, self.notes)

        self.health = {"spans_recorded": 0, "spans_exported": 0, "spans_dropped": 0,
                       "export_failures": 0, "parent_dropped": 0, "parent_recorded": 0, "root_spans": 0}
        self._queue: deque = deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closing = False
        self._gauge_values: dict[str, list] = {}
        self._instruments: dict[str, object] = {}
        self._declared: dict[str, tuple] = {}

        readers = make_metric_readers(selected_exporters("metrics", file_dir),
                                      file_dir, float(config.get("metric_export_interval_s", 1.0)),
                                      export_timeout_s, self.notes)
        self.meter_provider = MeterProvider(
            resource=self.resource, metric_readers=readers, shutdown_on_exit=False,
            views=[View(instrument_name=self.stage_metric,
                        aggregation=ExplicitBucketHistogramAggregation(STAGE_BUCKETS_S))])
        self.meter = self.meter_provider.get_meter("otel", "0.1.0")
        self.stage_hist = self.meter.create_histogram(
            self.stage_metric, unit="s", description="Duration of a pipeline stage (clock=host|device).")
        self._health_counters()

        self.span_builder = SpanBuilder(config["run_id"], config["epoch_offset_ns"],
                                        config.get("root_spans", True))
        self.gpu = None
        if config.get("gpu_devices") is not None:
            self.gpu = GpuSampler(config["gpu_devices"], float(config.get("gpu_interval_s", 1.0))).start()
            if not self.gpu.available:
                self.notes.append(f"GPU telemetry unavailable: {self.gpu.reason}")
            for name, (unit, desc) in self.gpu.gauge_specs().items():
                self.meter.create_observable_gauge(name, [self._gpu_callback(name)], unit=unit, description=desc)

        self._thread = threading.Thread(target=self._export_loop, name="otel-span-export", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ metrics setup
    def _health_counters(self):
        for name, key, desc in (
            ("otel.spans.recorded", "spans_recorded", "Spans recorded (stages and synthesized root spans)."),
            ("otel.spans.exported", "spans_exported", "Spans accepted by the trace exporters."),
            ("otel.spans.dropped", "spans_dropped", "Spans dropped (full buffers, dead collector)."),
            ("otel.export.failures", "export_failures", "Failed span export calls."),
        ):
            self.meter.create_observable_counter(
                name, [lambda options, key=key: [Observation(self.status()[key])]], unit="1", description=desc)

    def _gpu_callback(self, name):
        def cb(options):
            return [Observation(v, a) for v, a in self.gpu.observations().get(name, [])]
        return cb

    def _user_gauge_callback(self, name):
        def cb(options):
            return [Observation(v, a) for v, a in self._gauge_values.get(name, [])]
        return cb

    def _instrument(self, name: str, default_kind: str):
        inst = self._instruments.get(name)
        if inst is None:
            kind, unit, desc = self._declared.get(name, (default_kind, "1", ""))
            create = {"counter": self.meter.create_counter,
                      "updown": self.meter.create_up_down_counter,
                      "histogram": self.meter.create_histogram}[kind]
            inst = self._instruments[name] = create(name, unit=unit, description=desc)
        return inst

    # ------------------------------------------------------------ consume
    def consume(self, batch: dict) -> None:
        for name, spec in batch.get("instruments", {}).items():
            kind, unit, desc = spec
            if kind == "gauge":
                if name not in self._instruments:
                    self._instruments[name] = self.meter.create_observable_gauge(
                        name, [self._user_gauge_callback(name)], unit=unit, description=desc)
            else:
                self._declared[name] = spec
        raw = batch.get("raw")
        if raw or batch.get("final"):
            self._consume_spans(self.span_builder.build(raw or (), bool(batch.get("final"))))
        for name, attrs, value in batch.get("adds", ()):
            self._metric_call(name, "counter", "add", value, dict(attrs))
        for name, value, attrs in batch.get("records", ()):
            self._metric_call(name, "histogram", "record", value, attrs)
        for name, points in batch.get("gauges", {}).items():
            self._gauge_values[name] = [(v, _clean(a)) for v, a in points]
        health = batch.get("health")
        if health:
            self.health["parent_recorded"] = health["spans_recorded"]
            delta = health["spans_dropped"] - self.health["parent_dropped"]
            self.health["parent_dropped"] = health["spans_dropped"]
            self.health["spans_dropped"] += delta

    def _metric_call(self, name, default_kind, method, value, attrs) -> None:
        try:
            getattr(self._instrument(name, default_kind), method)(value, _clean(attrs))
        except Exception as e:  # e.g. tel.record on a name declared as a counter
            self.health["metric_errors"] = self.health.get("metric_errors", 0) + 1
            if self.health["metric_errors"] == 1:
                msg = f"metric {name!r}: {type(e).__name__}: {e}"
                self.notes.append(msg)
                print(f"otel: {msg} (further metric errors are only counted)", file=sys.stderr)

    def _consume_spans(self, spans: list) -> None:
        if not spans:
            return
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
                Status(StatusCode.ERROR, error) if error else Status(StatusCode.UNSET),
                start, end, _SCOPE))
            if attrs.get("otel.root"):
                continue  # synthesized per-key roots are not stages
            m = {"stage": name, "clock": "host"}
            for k in mattrs:
                v = attrs.get(k)
                if v is not None:
                    m[k] = v if isinstance(v, _VALID) else str(v)
            hist.record((end - start) / 1e9, m)
            if device_s is not None:
                m["clock"] = "device"
                hist.record(device_s, m)
        with self._cv:
            room = self.max_queue - len(self._queue)
            if room < len(built):
                self.health["spans_dropped"] += len(built) - max(room, 0)
                built = built[:max(room, 0)]
            self._queue.extend(built)
            self._cv.notify()

    # ------------------------------------------------------------ export thread
    def _export_loop(self):
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue and self._closing:
                    return
                n = min(self.chunk, len(self._queue))
                chunk = [self._queue.popleft() for _ in range(n)]
                self._busy = True
            ok = True
            for exp in self.span_exporters:
                try:
                    result = exp.export(chunk)
                except Exception:
                    result = SpanExportResult.FAILURE
                if result is not SpanExportResult.SUCCESS:
                    ok = False
                    self.health["export_failures"] += 1
            with self._cv:
                if ok:
                    self.health["spans_exported"] += len(chunk)
                else:
                    self.health["spans_dropped"] += len(chunk)
                self._busy = False
                self._cv.notify_all()

    def flush(self, timeout_s: float) -> bool:
        """Export queued spans and collect metrics once, within the bound."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            self._cv.notify_all()
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        left = max(deadline - time.monotonic(), 0.01)
        return bool(self.meter_provider.force_flush(timeout_millis=left * 1000))

    def shutdown(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        self.flush(timeout_s * 0.6)
        with self._cv:
            dropped = len(self._queue)
            self._queue.clear()
            self.health["spans_dropped"] += dropped
            self._closing = True
            self._cv.notify_all()
        if self.gpu is not None:
            self.gpu.stop()
        for exp in self.span_exporters:  # also aborts an OTLP exporter's retry backoff
            try:
                exp.shutdown()
            except Exception:
                pass
        left = max(deadline - time.monotonic(), 0.05)
        try:
            self.meter_provider.shutdown(timeout_millis=left * 1000)
        except Exception:
            pass

    def status(self) -> dict:
        # synthesized root spans count as recorded (they are exported too);
        # parent_dropped lets the parent avoid double counting its own drops
        self.health["root_spans"] = self.span_builder.roots_emitted
        self.health["spans_recorded"] = self.health["parent_recorded"] + self.health["root_spans"]
        s = dict(self.health)
        s["notes"] = list(self.notes)
        return s
