"""Checkpoint saving: `save` (every rank calls it; rank 0 snapshots and hands the write to
a background writer) and `wait_for_checkpoint` (end of run). Used by `train.py` and by the
end-of-step path (`step_end.py`); imports neither."""
from __future__ import annotations

from ..checkpoint import checkpoint as ckpt
from . import distributed as dist_mod
from .context import RunContext


def save(ctx: RunContext) -> None:
    ctx.finish_readback()  # the saved loss history must include every step so far
    tokens = int(dist_mod.sum_over_ranks(ctx.tokens, ctx.vote.group))  # every rank calls save
    if not ctx.is_lead:
        return
    state = {"step": ctx.trainer.step, "tokens": tokens, "history": ctx.history}
    if ctx.writer is None:
        ctx.writer = ckpt.CheckpointWriter(ctx.tel)
    # the drafter's thread only takes a device-side snapshot; the writer thread does the
    # device->host copy and the atomic write (waiting here only if the last one still runs)
    with ctx.tel.stage("checkpoint", worker=ctx.worker, step=ctx.trainer.step):
        snap = ckpt.snapshot(ctx.trainer.drafter, run_config=ctx.cfg.to_dict(), state=state,
                             training_state=ctx.trainer.state())
        ctx.writer.submit(ctx.out / "checkpoint", snap)


def wait_for_checkpoint(ctx: RunContext) -> None:
    """Block until the last checkpoint is on disk (end of run); re-raises a failed write."""
    if ctx.writer is not None:
        ctx.writer.wait()
