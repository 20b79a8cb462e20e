"""Local file sink in the OpenTelemetry Collector file exporter's OTLP/JSON format.

One ExportTraceServiceRequest / ExportMetricsServiceRequest per line (traces.jsonl,
metrics.jsonl). OTLP/JSON differs from protobuf's default JSON mapping in two ways that
matter: trace/span ids are hex strings (not base64) and enums are integers.

Lines stay whole. A write that fails part-way (disk full) is cut back to the last whole
line, and its spans count as dropped (`write_failed`), so the next line starts clean and
the accounting matches the file. A torn tail left by a killed process is cut when the file
is opened again. Readers count what they could not parse (`read_lines(..., skipped=)`).
"""
from __future__ import annotations

import base64
import json
import os
import threading
from typing import Sequence

from google.protobuf.json_format import MessageToDict
from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

TRACES_FILE = "traces.jsonl"
METRICS_FILE = "metrics.jsonl"
_ID_KEYS = frozenset(("traceId", "spanId", "parentSpanId"))


def _hex_ids(node):
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _ID_KEYS and isinstance(v, str):
                node[k] = base64.b64decode(v).hex()
            else:
                _hex_ids(v)
    elif isinstance(node, list):
        for v in node:
            _hex_ids(v)
    return node


def to_otlp_json(message) -> str:
    """A protobuf export request as one OTLP/JSON line (no trailing newline)."""
    d = MessageToDict(message, use_integers_for_enums=True)  # lowerCamelCase keys
    return json.dumps(_hex_ids(d), separators=(",", ":"))


class _LineFile:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.path = path
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        self._lock = threading.Lock()
        _cut_torn_tail(self._fd)

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode()
        with self._lock:
            if self._fd is None:
                raise ValueError("file sink closed")
            whole = os.fstat(self._fd).st_size  # the end of the last whole line (one writer)
            view = memoryview(data)
            try:
                while view:  # a full disk writes part of it, then raises on the rest
                    n = os.write(self._fd, view)
                    view = view[n:]
            except OSError:
                try:
                    os.ftruncate(self._fd, whole)
                except OSError:
                    pass
                raise

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _cut_torn_tail(fd: int) -> None:
    """Cut a last line without its newline (a process killed mid-write) before appending."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    pos = size
    while pos > 0:
        start = max(0, pos - 65536)
        chunk = os.pread(fd, pos - start, start)
        nl = chunk.rfind(b"\n")
        if nl >= 0:
            os.ftruncate(fd, start + nl + 1)
            return
        pos = start
    os.ftruncate(fd, 0)


class FileSpanExporter(SpanExporter):
    drop_reason = "write_failed"  # what the export pipeline counts a failed export as

    def __init__(self, directory: str):
        self._file = _LineFile(os.path.join(directory, TRACES_FILE))

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            self._file.write_line(to_otlp_json(encode_spans(spans)))
            return SpanExportResult.SUCCESS
        except (OSError, ValueError):
            return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self._file.close()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


class FileMetricExporter(MetricExporter):
    def __init__(self, directory: str, **kwargs):
        super().__init__(**kwargs)
        self._file = _LineFile(os.path.join(directory, METRICS_FILE))

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        try:
            self._file.write_line(to_otlp_json(encode_metrics(metrics_data)))
            return MetricExportResult.SUCCESS
        except (OSError, ValueError):
            return MetricExportResult.FAILURE

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        self._file.close()


# ---------------------------------------------------------------- readers

def _any_value(v: dict):
    if "stringValue" in v:
        return v["stringValue"]
    if "boolValue" in v:
        return v["boolValue"]
    if "intValue" in v:
        return int(v["intValue"])
    if "doubleValue" in v:
        return float(v["doubleValue"])
    if "arrayValue" in v:
        return [_any_value(x) for x in v["arrayValue"].get("values", [])]
    if "kvlistValue" in v:
        return attributes(v["kvlistValue"].get("values", []))
    if "bytesValue" in v:
        return base64.b64decode(v["bytesValue"])
    return None


def attributes(kvs: list) -> dict:
    """OTLP/JSON KeyValue list -> plain dict."""
    return {kv["key"]: _any_value(kv.get("value", {})) for kv in kvs or []}


def read_lines(path: str, skipped: list | None = None):
    """Parsed JSON objects, one per complete line. A line that does not parse (or a torn
    final line) is skipped and, when ``skipped`` is given, its line number appended there."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, start=1):
            if not raw.endswith(b"\n"):
                if skipped is not None:
                    skipped.append(i)
                break
            try:
                yield json.loads(raw)
            except ValueError:
                if skipped is not None:
                    skipped.append(i)


def read_spans(path: str, skipped: list | None = None) -> list[dict]:
    """Spans from a traces.jsonl (or a directory holding one) as flat dicts; ``skipped``:
    see read_lines."""
    if os.path.isdir(path):
        path = os.path.join(path, TRACES_FILE)
    out = []
    for req in read_lines(path, skipped):
        for rs in req.get("resourceSpans", []):
            resource = attributes(rs.get("resource", {}).get("attributes"))
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    out.append({
                        "name": sp["name"],
                        "trace_id": sp["traceId"],
                        "span_id": sp["spanId"],
                        "parent_span_id": sp.get("parentSpanId", ""),
                        "start_ns": int(sp["startTimeUnixNano"]),
                        "end_ns": int(sp["endTimeUnixNano"]),
                        "attributes": attributes(sp.get("attributes")),
                        "events": [{"name": e["name"], "time_ns": int(e["timeUnixNano"]),
                                    "attributes": attributes(e.get("attributes"))}
                                   for e in sp.get("events", [])],
                        "links": [{"trace_id": l["traceId"], "span_id": l["spanId"],
                                   "attributes": attributes(l.get("attributes"))}
                                  for l in sp.get("links", [])],
                        "status": sp.get("status", {}),
                        "resource": resource,
                    })
    return out


def read_metrics(path: str) -> list[dict]:
    """Metric points from a metrics.jsonl (or its directory): one dict per data point with
    name, unit, type (gauge/sum/histogram), time_ns, attributes, value (or count/sum/
    bucket_counts/explicit_bounds/min/max for histograms), resource."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    out = []
    for req in read_lines(path):
        for rm in req.get("resourceMetrics", []):
            resource = attributes(rm.get("resource", {}).get("attributes"))
            for sm in rm.get("scopeMetrics", []):
                for m in sm.get("metrics", []):
                    for kind in ("gauge", "sum", "histogram"):
                        if kind not in m:
                            continue
                        for p in m[kind].get("dataPoints", []):
                            point = {"name": m["name"], "unit": m.get("unit", ""), "type": kind,
                                     "time_ns": int(p.get("timeUnixNano", 0)),
                                     "attributes": attributes(p.get("attributes")),
                                     "resource": resource}
                            if kind == "histogram":
                                point.update(count=int(p.get("count", 0)), sum=p.get("sum", 0.0),
                                             bucket_counts=[int(c) for c in p.get("bucketCounts", [])],
                                             explicit_bounds=p.get("explicitBounds", []),
                                             min=p.get("min"), max=p.get("max"))
                            else:
                                point["value"] = (float(p["asDouble"]) if "asDouble" in p
                                                  else int(p.get("asInt", 0)))
                            out.append(point)
    return out
