"""The training process's background thread: drain the per-thread buffers, resolve CUDA
events with query() only, keep the profile, aggregate counters, and hand one batch of
raw records per cycle to the transport.

Nothing here builds OpenTelemetry objects or even span ids: that happens on the SDK side
(otel.span_builder, in the exporter subprocess in "process" mode), which is what keeps
worker threads free of GIL stalls.
"""
from __future__ import annotations

import sys
import threading
import time
from time import perf_counter_ns

from otel.hot_path import ADD, RECORD, SPAN

CUDA_GIVE_UP_S = 60.0     # unresolved events after this long: host timing only


class BackgroundThread:
    def __init__(self, tel, transport):
        self.tel = tel
        self.transport = transport
        self._pending_cuda: list = []       # (record, first_seen_monotonic)
        self._late_events: list = []        # given-up event pairs: back to the pool once done
        self._lock = threading.Lock()       # one cycle at a time (loop vs flush())
        self._stop = threading.Event()
        self._last_gauges = 0.0
        self._last_console = time.monotonic()
        self.spans_recorded = 0
        self.hot_dropped = 0
        self.gauge_errors = 0
        self._thread = threading.Thread(target=self._run, name="otel-background", daemon=True)

    @staticmethod
    def epoch_offset_ns() -> int:
        # one offset maps perf_counter_ns to epoch ns for every record
        return time.time_ns() - perf_counter_ns()

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        interval = self.tel.export_interval_s
        while not self._stop.wait(interval):
            try:
                self.cycle()
            except Exception as e:  # telemetry must never take the process down
                print(f"otel: background cycle failed: {e!r}", file=sys.stderr)
            ci = self.tel.console_interval_s
            if ci and time.monotonic() - self._last_console >= ci:
                self._last_console = time.monotonic()
                print(self.tel.profile_table(), file=sys.stderr, flush=True)

    def stop(self, join_timeout_s: float = 0.5):
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=join_timeout_s)

    def cycle(self, final: bool = False, give_up_cuda: bool = False, lock_timeout_s: float = -1) -> bool:
        """One drain/ship round. final: emit every open root span (flush, shutdown);
        give_up_cuda: ship records whose CUDA events are still pending with host timing
        only (shutdown: we never wait for the GPU). False if another cycle held the lock
        past lock_timeout_s."""
        if not self._lock.acquire(timeout=lock_timeout_s):
            return False
        try:
            records, self.hot_dropped = self.tel._registry.drain()
            raw, adds, hist = [], {}, []
            for rec in records:
                kind = rec[0]
                if kind == SPAN:
                    if rec[9] is not None:
                        self._pending_cuda.append((rec, time.monotonic()))
                    else:
                        raw.append(rec)  # shipped as is: no copy per record
                elif kind == ADD:  # summed per (name, attributes) before shipping
                    try:
                        key = (rec[1], tuple(sorted(rec[3].items())))
                        adds[key] = adds.get(key, 0) + rec[2]
                    except TypeError:  # unhashable attribute value (a list, ...)
                        key = (rec[1], tuple(sorted((k, str(v)) for k, v in rec[3].items())))
                        adds[key] = adds.get(key, 0) + rec[2]
                elif kind == RECORD:
                    hist.append((rec[1], rec[2], rec[3]))
            if self._pending_cuda or self._late_events:
                self._resolve_cuda(raw, give_up_cuda)
            self.spans_recorded += len(raw)
            self.tel._profile.add_records(raw)
            idle = self.tel._idle
            if idle is not None:
                idle.feed(raw)
                for name, attrs, secs in idle.deltas(perf_counter_ns(), final):
                    adds[(name, attrs)] = adds.get((name, attrs), 0) + secs
            batch = {"raw": raw, "adds": [(n, a, v) for (n, a), v in adds.items()], "records": hist}
            if final:
                batch["final"] = True
            new_instruments = self.tel._take_new_instruments()
            if new_instruments:
                batch["instruments"] = new_instruments
            now = time.monotonic()
            if final or now - self._last_gauges >= self.tel.metric_export_interval_s:
                self._last_gauges = now
                batch["gauges"] = self._observe_gauges()
            batch["health"] = {"spans_recorded": self.spans_recorded,
                               "spans_dropped": self.hot_dropped + self.transport.dropped}
            self.transport.send(batch)
            return True
        finally:
            self._lock.release()

    def _resolve_cuda(self, raw, give_up):
        still = []
        now = time.monotonic()
        pool = self.tel._cuda_pool_or_none()
        late = []
        for pair in self._late_events:  # a long stall must not shrink the pool for good
            if pair[1].query():
                pool.give_back(pair)
            else:
                late.append(pair)
        self._late_events = late
        for rec, since in self._pending_cuda:
            start_ev, end_ev = rec[9][0], rec[9][1]
            if end_ev.query():
                # both events completed, so elapsed_time cannot block
                device_s = start_ev.elapsed_time(end_ev) / 1000.0
                pool.give_back(rec[9])
                raw.append(rec[:9] + (device_s, rec[10]))
            elif give_up or now - since > CUDA_GIVE_UP_S:
                # never wait for the GPU: host timing only; the pair is reused once it completes
                raw.append(rec[:9] + (None, rec[10]))
                self._late_events.append(rec[9])
            else:
                still.append((rec, since))
        self._pending_cuda = still

    def _observe_gauges(self) -> dict:
        out = {}
        for name, callback in list(self.tel._gauge_callbacks.items()):
            try:
                out[name] = [(v, dict(a or {})) for v, a in callback()]
            except Exception as e:
                self.gauge_errors += 1
                if self.gauge_errors == 1:
                    print(f"otel: gauge callback {name!r} failed: {e!r}", file=sys.stderr)
        return out
