"""The DDP all-reduce wait of a drafter rank, measured: the `sync` idle cause.

DDP overlaps gradient all-reduces with the backward pass; what a rank loses is the time
between its last bucket being ready (its own backward compute is done) and the last
all-reduce completing (the slowest drafter rank caught up). A comm hook that does the
same all-reduce as DDP's default stamps both moments; `take()` returns that wait for the
step, which the backward span carries as `sync_s` (carved out of it as `sync`).

gloo completes the future on the host, so the stamp is the real wait. On NCCL the host
does not wait at all (the wait is on the device's stream), and the figure is ~0: the
device-side wait then shows in the span's `device.duration_s`.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


class SyncTimer:
    def __init__(self, group):
        self.group = group
        self.world = dist.get_world_size(group)
        self._last_ready = 0.0
        self._last_done = 0.0

    def hook(self, state, bucket):
        self._last_ready = time.perf_counter()
        buf = bucket.buffer()
        buf.div_(self.world)
        fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()

        def done(f):
            self._last_done = time.perf_counter()
            return f.value()[0]
        return fut.then(done)

    def take(self) -> float:
        """Seconds this rank waited on the last all-reduce of the step just finished."""
        wait = max(0.0, self._last_done - self._last_ready)
        self._last_ready = self._last_done = 0.0
        return wait


def attach(ddp_module, group) -> SyncTimer:
    timer = SyncTimer(group)
    ddp_module.register_comm_hook(None, timer.hook)
    return timer
