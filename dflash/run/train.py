"""`dflash train`: set up, run the loop (pipelined or reference), checkpoint, summarise."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from ..analysis.idle_rules import DFLASH_RULES
from ..config import Config, dump, resolve_dtype
from ..data.prepare import prepare
from ..model import checkpoint as ckpt
from ..model import target as target_mod
from ..model.trainer import DrafterStep, build_drafter, preload_features, replicate_target
from . import distributed as dist_mod
from .context import RunContext
from .saving import save, wait_for_checkpoint


def _make_telemetry(cfg: Config, out: Path, rank: int, world_size: int, run_id: str):
    import otel

    if not cfg.telemetry.enabled:
        return otel.Telemetry.disabled()
    tdir = out / "telemetry" / (f"rank{rank}" if world_size > 1 else "")
    gpus = sorted({torch.device(d).index or 0 for d in cfg.pipeline.target_devices + cfg.pipeline.drafter_devices
                   if d.startswith("cuda")}) or None
    return otel.Telemetry.from_env(
        service_name="dflash", run_id=run_id, file_dir=str(tdir),
        resource_attributes={"rank": rank, "world_size": world_size, "dflash.target": cfg.model.target},
        console=rank == 0, console_interval_s=cfg.telemetry.console_interval_s or None,
        mode=cfg.telemetry.mode, gpu_indices=gpus, idle_rules=DFLASH_RULES, root_spans=rank == 0)


def _prometheus_enabled() -> bool:
    return "prometheus" in os.environ.get("OTEL_METRICS_EXPORTER", "").replace(" ", "").split(",")


@contextlib.contextmanager
def rank_prometheus_port():
    """Under torchrun each rank serves its own scrape endpoint: port = base + LOCAL_RANK,
    base = OTEL_EXPORTER_PROMETHEUS_PORT (default 9464). Set only while the telemetry
    layer is built (it reads the environment then), so the base stays as the user gave it."""
    local = os.environ.get("LOCAL_RANK")
    if not _prometheus_enabled() or local is None:
        yield
        return
    key = "OTEL_EXPORTER_PROMETHEUS_PORT"
    before = os.environ.get(key)
    os.environ[key] = str(int(before or 9464) + int(local))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def _linger_for_scrape(tel) -> None:
    """DFLASH_PROMETHEUS_LINGER_S=N: keep the scrape endpoint up N s after the last step so
    Prometheus' last scrape sees the final counts (a pulled endpoint dies with the run)."""
    secs = float(os.environ.get("DFLASH_PROMETHEUS_LINGER_S", "0") or 0)
    if secs > 0 and _prometheus_enabled():
        tel.flush(timeout_s=2.0)
        time.sleep(secs)


