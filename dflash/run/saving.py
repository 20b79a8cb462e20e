"""Checkpoint saving: `save` (every rank calls it; the lead snapshots and hands the write to
a background writer) and `wait_for_checkpoint` (end of run). Used by the trainer
(trainer.py) and by the end-of-step path (workers.py `StepEnd`); imports neither."""
from __future__ import annotations

from ..checkpoint import checkpoint as ckpt
from . import distributed as dist_mod
from . import readback
from .context import RunSpec, RunState


def save(spec: RunSpec, state: RunState, *, final: bool = False) -> None:
    """``final``: the run's last save, which the caller waits for before anything else
    touches the drafter: written from the live tensors, no snapshot copy."""
    readback.finish(state)  # the saved loss history must include every step so far
    tokens = int(dist_mod.sum_over_ranks(state.tokens, state.vote_group))  # every rank calls save
    if not spec.is_lead:
        return
    st = state.train_step
    saved = {"step": st.step, "tokens": tokens, "history": state.history}
    if state.estimate is not None:  # the points collected so far (one still in flight is not waited for)
        saved["estimate_history"] = state.estimate.saved()
    if state.writer is None:
        state.writer = ckpt.CheckpointWriter(state.tel)
    # the drafter's thread only takes a device-side snapshot; the writer thread does the
    # device->host copy and the atomic write (waiting here only if the last one still runs)
    with state.tel.stage("checkpoint", worker=spec.worker, step=st.step):
        # the last write done before the copy, not after: never two snapshots in memory at once
        # (submit would wait for it anyway; the weights do not change while this thread waits)
        state.writer.wait()
        snap = ckpt.snapshot(st.drafter, run_config=spec.cfg.to_dict(), state=saved, training_state=st.state(),
                             copy=not final)
        state.writer.submit(spec.out / "checkpoint", snap)


def wait_for_checkpoint(state: RunState) -> None:
    """Block until the last checkpoint is on disk (end of run); re-raises a failed write."""
    if state.writer is not None:
        state.writer.wait()
