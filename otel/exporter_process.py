"""Entry point of the exporter subprocess: `python -m otel.exporter_process`.

stdin: length-prefixed pickles from otel.transport.ProcessTransport (config first, then
batches and flush/shutdown requests). stdout: JSON status lines. It owns the
OpenTelemetry SDK, the OTLP/file/Prometheus exporters and the NVML sampler, so their GIL
time is not the training process's. EOF on stdin (the parent exited or shut down) means
flush within the budget and exit: the child never outlives its parent.
"""
from __future__ import annotations

import json
import os
import pickle
import signal
import sys
import threading
import time

from otel.transport import _HEADER


def _read_exact(stream, n: int):
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def _frames(stream):
    while True:
        head = _read_exact(stream, _HEADER.size)
        if head is None:
            return
        body = _read_exact(stream, _HEADER.unpack(head)[0])
        if body is None:
            return
        yield pickle.loads(body)


def main() -> int:
    # Ctrl-C reaches the whole process group; the parent decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stdin = sys.stdin.buffer
    out_lock = threading.Lock()

    def say(msg: dict):
        with out_lock:
            try:
                sys.stdout.write(json.dumps(msg) + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass

    frames = _frames(stdin)
    first = next(frames, None)
    if not first or "config" not in first:
        return 1
    try:
        # on a saturated host the training threads get the CPU first; export may lag
        # (and drop, counted) rather than slow the workers
        os.nice(int(first["config"].get("exporter_nice", 19)))
    except OSError:
        pass
    from otel.sdk_pipeline import ExportPipeline
    pipeline = ExportPipeline(first["config"])
    stop = threading.Event()

    def report():
        # only on change: every wake-up of the parent's reader thread costs it a GIL handoff
        last = None
        while not stop.wait(0.5):
            status = pipeline.status()
            if status != last:
                say({"status": status})
                last = status

    threading.Thread(target=report, name="otel-status", daemon=True).start()
    say({"status": pipeline.status()})
    budget = 2.0
    errors = 0
    for msg in frames:
        if "flush" in msg:
            ok = pipeline.flush(msg.get("timeout_s", 2.0))
            say({"status": pipeline.status()})
            say({"flushed": msg["flush"], "ok": ok})
        elif "shutdown" in msg:
            budget = msg["shutdown"]
        else:
            try:
                pipeline.consume(msg)
            except Exception as e:  # one bad batch must not end the exporter
                errors += 1
                if errors == 1:
                    print(f"otel exporter: batch failed: {e!r}", file=sys.stderr, flush=True)
    stop.set()
    t0 = time.monotonic()
    pipeline.shutdown(budget)
    status = pipeline.status()
    status["shutdown_s"] = time.monotonic() - t0
    say({"status": status})
    sys.stdout.flush()
    os._exit(0)  # don't wait for exporter/grpc threads still retrying


if __name__ == "__main__":
    sys.exit(main())