def setup(cfg: Config, *, resume: bool, tel=None) -> RunContext:
    out = Path(cfg.out)
    rank, world, run_id = dist_mod.init_from_env(cfg, out)
    out.mkdir(parents=True, exist_ok=True)
    tdevs = [_local(d) for d in cfg.pipeline.target_devices]
    tdev = tdevs[0]
    ddev = _local(cfg.pipeline.drafter_devices[rank % len(cfg.pipeline.drafter_devices)])
    if ddev.startswith("cuda") or tdev.startswith("cuda"):
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    torch.manual_seed(cfg.train.seed)
    target, tok = target_mod.load_target(cfg.model.target, device=tdev, dtype=resolve_dtype(cfg, tdev),
                                         seed=cfg.model.target_seed)
    from ..model.warmup import warm_up
    # CUDA only: Triton compile/autotune and first-call costs, paid and reported before
    # regeneration, the eval and the timed loop (None on the CPU)
    warmup_s = warm_up(target, batch_size=cfg.train.batch_size, seq_len=cfg.data.max_len, quiet=rank != 0)
    L = target_mod.num_layers(target)
    layer_ids = cfg.model.target_layer_ids or target_mod.default_layer_ids(L, cfg.model.num_target_layers)
    # a resumed run does not rebuild the feature cache (build_drafter is skipped): no features
    prep = prepare(cfg, target, tok, device=tdev, layer_ids=None if resume else layer_ids)
    if tel is None:  # after data prep: the profile's wall time is the training's
        with rank_prometheus_port():
            tel = _make_telemetry(cfg, out, rank, world, run_id)

    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if ddev != tdev:  # the drafter device holds its own frozen copies of embedding / lm_head
        import copy
        embed, head = copy.deepcopy((embed, head))  # one copy of the pair: a tied lm_head stays tied
        embed, head = embed.to(ddev), head.to(ddev)
    start, history, tokens = 0, [], 0
    if resume:
        drafter, _ = ckpt.load_drafter(out / "checkpoint", device=ddev, dtype=torch.float32)
        tstate, jstate = ckpt.load_training_state(out / "checkpoint")
    else:
        drafter = build_drafter(cfg, target, tok, layer_ids).to(ddev)
        # features regeneration kept: the first epoch needs no target forward either
        preload_features(target, layer_ids, prep.features, cfg.data.max_len)
    ddp = dist_mod.wrap_ddp(drafter, ddev) if world > 1 else None
    step = DrafterStep(cfg, drafter, embed, head, ddev, ddp=ddp)
    if resume:
        step.load_state(tstate)
        # the saved count is the all-rank total: rank 0 carries it, so sums stay exact
        start, tokens = tstate["step"], jstate.get("tokens", 0) if rank == 0 else 0
        history = [tuple(h) for h in jstate.get("history", [])]
    samples, held_out = prep.samples, []
    if cfg.train.estimate_every and len(samples) > cfg.train.estimate_samples:
        # kept out of training: the acceptance estimate must measure held-out replies
        samples, held_out = samples[:-cfg.train.estimate_samples], samples[-cfg.train.estimate_samples:]
    step.use_loss_vocab(samples)
    ctx = RunContext(cfg=cfg, tel=tel, target=target, tokenizer=tok, layer_ids=layer_ids, step=step,
                     samples=samples, eval_convs=prep.eval_convs, out=out, rank=rank, world_size=world,
                     start_step=start, history=history, tokens=tokens)
    if held_out:
        from .acceptance_estimate import AcceptanceEstimate
        ctx.estimate = AcceptanceEstimate(ctx, held_out, cfg.train.estimate_every)
        tel.observable_gauge("dflash.train.acceptance_estimate",
                             lambda: [(e[1], {})] if (e := ctx.estimate.latest()) else [], "1",
                             "Estimated acceptance length on held-out replies (one forward, no decoding).")
    replicas = {tdev: target}
    for d in tdevs:  # one frozen replica per target device; workers on one device share it
        if d not in replicas:
            replicas[d] = replicate_target(target, d)
            warm_up(replicas[d], batch_size=cfg.train.batch_size, seq_len=cfg.data.max_len, quiet=True)
    ctx.targets = [replicas[d] for d in tdevs]
    ctx.vote = dist_mod.StopVote(world)
    ctx.warmup_s = warmup_s
    return ctx


def _local(dev: str) -> str:
    """Plain `cuda` under torchrun means this rank's GPU (LOCAL_RANK)."""
    return f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if dev == "cuda" else dev


def run_eval(ctx: RunContext, label: str) -> dict:
    from ..model.evaluate import describe_lossless, evaluate

    e = ctx.cfg.eval
    drafter = ctx.step.drafter
    if next(drafter.parameters()).device != ctx.target.device:  # eval beside the target; training copy stays
        import copy
        drafter = copy.deepcopy(drafter).to(ctx.target.device)
    res = evaluate(ctx.target, drafter, ctx.tokenizer, ctx.eval_convs, stop=ctx.stop,
                   prompts=e.prompts, max_new_tokens=e.max_new_tokens, max_prompt_len=e.max_prompt_len,
                   temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, seed=ctx.cfg.train.seed)
    print(f"tau {label}: {res['acceptance_length']:.3f} (block {res['block_size']}, "
          f"{res['prompts']} prompts, {res['dtype']}, {describe_lossless(res)})"
          + (" [interrupted]" if res["interrupted"] else ""), file=sys.stderr)
    return res


def eval_command(cfg: Config) -> str:
    """The command that runs the eval an interrupted run skipped."""
    return f"dflash eval --checkpoint {Path(cfg.out) / 'checkpoint'}"


def summarize(ctx: RunContext, wall: float, step0: int, tokens0: int) -> dict:
    """The training part of summary.json (every drafter rank calls it: the sums are collective)."""
    cfg = ctx.cfg
    losses = [h[1] for h in ctx.history]
    # every rank trains on its own share of each global batch: totals are sums
    tokens = int(dist_mod.sum_over_ranks(ctx.tokens, ctx.vote.group))
    tokens_run = int(dist_mod.sum_over_ranks(ctx.tokens - tokens0, ctx.vote.group))
    return {
        "rank": ctx.rank, "lead": ctx.is_lead, "steps": ctx.step.step, "steps_this_run": ctx.step.step - step0,
        "tokens": tokens, "tokens_this_run": tokens_run, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens_run / wall, 1) if wall > 0 else 0.0,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "acc_last": ctx.history[-1][2] if ctx.history else None,
        "loss_history": [[h[0], round(h[1], 6)] for h in ctx.history],
        "nonfinite_steps": ctx.nonfinite_steps, "interrupted": ctx.stop.is_set(),
        "target": cfg.model.target, "pipelined": cfg.pipeline.pipelined,
        "world_size": ctx.world_size, "train_samples": len(ctx.samples),
    }


