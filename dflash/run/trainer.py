"""`dflash train`, one trainer for every placement: set up -> run the workers -> finish.

    setup     join the ranks (placement.py says what this process does), load the target,
              prepare the data, build or resume the drafter, make the telemetry: once,
              whatever the placement;
    run_loop  build this process's workers (target_worker.py, drafter_worker.py) and the
              channel that joins them (channels.py), run them to the last step;
    finish    checkpoint, summary, evals, end of telemetry.

A layout only changes which workers a process builds and which channel joins them.
"""
from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from ..config import Config, dump, resolve_dtype
from ..model import checkpoint as ckpt
from ..model import target as target_mod
from ..model.drafter_build import build_drafter, drafter_config
from ..model.drafter_trainer import DrafterTrainer
from ..model.feature_cache import FeatureCache
from ..model.features import replicate_target
from ..prep.prepare import prepare
from . import distributed as dist_mod
from . import placement as placement_mod
from .batch_source import InlineSource, Prefetcher
from .channels import DirectChannel, QueueChannel, RankChannel
from .context import RunContext
from .drafter_worker import DrafterWorker
from .saving import save, wait_for_checkpoint
from .summary import balance_from_files, rank_reports, summarize
from .target_worker import TargetWorker
from .telemetry_setup import linger_for_scrape, make_telemetry
from .worker_threads import WorkerSet


# -- set-up ---------------------------------------------------------------------------------
def setup(cfg: Config, *, resume: bool, tel=None) -> RunContext:
    place = placement_mod.resolve(cfg)
    out = Path(cfg.out)
    run_id, groups = dist_mod.join(cfg, place)
    out.mkdir(parents=True, exist_ok=True)
    if any(d and d.startswith("cuda") for d in place.target_devices + [place.drafter_device]):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.manual_seed(cfg.train.seed)
    # the target's dtype is the target role's, also where a drafter rank borrows it on the host
    dtype = resolve_dtype(cfg, placement_mod.local_device(cfg.pipeline.target_devices[0]))
    target, tok = target_mod.load_target(cfg.model.target, device=place.load_device, dtype=dtype,
                                         seed=cfg.model.target_seed)
    from ..model.warmup import warm_up
    warmup_s = None
    if place.has_target:  # CUDA only: Triton compile/autotune and first-call costs, before anything is timed
        warmup_s = warm_up(target, batch_size=cfg.train.batch_size, seq_len=cfg.data.max_len,
                           quiet=place.rank != 0 or place.layout is not None)
    L = target_mod.num_layers(target)
    layer_ids = cfg.model.target_layer_ids or target_mod.default_layer_ids(L, cfg.model.num_target_layers)
    prep = _prepare_data(cfg, place, groups, target, tok, resume, layer_ids)
    ctx = RunContext(cfg=cfg, tel=tel, placement=place, tokenizer=tok, layer_ids=layer_ids,
                     samples=prep.samples, out=out, eval_convs=prep.eval_convs, groups=groups, run_id=run_id,
                     warmup_s=warmup_s)
    ctx.start_step = _start_step(ctx, resume)
    if place.has_drafter:
        _setup_drafter(ctx, target, resume, dtype)
    if place.has_target:
        _setup_targets(ctx, target, resume, prep.features)
    del target  # a drafter rank keeps no target: only its copies of the embedding and lm_head
    if ctx.tel is None:  # after the data and the models: the profile's wall time is the training's
        ctx.use_telemetry(make_telemetry(cfg, out, place, run_id))
    if ctx.estimate is not None:
        est = ctx.estimate
        ctx.tel.observable_gauge("dflash.train.acceptance_estimate",
                                 lambda: [(e[1], {})] if (e := est.latest()) else [], "1",
                                 "Estimated acceptance length on held-out replies (one forward, no decoding).")
    return ctx


