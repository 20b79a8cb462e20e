"""Each drafter rank's own stream of batches, rebuilt wherever it is needed.

Drafter rank d trains on `samples[d::M]` in the deterministic order of data.batches;
the target rank that makes batch (d, step) rebuilds the same stream from the same
samples and seed, so only hidden states ever cross the wire: a batch's token ids,
masks and lengths are known on both ends without being sent.
"""
from __future__ import annotations

from ...data import dataset as data_mod
from ...data.batch import Batch
from .layout import Layout


class ShardStreams:
    def __init__(self, samples, layout: Layout, *, batch_size: int, seed: int, pad_id: int, start_step: int):
        self.layout = layout
        # each batch built with its global id (trace key, anchors): layout.batch_id(step, d)
        self._its = [data_mod.batches(samples[d::layout.drafters], batch_size=batch_size, seed=seed,
                                      pad_id=pad_id, start=start_step, batch_id=lambda i, d=d: layout.batch_id(i, d))
                     for d in range(layout.drafters)]
        self._next = [start_step] * layout.drafters

    def get(self, d: int, step: int) -> Batch:
        """Batch `step` of drafter d's stream; steps must not go backwards for a given d."""
        if step < self._next[d]:
            raise ValueError(f"shard {d}: step {step} was already passed (at {self._next[d]})")
        while True:
            b = next(self._its[d])
            s = self._next[d]
            self._next[d] += 1
            if s == step:
                return b
