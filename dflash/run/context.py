"""`RunContext`: everything a training loop needs, built once by `train.setup`.

Its own module so the loops, the end-of-step path and checkpoint saving can share it
without importing `train.py` (which imports them)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..config import Config
from ..data import dataset as data_mod
from ..model.trainer import Batch, DrafterStep
from .readback import DeferredScalars


@dataclass
class RunContext:
    """Everything a loop needs; built once by `setup`."""
    cfg: Config
    tel: object
    target: object
    tokenizer: object
    layer_ids: list[int]
    step: DrafterStep
    samples: list
    eval_convs: list
    out: Path
    rank: int = 0
    world_size: int = 1
    start_step: int = 0
    history: list = field(default_factory=list)      # (step, loss, acc, grad_norm)
    readback: DeferredScalars = field(default_factory=DeferredScalars)
    stop: threading.Event = field(default_factory=threading.Event)   # Ctrl-C: finish the step, save
    tokens: int = 0
    nonfinite: list = field(default_factory=list)    # steps whose update was skipped
    targets: list = field(default_factory=list)      # one target replica per target worker
    vote: object = None                              # distributed.StopVote
    estimate: object = None                          # acceptance_estimate.AcceptanceEstimate, if enabled
    writer: object = None                            # checkpoint.CheckpointWriter (rank 0, first save)
    warmup_s: float | None = None                    # CUDA kernel warm-up before anything was timed
    lead: bool | None = None                         # saves and summarises; None: rank 0
    worker: str = "drafter0"                         # this process's drafter worker (span attribute)

    @property
    def is_lead(self) -> bool:
        return self.rank == 0 if self.lead is None else self.lead

    @property
    def nonfinite_steps(self) -> int:
        return len(self.nonfinite)

    def more_steps(self) -> bool:
        t = self.cfg.train
        end = min(t.steps, t.stop_after) if t.stop_after else t.steps
        stop = self.vote(self.stop.is_set())  # every rank votes every step: same stop step everywhere
        return self.step.step < end and not stop

    def batch_stream(self):
        """Deterministic batches of this rank; skips what a resumed run already consumed."""
        shard = self.samples[self.rank::self.world_size]
        it = data_mod.batches(shard, batch_size=self.cfg.train.batch_size, seed=self.cfg.train.seed,
                              pad_id=self.tokenizer.pad_token_id, start=self.start_step)
        for i, d in enumerate(it, start=self.start_step):
            b = Batch.from_dict(d)
            b.index = i  # the step that consumes it: one global batch = every rank's share
            yield b

    def record(self, step: int, loss, acc, gnorm, nonfinite):
        """Called on the drafter thread after each optimizer step: no host read here."""
        # every step: one tiny async copy; gives the exact loss trajectory and non-finite steps
        self.readback.put(step, loss=loss, acc=acc, grad_norm=gnorm, nonfinite=nonfinite)
        for s, v in self.readback.ready():
            self._log(s, v)

    def _log(self, s, v):
        self.history.append((s, v["loss"], v["acc"], v["grad_norm"]))
        if v["nonfinite"]:
            self.nonfinite.append(s)

    def finish_readback(self):
        for s, v in self.readback.drain_blocking():
            self._log(s, v)
