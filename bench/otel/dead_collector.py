"""A dead collector must cost the workers nothing: OTLP endpoint on a closed port.

A worker loop (3 stages of ~0.3 ms of Python work each) runs in short alternating
segments, plain / with tel.stage around each stage, while the layer exports to the dead
endpoint; A/B alternation every half second cancels the drift of a shared, noisy machine.
Process and thread mode. Reports the throughput ratio (iterations traced / plain), the
worker-CPU ratio (CPU per iteration plain / traced: the cost on the worker thread itself,
insensitive to neighbours' load), peak RSS growth (training process + exporter child) and
shutdown time. Last line: one JSON object.

    .venv/bin/python bench/otel/dead_collector.py [--seconds 6] [--segment 0.5]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def closed_port_endpoint() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def work_unit():
    x = 0
    for i in range(6000):   # ~0.3 ms of pure-Python host work
        x += i * i
    return x


def run_loop(seconds: float, tel) -> int:
    c0 = time.thread_time()
    iters = run_loop_inner(seconds, tel)
    CPU[tel is not None] += time.thread_time() - c0
    return iters


CPU = {False: 0.0, True: 0.0}   # worker-thread CPU seconds: plain, traced


def run_loop_inner(seconds: float, tel) -> int:
    iters = 0
    stop = time.perf_counter() + seconds
    if tel is None:
        while time.perf_counter() < stop:
            work_unit()
            work_unit()
            work_unit()
            iters += 1
    else:
        stage = tel.stage
        while time.perf_counter() < stop:
            with stage("model_forward", trace=("batch", iters), worker="target0"):
                work_unit()
            with stage("pack_hidden", trace=("batch", iters), worker="target0"):
                work_unit()
            with stage("optimizer_step", links=[("batch", iters)], worker="drafter0"):
                work_unit()
            iters += 1
    return iters


class PeakRss:
    """Samples RSS of this process and its children every 20 ms."""

    def __init__(self):
        self.me = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        total = self.me.memory_info().rss
        for c in self.me.children(recursive=True):
            try:
                total += c.memory_info().rss
            except psutil.Error:
                pass
        return total

    def _run(self):
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.rss())

    def __enter__(self):
        self.start = self.rss()
        self.peak = self.start
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=6.0, help="per mode, both arms together")
    ap.add_argument("--segment", type=float, default=0.5)
    ap.add_argument("--nice", type=int, default=19, help="exporter process niceness increment")
    args = ap.parse_args()
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = closed_port_endpoint()
    os.environ["OTEL_EXPORTER_OTLP_PROTOCOL"] = "grpc"
    import otel

    out = {"seconds": args.seconds, "segment_s": args.segment, "exporter_nice": args.nice}
    print(f"{'mode':<10}{'iters plain':>12}{'iters traced':>14}{'ratio':>8}{'cpu ratio':>11}{'peak RSS growth MB':>20}{'shutdown s':>12}")
    for mode in ("process", "thread"):
        tel = otel.Telemetry.from_env("bench", console=False, mode=mode, max_queue=8192, exporter_nice=args.nice)
        time.sleep(1.0)  # exporter start-up is outside the measurement
        plain = traced = 0
        CPU[False] = CPU[True] = 0.0
        with PeakRss() as mem:
            for _ in range(int(args.seconds / args.segment / 2)):
                plain += run_loop(args.segment, None)
                traced += run_loop(args.segment, tel)
            health = tel.summary()["health"]
            t0 = time.perf_counter()
            tel.shutdown(timeout_s=2.0)
            shut = time.perf_counter() - t0
        ratio = traced / plain
        # CPU-time view, immune to the neighbours' load: worker CPU per iteration
        cpu_ratio = (CPU[False] / plain) / (CPU[True] / traced)
        growth = (mem.peak - mem.start) / 2**20
        print(f"{mode:<10}{plain:>12}{traced:>14}{ratio:>8.3f}{cpu_ratio:>11.3f}{growth:>20.1f}{shut:>12.2f}")
        out[mode] = {"iterations_plain": plain, "iterations_traced": traced,
                     "throughput_ratio": round(ratio, 4), "worker_cpu_ratio": round(cpu_ratio, 4),
                     "peak_rss_growth_mb": round(growth, 1),
                     "shutdown_s": round(shut, 3), "health": health,
                     "goal_ratio_ge_0.99": ratio >= 0.99, "goal_shutdown_le_2s": shut <= 2.0}
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
