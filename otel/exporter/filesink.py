"""Local file sink in the OpenTelemetry Collector file exporter's OTLP/JSON format.

One ExportTraceServiceRequest / ExportMetricsServiceRequest per line (traces.jsonl,
metrics.jsonl). OTLP/JSON differs from protobuf's default JSON mapping in two ways that
matter: trace/span ids are hex strings (not base64) and enums are integers.

Lines stay whole. A write that fails part-way (disk full) is cut back to the last whole
line, and its spans count as dropped (`write_failed`), so the next line starts clean and
the accounting matches the file. A torn tail left by a killed process is cut when the file
is opened again. The readers of this format are in otel/readers.py (no SDK import).
"""
from __future__ import annotations

import base64
import errno
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

from otel.confined import link_refused
from otel.readers import METRICS_FILE, TRACES_FILE

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
        try:  # a link planted where the file goes is refused, never followed (otel.confined)
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise link_refused(path, path) from None
            raise
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