def balance_from_files(out: Path) -> dict | None:
    """The balance answer (analysis/balance.py) from this run's span files, as `dflash
    stalls` computes it; None when spans went only to an OTLP endpoint (ask Jaeger then)."""
    from ..analysis.balance import balance
    from ..analysis.stalls import load_run, select_run
    from ..config import ConfigError
    try:
        _, spans = select_run(load_run(out))
    except ConfigError:
        return None
    return balance(spans)


def train(cfg: Config, *, resume: bool = False, eval_before_after: bool = False) -> dict:
    if cfg.pipeline.layout:  # roles by rank under torchrun: a different set-up, the same stages
        from .roles.run import train_with_layout
        return train_with_layout(cfg, resume=resume)
    from .loop import run_reference
    from .pipeline import run_pipelined

    from .. import wandb_bridge

    ctx = setup(cfg, resume=resume)
    if ctx.rank == 0:
        dump(cfg, ctx.out / "config.yaml")
    bridge = wandb_bridge.start(ctx)  # its own thread; None unless --wandb (rank 0)
    summary: dict = {}
    prev = signal.getsignal(signal.SIGINT)

    def on_sigint(signum, frame):  # first Ctrl-C: stop after the current step and save
        if ctx.stop.is_set():
            raise KeyboardInterrupt
        print("\ninterrupt: finishing the current step, then saving a checkpoint", file=sys.stderr)
        ctx.stop.set()

    prev_term = signal.getsignal(signal.SIGTERM)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGTERM, on_sigint)  # preemption / torchrun shutdown: save too
    try:
        if eval_before_after and cfg.eval.before:
            summary["eval_before"] = run_eval(ctx, "before training")
        t0 = time.perf_counter()
        tokens0, step0 = ctx.tokens, ctx.step.step
        if ctx.estimate is not None:  # the curve's first point: where training starts from
            ctx.estimate(ctx.step.step)
        loop = run_pipelined if cfg.pipeline.pipelined else run_reference
        loop(ctx)
        ctx.finish_readback()
        wall = time.perf_counter() - t0
        save(ctx)
        wait_for_checkpoint(ctx)  # the run's result is on disk before anything else happens
        summary.update(summarize(ctx, wall, step0, tokens0))
        if ctx.estimate is not None:
            summary["acceptance_estimate"] = ctx.estimate.summary()
        if ctx.rank == 0 and ctx.history:
            from ..analysis.learning_curve import write_png
            write_png(ctx.out / "learning_curve.png", ctx.history, ctx.estimate.history if ctx.estimate else [],
                      cfg.model.block_size, f"{cfg.model.target}: drafter training")
        if ctx.warmup_s is not None:
            summary["warmup_s"] = round(ctx.warmup_s, 2)
        if ctx.writer is not None:  # off the drafter's path, but worth knowing
            summary["checkpoint_write_s"] = round(ctx.writer.last_write_s, 3)
        if eval_before_after and ctx.stop.is_set():
            # preempted: the grace period (30 s on Kubernetes) is for saving, not for an eval
            summary["eval_after"] = {"skipped": "interrupted", "command": eval_command(cfg)}
            if ctx.rank == 0:
                print(f"eval after training skipped (interrupted); run it with: {eval_command(cfg)}",
                      file=sys.stderr)
        elif eval_before_after:
            summary["eval_after"] = run_eval(ctx, "after training")
        if ctx.rank == 0 and summary.get("steps") is not None:  # a servable copy: OUT/export/ (or why not)
            from ..export import export_after_run
            summary["export"] = export_after_run(ctx, summary)
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, prev)
            signal.signal(signal.SIGTERM, prev_term)
        _linger_for_scrape(ctx.tel)
        ctx.tel.shutdown(timeout_s=2.0)
        summary["telemetry"] = ctx.tel.summary()
        if ctx.is_lead and summary.get("steps") is not None:
            summary["balance"] = balance_from_files(ctx.out)
        dist_mod.shutdown()
        if bridge is not None:  # bounded; falls back to OUT/wandb_fallback.jsonl
            try:
                bridge.close(summary)
            except Exception as e:
                print(f"dflash: W&B bridge: {wandb_bridge.redact(repr(e))}", file=sys.stderr)
    if ctx.rank == 0:
        (ctx.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