def _prepare_data(cfg, place, groups, target, tok, resume, layer_ids):
    """Every process of a single-process run or a replica prepares (cached on disk); in a
    layout rank 0 (a target rank) prepares once and the samples go to every rank: no other
    rank reads the data set or generates, and nodes need no shared file system."""
    if place.layout is None:
        # a resumed run does not rebuild the feature cache: no features
        return prepare(cfg, target, tok, device=place.load_device, layer_ids=None if resume else layer_ids)
    from ..prep.prepare import Prepared
    samples = prepare(cfg, target, tok, device=place.load_device).samples if place.rank == 0 else None
    return Prepared(samples=dist_mod.broadcast(samples, 0, groups), eval_convs=[], regenerated=False)


def _start_step(ctx, resume: bool) -> int:
    """Where a resumed run starts: read by the lead from its checkpoint, told to every rank."""
    place = ctx.placement
    step = ckpt.load_training_state(ctx.out / "checkpoint")[0]["step"] if resume and place.lead else 0
    if place.layout is not None:
        step = dist_mod.broadcast(step, place.layout.drafter_rank(0), ctx.groups)
    elif place.world > 1:
        step = dist_mod.broadcast(step, 0, None)
    return step


def _setup_drafter(ctx, target, resume: bool, dtype) -> None:
    cfg, place = ctx.cfg, ctx.placement
    ddev = place.drafter_device
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if not place.has_target or torch.device(ddev) != target.device:
        # the drafter's own frozen copies; one deepcopy of the pair: a tied lm_head stays tied
        embed, head = copy.deepcopy((embed, head))
        embed, head = embed.to(ddev, dtype), head.to(ddev, dtype)
    tstate = jstate = None
    if resume:
        drafter, _ = ckpt.load_drafter(ctx.out / "checkpoint", device=ddev, dtype=torch.float32)
        ckpt.check_fits(drafter.cfg, drafter_config(cfg, target, ctx.tokenizer, ctx.layer_ids), ctx.out / "checkpoint")
        tstate, jstate = ckpt.load_training_state(ctx.out / "checkpoint")
    else:
        drafter = build_drafter(cfg, target, ctx.tokenizer, ctx.layer_ids).to(ddev)
    ddp = sync_timer = None
    if place.layout is not None:  # DDP among the drafter ranks, with the all-reduce wait measured
        ddp = dist_mod.wrap_ddp(drafter, ddev, group=ctx.groups.drafters)
        from .roles.sync_timing import attach
        sync_timer = attach(ddp, ctx.groups.drafters)
        ctx.vote = dist_mod.StopVote(place.drafter_world, group=ctx.groups.drafter_votes)
    else:
        ddp = dist_mod.wrap_ddp(drafter, ddev) if place.world > 1 else None
        ctx.vote = dist_mod.StopVote(place.world)
    ctx.sync_timer = sync_timer
    ctx.trainer = DrafterTrainer(cfg.train, cfg.model.block_size, drafter, embed, head, ddev, ddp=ddp)
    samples = ctx.samples
    if cfg.train.estimate_every and len(samples) > cfg.train.estimate_samples:
        # kept out of training: the acceptance estimate must measure held-out replies
        ctx.samples, held_out = samples[:-cfg.train.estimate_samples], samples[-cfg.train.estimate_samples:]
        ctx.held_out = held_out
    ctx.trainer.use_loss_vocab(ctx.samples)
    if resume:
        ctx.trainer.load_state(tstate)
        # the saved count is the all-rank total: the lead carries it, so sums stay exact
        ctx.tokens = jstate.get("tokens", 0) if place.lead else 0
        ctx.history = [tuple(h) for h in jstate.get("history", [])]


