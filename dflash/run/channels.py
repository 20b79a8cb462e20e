"""What joins a target worker to a drafter worker when they are not one loop: the `Channel`
protocol, and its two implementations:

    queue    threads of one process: the bounded, in-order HiddenQueue; on CUDA the
             device->host copy into pinned, pre-allocated buffers on a side stream;
    ranks    roles by rank: credit-based hand-off over torch.distributed (roles/handoff.py).

The reference loop needs none: it hands the target worker's item to the drafter worker
itself (run_loop.py `reference_loop`).

Ordering across streams is explicit everywhere: events, `record_stream`, and a staging
buffer goes back to its pool only once the drafter's copy out of it has finished.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, runtime_checkable

import torch

from ..data.batch import Batch
from .hidden_queue import Closed, HiddenQueue


@dataclass
class HiddenItem:
    batch: Batch
    packed: torch.Tensor        # valid tokens only; host (pinned) or on the drafter's device
    ready: torch.cuda.Event | None = None  # the copy into `packed` is complete
    release: Callable[[torch.cuda.Event], None] | None = None  # give the staging buffer back
    worker: str = ""


@runtime_checkable
class Channel(Protocol):
    """Target side, inside the cpu_copy_enqueue stage: `staging` gives the worker its pinned
    pool (or None), `stage_copy` starts the copy toward the drafter (the queue, on CUDA; a
    no-op elsewhere), `hand_over(item, stop) -> seconds blocked` (None from a ranks channel
    whose drafters stopped); `span_attrs` are what the stage carries about the channel.
    Drafter side: `batch_id(step)`, `take(step) -> (item, seconds waited)` inside queue_get,
    `taken(step)` once it is out, `depth()` for the span. `producers_done` when the target
    side has made its last item, `close` to wake every waiter (end or failure)."""
    span_attrs: dict[str, str]

    def staging(self, target_device: torch.device, numel: int, dtype: torch.dtype) -> PinnedPool | None: ...
    def stage_copy(self, item: HiddenItem, pool: PinnedPool | None, side: torch.cuda.Stream | None,
                   cur: torch.cuda.Stream | None, stop: threading.Event) -> None: ...
    def hand_over(self, item: HiddenItem, stop: bool = False) -> float | None: ...
    def batch_id(self, step: int) -> int: ...
    def take(self, step: int) -> tuple[HiddenItem, float]: ...
    def taken(self, step: int) -> None: ...
    def depth(self) -> int: ...
    def producers_done(self) -> None: ...
    def close(self) -> None: ...


class PinnedPool:
    """Pre-allocated pinned staging buffers of one target worker, reused. The drafter hands
    a buffer back with the event that marks the end of its copy out of it; the worker takes
    it again only once that event has completed (query(), no host wait). One producer and
    one consumer on atomic deque operations: no lock."""

    def __init__(self, n: int, numel: int, dtype, pin_memory: bool = True):
        self._free = deque(torch.empty(numel, dtype=dtype, pin_memory=pin_memory) for _ in range(n))
        self._returned: deque = deque()   # (buffer, done event), in hand-back order

    def take(self, stop: threading.Event) -> torch.Tensor:
        while not stop.is_set():
            while self._returned and self._returned[0][1].query():
                self._free.append(self._returned.popleft()[0])
            if self._free:
                return self._free.popleft()
            time.sleep(0.0005)
        raise Closed

    def give_back(self, buf, done_event) -> None:
        self._returned.append((buf, done_event))


class QueueChannel:
    """Target worker threads -> the bounded in-order queue -> the drafter thread."""
    span_attrs: dict = {}

    def __init__(self, pcfg, drafter_device: torch.device, capacity: int | None = None):
        self.pcfg, self.drafter_device = pcfg, drafter_device
        self.hq = HiddenQueue(capacity or pcfg.queue_size, pcfg.min_ready)

    def staging(self, target_device: torch.device, numel: int, dtype) -> PinnedPool | None:
        """A pinned pool when the batch must cross from a GPU to another device."""
        if target_device.type == "cuda" and self.drafter_device != target_device:
            return PinnedPool(self.pcfg.queue_size + 2, numel, dtype)
        return None

    def stage_copy(self, item: HiddenItem, pool, side, cur, stop) -> None:
        """On CUDA: start the copy to the drafter (side stream into a pinned buffer, or an
        event on the same device); nobody on this side waits for it."""
        packed = item.packed
        if pool is not None:
            buf = pool.take(stop)
            host = buf[: packed.numel()].view(packed.shape)
            side.wait_stream(cur)          # the copy must see the finished pack
            with torch.cuda.stream(side):
                host.copy_(packed, non_blocking=True)
                packed.record_stream(side)  # allocator: don't reuse before the copy ran
                ev = torch.cuda.Event()
                ev.record(side)
            item.packed, item.ready = host, ev
            item.release = lambda done_ev, buf=buf: pool.give_back(buf, done_ev)
        elif cur is not None:  # same device: hand over the tensor, ordered by an event
            ev = torch.cuda.Event()
            ev.record(cur)
            item.ready = ev

    def hand_over(self, item: HiddenItem, stop: bool = False) -> float:
        return self.hq.put(item.batch.index, item)

    def take(self, step: int):
        return self.hq.get(step)

    def taken(self, step: int) -> None:
        pass

    def batch_id(self, step: int) -> int:
        return step

    def depth(self) -> int:
        return self.hq.depth()

    def producers_done(self) -> None:
        self.hq.producers_done()

    def close(self) -> None:
        self.hq.close()


class RankChannel(QueueChannel):
    """Roles by rank. A target rank sends each batch against its drafter's credit; a drafter
    rank's receiver thread puts what arrives into the same in-order queue (the credits bound
    what is in flight, so the queue never needs to push back itself)."""

    def __init__(self, pcfg, drafter_device, *, target_side=None, drafter_side=None, layout=None, index=0):
        super().__init__(pcfg, drafter_device, capacity=pcfg.queue_size + 1)
        self.target_side, self.drafter_side = target_side, drafter_side
        self.layout, self.index = layout, index
        self.span_attrs = {"transport": target_side.transport} if target_side is not None else {}

    # target rank
    def staging(self, target_device, numel: int, dtype) -> None:
        return None  # the payload goes over the wire from where it is (handoff.py)

    def stage_copy(self, item, pool, side, cur, stop) -> None:
        pass

    def hand_over(self, item: HiddenItem, stop: bool = False) -> float | None:
        t0 = time.perf_counter()
        granted = self.target_side.wait_credit(item.batch.index)
        blocked = time.perf_counter() - t0
        if not granted:  # the drafters stopped (end of run, or a stop they voted on)
            return None
        self.target_side.send(item.batch.index, item.packed, stop=stop)
        return blocked

    # drafter rank
    def batch_id(self, step: int) -> int:
        return self.layout.batch_id(step, self.index)

    def taken(self, step: int) -> None:
        self.drafter_side.grant_until(step + 1 + self.pcfg.queue_size)
