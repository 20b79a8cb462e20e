"""Entry point of the exporter subprocess: `python -m otel.exporter.process`.

stdin: the frames of otel.transport.ProcessTransport (the ExportConfig first, then
batches and flush/shutdown requests). stdout: JSON lines: `ready`, then `status` (the
committed span counts of otel.health with `done_seq`, plus the profile/idle summary)
whenever it changed, `flushed` answers, and `final` once everything is exported.

It owns the OpenTelemetry SDK, the OTLP/file/Prometheus exporters, the NVML sampler, and
every per-record step (profile, idle attribution, span building: otel.exporter.consumer), so
their GIL time is not the training process's.

Signals: SIGINT, SIGTERM and SIGHUP are ignored. Ctrl-C, `timeout`, `scancel`, many job
runners and a closed terminal signal the whole process group; the training process decides
when telemetry stops (it may still be saving a checkpoint and flushing). EOF on stdin means it is done
or gone: export what is left (local files completely, the network within the budget)
and exit. The child never outlives its parent for long: one stopped (SIGSTOP) when its parent
dies is continued (the parent-death signal is SIGCONT), so it reads the EOF and exits; a
parent that died without saying so (SIGKILL) gets its open traces' root spans all the same.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from otel.config import ExportConfig
from otel.transport import read_frames


def _nice(config: ExportConfig) -> None:
    try:
        os.nice(int(config.exporter_nice))
    except OSError:
        pass


def _continue_when_orphaned() -> None:
    """Linux: SIGCONT when the parent dies (prctl PR_SET_PDEATHSIG). A child stopped by SIGSTOP
    (a debugger, a job control mishap) would else stay stopped forever, holding its parent's
    stderr open; continued, it finds stdin at EOF and exits."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGCONT))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError, ValueError):
        pass


def main() -> int:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    _continue_when_orphaned()
    stdin = sys.stdin.buffer
    out_lock = threading.Lock()

    def say(msg: dict):
        with out_lock:
            try:
                sys.stdout.write(json.dumps(msg, default=str) + "\n")
                sys.stdout.flush()
            except (OSError, ValueError):
                pass

    frames = read_frames(stdin)
    first = next(frames, None)
    if not first or not isinstance(first.get("config"), ExportConfig):
        return 1
    config = first["config"]
    from otel.exporter.consumer import BatchConsumer
    consumer = BatchConsumer(config)  # imports and start-up at the parent's priority
    # then yield to the workers; raising one's own niceness needs no privilege
    _nice(config)
    lock = threading.Lock()   # consume vs status snapshots (the summary walks live dicts)
    stop = threading.Event()

    def report():
        # only on change: every wake-up of the parent's reader thread costs it a GIL handoff
        last = None
        while not stop.wait(0.5):
            with lock:
                status = consumer.status()
            if status != last:
                say({"status": status})
                last = status

    say({"ready": True})
    threading.Thread(target=report, name="otel-status", daemon=True).start()
    budget, end_epoch_s = 2.0, None
    errors = 0
    told = False  # the parent said it is done (shutdown); EOF without it: the parent is gone
    for msg in frames:
        if "flush" in msg:
            # in order: every batch before it is consumed; "network": False asks no more than that
            ok = consumer.flush(msg.get("timeout_s", 2.0)) if msg.get("network", True) else True
            with lock:
                say({"status": consumer.status()})
            say({"flushed": msg["flush"], "ok": ok})
        elif "shutdown" in msg:
            told = True
            budget, end_epoch_s = msg["shutdown"], msg.get("end_epoch_s")
        else:
            try:
                with lock:
                    consumer.consume(msg)
            except Exception as e:  # one bad batch must not end the exporter
                errors += 1
                if errors == 1:
                    print(f"otel exporter: batch failed: {e!r}", file=sys.stderr, flush=True)
    stop.set()
    t0 = time.monotonic()
    with lock:
        if not told:  # the parent died (SIGKILL, OOM): close its open traces, so no stage span is orphaned
            try:
                consumer.consume({"seq": 0, "spans": [], "final": True})
            except Exception:
                pass
        final = consumer.shutdown(budget, end_epoch_s)
    final["shutdown_s"] = time.monotonic() - t0
    say({"final": final})
    sys.stdout.flush()
    os._exit(0)  # don't wait for exporter/grpc threads still retrying


if __name__ == "__main__":
    sys.exit(main())
