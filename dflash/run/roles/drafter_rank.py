"""A drafter rank: the drafter (DDP among drafter ranks), the frozen embedding and
lm_head it needs, and no target. A receiver thread takes the hidden states its credits
asked for off the wire and puts them in the same bounded queue the single-process
pipeline uses; the training thread is the pipeline's drafter loop.

    receiver thread   (header + payload from the target rank of each step's batch)
    training thread   queue_get -> drafter_forward -> backward (DDP all-reduce) -> optimizer_step

Credits: `queue_size` ahead of the step being trained, one more per batch taken.
"""
from __future__ import annotations

from ..hidden_queue import HiddenQueue
from ..pipeline import HiddenItem, Pipeline
from .handoff import DrafterSide
from .shards import ShardStreams


class DrafterRank(Pipeline):
    def __init__(self, ctx, rc):
        super().__init__(ctx)
        self.rc, self.layout = rc, rc.layout
        p = self.cfg.pipeline
        self.worker = f"drafter{rc.index}"
        # the credits bound what is in flight; the queue never needs to push back itself
        self.hq = HiddenQueue(p.queue_size + 1, p.min_ready)
        self.side = DrafterSide(rc.layout, rc.groups, rc.index, self.drafter_device, ctx.start_step,
                                rc.end_step, p.queue_size)
        self.streams = ShardStreams(ctx.samples, rc.layout, batch_size=self.cfg.train.batch_size,
                                    seed=self.cfg.train.seed, pad_id=ctx.tokenizer.pad_token_id,
                                    start_step=ctx.start_step)
        self.sync_timer = rc.sync_timer

    # -- hooks of the pipeline's drafter loop --------------------------------------------
    def batch_id(self, step: int) -> int:
        return self.layout.batch_id(step, self.rc.index)

    def taken(self, step: int) -> None:
        self.side.grant_until(step + 1 + self.cfg.pipeline.queue_size)

    def sync_wait(self) -> float:
        return self.sync_timer.take() if self.sync_timer is not None else 0.0

    # -- receiver ------------------------------------------------------------------------
    def _deliver(self, step, g, packed, ready, stop, waited):
        b = self.streams.get(self.rc.index, step)
        t = self.layout.producer(g)
        if stop:  # a target rank was interrupted: the drafters vote and stop together
            self.ctx.stop.set()
        self.hq.put(step, HiddenItem(batch=b, packed=packed, ready=ready, worker=f"target{t}"))

    def receiver(self):
        try:
            self.side.receive_loop(self._deliver, self.stop)
        finally:
            self.hq.producers_done()

    def run(self):
        self.side.grant_until(self.ctx.start_step + self.cfg.pipeline.queue_size)
        self._guard("receiver", self.receiver).start()
        ok = False
        try:
            self.drafter_loop()
            ok = True
        except Exception as e:
            self.errors.append((self.worker, e))
        finally:
            if ok and not self.errors:
                try:  # END to every target; the receiver then takes in what was promised
                    self.side.end()
                except Exception as e:
                    self.errors.append((self.worker, e))
                self._join_workers()
            self.shutdown_workers()
            self._join_workers()
        self.raise_first_error()
