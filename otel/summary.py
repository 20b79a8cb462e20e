"""The summary dict's shared helpers: stage shares of wall time, and the console profile
table that renders a `tel.summary()` dict. Shared: the facade builds the summary and
prints the table (`tel.profile_table()`, at shutdown); the exporter side computes the
stage figures (otel.exporter.profile) and prints the table every `console_interval_s`
(otel.exporter.consumer)."""
from __future__ import annotations


def with_shares(stage: dict, wall_s: float) -> dict:
    """Set a stage summary's shares of wall time: `share` (its whole duration) and, for a
    stage that recorded waits, `work_share` and `wait_share`."""
    for key, total in (("share", "total_s"), ("work_share", "work_total_s"), ("wait_share", "wait_total_s")):
        if total in stage:
            stage[key] = stage[total] / wall_s if wall_s > 0 else 0.0
    return stage


def _fmt_s(s: float) -> str:
    if s >= 1:
        return f"{s:8.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:7.2f} ms"
    return f"{s * 1e6:7.1f} us"


def format_table(summary: dict, title: str = "telemetry profile", wait_attributes=()) -> str:
    """Render tel.summary() as the console profile table. A stage that recorded a wait
    (one of `wait_attributes`, seconds spent inside the stage waiting, e.g. for queue
    space) shows its work (duration minus wait) in the duration columns and the wait
    apart, so a stage that mostly waits does not look like the bottleneck."""
    stages = summary.get("stages", {})
    width = max([len("stage")] + [len(n) for n in stages])
    waits = any("wait_total_s" in st for st in stages.values())
    # the title holds OTEL_SERVICE_NAME, which may be anything: a control character (a newline, an
    # escape sequence) is shown escaped, never sent to the terminal
    title = "".join(c if c.isprintable() else repr(c)[1:-1] for c in title)
    lines = [f"== {title}: wall {summary.get('wall_s', 0.0):.2f} s =="]
    head = f"{'stage':<{width}} {'count':>8} {'p50':>10} {'p95':>10} {'max':>10} {'share':>7}"
    lines.append(head + (f" {'wait p50':>10} {'wait':>7}" if waits else ""))
    for name, st in sorted(stages.items(), key=lambda kv: -kv[1].get("work_total_s", kv[1]["total_s"])):
        if "wait_total_s" in st:
            row = (st["work_p50_s"], st["work_p95_s"], st["work_max_s"], st["work_share"])
            tail = f" {_fmt_s(st['wait_p50_s']):>10} {st['wait_share'] * 100:6.1f}%"
        else:
            row = (st["p50_s"], st["p95_s"], st["max_s"], st["share"])
            tail = f" {'-':>10} {'-':>7}" if waits else ""
        lines.append(f"{name:<{width}} {st['count']:>8} {_fmt_s(row[0]):>10} {_fmt_s(row[1]):>10} "
                     f"{_fmt_s(row[2]):>10} {row[3] * 100:6.1f}%" + tail)
    if waits:
        names = ", ".join(wait_attributes) or "its wait attributes"
        lines.append(f"(p50/p95/max/share: a stage's work, its duration minus the wait it recorded "
                     f"({names}); wait p50 / wait: that wait)")
    h = summary.get("health", {})
    reasons = ", ".join(f"{r} {n}" for r, n in (h.get("dropped") or {}).items() if n)
    lines.append(
        "health: spans recorded {0} exported {1} dropped {2}{3}, queued {4}, export failures {5}".format(
            h.get("spans_recorded", 0), h.get("spans_exported", 0), h.get("spans_dropped", 0),
            f" ({reasons})" if reasons else "", h.get("spans_queued", 0), h.get("export_failures", 0))
    )
    if h.get("exporters"):
        from otel.health import exporters_line
        lines.append(f"health by exporter: {exporters_line(h['exporters'])}")
    for note in summary.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)
