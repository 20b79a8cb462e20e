"""A cheap learning curve for acceptance: every `train.estimate_every` steps, one no-grad
drafter forward over a fixed held-out batch, no decoding.

The held-out batch is a few regenerated samples kept out of training; their target
features are captured once at setup, so an estimate costs one drafter forward. For each
sampled anchor the drafter's greedy guesses for slots 1..B-1 are compared with the
labels, which are the target's own greedy tokens (regenerated replies). DFlash drafts all
slots of a block in parallel, so the number of leading correct slots is exactly what a
verify step would accept at that anchor: the mean of (leading correct + 1) is an estimate
of tau over the held-out replies, and the per-slot accuracies say where a block breaks.
(It skips decoding's feedback: real anchors are wherever the last verify stopped.)
A drafter with a copy head (model/copy_head.py) is scored with and without its copy
proposals, from the same forward: the curve shows what the drafter itself learned too.

Values come back through a deferred read-back (no host sync on the drafter's thread).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..config import derived_seed
from ..data import dataset as data_mod
from ..model.drafter import sample_anchors
from ..model.features import target_features
from .step import DeferredScalars, TrainStep

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..config import Config
    from ..data.sample import Sample
    from ..offline.feature_shards import FeatureStore
    from ..offline.train_from_features import FeatureSide
    from .best import BestKeeper

ESTIMATE_ANCHORS = 16   # per held-out sequence; the lm_head over every slot is most of the cost


class AcceptanceEstimate:
    def __init__(self, train_step: TrainStep, target: PreTrainedModel | FeatureSide, samples: list[Sample], *,
                 cfg: Config, pad_id: int, layer_ids: list[int], feature_store: FeatureStore | None, every: int):
        self.every = every
        self.train_step = train_step
        self.batch = next(data_mod.batches(samples, batch_size=len(samples), seed=cfg.train.seed,
                                           pad_id=pad_id, bucket=False))
        dev = self.train_step.device
        if feature_store is not None:  # train --features: the held-out rows were captured too
            feature_store.attach(self.batch)
        with torch.no_grad():
            self.features = target_features(target, self.batch, layer_ids, target.device).to(dev)
        g = torch.Generator().manual_seed(derived_seed(cfg.train.seed, 7919))
        anchors, valid = sample_anchors(self.batch.loss_mask, ESTIMATE_ANCHORS, cfg.model.block_size, generator=g)
        self.ids = self.batch.input_ids.to(dev)
        self.anchors, self.valid = anchors.to(dev), valid.to(dev)
        Bk = cfg.model.block_size
        pos = self.anchors[..., None] + torch.arange(1, Bk, device=dev)
        lm = self.batch.loss_mask.to(dev)
        self.label_ok = torch.gather(lm, 1, pos.clamp(max=self.ids.shape[1] - 1).view(self.ids.shape[0], -1)
                                     ).view_as(pos).bool() & self.valid[..., None]
        self.readback = DeferredScalars()
        self.history: list = []          # (step, tau_estimate, [accuracy of slot 1..B-1], tau without copies)
        self.keeper: BestKeeper | None = None  # run/best.py: keeps the best checkpoint by this estimate
        self.block_size = Bk

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    @torch.no_grad()
    def __call__(self, step: int) -> None:
        """Drafter thread, after an optimizer step: queue one estimate, collect finished ones."""
        st = self.train_step
        model = st.drafter
        was_training = model.training
        model.eval()
        try:
            own, hidden, labels = model.slot_outputs(self.features, self.ids, self.anchors, self.valid,
                                                     st.embed, st.lm_head)
            logits = model.add_copies(own, hidden, self.ids, self.anchors, st.lm_head)
        finally:
            model.train(was_training)
        tau, per_slot = self._score(logits, labels)
        extra = {"tau_no_copy": self._score(own, labels)[0]} if model.copying else {}
        self.readback.put(step, tau=tau, **extra, **{f"acc{k}": per_slot[k - 1] for k in range(1, self.block_size)})
        if self.keeper is not None:  # the weights this estimate judges, until its value is known
            self.keeper.queued(step)
        self.collect()

    def _score(self, logits, labels):
        """(tau estimate, per-slot accuracy) as device tensors."""
        ok = self.label_ok
        correct = (logits.argmax(-1) == labels) & ok
        blocks = ok[..., 0]                                   # anchors whose slot 1 is a reply token
        leading = correct.int().cumprod(-1).sum(-1).float()   # accepted drafts per block
        n = blocks.sum().clamp_min(1)
        tau = 1.0 + (leading * blocks).sum() / n
        return tau, correct.float().sum((0, 1)) / ok.float().sum((0, 1)).clamp_min(1)

    def collect(self, blocking: bool = False) -> list:
        done = self.readback.drain_blocking() if blocking else self.readback.ready()
        for s, v in done:
            self.history.append((s, v["tau"], [v[f"acc{k}"] for k in range(1, self.block_size)],
                                 v.get("tau_no_copy")))
            if self.keeper is not None:  # judged as served: without a copy head's proposals
                self.keeper.result(s, v["tau_no_copy"] if v.get("tau_no_copy") is not None else v["tau"])
        return done

    def latest(self):
        return self.history[-1] if self.history else None

    def summary(self) -> dict:
        self.collect(blocking=True)
        out = {"every": self.every, "held_out_sequences": len(self.batch.lengths),
               "history": [[s, round(t, 4)] for s, t, *_ in self.history], "last": None}
        if self.history:
            step, tau, slots, no_copy = self.history[-1]
            out["last"] = {"step": step, "tau": round(tau, 4), "slot_accuracy": [round(a, 4) for a in slots]}
            if no_copy is not None:  # a copy head's drafter: the same estimate without its proposals
                out["history_no_copy"] = [[s, round(nc, 4)] for s, _, _, nc in self.history]
                out["last"]["tau_no_copy"] = round(no_copy, 4)
        return out