def _setup_targets(ctx, target, resume: bool, features) -> None:
    """One frozen replica per target device (workers on one device share it), each with its
    own feature cache (train.feature_cache) where a hit must come back."""
    cfg, place = ctx.cfg, ctx.placement
    replicas = {str(target.device): target}
    caches = {}
    if cfg.train.feature_cache and not resume:
        caches[str(target.device)] = FeatureCache(ctx.layer_ids, target.device)
        caches[str(target.device)].preload(features, cfg.data.max_len)  # regeneration's: no forward in epoch 1
    from ..model.warmup import warm_up
    for d in place.target_devices:
        key = str(torch.device(d))
        if key not in replicas:
            replicas[key] = replicate_target(target, d)
            warm_up(replicas[key], batch_size=cfg.train.batch_size, seq_len=cfg.data.max_len, quiet=True)
            if caches:
                caches[key] = next(iter(caches.values())).replica(d)
    keys = [str(torch.device(d)) for d in place.target_devices]
    ctx.targets = [replicas[k] for k in keys]
    ctx.feature_caches = [caches.get(k) for k in keys]
    if ctx.held_out:
        from .acceptance_estimate import AcceptanceEstimate
        ctx.estimate = AcceptanceEstimate(ctx, ctx.held_out, cfg.train.estimate_every)


# -- the workers ----------------------------------------------------------------------------
def run_loop(ctx: RunContext) -> None:
    """Build this process's workers and the channel between them; run to the last step."""
    place, cfg = ctx.placement, ctx.cfg
    ctx.workers_stop.clear()
    if place.channel == "direct":
        channel = DirectChannel()
        ws = WorkerSet(ctx, channel)
        tw = TargetWorker(ctx, ctx.target, channel, "main", cache=ctx.feature_caches[0])
        stream = ctx.batch_stream()
        plan = ((s, s, {}, lambda: next(stream)) for s in itertools.count(ctx.start_step))
        source = InlineSource(ctx, "main", plan).batches_for("main")
        channel.produce = lambda step: tw.make(*next(source))[0]
        try:
            ws.run_here("main", DrafterWorker(ctx, channel, "main").run)
        finally:
            ws.finish()
        return
    if place.role == placement_mod.TARGET:
        _run_target_rank(ctx)
        return
    dev = ctx.trainer.device
    if place.layout is None:
        channel = QueueChannel(cfg.pipeline, dev)
        ws = WorkerSet(ctx, channel)
        _register_queue_metrics(ctx, channel)
        prefetch = Prefetcher(ctx, ctx.workers_stop, len(ctx.targets))
        ws.start("prefetch", prefetch.run)
        done: list = []

        def target_thread(wid: int, tw: TargetWorker):
            try:
                tw.run(prefetch)
            finally:
                done.append(wid)
                if len(done) == len(ctx.targets):
                    channel.producers_done()
        for wid, (tgt, cache) in enumerate(zip(ctx.targets, ctx.feature_caches)):
            ws.start(f"target{wid}", target_thread, wid, TargetWorker(ctx, tgt, channel, f"target{wid}", cache=cache))
        try:
            ws.run_here(place.worker, DrafterWorker(ctx, channel, place.worker).run)
        finally:
            ws.finish()
        return
    _run_drafter_rank(ctx, dev)


def _register_queue_metrics(ctx, channel) -> None:
    """Read by the telemetry thread; callbacks never touch a worker."""
    tel, rank, hq = ctx.tel, {"rank": ctx.rank}, channel.hq
    tel.observable_gauge("dflash.queue.depth", lambda: [(hq.depth(), rank)], unit="{batch}",
                         description="hidden-state batches waiting for the drafter")
    tel.observable_gauge("dflash.queue.min_ready_ratio", lambda: [(hq.depth() / hq.min_ready, rank)],
                         unit="1", description="queue depth / min_ready (>= 1: drafter can start at once)")
    tel.observable_gauge("dflash.queue.producer_blocked", lambda: [(hq.blocked_s, rank)], unit="s",
                         description="total time target workers waited on a full queue")
    tel.observable_gauge("dflash.queue.consumer_starved", lambda: [(hq.starved_s, rank)], unit="s",
                         description="total time the drafter waited on an empty queue")
    dev = ctx.trainer.device
    if dev.type == "cuda":
        def alloc():
            s = torch.cuda.memory_stats(dev)  # host-side counters: no sync
            a = {"device": str(dev)} | rank
            return [(s.get("allocated_bytes.all.current", 0), a | {"kind": "allocated"}),
                    (s.get("reserved_bytes.all.current", 0), a | {"kind": "reserved"}),
                    (s.get("allocated_bytes.all.peak", 0), a | {"kind": "peak_allocated"})]
        tel.observable_gauge("dflash.cuda.memory", alloc, unit="By", description="CUDA caching allocator")


