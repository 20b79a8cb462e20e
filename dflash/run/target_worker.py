"""The target worker, written once for every placement:

    data_load (its batch source) -> model_forward -> pack_hidden -> cpu_copy_enqueue (hand over)

It runs the frozen target (one replica per target device), captures the selected layers,
keeps valid tokens only and hands them to its channel: a queue (threads; on CUDA a copy
to pinned host buffers on a side stream, announced by an event: nobody on this side
waits for it), another rank (credit-based, roles/handoff.py), or nothing at all (the
reference loop, whose drafter takes the item from `make` directly).
"""
from __future__ import annotations

import torch

from ..model.features import pack, target_features
from .channels import HiddenItem
from .faults import inject


class TargetWorker:
    def __init__(self, ctx, target, channel, name: str, cache=None, extra_attrs: dict | None = None):
        self.ctx, self.target, self.channel, self.name, self.cache = ctx, target, channel, name, cache
        self.dev = torch.device(target.device)
        self.cuda = self.dev.type == "cuda"
        self.extra = dict(extra_attrs or {})
        if ctx.feature_store is not None:  # train --features: model_forward only moves captured rows
            self.extra["source"] = "features"
        self.side = self.pool = None
        if channel.waits:  # a queue: on CUDA, a side stream and (across devices) pinned staging
            self.side = torch.cuda.Stream(self.dev) if self.cuda else None
            H = target.config.get_text_config().hidden_size * len(ctx.feature_ids)
            t = ctx.cfg.train
            self.pool = channel.staging(self.dev, t.batch_size * ctx.cfg.data.max_len * H, target.dtype)
        self.batches = self.tokens = 0
        self.blocked_s = 0.0

    def attrs(self, b, extra: dict) -> dict:
        return dict(worker=self.name, device=str(self.dev), rank=self.ctx.rank, batch_id=b.index,
                    tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len, **self.extra, **extra)

    def make(self, b, extra: dict) -> tuple[HiddenItem, dict, object]:
        """model_forward -> pack_hidden: (item, span attributes, the stream they ran on)."""
        ctx, key, a = self.ctx, ("batch", b.index), self.attrs(b, extra)
        step = a["step"]
        cur = torch.cuda.current_stream(self.dev) if self.cuda else None
        with ctx.tel.stage("model_forward", trace=key, stream=cur, **a):
            feats = target_features(self.target, b, ctx.feature_ids, self.dev, cache=self.cache)
            inject(ctx.cfg.pipeline, "model_forward", step)
        with ctx.tel.stage("pack_hidden", trace=key, stream=cur, **a):
            packed = pack(feats, b.lengths)
            inject(ctx.cfg.pipeline, "pack_hidden", step)
        return HiddenItem(batch=b, packed=packed, worker=self.name), a, cur

    def hand_over(self, item: HiddenItem, a: dict, cur) -> bool:
        """cpu_copy_enqueue: False when the channel takes nothing more (the drafters stopped)."""
        ctx, ch, thr = self.ctx, self.channel, self.ctx.cfg.pipeline.stall_threshold_s
        with ctx.tel.stage("cpu_copy_enqueue", trace=("batch", item.batch.index), **a, **ch.span_attrs) as s:
            ch.stage_copy(item, self.pool, self.side, cur, ctx.workers_stop)  # toward the drafter's device
            inject(ctx.cfg.pipeline, "cpu_copy_enqueue", a["step"])
            blocked = ch.hand_over(item, stop=ctx.stop.is_set())
            if blocked is None:
                s.set(cancelled=True)
                return False
            s.set(blocked_s=round(blocked, 6))
            if blocked > thr:
                s.event("queue_full", wait_s=round(blocked, 6))
        tel = ctx.tel
        tel.add("dflash.queue.producer_blocked_seconds", blocked, worker=self.name)
        tel.add("dflash.worker.batches", 1, worker=self.name)
        tel.add("dflash.worker.tokens", item.batch.tokens, worker=self.name)
        self.batches += 1
        self.tokens += item.batch.tokens
        self.blocked_s += blocked
        return True

    def run(self, source) -> None:
        """The worker's loop over its batch source (a thread, or a target rank's main thread)."""
        for b, extra in source.batches_for(self.name):
            if self.ctx.workers_stop.is_set():
                break
            item, a, cur = self.make(b, extra)
            if not self.hand_over(item, a, cur):
                break

    def counts(self) -> dict:
        return {"batches": self.batches, "tokens": self.tokens, "credit_wait_s": round(self.blocked_s, 3)}
