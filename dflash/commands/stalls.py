"""`dflash stalls`: why workers were idle, from a run's telemetry or a Jaeger query API.
Reads telemetry only (no torch import, no model); bad input is a ConfigError (exit 2)."""
from __future__ import annotations

import json


def add_source_args(p, run_required=True):
    p.add_argument("run_dir", metavar="RUN_DIR", nargs=None if run_required else "?",
                   help="run directory (reads RUN_DIR/telemetry/**/traces.jsonl), a --telemetry-dir or one traces.jsonl")
    p.add_argument("--run-id", help="which run, when the source holds several (default: the latest)")
    p.add_argument("--window", metavar="START:END", help="seconds from run start, e.g. 2:5 or 3:")


def add_parser(sub) -> None:
    s = sub.add_parser("stalls", help="why workers were idle: busy fraction, idle by cause, top stalls")
    add_source_args(s, run_required=False)
    s.add_argument("--json", action="store_true", help="last line: one JSON object")
    s.add_argument("--jaeger", metavar="URL", help="read spans from a Jaeger query API, e.g. http://127.0.0.1:16686")
    s.add_argument("--service", default="dflash", help="service name to query in Jaeger (default dflash)")
    s.add_argument("--limit", type=int, default=1000, help="traces to fetch from Jaeger (default 1000)")
    s.add_argument("--lookback", type=float, default=48.0, metavar="HOURS",
                   help="Jaeger query range: the last HOURS (default 48)")
    s.add_argument("--top", type=int, default=10, metavar="N", help="stalls to list (default 10)")


def run(a) -> int:
    from ..analysis.stalls import MAX_S, analyze, format_report, load, parse_window
    from ..errors import ConfigError

    if not a.run_dir and not a.jaeger:
        raise ConfigError("RUN_DIR or --jaeger URL is required")
    if a.run_dir and a.jaeger:  # one source: the other would be read silently never
        raise ConfigError(f"RUN_DIR {a.run_dir} and --jaeger {a.jaeger}: expected one of them (the run's files, or "
                          f"Jaeger with --run-id to pick the run)")
    if a.top < 0 or a.limit < 1 or not 0 < a.lookback <= MAX_S / 3600:  # NaN fails it too
        raise ConfigError(f"--top {a.top}, --limit {a.limit}, --lookback {a.lookback:g}: expected --top >= 0, "
                          f"--limit >= 1 and 0 < --lookback <= {MAX_S / 3600:g} hours")
    window = parse_window(a.window)
    rid, spans, source = load(a.run_dir, a.jaeger, a.service, a.limit, a.run_id, a.lookback)
    rep = analyze(spans, top=a.top, window=window, run_id=rid, source=source)
    print(format_report(rep))
    if a.json:
        print(json.dumps(rep))
    return 0