def _run_target_rank(ctx) -> None:
    """A layout's target rank: its share of the global batches, each sent to the drafter rank
    that trains on it against that drafter's credit (roles/handoff.py)."""
    from .roles.handoff import TargetSide
    from .roles.shards import ShardStreams

    cfg, place, layout = ctx.cfg, ctx.placement, ctx.placement.layout
    dev = torch.device(place.target_devices[0])
    side = TargetSide(layout, ctx.groups, dev, max_in_flight=cfg.pipeline.queue_size)
    channel = RankChannel(cfg.pipeline, None, target_side=side, layout=layout, index=place.index)
    streams = ShardStreams(ctx.samples, layout, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                           pad_id=ctx.tokenizer.pad_token_id, start_step=ctx.start_step)
    plan = ((g, step, {"drafter_rank": layout.drafter_rank(d)}, lambda d=d, step=step: streams.get(d, step))
            for g in layout.batches_of_target(place.index, ctx.start_step, cfg.train.steps)
            for d, step in [layout.consumer(g)])
    name = f"target{place.index}"
    tw = TargetWorker(ctx, ctx.target, channel, name)
    ws = WorkerSet(ctx, channel)
    try:
        if ws.run_here(name, lambda: tw.run(InlineSource(ctx, name, plan))):
            side.finish()
        ctx.target_counts = tw.counts() | {"transport": side.transport}
    finally:
        ws.finish()


def _run_drafter_rank(ctx, dev) -> None:
    """A layout's drafter rank: a receiver thread takes the hidden states its credits asked
    for off the wire into the in-order queue; this thread is the drafter worker."""
    from .channels import HiddenItem
    from .roles.handoff import DrafterSide
    from .roles.shards import ShardStreams

    cfg, place, layout = ctx.cfg, ctx.placement, ctx.placement.layout
    p = cfg.pipeline
    side = DrafterSide(layout, ctx.groups, place.index, dev, ctx.start_step, cfg.train.steps, p.queue_size)
    channel = RankChannel(p, dev, drafter_side=side, layout=layout, index=place.index)
    streams = ShardStreams(ctx.samples, layout, batch_size=cfg.train.batch_size, seed=cfg.train.seed,
                           pad_id=ctx.tokenizer.pad_token_id, start_step=ctx.start_step)
    ws = WorkerSet(ctx, channel)
    _register_queue_metrics(ctx, channel)

    def deliver(step, g, packed, ready, stop, waited):
        b = streams.get(place.index, step)
        if stop:  # a target rank was interrupted: the drafters vote and stop together
            ctx.stop.set()
        channel.hq.put(step, HiddenItem(batch=b, packed=packed, ready=ready, worker=f"target{layout.producer(g)}"))

    def receiver():
        try:
            side.receive_loop(deliver, ctx.workers_stop)
        finally:
            channel.producers_done()

    side.grant_until(ctx.start_step + p.queue_size)
    ws.start("receiver", receiver)
    try:
        if ws.run_here(place.worker, DrafterWorker(ctx, channel, place.worker, ctx.sync_timer).run) \
                and not ws.errors:
            try:  # END to every target; the receiver then takes in what was promised
                side.end()
            except Exception as e:
                ws.errors.append((place.worker, e))
            ws.join()
    finally:
        ws.finish()


