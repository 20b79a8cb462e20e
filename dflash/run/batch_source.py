"""Where a target worker's batches come from (the `data_load` stage), by placement:

    Prefetcher   a thread ahead of the target workers (pipelined): data_load as `prefetch`,
                 a bounded queue, one end marker per worker; the worker's wait for it is
                 its `data_wait` idle cause;
    InlineSource the worker loads each batch itself: the reference loop (its step's batch),
                 a layout's target rank (its share of the global batches, rebuilt from the
                 drafter shards' streams: only hidden states cross the wire).
"""
from __future__ import annotations

import queue
import time

from .faults import inject


class Prefetcher:
    def __init__(self, ctx, stop, n_workers: int):
        self.ctx, self.stop, self.n_workers = ctx, stop, n_workers
        self.batches: queue.Queue = queue.Queue(maxsize=ctx.cfg.pipeline.prefetch)

    def run(self) -> None:
        ctx, tel = self.ctx, self.ctx.tel
        stream = ctx.batch_stream()
        idx = ctx.start_step
        blocked = 0.0  # the previous batch's wait for room in the batch queue
        while not self.stop.is_set() and idx < ctx.cfg.train.steps:
            with ctx.tel.stage("data_load", trace=("batch", idx), worker="prefetch", device="cpu", rank=ctx.rank,
                           batch_id=idx, step=idx, blocked_before_s=round(blocked, 6)) as s:
                b = next(stream)
                s.set(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                inject(ctx.cfg.pipeline, "data_load", idx)
            t0 = time.perf_counter()
            self._put(b)
            blocked = time.perf_counter() - t0  # idle cause queue_full: ahead of the targets
            tel.record("dflash.batch.padding_ratio", 1 - b.tokens / (len(b.lengths) * b.padded_len))
            for n in b.lengths:
                tel.record("dflash.batch.sequence_length", n)
            idx += 1
        for _ in range(self.n_workers):  # one end marker per worker
            self._put(None)

    def _put(self, b) -> None:
        while not self.stop.is_set():
            try:
                return self.batches.put(b, timeout=0.1)
            except queue.Full:
                continue

    def batches_for(self, worker: str):
        """(batch, attributes) for one target worker until the end marker."""
        while not self.stop.is_set():
            t0 = time.perf_counter()
            b = None
            while not self.stop.is_set():
                try:
                    b = self.batches.get(timeout=0.1)
                    break
                except queue.Empty:
                    continue
            if b is None:
                return
            # data_wait: idle cause `data_wait` (the prefetcher is behind)
            yield b, {"step": b.index, "data_wait_s": round(time.perf_counter() - t0, 6)}


class InlineSource:
    """data_load on the worker's own thread. ``plan`` yields (batch id, step, attributes,
    load) where load() returns the batch."""

    def __init__(self, ctx, worker: str, plan):
        self.ctx, self.worker, self.plan = ctx, worker, plan

    def batches_for(self, worker: str):
        ctx = self.ctx
        for bid, step, attrs, load in self.plan:
            with ctx.tel.stage("data_load", trace=("batch", bid), worker=worker, rank=ctx.rank, batch_id=bid,
                               step=step, device="cpu", **attrs) as s:
                b = load()
                s.set(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                inject(ctx.cfg.pipeline, "data_load", step)
            yield b, {"step": step, **attrs}
