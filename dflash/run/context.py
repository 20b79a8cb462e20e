"""A run in two typed parts, both built once by setup.py:

    RunSpec   what the run is, fixed once set up (frozen): the configuration, the placement,
              paths and ids, the data it trains on;
    RunState  what changes while it trains: the training step (drafter, optimizer, schedule),
              the target replicas, tokens, loss history, the stop flags, the telemetry handle.

Their own module so the workers, the step end and checkpoint saving share them without
importing trainer.py or setup.py (which import those). Nothing here imports the modules
whose types it names (the `TYPE_CHECKING` imports): they sit below it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from ..config import Config
from ..data import dataset as data_mod
from .placement import Placement
from .readback import DeferredScalars

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from otel import TelemetryAPI

    from ..data.batch import Batch
    from ..data.sample import Sample
    from ..checkpoint.checkpoint import CheckpointWriter
    from ..model.feature_cache import FeatureCache
    from ..offline.feature_shards import FeatureStore
    from ..offline.train_from_features import FeatureSide
    from .acceptance_estimate import AcceptanceEstimate
    from .distributed import StopVote
    from .roles.handoff import Groups
    from .roles.sync_timing import SyncTimer
    from .step import TrainStep


@dataclass(frozen=True)
class RunSpec:
    cfg: Config
    placement: Placement
    out: Path
    run_id: str
    tokenizer: PreTrainedTokenizerBase
    layer_ids: list[int]
    feature_ids: list[int]        # what the target side captures per token (model/losses.py `feature_ids`)
    start_step: int               # 0, or where a resumed run goes on
    target_config: PretrainedConfig   # the target's HF config (kept where the target is not)
    samples: list[Sample]         # this run's training samples (all ranks; each takes its shard)
    held_out: list[Sample] = field(default_factory=list)  # kept out of training for the estimate (capture runs)
    eval_convs: list[list[dict]] = field(default_factory=list)  # held-out conversations: eval prompts
    feature_store: FeatureStore | None = None  # train --features: the captured rows
    groups: Groups | None = None  # a layout's process groups
    warmup_s: float | None = None  # CUDA kernel warm-up before anything was timed
    regen_counts: dict[str, float] = field(default_factory=dict)  # regeneration: regenerated / cached / total / seconds
    memory: dict = field(default_factory=dict)  # the memory check's estimate (preflight/memory.py)

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

    def batch_stream(self) -> Iterator[Batch]:
        """Deterministic batches of this rank (batch id == the step that consumes it); skips
        what a resumed run already consumed."""
        shard = self.samples[self.rank::self.world_size]
        stream = data_mod.batches(shard, batch_size=self.cfg.train.batch_size, seed=self.cfg.train.seed,
                                  pad_id=self.tokenizer.pad_token_id, start=self.start_step)
        # train --features: each batch reads its captured rows as it is loaded (data_load)
        return stream if self.feature_store is None else map(self.feature_store.attach, stream)


@dataclass
class RunState:
    tel: TelemetryAPI
    train_step: TrainStep | None = None   # drafter roles: the drafter, its optimizer and schedule
    targets: list[PreTrainedModel | FeatureSide] = field(default_factory=list)  # one frozen replica per target worker
    feature_caches: list[FeatureCache | None] = field(default_factory=list)  # train.feature_cache: one per target worker
    vote: StopVote | None = None          # ranks that stop together; None alone
    sync_timer: SyncTimer | None = None   # a layout's drafter: DDP all-reduce wait
    estimate: AcceptanceEstimate | None = None  # train.estimate_every
    writer: CheckpointWriter | None = None  # the lead, from its first save
    tokens: int = 0
    history: list[tuple[int, float, float, float]] = field(default_factory=list)  # (step, loss, acc, grad_norm)
    nonfinite: list[int] = field(default_factory=list)   # steps whose update was skipped
    readback: DeferredScalars = field(default_factory=DeferredScalars)
    stop: threading.Event = field(default_factory=threading.Event)          # a signal: finish the step, save
    workers_stop: threading.Event = field(default_factory=threading.Event)  # end or failure: workers leave
    target_counts: dict[str, float] = field(default_factory=dict)  # a layout's target rank: what it made and sent

    @property
    def target(self) -> PreTrainedModel | FeatureSide | None:
        return self.targets[0] if self.targets else None

    @property
    def vote_group(self) -> torch.distributed.ProcessGroup | None:
        """The group end-of-run sums go over (None: this rank alone)."""
        return self.vote.group if self.vote is not None else None

