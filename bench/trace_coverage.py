"""How much of a command's wall its own trace covers (issue 52): runs the command, times its
process from outside (start to exit), then reads the run's telemetry dir and prints the union
of the root span's phases over that wall, the longest stretch outside them, and the root span's
own start and end against the wall. The phase table the command prints says where the time
went; this says how much of it has a name.

    .venv/bin/python bench/trace_coverage.py --telemetry runs/demo/telemetry -- \\
        .venv/bin/python -m dflash train --config configs/demo.yaml --eval --overwrite

The last line is one JSON object. The command's exit code is passed on.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dflash.analysis.startup import coverage  # noqa: E402
from otel import read_spans  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--telemetry", type=Path, required=True, help="the run's telemetry dir (read after the command)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        print("trace_coverage.py: no command given after --: expected the command to time", file=sys.stderr)
        return 2
    if a.telemetry.exists() and not a.telemetry.is_dir():
        print(f"trace_coverage.py: --telemetry {a.telemetry}: not a directory", file=sys.stderr)
        return 2
    t0 = time.time_ns()
    try:
        rc = subprocess.call(cmd, cwd=ROOT)
    except OSError as e:  # no such program, not executable
        print(f"trace_coverage.py: cannot run {cmd[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 2
    t1 = time.time_ns()
    files = sorted(a.telemetry.rglob("traces.jsonl")) if a.telemetry.is_dir() else []
    spans = [s for f in files for s in read_spans(str(f)) if (s.get("attributes") or {}).get("otel.kind")]
    # this command's trace only: a run span that ended before it started is an earlier run's
    ours = {s["trace_id"] for s in spans if s["attributes"]["otel.kind"] == "run" and s["end_ns"] >= t0}
    spans = [s for s in spans if s["trace_id"] in ours]
    if not spans:
        print(f"trace_coverage.py: no run span of this command under {a.telemetry} (exit {rc}; spans of "
              f"earlier runs are not counted)", file=sys.stderr)
        return rc or 1
    c = coverage(spans, t0, t1) | {"exit": rc, "command": " ".join(cmd)}
    print(f"wall {c['wall_s']:.1f} s; phases cover {100 * c['share']:.1f}% ({c['phases']} top-level phases); "
          f"longest stretch outside them {c['longest_gap_s']:.2f} s at +{c['longest_gap_at_s']:.1f} s; "
          f"root span from +{c['root_starts_after_s']:.2f} s to {c['root_ends_before_s']:.2f} s before exit")
    print(json.dumps(c))
    return rc


if __name__ == "__main__":
    sys.exit(main())
