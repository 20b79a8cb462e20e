"""`dflash timeline`: a per-worker Gantt of stages and stalls, from a run's telemetry (PNG,
Perfetto JSON). Reads telemetry only (no torch import, no model); bad input is a
ConfigError (exit 2)."""
from __future__ import annotations

import os

from .stalls import add_source_args


def add_parser(sub) -> None:
    t = sub.add_parser("timeline", help="per-worker Gantt of stages and stalls (PNG, Perfetto JSON)")
    add_source_args(t)
    t.add_argument("--png", metavar="FILE", help="write a PNG picture")
    t.add_argument("--perfetto", metavar="FILE", help="write Chrome/Perfetto trace-event JSON (ui.perfetto.dev)")


def run(a) -> int:
    from ..analysis.stalls import check_window, load, parse_window, worker_of
    from ..analysis.timeline import check_output, write_perfetto, write_png
    from ..errors import ConfigError

    if not a.png and not a.perfetto:
        raise ConfigError("nothing to write: give --png FILE and/or --perfetto FILE")
    for flag, path, suffix in (("--png", a.png, ".png"), ("--perfetto", a.perfetto, ".json")):
        if path:  # before reading anything: never onto the run's files, nor anyone else's
            check_output(path, flag=flag, suffix=suffix, run_dir=a.run_dir)
    if a.png and a.perfetto and os.path.abspath(a.png) == os.path.abspath(a.perfetto):
        raise ConfigError(f"--png and --perfetto name the same file {a.png!r}")
    window = parse_window(a.window)
    rid, spans, source = load(a.run_dir, run_id=a.run_id, steps=True)  # not an export's run beside it
    if not any(worker_of(s) is not None for s in spans):
        raise ConfigError(f"{source}: no training step in run {rid} (its phases only): nothing to draw; "
                          f"`dflash stalls {a.run_dir}` prints its start-up")
    check_window(spans, window)
    if a.png:
        write_png(spans, a.png, window=window, run_id=rid)
        print(f"wrote {a.png}")
    if a.perfetto:
        n = write_perfetto(spans, a.perfetto, window=window, run_id=rid)
        print(f"wrote {a.perfetto} ({n} events; open in https://ui.perfetto.dev)")
    return 0
