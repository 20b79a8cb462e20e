"""Readers of the file sink's format (otel/exporter/filesink.py: the OpenTelemetry
Collector file exporter's OTLP/JSON lines). Plain JSON, no SDK import: offline tools
(`dflash stalls`, the W&B bridge, tests) read runs with these.

A line that does not parse, or a torn last line left by a killed process, is skipped and
counted (`read_lines(..., skipped=)`).
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
