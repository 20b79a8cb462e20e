"""A target rank: one frozen target replica on this rank's device, making the hidden
states of its share of the batches (layout.batches_of_target) and sending each to the
drafter rank that trains on it, against that drafter's credit.

    data_load -> model_forward -> pack_hidden -> cpu_copy_enqueue (credit wait + send)

The stage names are the single-process pipeline's; `cpu_copy_enqueue` carries
`transport` (nccl | gloo | host) and `blocked_s`, the wait for a credit: the target
was ahead of its drafters (idle cause `queue_full`). The forward of the next batch runs
before its credit is in, so a credit that arrives finds the batch ready.
"""
from __future__ import annotations

import time

import torch

from ...errors import naming_stages
from ...model.trainer import pack, target_features
from ..faults import inject
from .handoff import TargetSide
from .shards import ShardStreams


def run_target_rank(rc) -> dict:
    """rc: roles.setup.RoleContext of a target rank. Returns this rank's counts."""
    cfg, tel, layout = rc.cfg, rc.tel, rc.layout
    p = cfg.pipeline
    stage = naming_stages(tel.stage)
    t = rc.index
    worker, dev = f"target{t}", torch.device(rc.device)
    side = TargetSide(layout, rc.groups, dev, max_in_flight=p.queue_size)
    streams = ShardStreams(rc.samples, layout, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                           pad_id=rc.tokenizer.pad_token_id, start_step=rc.start_step)
    cuda = dev.type == "cuda"
    batches = tokens = 0
    blocked_total = 0.0
    for g in layout.batches_of_target(t, rc.start_step, rc.end_step):
        d, step = layout.consumer(g)
        key = ("batch", g)
        common = dict(worker=worker, rank=rc.rank, batch_id=g, step=step,
                      drafter_rank=layout.drafter_rank(d))
        with stage("data_load", trace=key, device="cpu", **common) as s:
            b = streams.get(d, step)
            s.set(tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
            inject(p, "data_load", step)
        a = dict(common, device=str(dev), tokens=b.tokens, sequences=len(b.lengths), padded_len=b.padded_len)
        cur = torch.cuda.current_stream(dev) if cuda else None
        with stage("model_forward", trace=key, stream=cur, **a):
            feats = target_features(rc.target, b, rc.layer_ids, dev)
            inject(p, "model_forward", step)
        with stage("pack_hidden", trace=key, stream=cur, **a):
            packed = pack(feats, b.lengths)
            inject(p, "pack_hidden", step)
        with stage("cpu_copy_enqueue", trace=key, transport=side.transport, **a) as s:
            t0 = time.perf_counter()
            granted = side.wait_credit(g)
            blocked = time.perf_counter() - t0
            s.set(blocked_s=round(blocked, 6))
            if blocked > p.stall_threshold_s:
                s.event("queue_full", wait_s=round(blocked, 6))
            if not granted:  # the drafters stopped (end of run, or a stop they voted on)
                s.set(cancelled=True)
                break
            inject(p, "cpu_copy_enqueue", step)
            side.send(g, packed, stop=rc.stop.is_set())
        blocked_total += blocked
        tel.add("dflash.queue.producer_blocked_seconds", blocked, worker=worker)
        tel.add("dflash.worker.batches", 1, worker=worker)
        tel.add("dflash.worker.tokens", b.tokens, worker=worker)
        batches += 1
        tokens += b.tokens
    side.finish()
    return {"batches": batches, "tokens": tokens, "credit_wait_s": round(blocked_total, 3),
            "transport": side.transport}
