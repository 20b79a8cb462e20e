"""The drafter worker, written once for every placement:

    take (queue_get) -> drafter_forward -> backward -> optimizer_step -> step end

It takes step `s`'s batch from its channel (in step order whatever the number of target
workers, so training is identical to the reference loop), makes its own stream wait on
the hand-over's event (never the host), trains, and hands the loss, accuracy and grad
norm to the step end as device tensors (read back later, no sync).
"""
from __future__ import annotations

import torch

from ..model.features import unpack
from .faults import inject
from .step_end import StepEnd


class DrafterWorker:
    def __init__(self, ctx, channel, name: str, sync_timer=None):
        self.ctx, self.channel, self.name, self.sync_timer = ctx, channel, name, sync_timer
        self.dev = ctx.trainer.device
        self.cuda = self.dev.type == "cuda"

    def _take(self, step: int, key, a: dict):
        """The item for `step`; through a queue, the queue_get stage with its wait."""
        ctx, ch = self.ctx, self.channel
        if not ch.waits:
            return ch.take(step)[0]
        with ctx.tel.stage("queue_get", trace=key, **a) as s:
            item, waited = ch.take(step)
            ch.taken(step)
            inject(ctx.cfg.pipeline, "queue_get", step)
            s.set(wait_s=round(waited, 6), queue_depth=ch.depth())
            if waited > ctx.cfg.pipeline.stall_threshold_s:
                s.event("stall", cause="queue_empty", wait_s=round(waited, 6))
        ctx.tel.add("dflash.queue.consumer_starved_seconds", waited, worker=self.name)
        return item

    def run(self) -> None:
        ctx, st, pcfg = self.ctx, self.ctx.trainer, self.ctx.cfg.pipeline
        end_step = StepEnd(ctx, self.name)  # tokens, read-back, progress, save cadence
        try:
            while ctx.more_steps() and not ctx.workers_stop.is_set():
                step = st.step
                bid = self.channel.batch_id(step)
                key = ("batch", bid)
                a = dict(worker=self.name, device=str(self.dev), rank=ctx.rank, batch_id=bid, step=step)
                item = self._take(step, key, a)
                b = item.batch
                a |= dict(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
                cur = torch.cuda.current_stream(self.dev) if self.cuda else None
                with ctx.tel.stage("drafter_forward", trace=key, stream=cur, **a):
                    if item.ready is not None:
                        cur.wait_event(item.ready)     # device-side wait, the host moves on
                    if item.packed.device == self.dev and self.cuda:
                        item.packed.record_stream(cur)  # made on another stream (NCCL receive)
                    x = item.packed.to(self.dev, non_blocking=True)
                    if item.release is not None:
                        done = torch.cuda.Event()
                        done.record(cur)
                        item.release(done)
                    loss, acc = st.forward(unpack(x, b.lengths, b.padded_len), b)
                    inject(pcfg, "drafter_forward", step)
                with ctx.tel.stage("backward", trace=key, stream=cur, **a) as s:
                    st.backward(loss)
                    inject(pcfg, "backward", step)
                    sync = self.sync_timer.take() if self.sync_timer is not None else 0.0
                    if sync:
                        s.set(sync_s=round(sync, 6))
                with ctx.tel.stage("optimizer_step", trace=key, links=[key], stream=cur, **a):
                    gnorm, nonfinite = st.optimizer_step(loss)
                    inject(pcfg, "optimizer_step", step)
                end_step(step, b.tokens, loss, acc, gnorm, nonfinite)
        finally:
            end_step.close()
