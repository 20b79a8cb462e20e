"""Build this process's workers (workers.py) and the channel that joins them (channels.py),
and run them to the last step:

    direct   (reference loop)   `reference_loop`, one thread, top-down: each step's batch,
                                the target's features for it, the drafter's step on them;
    queue    (pipelined)        a prefetcher and a target thread per target device feed the
                                drafter on this thread;
    ranks    (layout)           a target rank makes and sends its share; a drafter rank's
                                receiver thread feeds its drafter.
"""
from __future__ import annotations

import torch

from . import placement as placement_mod
from .channels import QueueChannel, RankChannel
from .context import RunSpec, RunState
from .worker_threads import WorkerSet
from .workers import DrafterWorker, InlineSource, Prefetcher, TargetWorker


def run_loop(spec: RunSpec, state: RunState) -> None:
    """Build this process's workers and the channel between them; run to the last step."""
    place, cfg = spec.placement, spec.cfg
    state.workers_stop.clear()
    if place.channel == "direct":
        ws = WorkerSet(state)  # a failure is reported as worker "main"'s, with its stage
        try:
            ws.run_here("main", lambda: reference_loop(spec, state))
        finally:
            ws.finish()
        return
    if place.role == placement_mod.TARGET:
        _run_target_rank(spec, state)
        return
    dev = state.train_step.device
    if place.layout is None:
        channel = QueueChannel(cfg.pipeline, dev)
        ws = WorkerSet(state, channel)
        _register_queue_metrics(spec, state, channel)
        prefetch = Prefetcher(spec, state, state.workers_stop, len(state.targets))
        ws.start("prefetch", prefetch.run)
        done: list = []

        def target_thread(wid: int, tw: TargetWorker):
            try:
                tw.run(prefetch)
            finally:
                done.append(wid)
                if len(done) == len(state.targets):
                    channel.producers_done()
        for wid, (tgt, cache) in enumerate(zip(state.targets, state.feature_caches)):
            ws.start(f"target{wid}", target_thread, wid,
                     TargetWorker(spec, state, tgt, channel, f"target{wid}", cache=cache))
        try:
            ws.run_here(place.worker, DrafterWorker(spec, state, channel, place.worker).run)
        finally:
            ws.finish()
        return
    _run_drafter_rank(spec, state, dev)


def reference_loop(spec: RunSpec, state: RunState) -> None:
    """The reference loop (`train --reference`), on this thread, no queue: for each step, its
    batch (data_load), the target's features for it (`TargetWorker.make`: model_forward,
    pack_hidden), the drafter's training step on them (`DrafterWorker.step`:
    drafter_forward -> backward -> optimizer_step -> the step's end)."""
    batches = InlineSource.reference(spec, state).batches_for("main")
    target = TargetWorker(spec, state, state.target, None, "main", cache=state.feature_caches[0])
    drafter = DrafterWorker(spec, state, None, "main")
    try:
        while drafter.more_steps():
            step_no = state.train_step.step
            batch, attrs = next(batches)
            features = target.make(batch, attrs)
            drafter.step(step_no, features)
    finally:
        drafter.close()


def _register_queue_metrics(spec: RunSpec, state: RunState, channel: QueueChannel) -> None:
    """Read by the telemetry thread; callbacks never touch a worker."""
    tel, rank, hq = state.tel, {"rank": spec.rank}, channel.hq
    tel.observable_gauge("dflash.queue.depth", lambda: [(hq.depth(), rank)], unit="{batch}",
                         description="hidden-state batches waiting for the drafter")
    tel.observable_gauge("dflash.queue.min_ready_ratio", lambda: [(hq.depth() / hq.min_ready, rank)],
                         unit="1", description="queue depth / min_ready (>= 1: drafter can start at once)")
    tel.observable_gauge("dflash.queue.producer_blocked", lambda: [(hq.blocked_s, rank)], unit="s",
                         description="total time target workers waited on a full queue")
    tel.observable_gauge("dflash.queue.consumer_starved", lambda: [(hq.starved_s, rank)], unit="s",
                         description="total time the drafter waited on an empty queue")
    dev = state.train_step.device
    if dev.type == "cuda":
        def alloc():
            s = torch.cuda.memory_stats(dev)  # host-side counters: no sync
            a = {"device": str(dev)} | rank
            return [(s.get("allocated_bytes.all.current", 0), a | {"kind": "allocated"}),
                    (s.get("reserved_bytes.all.current", 0), a | {"kind": "reserved"}),
                    (s.get("allocated_bytes.all.peak", 0), a | {"kind": "peak_allocated"})]
        tel.observable_gauge("dflash.cuda.memory", alloc, unit="By", description="CUDA caching allocator")


