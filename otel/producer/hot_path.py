"""What a worker thread pays: two perf_counter_ns readings and a tuple appended to its
own list. No OpenTelemetry objects, no locks, no device syncs.

Each thread has three lists (see otel/records.py for the tuples): stage records without
CUDA events, stage records with CUDA events (only those need the background thread's
attention per record), and metric points. Keeping them apart at the source is what lets
the background thread ship whole lists without looking at a single record. It drains a
list with `items[:n]` then `del items[:n]`; both are atomic under the GIL and appends
only touch the tail, so no lock is needed.
"""
from __future__ import annotations

import threading
import traceback
from collections import deque
from time import perf_counter_ns

from otel.api import name_exception
from otel.records import ADD, RECORD

__all__ = ["ADD", "RECORD", "ThreadBuffer", "BufferRegistry", "CudaEventPool", "Stage",
           "bound_stage_class", "Drained"]


class ThreadBuffer:
    __slots__ = ("spans", "cuda", "points", "cap", "dropped", "dropped_points", "thread", "__weakref__")

    def __init__(self, cap: int, thread: threading.Thread):
        self.spans: list = []       # stage records, host timing only
        self.cuda: list = []        # stage records holding a CUDA event pair
        self.points: list = []      # tel.add / tel.record values
        self.cap = cap              # per list
        self.dropped = 0            # stage records lost to a full list; owning thread only
        self.dropped_points = 0
        self.thread = thread


class Drained:
    """One drain of every thread's buffers; the drop counts are running totals."""
    __slots__ = ("spans", "cuda", "points", "dropped", "dropped_points")

    def __init__(self, spans, cuda, points, dropped, dropped_points):
        self.spans, self.cuda, self.points = spans, cuda, points
        self.dropped, self.dropped_points = dropped, dropped_points


def _take(items: list, out: list) -> None:
    n = len(items)
    if n:
        out.extend(items[:n])
        del items[:n]


class BufferRegistry:
    """One ThreadBuffer per thread, created on first use (the only locked step)."""

    def __init__(self, cap: int):
        self.cap = cap
        self.tls = threading.local()     # .buf: the calling thread's ThreadBuffer, once made
        self._lock = threading.Lock()
        self.buffers: list[ThreadBuffer] = []
        self._dead_dropped = 0
        self._dead_dropped_points = 0

    def get(self) -> ThreadBuffer:
        try:
            return self.tls.buf
        except AttributeError:
            buf = ThreadBuffer(self.cap, threading.current_thread())
            with self._lock:
                self.buffers.append(buf)
            self.tls.buf = buf
            return buf

    def drain(self) -> Drained:
        """All buffered records and the running drop totals; forgets finished threads."""
        spans: list = []
        cuda: list = []
        points: list = []
        with self._lock:
            buffers = list(self.buffers)
        dropped, dropped_points = self._dead_dropped, self._dead_dropped_points
        dead = []
        for b in buffers:
            _take(b.spans, spans)
            _take(b.cuda, cuda)
            _take(b.points, points)
            dropped += b.dropped
            dropped_points += b.dropped_points
            if not (b.spans or b.cuda or b.points) and not b.thread.is_alive():
                dead.append(b)
        if dead:
            with self._lock:
                self._dead_dropped += sum(b.dropped for b in dead)
                self._dead_dropped_points += sum(b.dropped_points for b in dead)
                self.buffers = [b for b in self.buffers if b not in dead]
        return Drained(spans, cuda, points, dropped, dropped_points)

    def dropped_points(self) -> int:
        """Running total of metric points refused by full lists (reads only)."""
        return self._dead_dropped_points + sum(b.dropped_points for b in list(self.buffers))

    def abandon(self) -> int:
        """Shutdown without its final drain (the background cycle held the lock past the network
        bound): the records still in the lists, counted as dropped (buffer_full) instead of
        vanishing. Returns how many."""
        n = 0
        with self._lock:
            for b in self.buffers:
                left = len(b.spans) + len(b.cuda)
                b.spans.clear()
                b.cuda.clear()
                self._dead_dropped += left
                n += left
        return n

    def close(self) -> None:
        """Stop buffering (after shutdown, or in a forked child): later records are
        counted as dropped, never silently kept."""
        self.cap = 0
        for buf in list(self.buffers):
            buf.cap = 0


