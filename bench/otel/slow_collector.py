"""A collector that answers every OTLP/HTTP request after a delay: how many spans of a steady
stream reach it before the shutdown bound, in each transport mode (otel/exporter/sdk_pipeline.py:
a network lane sends what has queued up, up to `export_chunk` spans a request: 512 in process
mode, 64 in thread mode). Each mode in a child process of its own, one after the other, the
collector a local HTTP server in this process. Last line: one JSON object.

    .venv/bin/python bench/otel/slow_collector.py [--delay 0.3] [--seconds 3] [--rate 650]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
import otel
tel = otel.Telemetry.from_env("bench", console=False, mode={mode!r})
t0 = time.monotonic()
while time.monotonic() - t0 < {seconds}:
    for _ in range(20):
        with tel.stage("step", worker="w0"):
            pass
    time.sleep(20 / {rate})
t = time.monotonic()
tel.shutdown(timeout_s={bound})
h = tel.summary()["health"]
print(json.dumps({{"recorded": h["spans_recorded"], "exported": h["spans_exported"], "dropped": h["dropped"],
                  "shutdown_s": round(time.monotonic() - t, 2)}}))
"""


def serve(delay: float) -> tuple[ThreadingHTTPServer, dict]:
    seen = {"requests": 0}

    class Slow(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            seen["requests"] += "traces" in self.path
            time.sleep(delay)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Slow)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, seen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--delay", type=float, default=0.3, help="seconds the collector takes to answer a request")
    ap.add_argument("--seconds", type=float, default=3.0, help="how long the stream of stages runs")
    ap.add_argument("--rate", type=float, default=650.0, help="stages a second")
    ap.add_argument("--bound", type=float, default=3.0, help="the shutdown bound (seconds)")
    a = ap.parse_args()
    for name, v in (("--delay", a.delay), ("--seconds", a.seconds), ("--rate", a.rate), ("--bound", a.bound)):
        if not (v > 0 and v < 1e6):
            print(f"slow_collector: {name}={v}: expected a positive number", file=sys.stderr)
            sys.exit(2)
    srv, seen = serve(a.delay)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env |= {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{srv.server_address[1]}",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_METRICS_EXPORTER": "none"}
    out = {"delay_s": a.delay, "modes": {}}
    for mode in ("process", "thread"):
        before = seen["requests"]
        code = CHILD.format(root=ROOT, mode=mode, seconds=a.seconds, rate=a.rate, bound=a.bound)
        p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        if p.returncode != 0:
            print(p.stderr[-2000:], file=sys.stderr)
            sys.exit(1)
        r = json.loads(p.stdout.strip().splitlines()[-1]) | {"requests": seen["requests"] - before}
        out["modes"][mode] = r
        print(f"{mode:8} recorded {r['recorded']:6}  exported {r['exported']:6}  requests {r['requests']:4}  "
              f"shutdown {r['shutdown_s']:.2f} s  dropped {sum(r['dropped'].values())}")
    srv.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
