"""What a run reports: summary.json's training part (every drafter rank calls it: the
sums are collective), the balance answer from the run's span files, the ranks' reports."""
from __future__ import annotations

import json
import time
from pathlib import Path

from . import distributed as dist_mod


def summarize(ctx, wall: float, step0: int, tokens0: int) -> dict:
    cfg = ctx.cfg
    losses = [h[1] for h in ctx.history]
    # every rank trains on its own share of each global batch: totals are sums
    tokens = int(dist_mod.sum_over_ranks(ctx.tokens, ctx.vote.group))
    tokens_run = int(dist_mod.sum_over_ranks(ctx.tokens - tokens0, ctx.vote.group))
    step = ctx.trainer.step
    out = {
        "rank": ctx.rank, "lead": ctx.is_lead, "steps": step, "steps_this_run": step - step0,
        "tokens": tokens, "tokens_this_run": tokens_run, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens_run / wall, 1) if wall > 0 else 0.0,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "acc_last": ctx.history[-1][2] if ctx.history else None,
        "loss_history": [[h[0], round(h[1], 6)] for h in ctx.history],
        "nonfinite_steps": ctx.nonfinite_steps, "interrupted": ctx.stop.is_set(),
        "target": cfg.model.target, "pipelined": cfg.pipeline.pipelined,
        "world_size": ctx.world_size, "train_samples": len(ctx.samples),
    }
    if c := ctx.regen_counts:  # regeneration, all ranks: replies made this run, found cached, distinct prompts
        out["data"] = {"regenerated": c["regenerated"], "regen_cached": c["cached"], "regen_total": c["total"],
                       "regen_s": c["seconds"]}
    return out


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


def rank_reports(out: Path, world: int) -> list:
    """Every rank's OUT/ranks/rank{r}.json, as far as written (they end at about the same time)."""
    deadline = time.monotonic() + 30
    reps = []
    for r in range(world):
        f = out / "ranks" / f"rank{r}.json"
        while not f.is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        if f.is_file():
            try:
                reps.append(json.loads(f.read_text()))
            except (ValueError, RecursionError):
                reps.append({"rank": r, "missing": True})
    return reps
