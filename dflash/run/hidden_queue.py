"""The bounded hidden-state queue between target workers and a drafter worker.

- Bounded: a producer blocks while `capacity` items wait (back-pressure); the time it
  spends blocked is returned so the caller can account it.
- `min_ready`: the consumer waits until that many items are present (or producers are
  done) so it always has a mix of sequence lengths at hand.
- In-order delivery: the consumer asks for the next batch id; with several target workers
  batches may finish out of order, and taking them in id order keeps training identical
  to the single-process loop whatever the number of workers.
- `close()` (normal end or an error anywhere) wakes every waiter at once.
"""
from __future__ import annotations

import threading
import time


class Closed(Exception):
    pass


class HiddenQueue:
    def __init__(self, capacity: int, min_ready: int = 1):
        self.capacity, self.min_ready = capacity, min_ready
        self._items: dict[int, object] = {}
        self._cv = threading.Condition()
        self._closed = False
        self._producers_done = False
        self.blocked_s = 0.0   # producers' total wait on a full queue
        self.starved_s = 0.0   # consumer's total wait on an empty (or not ready) queue

    def depth(self) -> int:
        return len(self._items)

    def put(self, index: int, item) -> float:
        t0 = time.perf_counter()
        with self._cv:
            # the item the consumer needs next is always let in: it may not deadlock behind others
            while len(self._items) >= self.capacity and not self._closed and index != min(
                    [index] + [i for i in self._items]):
                self._cv.wait(0.1)
            if self._closed:
                raise Closed
            self._items[index] = item
            self._cv.notify_all()
        waited = time.perf_counter() - t0
        self.blocked_s += waited
        return waited

    def get(self, index: int) -> tuple[object, float]:
        """The item with this batch id, once it is present and min_ready items wait."""
        t0 = time.perf_counter()
        with self._cv:
            while not self._closed:
                ready = len(self._items) >= self.min_ready or self._producers_done
                if index in self._items and ready:
                    break
                if self._producers_done and index not in self._items:
                    raise Closed
                self._cv.wait(0.1)
            if self._closed:
                raise Closed
            item = self._items.pop(index)
            self._cv.notify_all()
        waited = time.perf_counter() - t0
        self.starved_s += waited
        return item, waited

    def producers_done(self) -> None:
        with self._cv:
            self._producers_done = True
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
