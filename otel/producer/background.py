"""The training process's background thread: drain the per-thread buffers, resolve CUDA
events with query() only, and hand one batch per cycle to the transport.

It never looks at a host-timed record: the hot path already sorted records into stage
records with and without CUDA events and metric points, so a cycle is a few list moves
and one pickle (done by the transport) at C speed. Profile, idle attribution, counter
sums and span building all happen on the other side of the transport
(otel.exporter.consumer.BatchConsumer), in the exporter process in "process" mode.
"""
from __future__ import annotations

import sys
import threading
import time

from otel.records import CUDA

CUDA_GIVE_UP_S = 60.0     # unresolved events after this long: host timing only


class CudaResolver:
    """Stage records holding a CUDA event pair wait here until the end event completed
    (`query()`, never `synchronize()`); then the pair is replaced by the device duration
    in seconds and the events go back to the pool."""

    def __init__(self, pool_getter):
        self._pool = pool_getter
        self.pending: list = []       # (record, first_seen_monotonic)
        self._late: list = []         # given-up pairs: back to the pool once complete

    @property
    def waiting(self) -> bool:
        return bool(self.pending or self._late)

    def resolve(self, new: list, give_up: bool) -> list:
        now = time.monotonic()
        pool = self._pool()
        late = []
        for pair in self._late:  # a long stall must not shrink the pool for good
            if pair[1].query():
                pool.give_back(pair)
            else:
                late.append(pair)
        self._late = late
        done, still = [], []
        for rec, since in self.pending + [(r, now) for r in new]:
            pair = rec[CUDA]
            if pair[1].query():
                # both events completed, so elapsed_time cannot block
                device_s = pair[0].elapsed_time(pair[1]) / 1000.0
                pool.give_back(pair)
                done.append(rec[:CUDA] + (device_s,) + rec[CUDA + 1:])
            elif give_up or now - since > CUDA_GIVE_UP_S:
                # never wait for the GPU: host timing only; the pair is reused once it completes
                done.append(rec[:CUDA] + (None,) + rec[CUDA + 1:])
                self._late.append(pair)
            else:
                still.append((rec, since))
        self.pending = still
        return done


class BackgroundThread:
    """Collaborators: the buffer registry, the transport, the instruments (declarations
    and gauge callbacks) and a getter for the CUDA event pool (None until first used)."""

    def __init__(self, registry, transport, instruments, cuda_pool_getter, *,
                 interval_s: float = 0.1, metric_interval_s: float = 1.0, phases=None):
        self.registry = registry
        self.transport = transport
        self.instruments = instruments
        self.cuda = CudaResolver(cuda_pool_getter)
        self.phases = phases                # otel.producer.phases.RunTrace: finished phases ship too
        self.profile_start_epoch_s = None   # set by Telemetry.begin_profile: shipped once
        self._profile_start_sent = None
        self.interval_s = interval_s
        self.metric_interval_s = metric_interval_s
        self._lock = threading.Lock()       # one cycle at a time (loop vs flush())
        self._stop = threading.Event()
        self._last_gauges = 0.0
        self.seq = 0
        self.spans_shipped = 0              # stage records handed to the transport
        self.buffer_full = 0                # stage records lost to a full per-thread list
        self._thread = threading.Thread(target=self._run, name="otel-background", daemon=True)

    @staticmethod
    def epoch_offset_ns() -> int:
        # one offset maps perf_counter_ns to epoch ns for every record
        return time.time_ns() - time.perf_counter_ns()

    @property
    def spans_pending(self) -> int:
        """Stage records waiting here for their CUDA events."""
        return len(self.cuda.pending)

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(self.interval_s):
            try:
                self.cycle()
            except Exception as e:  # telemetry must never take the process down
                print(f"otel: background cycle failed: {e!r}", file=sys.stderr)

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
            d = self.registry.drain()
            cuda = self.cuda.resolve(d.cuda, give_up_cuda) if (d.cuda or self.cuda.waiting) else []
            self.seq += 1
            self.buffer_full = d.dropped
            batch = {"seq": self.seq, "spans": d.spans, "cuda": cuda, "points": d.points,
                     "buffer_full": d.dropped}
            if final:
                batch["final"] = True
            if self.phases is not None:
                phases = self.phases.take()
                if phases:
                    batch["phases"] = phases
            if self.profile_start_epoch_s != self._profile_start_sent:
                batch["profile_start_epoch_s"] = self._profile_start_sent = self.profile_start_epoch_s
            new = self.instruments.take_new()
            if new:
                batch["instruments"] = new
            now = time.monotonic()
            if final or now - self._last_gauges >= self.metric_interval_s:
                self._last_gauges = now
                batch["gauges"] = self.instruments.observe()
            self.spans_shipped += len(d.spans) + len(cuda)
            self.transport.send(batch)
            return True
        finally:
            self._lock.release()