def _run_target_rank(spec: RunSpec, state: RunState) -> None:
    """A layout's target rank: its share of the global batches, each sent to the drafter rank
    that trains on it against that drafter's credit (roles/handoff.py)."""
    from .roles.handoff import TargetSide
    from .roles.shards import ShardStreams

    cfg, place, layout = spec.cfg, spec.placement, spec.placement.layout
    dev = torch.device(place.target_devices[0])
    side = TargetSide(layout, spec.groups, dev, max_in_flight=cfg.pipeline.queue_size)
    channel = RankChannel(cfg.pipeline, None, target_side=side, layout=layout, index=place.index)
    streams = ShardStreams(spec.samples, layout, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                           pad_id=spec.tokenizer.pad_token_id, start_step=spec.start_step)
    plan = ((g, step, {"drafter_rank": layout.drafter_rank(d)}, lambda d=d, step=step: streams.get(d, step))
            for g in layout.batches_of_target(place.index, spec.start_step, cfg.train.steps)
            for d, step in [layout.consumer(g)])
    name = f"target{place.index}"
    tw = TargetWorker(spec, state, state.target, channel, name)
    ws = WorkerSet(state, channel)
    try:
        if ws.run_here(name, lambda: tw.run(InlineSource(spec, state, plan))):
            side.finish()
        state.target_counts = tw.counts() | {"transport": side.transport}
    finally:
        ws.finish()


def _run_drafter_rank(spec: RunSpec, state: RunState, dev: torch.device) -> None:
    """A layout's drafter rank: a receiver thread takes the hidden states its credits asked
    for off the wire into the in-order queue; this thread is the drafter worker."""
    from .channels import HiddenItem
    from .roles.handoff import DrafterSide
    from .roles.shards import ShardStreams

    cfg, place, layout = spec.cfg, spec.placement, spec.placement.layout
    p = cfg.pipeline
    side = DrafterSide(layout, spec.groups, place.index, dev, spec.start_step, cfg.train.steps, p.queue_size)
    channel = RankChannel(p, dev, drafter_side=side, layout=layout, index=place.index)
    streams = ShardStreams(spec.samples, layout, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                           pad_id=spec.tokenizer.pad_token_id, start_step=spec.start_step)
    ws = WorkerSet(state, channel)
    _register_queue_metrics(spec, state, channel)

    def deliver(step, g, packed, ready, stop, waited):
        b = streams.get(place.index, step)
        if stop:  # a target rank was interrupted: the drafters vote and stop together
            state.stop.set()
        channel.hq.put(step, HiddenItem(batch=b, packed=packed, ready=ready, worker=f"target{layout.producer(g)}"))

    def receiver():
        try:
            side.receive_loop(deliver, state.workers_stop)
        finally:
            channel.producers_done()

    side.grant_until(spec.start_step + p.queue_size)
    ws.start("receiver", receiver)
    try:
        if ws.run_here(place.worker, DrafterWorker(spec, state, channel, place.worker, state.sync_timer).run) \
                and not ws.errors:
            try:  # END to every target; the receiver then takes in what was promised
                side.end()
            except Exception as e:
                ws.errors.append((place.worker, e))
            ws.join()
    finally:
        ws.finish()
