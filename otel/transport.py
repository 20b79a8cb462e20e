"""How the background thread hands batches to the exporter side: the only bridge between
otel.producer (the training process) and otel.exporter.

ProcessTransport ("process" mode): each batch is marshalled once and written, length
prefixed, to the stdin pipe of `python -m otel.exporter.process` (spawned with
subprocess, never forked). The pipe is non-blocking: the background thread never waits
on it. The child acknowledges batches once every span in them is exported or dropped
(`done_seq` in its JSON status lines on stdout); until then the batch's bytes stay here,
so that if the child dies or never starts, this process exports them itself (a fallback
InProcessTransport writing to the same sinks). Memory stays bounded: past
`max_backlog_bytes` of unacknowledged batches new ones are dropped and counted
(buffer_full).

Shutdown: a local sink (files, console) is drained completely, for as long as the child
keeps making progress (its CPU time or its acknowledgements move), because a child that
is slow to get the CPU on a busy host is not a reason to lose spans. A network exporter
gets the caller's bound. A child that never became ready, or stopped making progress, is
killed and its unacknowledged batches go to the fallback.

InProcessTransport ("thread" mode): feeds a BatchConsumer directly in the background
thread.

The wire format (`frame`, `read_frames`): the typed config (otel.config.ExportConfig)
first, then batches (see otel.exporter.consumer) and flush/shutdown requests.
"""
from __future__ import annotations

import json
import marshal
import os
import pickle
import struct
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from typing import Protocol

from otel.config import ExportConfig
from otel.confined import start_python
from otel.exporter_choice import LOCAL_EXPORTERS, spans_drained_whole
from otel.health import add_statuses, empty_status
from otel.records import ATTRS, EXTRA, POINT_ATTRS

_HEADER = struct.Struct("<Q")
_F_SETPIPE_SZ = 1031  # Linux fcntl: a bigger pipe absorbs export hiccups without backlog
EXPORTER_MODULE = "otel.exporter.process"  # started as `python -m`, never imported here


class Transport(Protocol):
    """What the background thread and the facade need from a transport."""

    dead: bool      # the exporter is gone: its own sinks receive nothing more

    def send(self, batch: dict) -> None: ...

    def status(self) -> dict: ...   # otel.health status: committed counts, notes, summary

    def flush(self, timeout_s: float, network: bool = True) -> bool: ...  # network False: consumed, not exported

    def shutdown(self, network_timeout_s: float, end_epoch_s: float) -> None: ...


def _sanitized(batch: dict) -> dict:
    """A batch with every attribute value that pickle refused turned into its str()."""
    def clean(d):
        return {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in d.items()}
    def clean_record(r):
        r = list(r)
        r[ATTRS] = clean(r[ATTRS])
        if r[EXTRA]:
            r[EXTRA] = clean(r[EXTRA])
        return tuple(r)

    def clean_point(p):
        p = list(p)
        p[POINT_ATTRS] = clean(p[POINT_ATTRS])
        return tuple(p)

    out = dict(batch)
    for key in ("spans", "cuda"):
        out[key] = [clean_record(r) for r in batch.get(key, ())]
    out["points"] = [clean_point(p) for p in batch.get("points", ())]
    return out


def frame(obj) -> bytes:
    """Length-prefixed bytes of a message. marshal first: batches are plain tuples, dicts,
    strings and numbers, which marshal writes in about half of pickle's time (measured in
    bench/otel/hot_path.py's background figure); anything else falls back to pickle, and an
    attribute value that not even pickle takes becomes its str()."""
    try:
        data = b"M" + marshal.dumps(obj)
    except ValueError:
        try:
            data = b"P" + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a lock, a CUDA tensor... as an attribute value
            data = b"P" + pickle.dumps(_sanitized(obj), protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(data)) + data


def unframe(data: bytes):
    body = memoryview(data)[_HEADER.size:]
    return marshal.loads(body[1:]) if body[0] == ord("M") else pickle.loads(body[1:])


def _read_exact(stream, n: int):
    buf = bytearray()
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frames(stream):
    """The messages `frame` wrote to a binary stream, until EOF (or a torn last frame)."""
    while True:
        head = _read_exact(stream, _HEADER.size)
        if head is None:
            return
        body = _read_exact(stream, _HEADER.unpack(head)[0])
        if body is None:
            return
        yield unframe(head + body)


