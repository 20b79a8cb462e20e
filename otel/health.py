"""Span accounting: every stage record the hot path saw ends in exactly one bucket.

  recorded = exported + dropped (by reason) + queued,   at any moment

- recorded: stage records (including those a full buffer refused) plus the synthesized
  per-key root spans;
- dropped, by reason:
    buffer_full       a per-thread list or the transport's bounded backlog was full
    collector_down    a span exporter refused the spans, or its bounded queue was full
    write_failed      the file sink could not write them (disk full, I/O error); the file
                      is cut back to its last whole line, so it stays readable
    exporter_gone     the exporter process died and its batches could not be re-exported
    shutdown_timeout  a network exporter was still busy when the shutdown bound ran out
    no_exporter       no span exporter could take them: every one configured failed to
                      start (a bad OTEL_* value, a refused file), or none is configured
- queued: waiting for CUDA events, in flight to the exporter, or in its export queue.

With several span exporters (`OTEL_TRACES_EXPORTER=otlp,file`, or an endpoint beside a run's
files) a span counts as exported when an exporter kept it; each exporter's own counts are in
``exporters`` (the file may hold every span a dead collector never got).

The exporter side commits its counts batch by batch (otel.exporter.sdk_pipeline), so the sum holds
for any status snapshot, not only at the end.
"""
from __future__ import annotations

DROP_REASONS = ("buffer_full", "collector_down", "write_failed", "exporter_gone", "shutdown_timeout",
                "no_exporter")


def empty_status() -> dict:
    """What a transport reports before its exporter said anything."""
    return {"done_seq": 0, "spans_done": 0, "roots": 0, "roots_queued": 0, "spans_exported": 0, "export_failures": 0,
            "dropped": {r: 0 for r in DROP_REASONS}, "notes": []}


def add_statuses(a: dict, b: dict) -> dict:
    """Two exporters' committed counts together (an exporter process and the fallback
    that took over from it)."""
    out = dict(a)
    for k in ("spans_done", "roots", "roots_queued", "spans_exported", "export_failures"):
        out[k] = a.get(k, 0) + b.get(k, 0)
    out["dropped"] = {r: a.get("dropped", {}).get(r, 0) + b.get("dropped", {}).get(r, 0) for r in DROP_REASONS}
    out["notes"] = list(a.get("notes", [])) + [n for n in b.get("notes", []) if n not in a.get("notes", [])]
    exporters: dict = {}  # with several span exporters: each one's own counts
    for st in (a, b):
        for name, c in (st.get("exporters") or {}).items():
            e = exporters.setdefault(name, {"exported": 0, "dropped": {}})
            e["exported"] += c.get("exported", 0)
            for r, n in (c.get("dropped") or {}).items():
                e["dropped"][r] = e["dropped"].get(r, 0) + n
    if exporters:
        out["exporters"] = exporters
    return out


def exporters_line(exporters: dict | None) -> str:
    """``otlp: exported 0, dropped 46 (collector_down); file: exported 46``, or "" for one exporter."""
    parts = []
    for name, c in (exporters or {}).items():
        why = ", ".join(f"{r} {n}" for r, n in c["dropped"].items() if n)
        parts.append(f"{name}: exported {c['exported']}" + (f", dropped {sum(c['dropped'].values())} ({why})"
                                                            if why else ""))
    return "; ".join(parts)


def health(buffer_full: int, pending: int, shipped: int, status: dict) -> dict:
    """buffer_full: records the hot path's lists refused; pending: records waiting for CUDA
    events; shipped: records handed to the transport; status: the transport's counts."""
    dropped = {r: status.get("dropped", {}).get(r, 0) for r in DROP_REASONS}
    in_transport = dropped["buffer_full"] + dropped["exporter_gone"]  # never reached an exporter
    dropped["buffer_full"] += buffer_full
    # a batch's roots count once it is enqueued, as its stage records do once shipped: a file lane
    # that wrote them while a dead collector's lane holds the batch open is never "more than recorded"
    roots_queued = status.get("roots_queued", 0)
    recorded = buffer_full + pending + shipped + status.get("roots", 0) + roots_queued
    queued = pending + shipped - status.get("spans_done", 0) - in_transport + roots_queued
    return {"spans_recorded": recorded, "spans_exported": status.get("spans_exported", 0),
            "spans_dropped": sum(dropped.values()), "spans_queued": queued,
            "dropped": dropped, "export_failures": status.get("export_failures", 0)}
