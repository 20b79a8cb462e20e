"""How the background thread hands batches to the SDK pipeline.

ProcessTransport ("process" mode): pickled batches, length-prefixed, written to the stdin
pipe of `python -m otel.exporter_process` (spawned with subprocess, never forked). The
pipe is non-blocking: if the child is slow or stuck the bytes wait in a bounded backlog,
and past that batches are dropped and counted; the background thread never blocks on it.
The child reports status as JSON lines on its stdout.

InProcessTransport ("thread" mode): calls the pipeline directly in the background thread.
"""
from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import weakref

_HEADER = struct.Struct("<Q")
_F_SETPIPE_SZ = 1031  # Linux fcntl: a bigger pipe absorbs export hiccups without backlog


def frame(obj) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def _bounded(fn, timeout_s: float) -> bool:
    """Run fn in a daemon thread; give up waiting after timeout_s (fn keeps running)."""
    t = threading.Thread(target=fn, name="otel-bounded", daemon=True)
    t.start()
    t.join(max(timeout_s, 0.0))
    return not t.is_alive()


class InProcessTransport:
    chunk = 64  # spans consumed per GIL-holding step; sleep(0) between lets workers run

    def __init__(self, config: dict):
        from otel.sdk_pipeline import ExportPipeline  # the SDK only loads when used
        self.pipeline = ExportPipeline(config)
        self.dropped = 0

    def send(self, batch: dict) -> None:
        raw = batch.get("raw") or []
        for i in range(self.chunk, len(raw), self.chunk):
            self.pipeline.consume({"raw": raw[i:i + self.chunk]})
            time.sleep(0)
        batch["raw"] = raw[:self.chunk]
        self.pipeline.consume(batch)

    def status(self) -> dict:
        return self.pipeline.status()

    def flush(self, timeout_s: float) -> bool:
        return self.pipeline.flush(timeout_s)

    def shutdown(self, timeout_s: float) -> None:
        _bounded(lambda: self.pipeline.shutdown(timeout_s * 0.9), timeout_s)


class ProcessTransport:
    def __init__(self, config: dict, max_backlog_bytes: int = 16 << 20):
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "otel.exporter_process"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)
        self._fd = self.proc.stdin.fileno()
        try:
            import fcntl
            fcntl.fcntl(self._fd, _F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass
        os.set_blocking(self._fd, False)
        self._max_backlog = max_backlog_bytes
        self._out = bytearray(frame({"config": config}))
        self._wlock = threading.Lock()
        self._dead = False
        self.dropped = 0
        self._status: dict = {}
        self._acked = 0
        self._seq = 0
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read_status, name="otel-exporter-status", daemon=True)
        self._reader.start()
        self._pump()
        # a forked child (e.g. a DataLoader worker) must not hold our pipe open: the
        # exporter relies on EOF to notice that the training process is gone
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (t := ref()) is not None and t._forget_after_fork())

    def _forget_after_fork(self):
        self._wlock = threading.Lock()  # another thread may have held it at fork time
        self._dead = True
        self._out.clear()
        try:
            os.close(self._fd)
        except OSError:
            pass

    # ------------------------------------------------------------ writing
    def send(self, batch: dict) -> None:
        data = frame(batch)  # pickling outside the lock
        with self._wlock:
            if self._dead or len(self._out) > self._max_backlog:
                self.dropped += len(batch.get("raw") or ())
            else:
                self._out += data
            self._pump_locked()

    def _append(self, obj) -> None:
        with self._wlock:
            if not self._dead:
                self._out += frame(obj)

    def _pump(self) -> None:
        with self._wlock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        # callers hold _wlock: os.write exports the bytearray's buffer, so no other thread
        # may resize it meanwhile (flush() runs in the caller's thread)
        while self._out and not self._dead:
            try:
                n = os.write(self._fd, self._out)
            except BlockingIOError:
                return
            except OSError:  # BrokenPipe: the child died
                self._mark_dead()
                return
            del self._out[:n]

    def _mark_dead(self):
        if not self._dead:
            self._dead = True
            self._out.clear()
            print("otel: exporter process is gone; telemetry is dropped from now on", file=sys.stderr)

    def _drain_out(self, deadline: float) -> bool:
        while self._out and not self._dead and time.monotonic() < deadline:
            self._pump()
            if self._out:
                time.sleep(0.002)
        return not self._out

    # ------------------------------------------------------------ status
    def _read_status(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cv:
                if "status" in msg:
                    self._status = msg["status"]
                if "flushed" in msg:
                    self._acked = max(self._acked, msg["flushed"])
                self._cv.notify_all()
        with self._cv:
            self._cv.notify_all()

    def status(self) -> dict:
        return dict(self._status)

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        if self._dead:
            return False
        self._seq += 1
        seq = self._seq
        self._append({"flush": seq, "timeout_s": timeout_s * 0.8})
        if not self._drain_out(deadline):
            return False
        with self._cv:
            while self._acked < seq and self.proc.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return self._acked >= seq

    def shutdown(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        if not self._dead:
            self._append({"shutdown": max(timeout_s * 0.7, 0.05)})
            self._drain_out(deadline - 0.05)
        try:
            self.proc.stdin.close()  # EOF: the child flushes within its budget and exits
        except OSError:
            pass
        try:
            self.proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            self.proc.kill()  # the bound wins over the last spans
            self.proc.wait()
        self._reader.join(timeout=max(min(0.2, deadline - time.monotonic()), 0.01))
        self._dead = True
