"""What a run reports: summary.json's training part (every drafter rank calls it: the
sums are collective), the balance answer from the run's span files, a layout rank's own
report and the ranks' reports."""
from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import torch
from otel.confined import write_text

from . import distributed as dist_mod
from .context import RunSpec, RunState


def summarize(spec: RunSpec, state: RunState, wall: float, step0: int, tokens0: int) -> dict:
    cfg = spec.cfg
    losses = [h[1] for h in state.history]
    # every rank trains on its own share of each global batch: totals are sums
    tokens = int(dist_mod.sum_over_ranks(state.tokens, state.vote_group))
    tokens_run = int(dist_mod.sum_over_ranks(state.tokens - tokens0, state.vote_group))
    step = state.train_step.step
    out = {
        "rank": spec.rank, "lead": spec.is_lead, "steps": step, "steps_this_run": step - step0,
        "tokens": tokens, "tokens_this_run": tokens_run, "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens_run / wall, 1) if wall > 0 else 0.0,
        "loss_first": losses[0] if losses else None, "loss_last": losses[-1] if losses else None,
        "acc_last": state.history[-1][2] if state.history else None,
        "loss_history": [[h[0], round(h[1], 6)] for h in state.history],
        "nonfinite_steps": len(state.nonfinite), "interrupted": state.stop.is_set(),
        "target": cfg.model.target, "pipelined": cfg.pipeline.pipelined,
        "world_size": spec.world_size, "train_samples": len(spec.samples),
    }
    if c := spec.regen_counts:  # regeneration, all ranks: replies made this run, found cached, distinct prompts
        out["data"] = {"regenerated": c["regenerated"], "regen_cached": c["cached"], "regen_total": c["total"],
                       "regen_s": c["seconds"]}
    return out


def balance_from_files(out: Path) -> dict | None:
    """The balance answer (analysis/balance.py) from this run's span files, as `dflash
    stalls` computes it; None when spans went only to an OTLP endpoint (ask Jaeger then)."""
    from ..analysis.balance import balance
    from ..analysis.stalls import load_run, select_run
    from ..errors import ConfigError
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


def rank_report(spec: RunSpec, state: RunState) -> dict:
    """A layout rank's OUT/ranks/rank{r}.json: role, device, what it really holds."""
    place = spec.placement
    (spec.out / "ranks").mkdir(exist_ok=True)
    write_text(spec.out / "ranks" / f"rank{place.rank}.pid", str(os.getpid()), inside=spec.out)
    rep = {"rank": place.rank, "role": place.role, "index": place.index,
           "device": place.drafter_device or place.target_devices[0], "layout": str(place.layout),
           "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "host": socket.gethostname(),
           "held_parameters": held_parameters()}
    if place.has_target:
        rep["target_parameters"] = sum(p.numel() for p in state.target.parameters())
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