# -- the run --------------------------------------------------------------------------------
def run_eval(ctx: RunContext, label: str) -> dict:
    from ..model.evaluate import describe_lossless, evaluate

    e = ctx.cfg.eval
    drafter = ctx.trainer.drafter
    if next(drafter.parameters()).device != ctx.target.device:  # eval beside the target; training copy stays
        drafter = copy.deepcopy(drafter).to(ctx.target.device)
    res = evaluate(ctx.target, drafter, ctx.tokenizer, ctx.eval_convs, stop=ctx.stop,
                   prompts=e.prompts, max_new_tokens=e.max_new_tokens, max_prompt_len=e.max_prompt_len)
    print(f"tau {label}: {res['acceptance_length']:.3f} (block {res['block_size']}, "
          f"{res['prompts']} prompts, {res['dtype']}, {describe_lossless(res)})"
          + (" [interrupted]" if res["interrupted"] else ""), file=sys.stderr)
    if ctx.stop.is_set():  # cut short by a signal: marked, with the command that redoes it
        res.update(interrupted=True, command=eval_command(ctx.cfg))
    return res


def eval_command(cfg: Config) -> str:
    """The command that runs the eval an interrupted run skipped."""
    return f"dflash eval --checkpoint {Path(cfg.out) / 'checkpoint'}"


