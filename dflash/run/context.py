"""`RunContext`: everything a run's workers need, built once by `trainer.setup`.

Its own module so the workers, the end-of-step path and checkpoint saving can share it
without importing `trainer.py` or `setup.py` (which import them)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path

from otel import TelemetryAPI

from ..config import Config
from ..data import dataset as data_mod
from .step import TrainStep
from .placement import Placement
from .readback import DeferredScalars


@dataclass
class RunContext:
    cfg: Config
    tel: TelemetryAPI | None
    placement: Placement
    tokenizer: object
    layer_ids: list[int]
    samples: list
    out: Path
    trainer: TrainStep | None = None              # drafter roles: drafter, optimizer, schedule
    eval_convs: list = field(default_factory=list)
    targets: list = field(default_factory=list)        # one frozen replica per target worker
    feature_caches: list = field(default_factory=list)  # train.feature_cache: one per target worker
    start_step: int = 0
    history: list = field(default_factory=list)      # (step, loss, acc, grad_norm)
    readback: DeferredScalars = field(default_factory=DeferredScalars)
    stop: threading.Event = field(default_factory=threading.Event)          # a signal: finish the step, save
    workers_stop: threading.Event = field(default_factory=threading.Event)  # end or failure: workers leave
    tokens: int = 0
    nonfinite: list = field(default_factory=list)    # steps whose update was skipped
    vote: object = None                              # distributed.StopVote
    estimate: object = None                          # acceptance_estimate.AcceptanceEstimate, if enabled
    writer: object = None                            # checkpoint.CheckpointWriter (the lead, first save)
    warmup_s: float | None = None                    # CUDA kernel warm-up before anything was timed
    groups: object = None                            # a layout's process groups (roles/handoff.Groups)
    run_id: str = ""
    held_out: list = field(default_factory=list)     # samples kept out of training for the estimate
    sync_timer: object = None                        # a layout's drafter: DDP all-reduce wait (sync_timing)
    target_counts: dict = field(default_factory=dict)  # a layout's target rank: what it made and sent
    target_config: object = None                     # the target's HF config (kept where the target is not)
    feature_store: object = None                     # train --features: offline/feature_shards.FeatureStore
    regen_counts: dict = field(default_factory=dict)  # regeneration: regenerated / cached / total / seconds


    @property
    def rank(self) -> int:
        return self.placement.rank

    @property
    def world_size(self) -> int:
        """Ranks that train the drafter together (their batches, tokens and votes)."""
        return self.placement.drafter_world

    @property
    def is_lead(self) -> bool:
        return self.placement.lead

    @property
    def worker(self) -> str:
        return self.placement.worker

    @property
    def feature_ids(self) -> list[int]:
        """What the target side captures per token: `layer_ids`, plus the target's last hidden
        state when the loss needs its distribution (run/step.py `feature_ids`)."""
        from .step import feature_ids
        return feature_ids(self.cfg.train, self.layer_ids, self.feature_store is not None)

    @property
    def target(self):
        return self.targets[0] if self.targets else None

    @property
    def nonfinite_steps(self) -> int:
        return len(self.nonfinite)

    def more_steps(self) -> bool:
        t = self.cfg.train
        end = min(t.steps, t.stop_after) if t.stop_after else t.steps
        stop = self.vote(self.stop.is_set())  # every rank votes every step: same stop step everywhere
        return self.trainer.step < end and not stop

    def batch_stream(self):
        """Deterministic batches of this rank (batch id == the step that consumes it); skips
        what a resumed run already consumed."""
        shard = self.samples[self.rank::self.world_size]
        stream = data_mod.batches(shard, batch_size=self.cfg.train.batch_size, seed=self.cfg.train.seed,
                                  pad_id=self.tokenizer.pad_token_id, start=self.start_step)
        # train --features: each batch reads its captured rows as it is loaded (data_load)
        return stream if self.feature_store is None else map(self.feature_store.attach, stream)

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
