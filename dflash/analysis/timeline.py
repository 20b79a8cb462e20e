"""`dflash timeline`: pictures of a run. A per-worker Gantt PNG (stages in cool colours,
idle time in warm colours by cause, from otel.idle's segments) and Chrome/Perfetto
trace-event JSON (one track per worker, stalls as their own events) for ui.perfetto.dev."""
from __future__ import annotations

import json
import math
from collections import defaultdict

from otel import BUSY

from .stalls import attribute, run_start_ns, window_ns, worker_label, worker_of, worker_order

# Idle causes get warm, saturated colours so stalls jump out; busy stages cool ones.
CAUSE_COLORS = {"queue_empty": "#d62728", "queue_full": "#ff7f0e", "data_wait": "#9467bd",
                "host": "#7f7f7f", "sync": "#8c564b", "checkpoint": "#e377c2", "other": "#bcbd22"}
STAGE_COLORS = ["#1f77b4", "#aec7e8", "#2ca02c", "#98df8a", "#17becf", "#9edae5", "#393b79",
                "#6b6ecf", "#637939", "#b5cf6b"]


# Each picture says who wrote it (a PNG text chunk; the JSON's first key), so a later run
# may replace its own earlier output, and nothing else (timeline_outputs).
GENERATOR = "dflash timeline"


def _written_by_us(path) -> bool:
    """Whether an existing file is a picture `dflash timeline` wrote: its marker sits in the
    first few KB (PNG tEXt chunks come before the image data; JSON: the first key)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    if head.startswith(b"\x89PNG"):
        return b"Software\x00" + GENERATOR.encode() in head
    return head.startswith(b'{"generator": "' + GENERATOR.encode() + b'"')


def check_output(path: str, *, flag: str, suffix: str, run_dir) -> None:
    """One line (ConfigError) unless `path` is a new file, or a picture `dflash timeline`
    wrote before, named ``*<suffix>`` and outside the run's own files (telemetry/,
    checkpoint/, export/, summary.json, ...). Writes nothing."""
    from pathlib import Path

    from ..errors import ConfigError
    from ..preflight.run_dir import check_place

    p = check_place(path, flag=flag, want_dir=False, expected=f"a file name ending in {suffix}")
    if not p.name.lower().endswith(suffix):
        raise ConfigError(f"{flag} {path}: expected a file name ending in {suffix}")
    if p.is_symlink():  # os.replace would put the picture in the link's place: never follow, never replace
        raise ConfigError(f"{flag} {path}: is a symbolic link (choose a new name, or remove the link first)")
    run = Path(run_dir).resolve()
    if p.absolute().is_relative_to(Path(run_dir).absolute()):  # named inside the run dir: no link out of it
        from otel.confined import links_on_the_way
        link = links_on_the_way(Path(run_dir).absolute(), p.absolute().parent)
        if link is not None:
            raise ConfigError(f"{flag} {path}: {link} is a symbolic link, never followed out of the run dir "
                              "(choose a place outside it, or remove the link)")
    where = p.resolve()
    for owned in ("telemetry", "checkpoint", "checkpoint.old", "export"):
        if where.is_relative_to(run / owned) or p.absolute().is_relative_to(Path(run_dir).absolute() / owned):
            raise ConfigError(f"{flag} {path}: inside the run's own {owned}/ (choose a place outside it)")
    if p.exists() and not _written_by_us(p):
        raise ConfigError(f"{flag} {path}: exists and is not a picture dflash timeline wrote; it is never "
                          "replaced (choose a new name, or remove it first)")


def _replace_atomically(path, write) -> None:
    """``write(tmp)`` then rename onto ``path``: a reader never sees half a file, and a failed
    write leaves the earlier one. The file gets a plain write's mode under the umask."""
    import os
    import tempfile
    from pathlib import Path

    from ..preflight.checkpoint_files import plain_modes

    dst = Path(path)
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.tmp-", dir=dst.parent)
    os.close(fd)
    try:
        write(tmp)
        plain_modes(Path(tmp))
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _text_color(hex_color: str) -> str:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 150 else "white"


def _stage_palette(spans) -> dict:
    """Colour by first appearance over the whole run, so a window keeps the same colours."""
    first = {}
    for s in sorted(spans, key=lambda s: s["start_ns"]):
        if worker_of(s) is not None:
            first.setdefault(s["name"], len(first))
    return {name: STAGE_COLORS[i % len(STAGE_COLORS)] for name, i in first.items()}


