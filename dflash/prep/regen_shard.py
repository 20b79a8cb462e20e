"""Who regenerates what under torchrun: the ranks that hold a target split the prompts
no rank has yet, and the replies are gathered over torch.distributed (no shared file system
assumed: each rank's disk cache serves its own resume).

Every participating rank calls the same collectives in the same order: ``agree`` (which
keys some rank already has) then ``gather`` (the replies). Ranks outside the group (a
layout's drafter ranks) call neither.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import interruptible


@dataclass
class Shard:
    index: int = 0           # this rank's position among the regenerating ranks
    count: int = 1
    group: object = None     # a gloo group of exactly those ranks (None: one process, no collectives)
    dst: int | None = None   # global rank that receives everything; None: every rank does

    def agree(self, have: set[str]) -> list[set[str]]:
        """Each rank's cached keys, in rank order (what each one can contribute)."""
        if self.count == 1:
            return [have]
        import torch.distributed as dist

        boxes: list = [None] * self.count
        interruptible(dist.all_gather_object, boxes, sorted(have), group=self.group)  # a signal still stops us
        return [set(b) for b in boxes]

    def mine(self, pending: list) -> list:
        """This rank's part of the length-sorted pending prompts: every count-th one, so each
        rank gets the same mix of short and long prompts (similar time per rank)."""
        return pending[self.index::self.count]

    def gather(self, records: dict) -> dict | None:
        """Every rank's records merged; None on a rank that is not ``dst``."""
        if self.count == 1:
            return records
        import torch.distributed as dist

        if self.dst is None:
            boxes: list = [None] * self.count
            interruptible(dist.all_gather_object, boxes, records, group=self.group)
        else:  # the slowest shard's rank is waited for here: a signal still stops the others
            boxes = [None] * self.count if dist.get_rank() == self.dst else None
            interruptible(dist.gather_object, records, boxes, dst=self.dst, group=self.group)
            if boxes is None:
                return None
        merged: dict = {}
        for b in boxes:
            merged.update(b)
        return merged


SOLO = Shard()