@contextlib.contextmanager
def _graceful_signals(ctx: RunContext):
    """First Ctrl-C / SIGTERM (preemption, torchrun's shutdown): finish the current step,
    save, stop (every rank at the same step: they vote); a second one raises."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    who = f"rank {ctx.rank}: " if ctx.placement.world > 1 else ""

    def on_signal(signum, frame):
        if ctx.stop.is_set():
            raise KeyboardInterrupt
        print(f"\n{who}interrupt: finishing the current step, then saving a checkpoint", file=sys.stderr)
        ctx.stop.set()

    prev = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in prev:
        signal.signal(s, on_signal)
    try:
        yield
    finally:
        for s, h in prev.items():
            signal.signal(s, h)


def train(cfg: Config, *, resume: bool = False, eval_before_after: bool = False) -> dict:
    from .. import wandb_bridge

    ctx = setup(cfg, resume=resume)
    place, out = ctx.placement, ctx.out
    if place.lead:
        dump(cfg, out / "config.yaml")
    report = _rank_report(ctx) if place.layout is not None else None
    bridge = wandb_bridge.start(ctx) if place.has_drafter else None  # its own thread; --wandb, the lead
    summary: dict = {}
    try:
        with _graceful_signals(ctx):
            if place.has_drafter:
                _train_drafter(ctx, summary, eval_before_after)
            else:
                run_loop(ctx)
                report.update(ctx.target_counts)
    finally:
        linger_for_scrape(ctx.tel)
        ctx.tel.shutdown(timeout_s=2.0)
        summary["telemetry"] = ctx.tel.summary()
        if report is not None:
            report.update({k: summary[k] for k in ("steps", "tokens", "drafter_parameters", "frozen_parameters",
                                                   "interrupted") if k in summary})
            report["telemetry"] = summary["telemetry"]["health"]
            (out / "ranks" / f"rank{place.rank}.json").write_text(json.dumps(report, indent=2))
        elif place.lead and summary.get("steps") is not None:
            summary["balance"] = balance_from_files(out)
        dist_mod.shutdown()
    if place.layout is not None and place.lead:
        summary |= {"layout": str(place.layout), "ranks": rank_reports(out, place.world),
                    "held_parameters": report["held_parameters"], "role": place.role}
        summary["balance"] = balance_from_files(out)  # every rank's spans are on disk by now
    if bridge is not None:  # bounded; falls back to OUT/wandb_fallback.jsonl
        try:
            bridge.close(summary)
        except Exception as e:
            print(f"dflash: W&B bridge: {wandb_bridge.redact(repr(e))}", file=sys.stderr)
    if place.lead:
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
    # under a layout only the lead reports (exit 130 when interrupted); it is the last to finish
    return summary if place.layout is None or place.lead else {"rank": place.rank, "role": place.role}


def _train_drafter(ctx: RunContext, summary: dict, eval_before_after: bool) -> None:
    cfg = ctx.cfg
    if eval_before_after and cfg.eval.before:
        summary["eval_before"] = run_eval(ctx, "before training")
    t0 = time.perf_counter()
    tokens0, step0 = ctx.tokens, ctx.trainer.step
    if ctx.estimate is not None:  # the curve's first point: where training starts from
        ctx.estimate(ctx.trainer.step)
    run_loop(ctx)
    ctx.finish_readback()
    wall = time.perf_counter() - t0
    save(ctx)
    wait_for_checkpoint(ctx)  # the run's result is on disk before anything else happens
    summary.update(summarize(ctx, wall, step0, tokens0))
    if ctx.placement.layout is not None:
        summary["drafter_parameters"] = sum(p.numel() for p in ctx.trainer.drafter.parameters())
        summary["frozen_parameters"] = sum(p.numel() for p in {id(p): p for p in (
            ctx.trainer.embed.weight, ctx.trainer.lm_head.weight)}.values())
    if ctx.estimate is not None:
        summary["acceptance_estimate"] = ctx.estimate.summary()
    if ctx.is_lead and ctx.history:
        from ..analysis.learning_curve import write_png
        where = f" ({ctx.placement.layout})" if ctx.placement.layout is not None else ""
        write_png(ctx.out / "learning_curve.png", ctx.history, ctx.estimate.history if ctx.estimate else [],
                  cfg.model.block_size, f"{cfg.model.target}: drafter training{where}")
    if ctx.warmup_s is not None:
        summary["warmup_s"] = round(ctx.warmup_s, 2)
    if ctx.writer is not None:  # off the drafter's path, but worth knowing
        summary["checkpoint_write_s"] = round(ctx.writer.last_write_s, 3)
    if eval_before_after and ctx.stop.is_set():
        # preempted: the grace period (30 s on Kubernetes) is for saving, not for an eval
        summary["eval_after"] = {"skipped": "interrupted", "command": eval_command(cfg)}
        if ctx.rank == 0:
            print(f"eval after training skipped (interrupted); run it with: {eval_command(cfg)}", file=sys.stderr)
    elif eval_before_after:
        summary["eval_after"] = run_eval(ctx, "after training")
        if ctx.stop.is_set():  # a signal during the eval: its figure is partial, and the run says so
            summary["interrupted"] = True
            if ctx.rank == 0:
                print(f"eval after training interrupted: tau above is partial; run it whole with: "
                      f"{eval_command(cfg)}", file=sys.stderr)


def _rank_report(ctx) -> dict:
    """A layout rank's OUT/ranks/rank{r}.json: role, device, what it really holds."""
    place = ctx.placement
    (ctx.out / "ranks").mkdir(exist_ok=True)
    (ctx.out / "ranks" / f"rank{place.rank}.pid").write_text(str(os.getpid()))
    rep = {"rank": place.rank, "role": place.role, "index": place.index,
           "device": place.drafter_device or place.target_devices[0], "layout": str(place.layout),
           "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "host": socket.gethostname(),
           "held_parameters": held_parameters()}
    if place.has_target:
        rep["target_parameters"] = sum(p.numel() for p in ctx.target.parameters())
    return rep


def held_parameters() -> int:
    """Every parameter alive in this process (garbage collector's view): what the rank
    really holds, not what it meant to keep."""
    import gc
    import warnings

    gc.collect()
    seen, total = set(), 0
    with warnings.catch_warnings():  # isinstance() on some module objects warns of deprecations
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            if isinstance(o, torch.nn.Parameter) and id(o) not in seen:
                seen.add(id(o))
                total += o.numel()
    return total