def write_png(spans, path, window=None, run_id=None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    snap, segments = attribute(spans, window)
    t0 = run_start_ns(spans)
    rows = sorted(segments, key=worker_order)
    palette = _stage_palette(spans)
    fig_h = 2.2 + 0.75 * len(rows)
    fig, ax = plt.subplots(figsize=(14, fig_h), dpi=110)
    lo = min((s[0][0] for s in segments.values() if s), default=t0)
    hi = max((s[-1][1] for s in segments.values() if s), default=t0 + 1)
    span_s = max((hi - lo) / 1e9, 1e-6)
    for y, key in enumerate(rows):
        by_color = defaultdict(list)
        for a, b, cause, stage, _ in segments[key]:
            color = palette[stage] if cause == BUSY else CAUSE_COLORS.get(cause, "#000000")
            by_color[color].append(((a - t0) / 1e9, (b - a) / 1e9))
            # name the wide busy bars; narrow ones would only be clutter
            if cause == BUSY and (b - a) / 1e9 > span_s / 25:
                ax.text((a + b - 2 * t0) / 2e9, y, stage, ha="center", va="center", fontsize=7,
                        color=_text_color(color), clip_on=True)
        for color, bars in by_color.items():
            ax.broken_barh(bars, (y - 0.38, 0.76), facecolors=color, edgecolor="none")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{worker_label(k)}\n" + (f"busy {snap[k]['busy_fraction']:.0%}" if snap[k]["wall_s"]
                                                   else "not active") for k in rows], fontsize=9)
    ax.set_ylim(len(rows) - 0.5, -0.5)                 # pipeline order top to bottom
    ax.set_xlim((lo - t0) / 1e9, (hi - t0) / 1e9)
    ax.set_xlabel("seconds from run start")
    ax.grid(axis="x", alpha=0.3)
    ax.set_axisbelow(True)
    title = f"run {run_id or '?'}: stages (blue/green) and idle time by cause (warm colours)"
    if window:
        title += f", window {window[0]:g}-{window[1]:g} s"
    ax.set_title(title, fontsize=11)
    used = {stage for segs in segments.values() for *_, c, stage, _ in segs if c == BUSY}
    # a cause worth a legend entry is one you can see: >= 0.1% of the longest row
    visible = 1e-3 * max((d["wall_s"] for d in snap.values()), default=0)
    causes = [c for c in CAUSE_COLORS if any(d["idle_s"].get(c, 0) >= visible > 0 for d in snap.values())]
    handles = ([Patch(color=CAUSE_COLORS[c], label=f"idle: {c}") for c in causes]
               + [Patch(color=palette[s], label=s) for s in palette if s in used])
    ncol = max(1, min(len(handles), 7))  # no entry at all: still one column
    legend_in = 0.25 + 0.22 * -(-len(handles) // ncol)  # rows of legend entries, in inches
    fig.legend(handles=handles, loc="lower center", ncol=ncol, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, legend_in / fig_h, 1, 1))
    _replace_atomically(path, lambda tmp: fig.savefig(tmp, format="png", metadata={"Software": GENERATOR}))
    plt.close(fig)


def perfetto_events(spans, window=None, run_id=None) -> list[dict]:
    """Trace events: pid = rank, tid = worker; "X" events in microseconds from run start."""
    snap, segments = attribute(spans, window)
    t0 = run_start_ns(spans)
    win = window_ns(spans, window)
    rows = sorted((k for k, segs in segments.items() if segs), key=worker_order)  # active in the window
    tid = {k: i + 1 for i, k in enumerate(rows)}
    us = lambda ns: (ns - t0) / 1e3  # noqa: E731
    ev = []
    for rank in sorted({k[0] for k in rows}):
        ev.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
    for k in rows:
        ev.append({"ph": "M", "name": "thread_name", "pid": k[0], "tid": tid[k], "args": {"name": k[1]}})
        ev.append({"ph": "M", "name": "thread_sort_index", "pid": k[0], "tid": tid[k], "args": {"sort_index": tid[k]}})
    for s in spans:
        k = worker_of(s)
        if k not in tid:
            continue
        a, b = s["start_ns"], s["end_ns"]
        if win:
            a, b = max(a, win[0]), min(b, win[1])
            if b <= a:
                continue
        args = {**_strict_json(s["attributes"]), "trace_id": s["trace_id"], "span_id": s["span_id"]}
        ev.append({"ph": "X", "cat": "stage", "name": s["name"], "pid": k[0], "tid": tid[k],
                   "ts": us(a), "dur": (b - a) / 1e3, "args": args})
        for e in s["events"]:
            ev.append({"ph": "i", "s": "t", "cat": "event", "name": e["name"], "pid": k[0], "tid": tid[k],
                       "ts": us(e["time_ns"]), "args": _strict_json(e["attributes"])})
    for k in rows:
        for a, b, cause, stage, span in segments[k]:
            if cause != BUSY:
                ev.append({"ph": "X", "cat": "stall", "name": f"idle: {cause}", "pid": k[0], "tid": tid[k],
                           "ts": us(a), "dur": (b - a) / 1e3,
                           "args": {"cause": cause, "stage": stage, "trace_id": span["trace_id"]}})
    return ev


def _strict_json(v):
    """Attributes as strict JSON holds them: a NaN or infinite number (valid in OTLP) as its
    text, since Perfetto's and other strict parsers refuse a bare NaN."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _strict_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_strict_json(x) for x in v]
    return v


def write_perfetto(spans, path, window=None, run_id=None) -> int:
    ev = perfetto_events(spans, window, run_id)
    doc = {"generator": GENERATOR, "traceEvents": ev, "displayTimeUnit": "ms",
           "otherData": {"run_id": run_id, "time_origin_unix_ns": run_start_ns(spans)}}

    def write(tmp):
        with open(tmp, "w") as f:  # bytes as hex (JSON has none), anything else JSON has no type for as its text
            json.dump(doc, f, default=lambda v: v.hex() if isinstance(v, (bytes, bytearray)) else str(v),
                      allow_nan=False)
    _replace_atomically(path, write)
    return len(ev)