class CudaEventPool:
    """Pre-allocated timing events, one set per CUDA device: an event is bound to the device
    of its first record, so a target on cuda:0 and a drafter on cuda:1 must never trade
    events. The hot path pops two, the background thread returns them once resolved;
    deque.pop/append are atomic, so no lock. A device's set is made on its first stage
    (or up front by Telemetry.prepare_cuda(devices=...)). Empty set -> the stage keeps host
    timing only (counted in `exhausted`). Pairs are (start, end, device)."""

    def __init__(self, size: int = 512, factory=None):
        if factory is None:
            import torch  # lazily: only code that passes a CUDA stream pays for torch

            def factory(device=None):
                return torch.cuda.Event(enable_timing=True)
        self._factory = factory
        self._size = size
        self._free: dict = {}
        self.exhausted = 0

    def prepare(self, device) -> deque:
        free = self._free.get(device)
        if free is None:
            try:
                free = deque(self._factory(device) for _ in range(self._size))
            except TypeError:  # factories that take no device argument (tests' fakes)
                free = deque(self._factory() for _ in range(self._size))
            self._free = {**self._free, device: free}  # copy-on-write: readers never lock
        return free

    def take_pair(self, device=None):
        free = self._free.get(device)
        if free is None:
            free = self.prepare(device)
        try:
            return free.pop(), free.pop(), device
        except IndexError:
            self.exhausted += 1
            return None

    def give_back(self, pair) -> None:
        free = self._free[pair[2]]
        free.append(pair[0])
        free.append(pair[1])


def exception_info(exc_type, exc, tb) -> tuple:
    """(type, message, stack trace) of the exception leaving a stage: the OpenTelemetry
    `exception` event's attributes. Only ever runs on the error path."""
    return (exc_type.__qualname__, str(exc), "".join(traceback.format_exception(exc_type, exc, tb)))


class Stage:
    """Context manager returned by tel.stage(); also the handle for set()/event().

    Each Telemetry makes a subclass bound to its buffer registry and CUDA event pool and
    uses it *as* `tel.stage`: calling the class directly saves one Python call per stage."""

    __slots__ = ("_buf", "name", "trace", "links", "stream", "attrs", "t0", "extra", "events", "_cuda")
    _tls = None         # the registry's thread-local (one attribute lookup less per stage)
    _new_buffer = None  # the registry's get(): the calling thread's first stage makes its buffer
    _cuda_pool = None   # () -> CudaEventPool, made on first use

    def __init__(self, name, trace=None, links=None, stream=None, **attrs):
        try:
            self._buf = self._tls.buf
        except AttributeError:
            self._buf = self._new_buffer()
        self.name = name
        self.trace = trace
        self.links = links
        self.stream = stream
        self.attrs = attrs
        self.extra = None
        self.events = None
        self._cuda = None

    def __enter__(self):
        if self.stream is not None:
            self._enter_cuda()
        self.t0 = perf_counter_ns()
        return self

    def __exit__(self, exc_type, exc, tb):
        t1 = perf_counter_ns()
        buf = self._buf
        cuda = self._cuda
        if cuda is None:
            items = buf.spans
        else:
            cuda[1].record(self.stream)
            items = buf.cuda
        if exc_type is None:
            error = None
        else:
            name_exception(exc, self.name)
            error = exception_info(exc_type, exc, tb)
        if len(items) < buf.cap:
            items.append((self.name, self.t0, t1, self.trace, self.links, self.attrs, self.extra,
                          self.events, cuda, error))
        else:
            buf.dropped += 1
            if cuda is not None:
                # nothing will resolve these events; they can be reused once complete,
                # and re-recording an event is legal, so hand them straight back.
                self._cuda_pool().give_back(cuda)
        return False

    def _enter_cuda(self):
        pair = self._cuda_pool().take_pair(getattr(self.stream, "device_index", None))
        if pair is not None:
            pair[0].record(self.stream)
            self._cuda = pair

    def set(self, **attrs) -> None:
        """Attributes known only once the stage ran (tokens, sizes, ...)."""
        if self.extra is None:
            self.extra = attrs
        else:
            self.extra.update(attrs)

    def event(self, name: str, **attrs) -> None:
        """A span event timestamped now."""
        if self.events is None:
            self.events = []
        self.events.append((name, perf_counter_ns(), attrs))


def bound_stage_class(registry: BufferRegistry, cuda_pool) -> type:
    """A Stage subclass writing to `registry`'s buffers; cuda_pool() -> CudaEventPool."""
    return type("Stage", (Stage,), {"__slots__": (), "_tls": registry.tls, "_new_buffer": registry.get,
                                    "_cuda_pool": staticmethod(cuda_pool)})
