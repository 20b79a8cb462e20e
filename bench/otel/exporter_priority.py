"""Which niceness should the exporter process run at (after its start-up, which always runs
at the training process's priority)? Side by side in one run, for each
candidate: while CPU burners saturate the host (as a training job does), a producer
records stages at a training-like rate next to a busy Python thread (bench/otel/gil_stall.py's
stand-in for a worker), then shuts the telemetry down. Per niceness it prints
- the busy thread's throughput, relative to the same load without telemetry,
- the share of the recorded spans already in the files when recording stopped (does the
  exporter keep up live, or only at shutdown?),
- how long shutdown took, and whether every span reached the files.

    .venv/bin/python bench/otel/exporter_priority.py [--nices 0,5,10,19] [--burners 3] [--seconds 4]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # -> gil_stall
for k in [k for k in os.environ if k.startswith("OTEL_")]:
    del os.environ[k]  # the file sink, nothing else

import otel  # noqa: E402
from gil_stall import TICK_S, measure  # noqa: E402


def count_spans(d) -> int:
    try:
        return len(otel.read_spans(d))
    except FileNotFoundError:
        return 0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--nices", default="0,5,10,19")
    ap.add_argument("--burners", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--rate", type=int, default=2000, help="stages recorded per second")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    per_tick = max(int(args.rate * TICK_S), 1)
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)]
    rows: dict = {}
    try:
        for _ in range(args.rounds):
            for nice in [int(x) for x in args.nices.split(",")]:
                # the baseline right before each candidate: the load drifts between them
                base = measure(args.seconds, lambda: None)["iterations"]
                d = tempfile.mkdtemp(prefix=f"prio{nice}-")
                tel = otel.Telemetry.from_env("bench", console=False, file_dir=d, exporter_nice=nice, run_id="prio")
                counter = [0]

                def tick(tel=tel, counter=counter):
                    for _ in range(per_tick):
                        counter[0] += 1
                        with tel.stage("model_forward", trace=("batch", counter[0] // 8), worker="target0"):
                            pass

                r = measure(args.seconds, tick)
                tel._bg.cycle()
                time.sleep(0.5)  # what a short run's tail would give it
                live = count_spans(d)
                t0 = time.monotonic()
                tel.shutdown(timeout_s=2.0)
                shut = time.monotonic() - t0
                h = tel.summary()["health"]
                rows.setdefault(nice, []).append({
                    "throughput_kept": r["iterations"] / base, "recorded": h["spans_recorded"],
                    "in_files_before_shutdown": live / max(h["spans_recorded"], 1),
                    "shutdown_s": shut, "complete": count_spans(d) == h["spans_recorded"],
                    "notes": tel.summary().get("notes", [])})
    finally:
        for p in burners:
            p.kill()
            p.wait()
    print(f"{args.burners} CPU burners on {os.cpu_count()} cores, {args.rate} stages/s, {args.seconds} s per round")
    print(f"{'nice':>5}{'kept':>8}{'live %':>9}{'shutdown s':>12}  complete")
    out = {}
    for nice, rs in rows.items():
        med = {k: sorted(r[k] for r in rs)[len(rs) // 2] for k in ("throughput_kept", "in_files_before_shutdown", "shutdown_s")}
        med["complete"] = all(r["complete"] for r in rs)
        med["fallback_used"] = any(any("exported the rest itself" in n for n in r["notes"]) for r in rs)
        out[nice] = med
        print(f"{nice:>5}{med['throughput_kept']:>8.3f}{med['in_files_before_shutdown'] * 100:>8.1f}%"
              f"{med['shutdown_s']:>12.2f}  {med['complete']}{' (fallback)' if med['fallback_used'] else ''}")
    print(json.dumps({"burners": args.burners, "rate": args.rate, "results": out}))


if __name__ == "__main__":
    main()