def _bounded(fn, timeout_s) -> bool:
    """Run fn in a daemon thread; give up waiting after timeout_s (None: wait)."""
    t = threading.Thread(target=fn, name="otel-bounded", daemon=True)
    t.start()
    t.join(None if timeout_s is None else max(timeout_s, 0.0))
    return not t.is_alive()


def _cpu_ticks(pid: int):
    """utime + stime of a process (Linux /proc), None where unavailable."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, IndexError, ValueError):
        return None


class InProcessTransport:
    chunk = 64  # stage records consumed per GIL-holding step; sleep(0) between lets workers run

    def __init__(self, config: ExportConfig):
        from otel.exporter.consumer import BatchConsumer  # the SDK only loads when used
        self.consumer = BatchConsumer(config)
        self.drain_whole = bool(set(l.name for l in self.consumer.pipeline.lanes) & LOCAL_EXPORTERS)
        self.dead = False
        self._final = None

    def send(self, batch: dict) -> None:
        spans = batch.get("spans") or []
        last = (len(spans) - 1) // self.chunk * self.chunk if len(spans) > self.chunk else 0
        for i in range(0, last, self.chunk):
            self.consumer.consume({"seq": batch.get("seq", 0), "spans": spans[i:i + self.chunk],
                                   "buffer_full": batch.get("buffer_full", 0)})
            time.sleep(0)
        self.consumer.consume({**batch, "spans": spans[last:]})

    def status(self) -> dict:
        st = self._final or self.consumer.status()
        out = add_statuses(empty_status(), st)
        out["summary"] = st.get("summary")
        return out

    def flush(self, timeout_s: float, network: bool = True) -> bool:
        # in-process, send() consumed each batch before returning: without the network there is nothing to wait for
        return self.consumer.flush(timeout_s) if network else True

    def shutdown(self, network_timeout_s: float, end_epoch_s: float | None = None) -> None:
        def run():
            self._final = self.consumer.shutdown(network_timeout_s * 0.9, end_epoch_s)
        if not _bounded(run, None if self.drain_whole else network_timeout_s):
            self._final = self.consumer.status(final=True)


# OTLP client files named by the standard variables: the exporter runs in a cwd of its own
_PATH_VARIABLES = ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE")


def _exporter_env() -> dict:
    """Our environment for the exporter process: this package first on its path (found
    wherever it is installed, or run from a source tree), relative file names in OTEL_*
    made absolute (the child's cwd is not ours)."""
    env = dict(os.environ)
    pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for k, v in env.items():
        if k.startswith("OTEL_EXPORTER_OTLP_") and k.endswith(_PATH_VARIABLES) and v and not os.path.isabs(v):
            env[k] = os.path.abspath(v)
    return env


class ProcessTransport:
    def __init__(self, config: ExportConfig, max_backlog_bytes: int = 16 << 20, start_wait_s: float = 3.0,
                 stuck_s: float = 15.0):
        self.config = config
        self.drain_whole = spans_drained_whole(config.file_dir)  # a local sink: shutdown waits for all of it
        self.start_wait_s = start_wait_s     # shutdown: how long a child that is not ready yet gets
        self.stuck_s = stuck_s               # shutdown: no progress for this long -> fallback
        self._max_backlog = max_backlog_bytes
        self._out = bytearray(frame({"config": config}))
        self._retained: deque = deque()      # (seq, n_spans, frame) not yet acknowledged
        self._retained_bytes = 0
        self._wlock = threading.Lock()       # _out, _retained
        self._cv = threading.Condition()     # child messages
        self.dead = False
        self.ready = False
        self._exited = False
        self._final = None                   # the child's status after its shutdown
        self._child: dict = empty_status()
        self._buffer_full = 0                # spans refused because the backlog was full
        self._gone = 0                       # spans neither child nor fallback could export
        self._fallback = None
        self._fallback_lock = threading.Lock()
        self._notes: list[str] = []
        self._acked = 0
        self._seq = 0
        env = _exporter_env()
        # nothing from the cwd or a run dir is importable in it (otel.confined): an `otel/`
        # folder where the training was started must not run in the exporter
        self.proc = start_python(sys.executable, EXPORTER_MODULE, env=env, stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, close_fds=True)
        self._fd = self.proc.stdin.fileno()
        try:
            import fcntl
            fcntl.fcntl(self._fd, _F_SETPIPE_SZ, 1 << 20)
        except OSError:
            pass
        os.set_blocking(self._fd, False)
        self._reader = threading.Thread(target=self._read_status, name="otel-exporter-status", daemon=True)
        self._reader.start()
        self._pump()
        # a forked child (e.g. a DataLoader worker) must not hold our pipe open: the
        # exporter relies on EOF to notice that the training process is gone
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (t := ref()) is not None and t._forget_after_fork())

    def _forget_after_fork(self):
        self._wlock = threading.Lock()  # another thread may have held it at fork time
        self.dead = True
        self._fallback = False          # a forked child exports nothing
        self._out.clear()
        self._retained.clear()
        if self._fd is not None:  # after shutdown the number may belong to someone else now
            try:
                os.close(self._fd)
            except OSError:
                pass

    # ------------------------------------------------------------ writing
    def send(self, batch: dict) -> None:
        if self.dead:
            self._fallback_send(batch)
            return
        data = frame(batch)  # pickling outside the lock
        n_spans = len(batch.get("spans") or ()) + len(batch.get("cuda") or ())
        with self._wlock:
            if not self.dead:
                if self._retained_bytes + len(data) > self._max_backlog:
                    self._buffer_full += n_spans
                else:
                    self._retained.append((batch.get("seq", 0), n_spans, data))
                    self._retained_bytes += len(data)
                    self._out += data
                self._pump_locked()
                return
        self._fallback_send(batch)  # died while we pickled

    def _append(self, obj) -> None:
        with self._wlock:
            if not self.dead:
                self._out += frame(obj)
                self._pump_locked()

    def _pump(self) -> None:
        with self._wlock:
            self._pump_locked()

    def _pump_locked(self) -> None:
        # callers hold _wlock: os.write exports the bytearray's buffer, so no other thread
        # may resize it meanwhile
        while self._out and not self.dead and self._fd is not None:
            try:
                n = os.write(self._fd, self._out)
            except BlockingIOError:
                return
            except OSError:  # BrokenPipe: the child died
                self._mark_dead_locked("exporter process is gone")
                return
            del self._out[:n]

    def _mark_dead_locked(self, why: str, take_over: bool = True) -> None:
        if not self.dead:
            self.dead = True
            self._out.clear()
            then = "this process exported the rest itself" if take_over else "the rest is counted as dropped"
            self._notes.append(f"{why}: {then}")
            print(f"otel: {why}; {then}", file=sys.stderr)

    # ------------------------------------------------------------ the fallback
    def _fallback_send(self, batch) -> None:
        fb = self._take_over()
        if fb:
            fb.send(batch)
        elif fb is None:
            self._gone += len(batch.get("spans") or ()) + len(batch.get("cuda") or ())

    def _take_over(self):
        """Start the in-process fallback once, and give it every batch the child did not
        acknowledge. None if it cannot run (its spans are exporter_gone); False after fork."""
        with self._fallback_lock:
            if self._fallback is None or self._fallback is False:
                if self._fallback is False:
                    return False
                with self._wlock:
                    retained, self._retained, self._retained_bytes = list(self._retained), deque(), 0
                try:
                    fb = InProcessTransport(self.config)
                except Exception as e:
                    self._notes.append(f"fallback exporter failed: {e!r}")
                    self._gone += sum(n for _, n, _ in retained)
                    self._fallback = "failed"
                    return None
                done = self._child.get("done_seq", 0)
                for seq, n, data in retained:
                    if seq > done:
                        fb.send(unframe(data))
                self._fallback = fb
            return self._fallback if self._fallback != "failed" else None

    # ------------------------------------------------------------ status
    def _read_status(self):
        for line in self.proc.stdout:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            with self._cv:
                if msg.get("ready"):
                    self.ready = True
                status = msg.get("status") or msg.get("final")
                if status:
                    self._child = status
                    self._release(status.get("done_seq", 0))
                if "final" in msg:
                    self._final = msg["final"]
                if "flushed" in msg:
                    self._acked = max(self._acked, msg["flushed"])
                self._cv.notify_all()
        with self._cv:
            self._exited = True
            self._cv.notify_all()
        if self._final is None:
            with self._wlock:
                self._mark_dead_locked("exporter process is gone")

    def _release(self, done_seq: int) -> None:
        with self._wlock:
            while self._retained and self._retained[0][0] <= done_seq:
                self._retained_bytes -= len(self._retained.popleft()[2])

    def status(self) -> dict:
        child = self._child
        if self.dead and self._final is None:
            # the roots of the batches it held open are re-sent by the fallback (counted there) or
            # lost with it (exporter_gone): no longer queued in the process that is gone
            child = {**child, "roots_queued": 0}
        fb = self._fallback
        if not isinstance(fb, InProcessTransport):  # None, False (not allowed) or "failed" (it could not start)
            fb = None
        st = add_statuses(empty_status(), child)
        if fb:
            st = add_statuses(st, fb.status())
        st["dropped"]["buffer_full"] += self._buffer_full
        st["dropped"]["exporter_gone"] += self._gone
        st["notes"] = st["notes"] + [n for n in self._notes if n not in st["notes"]]
        st["summary"] = child.get("summary")
        if fb and not (child.get("summary") or {}).get("stages"):
            st["summary"] = fb.status().get("summary")
        return st

    def flush(self, timeout_s: float, network: bool = True) -> bool:
        """Wait until the child has consumed what was sent (its status then counts it) and, with
        ``network``, exported it (a collector that does not answer holds this up to the bound)."""
        if self.dead:
            fb = self._take_over()
            return bool(fb) and fb.flush(timeout_s, network)
        deadline = time.monotonic() + timeout_s
        self._seq += 1
        seq = self._seq
        self._append({"flush": seq, "timeout_s": timeout_s * 0.8, "network": network})
        while self._out and not self.dead and time.monotonic() < deadline:
            self._pump()
            if self._out:
                time.sleep(0.002)
        with self._cv:
            while self._acked < seq and not self._exited:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return self._acked >= seq

    # ------------------------------------------------------------ shutdown
    def shutdown(self, network_timeout_s: float, end_epoch_s: float | None = None) -> None:
        deadline = None if self.drain_whole else time.monotonic() + network_timeout_s
        if not self.dead:
            self._append({"shutdown": max(network_timeout_s * 0.8, 0.05), "end_epoch_s": end_epoch_s})
            why = self._wait_child(deadline)
            if why:
                self.proc.kill()
                with self._wlock:
                    self._mark_dead_locked(f"exporter process {why}", take_over=deadline is None or
                                           time.monotonic() < deadline)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._close_pipe()
        self._reader.join(timeout=1.0)
        if self.dead and self._final is None:
            if deadline is not None and time.monotonic() >= deadline:
                # the network bound is spent: what the child still held is lost to it
                with self._wlock:
                    left = sum(n for seq, n, _ in self._retained if seq > self._child.get("done_seq", 0))
                    self._retained.clear()
                self._child = add_statuses(self._child, {"spans_done": left, "dropped": {"shutdown_timeout": left}})
                self._fallback = self._fallback or False
            fb = self._take_over()
            if fb:
                fb.shutdown(max(network_timeout_s, 0.05) if deadline is None else
                            max(deadline - time.monotonic(), 0.05), end_epoch_s)

    def _close_pipe(self) -> None:
        with self._wlock:
            if self._fd is not None:
                self._fd = None
                try:
                    self.proc.stdin.close()
                except OSError:
                    pass

    def _wait_child(self, deadline):
        """Write out what is pending, close the pipe, wait for the child's final status.
        None when it came; else why the child must be given up on."""
        t0 = last_progress = time.monotonic()
        closed = False
        mark = None
        while True:
            self._pump()
            if not self._out and not closed:
                self._close_pipe()  # EOF: the child finishes and exits
                closed = True
            with self._cv:
                if self._final is not None or self._exited:
                    return None if self._final is not None else "exited without a final status"
                self._cv.wait(0.05 if self._out else 0.5)
                progress = (self._child.get("done_seq", 0), _cpu_ticks(self.proc.pid), len(self._out))
            now = time.monotonic()
            if progress != mark:
                mark, last_progress = progress, now
            if deadline is not None and now >= deadline:
                return "ran past the shutdown bound"
            if not self.ready and now - t0 > self.start_wait_s:
                return "was not ready at shutdown"  # e.g. starved of CPU while importing the SDK
            if now - last_progress > self.stuck_s:
                return "made no progress at shutdown"
