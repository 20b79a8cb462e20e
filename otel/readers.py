"""Readers of the file sink's format (otel/exporter/filesink.py: the OpenTelemetry
Collector file exporter's OTLP/JSON lines). Plain JSON, no SDK import: offline tools
(`dflash stalls`, the W&B bridge, tests) read runs with these.

A line that does not parse, or a torn last line left by a killed process, is skipped and
counted (`read_lines(..., skipped=)`), and so is one that parses but is not what the format
says (a span without its ids or times, a time outside 0..2^63 ns or an end before its start,
a field of the wrong type), one nested deeper than the
parser goes, and one over MAX_LINE_BYTES (read through in bounded memory, never held whole):
telemetry files get copied and edited, and a reader never fails on one.
"""
from __future__ import annotations

import base64
import json
import os

TRACES_FILE = "traces.jsonl"
METRICS_FILE = "metrics.jsonl"


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
    if "bytesValue" in v:  # kept as its base64 text: JSON-safe wherever a reader's dicts are written
        base64.b64decode(_str(v["bytesValue"]), validate=True)
        return v["bytesValue"]
    return None


def attributes(kvs: list) -> dict:
    """OTLP/JSON KeyValue list -> plain dict (keys are strings; anything else is malformed)."""
    return {_str(kv["key"]): _any_value(kv.get("value", {})) for kv in kvs or []}


MAX_LINE_BYTES = 64 * 2**20  # one exported batch is well under a megabyte


def read_lines(path: str, skipped: list | None = None, max_line: int = MAX_LINE_BYTES):
    """Parsed JSON objects, one per complete line. A line that does not parse (or a torn
    final line, or one over ``max_line`` bytes, or one nested too deeply) is skipped and,
    when ``skipped`` is given, its line number appended there."""
    for _, obj in _numbered_lines(path, skipped, max_line):
        yield obj


def _numbered_lines(path: str, skipped: list | None, max_line: int = MAX_LINE_BYTES):
    with open(path, "rb") as f:
        i = 0
        while True:
            raw = f.readline(max_line + 1)
            if not raw:
                return
            i += 1
            if not raw.endswith(b"\n"):
                if len(raw) <= max_line:  # a torn last line
                    if skipped is not None:
                        skipped.append(i)
                    return
                while raw and not raw.endswith(b"\n"):  # too long: read through it a chunk at a time
                    raw = f.readline(1 << 20)
                if skipped is not None:
                    skipped.append(i)
                continue
            try:
                yield i, json.loads(raw)
            except (ValueError, RecursionError):
                if skipped is not None:
                    skipped.append(i)


# what a line that parses but is not the format's raises while it is read: skipped, counted
# (OverflowError: a time or an integer given as Infinity or 1e400)
_MALFORMED = (KeyError, TypeError, ValueError, AttributeError, RecursionError, OverflowError)

_MAX_TIME_NS = 2**63  # OTLP's times are fixed64 nanoseconds; past 2262 they name no real moment


def _each(path: str, skipped: list | None, convert) -> list:
    out = []
    for i, req in _numbered_lines(path, skipped):
        try:
            out.extend(convert(req))
        except _MALFORMED:
            if skipped is not None:
                skipped.append(i)
    return out


def _str(v) -> str:
    if not isinstance(v, str):
        raise TypeError("expected a string")
    return v


def _time_ns(v) -> int:
    """An OTLP time: an integer (or its decimal string) of nanoseconds since the epoch."""
    if isinstance(v, bool) or isinstance(v, float) and not v.is_integer():
        raise ValueError(f"not a time: {v!r}")
    t = int(v)
    if not 0 <= t < _MAX_TIME_NS:
        raise ValueError(f"not a time: {v!r}")
    return t


def _span_times(sp: dict) -> tuple[int, int]:
    """(start, end) of a span; one that ends before it starts is not the format (a span that
    lasts minus three seconds would shift every busy share computed from it)."""
    start, end = _time_ns(sp["startTimeUnixNano"]), _time_ns(sp["endTimeUnixNano"])
    if end < start:
        raise ValueError("a span that ends before it starts")
    return start, end


def _spans_of(req: dict) -> list[dict]:
    """One exported request's spans (all or nothing: a line with one malformed span is skipped)."""
    out = []
    for rs in req.get("resourceSpans", []):
        resource = attributes(rs.get("resource", {}).get("attributes"))
        for ss in rs.get("scopeSpans", []):
            for sp in ss.get("spans", []):
                start, end = _span_times(sp)
                out.append({
                    "name": _str(sp["name"]),
                    "trace_id": _str(sp["traceId"]),
                    "span_id": _str(sp["spanId"]),
                    "parent_span_id": _str(sp.get("parentSpanId", "")),
                    "start_ns": start,
                    "end_ns": end,
                    "attributes": attributes(sp.get("attributes")),
                    "events": [{"name": _str(e["name"]), "time_ns": _time_ns(e["timeUnixNano"]),
                                "attributes": attributes(e.get("attributes"))}
                               for e in sp.get("events", [])],
                    "links": [{"trace_id": _str(l["traceId"]), "span_id": _str(l["spanId"]),
                               "attributes": attributes(l.get("attributes"))}
                              for l in sp.get("links", [])],
                    "status": dict(sp.get("status", {})),
                    "resource": resource,
                })
    return out


def read_spans(path: str, skipped: list | None = None) -> list[dict]:
    """Spans from a traces.jsonl (or a directory holding one) as flat dicts; ``skipped``:
    see read_lines (a line that parses but holds a malformed span is skipped whole)."""
    if os.path.isdir(path):
        path = os.path.join(path, TRACES_FILE)
    return _each(path, skipped, _spans_of)


def read_metrics(path: str, skipped: list | None = None) -> list[dict]:
    """Metric points from a metrics.jsonl (or its directory): one dict per data point with
    name, unit, type (gauge/sum/histogram), time_ns, attributes, value (or count/sum/
    bucket_counts/explicit_bounds/min/max for histograms), resource. ``skipped``: see
    read_lines."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    return _each(path, skipped, _points_of)


def _points_of(req: dict) -> list[dict]:
    out = []
    for rm in req.get("resourceMetrics", []):
        resource = attributes(rm.get("resource", {}).get("attributes"))
        for sm in rm.get("scopeMetrics", []):
            for m in sm.get("metrics", []):
                for kind in ("gauge", "sum", "histogram"):
                    if kind not in m:
                        continue
                    for p in m[kind].get("dataPoints", []):
                        point = {"name": _str(m["name"]), "unit": m.get("unit", ""), "type": kind,
                                 "time_ns": _time_ns(p.get("timeUnixNano", 0)),
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
