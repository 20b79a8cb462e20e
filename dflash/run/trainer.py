"""`dflash train`, one trainer for every placement: set up -> run the workers -> finish.

    setup.py     join the ranks (placement.py says what this process does), load the
                 target, prepare the data, build or resume the drafter, make the telemetry;
    run_loop.py  build this process's workers (target_worker.py, drafter_worker.py) and
                 the channel that joins them (channels.py), run them to the last step;
    here         signals, the evals, checkpoint, summary, end of telemetry.

A layout only changes which workers a process builds and which channel joins them.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import torch

from ..config import Config, dump
from . import distributed as dist_mod
from .context import RunContext
from .run_loop import run_loop
from .saving import save, wait_for_checkpoint
from .setup import setup
from .summary import balance_from_files, rank_reports, summarize
from .telemetry_setup import linger_for_scrape


def run_eval(ctx: RunContext, label: str, *, served: bool = False, checked: dict | None = None) -> dict:
    """tau of the drafter as it is (`served=False`: before training; a copy head, if on, included),
    or of the drafter a user serves (`served`: OUT/export's weights, no copy head) beside prompt
    lookup on the same prompts (eval.baseline). `checked`: an eval of the same prompts whose
    outputs were checked against the target's greedy decode: this one's are compared with
    those instead of decoding the reference again (a greedy decode saved per prompt)."""
    from ..decode.evaluate import describe_lossless, evaluate

    e = ctx.cfg.eval
    drafter = ctx.trainer.drafter
    if served:
        from ..checkpoint.export import served_drafter
        drafter = served_drafter(drafter, ctx.target.device)
    elif next(drafter.parameters()).device != ctx.target.device:  # eval beside the target; training copy stays
        drafter = copy.deepcopy(drafter).to(ctx.target.device)
    res = evaluate(ctx.target, drafter, ctx.tokenizer, ctx.eval_convs, stop=ctx.stop,
                   prompts=e.prompts, max_new_tokens=e.max_new_tokens, max_prompt_len=e.max_prompt_len,
                   temperature=e.temperature, top_p=e.top_p, top_k=e.top_k, seed=ctx.cfg.train.seed,
                   baseline=e.baseline if served else "none",
                   check_lossless=not (checked and checked.get("lossless") is not None))
    if checked and checked.get("lossless") is not None:  # equal outputs: lossless exactly when those were
        same = [a["output_ids"] == b["output_ids"] for a, b in zip(res["per_prompt_steps"], checked["per_prompt_steps"])]
        res["lossless"] = checked["lossless"] and all(same)
        res["lossless_divergent_prompts"] = res["lossless_mismatches"] = same.count(False)
    if served:
        res["served"] = True  # OUT/export's drafter: no copy head, its export dtype's weights
    if drafter.copy is not None:
        res["copy_head"] = drafter.copying
    base = res.get("baseline")
    print(f"tau {label}: {res['acceptance_length']:.3f} (block {res['block_size']}, "
          f"{res['prompts']} prompts, {res['dtype']}, {describe_lossless(res)})"
          + (f"; prompt lookup on the same prompts: {base['acceptance_length']:.3f}" if base else "")
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
    from .. import trackers

    ctx = setup(cfg, resume=resume)
    place, out = ctx.placement, ctx.out
    if place.lead:
        dump(cfg, out / "config.yaml")
    report = _rank_report(ctx) if place.layout is not None else None
    bridge = trackers.start(ctx) if place.has_drafter else None  # --tracker/--wandb, the lead: own threads
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
    if bridge is not None:  # bounded; falls back to OUT/<tracker>_fallback.jsonl
        try:
            bridge.close(summary)
            summary["trackers"] = bridge.status()
        except Exception as e:
            from ..trackers.redaction import redact
            print(f"dflash: tracker bridge: {redact(repr(e))}", file=sys.stderr)
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
        best = ctx.estimate.keeper.finish() if ctx.estimate.keeper is not None else None
        if best is not None:  # OUT/best/checkpoint + OUT/best/export: which step, and its estimate
            summary["best"] = best
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
        # the headline: the drafter OUT/export holds (what a user serves), beside prompt lookup
        summary["eval_after"] = run_eval(ctx, "after training (served drafter)", served=True)
        if ctx.trainer.drafter.copying and not ctx.stop.is_set():  # the copy head's own figure
            summary["eval_after_copy_head"] = run_eval(ctx, "after training, with the copy head",
                                                       checked=summary["eval_after"])
        if ctx.stop.is_set():  # a signal during the eval: its figure is partial, and the run says so
            summary["interrupted"] = True
            if ctx.rank == 0:
                print(f"eval after training interrupted: tau above is partial; run it whole with: "
                      f"{eval_command(cfg)}", file=sys.stderr)
    if ctx.is_lead and ctx.history:  # after the eval: the picture shows its served tau beside prompt lookup's
        from ..analysis.learning_curve import write_png
        where = f" ({ctx.placement.layout})" if ctx.placement.layout is not None else ""
        write_png(ctx.out / "learning_curve.png", ctx.history, ctx.estimate.history if ctx.estimate else [],
                  cfg.model.block_size, f"{cfg.model.target}: drafter training{where}", final=summary.get("eval_after"))
    if ctx.is_lead:  # a servable copy: OUT/export/ (or why not)
        from ..checkpoint.export import export_after_run
        summary["export"] = export_after_run(ctx, summary)


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
