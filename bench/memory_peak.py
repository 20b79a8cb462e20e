"""The memory check's calibration (preflight/memory.py; docs/failures.md, "The memory check"):
real `dflash train` runs, each a child process, its peak resident set as the kernel measured it
(ru_maxrss from wait4, via bench/peak_rss.py) beside what the run estimated at its check (summary.json "memory").

    .venv/bin/python bench/memory_peak.py --layers 1,16,64,128
    .venv/bin/python bench/memory_peak.py --layers 16,64 --set train.save_every=2
    .venv/bin/python bench/memory_peak.py --layers 128 --steps 0

Every run: tiny-qwen3, tests/helpers.TINY's data and batch (2 x 4 anchors x block 8, max_len 96),
no telemetry, one at a time; `--set KEY=VALUE` is passed on to every run. A table on stdout and
one JSON line per run; `--out` keeps the run dirs (default: a temp dir, removed). Peaks are not
timings: other processes sharing the cores do not move them.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from helpers import TINY  # noqa: E402  (the tests' small data and batch)

MiB = 2**20


def check_args(a) -> str | None:
    """One line naming the first bad argument, or None: before any run starts."""
    try:
        a.layers = [int(x) for x in a.layers.split(",")]
    except ValueError:
        return f"--layers {a.layers!r}: expected a comma list of layer counts, e.g. 1,16,64"
    if any(not 1 <= n <= 128 for n in a.layers):
        return f"--layers {','.join(map(str, a.layers))}: expected layer counts in [1, 128]"
    if a.steps < 0:
        return f"--steps {a.steps}: expected a non-negative integer"
    bad = [s for s in a.set if "=" not in s]
    if bad:
        return f"--set {bad[0]!r}: expected KEY=VALUE"
    if a.out and Path(a.out).exists() and not Path(a.out).is_dir():
        return f"--out {a.out!r}: not a directory"
    return None


def run_one(out: Path, layers: int, steps: int, sets: list[str]) -> dict:
    """One `dflash train` child: its exit code, measured peak and the estimate it made."""
    cmd = [sys.executable, "-m", "dflash", "train", "--out", str(out), "--target", "tiny-qwen3", "--steps", str(steps),
           "--no-telemetry", "--overwrite", *TINY, "--set", f"model.num_layers={layers}",
           *[x for s in sets for x in ("--set", s)]]
    peak = out.parent / f"{out.name}.peak"  # reaped by peak_rss.py: the run's own peak, never this process's
    with open(out.parent / f"{out.name}.log", "w") as log:
        rc = subprocess.run([sys.executable, str(ROOT / "bench" / "peak_rss.py"), str(peak), "--", *cmd], cwd=ROOT,
                            stdout=log, stderr=subprocess.STDOUT).returncode
    row = {"layers": layers, "steps": steps, "set": sets, "rc": rc, "measured_peak_bytes": int(peak.read_text())}
    if rc == 0:
        mem = json.loads((out / "summary.json").read_text())["memory"]
        row |= {k: mem[k] for k in ("parameters", "estimated_peak_bytes", "held_at_check_bytes", "estimated_phase")}
        row["error"] = round(row["estimated_peak_bytes"] / row["measured_peak_bytes"] - 1, 4)
    else:
        row["log_tail"] = (out.parent / f"{out.name}.log").read_text()[-600:]
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="1,16,64", help="drafter layer counts, e.g. 1,16,64")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed on to dflash train")
    ap.add_argument("--out", default="", help="keep the run dirs here (default: a temp dir, removed)")
    a = ap.parse_args(argv)
    err = check_args(a)
    if err:
        print(f"bench/memory_peak.py: error: {err}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="memory-peak-") as tmp:
        where = Path(a.out or tmp).resolve()  # the runs' cwd is ROOT: absolute paths read back
        where.mkdir(parents=True, exist_ok=True)
        print(f"{'layers':>6} {'params':>12} {'held at check':>14} {'estimate':>10} {'measured':>10} {'error':>7}  phase")
        rows = []
        for n in a.layers:
            row = run_one(where / f"l{n}-s{a.steps}", n, a.steps, a.set)
            rows.append(row)
            if row["rc"]:
                print(f"{n:>6}  rc {row['rc']}: {row['log_tail'].strip().splitlines()[-1:]}")
                continue
            print(f"{n:>6} {row['parameters']:>12,} {row['held_at_check_bytes'] / MiB:>10.0f} MiB "
                  f"{row['estimated_peak_bytes'] / MiB:>6.0f} MiB {row['measured_peak_bytes'] / MiB:>6.0f} MiB "
                  f"{100 * row['error']:>+6.1f}%  {row['estimated_phase']}")
        for row in rows:
            print(json.dumps(row))
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
