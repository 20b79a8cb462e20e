"""Who does what under torchrun: the role of each rank and where each batch goes.

`--layout target:N,drafter:M` (or `pipeline.layout`) gives the first N ranks the target
role and the next M the drafter role; N + M must equal torchrun's WORLD_SIZE. On one
8-GPU node `target:5,drafter:3` puts the frozen target on GPUs 0-4 and the drafters on
5-7 (each rank uses cuda:LOCAL_RANK); across nodes the ranks simply continue.

Batch assignment is a pure function of the layout, so a run and its resume see the same
batches in the same places. Global batch id g = step * M + d: drafter rank d trains on
it at `step` (its own shard of the data), and target rank g % N produces its hidden
states. Round robin keeps every target rank equally loaded and needs no coordination.

No torch here: the CLI validates a layout before anything heavy is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...config import DRAFTER, TARGET, LayoutError, parse_layout


@dataclass(frozen=True)
class Layout:
    targets: int
    drafters: int

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """'target:5,drafter:3' (either order, spaces allowed): config.parse_layout."""
        return cls(*parse_layout(text))

    def __str__(self) -> str:
        return f"target:{self.targets},drafter:{self.drafters}"

    @property
    def world_size(self) -> int:
        return self.targets + self.drafters

    def check_world(self, world_size: int) -> None:
        if world_size != self.world_size:
            raise LayoutError(f"pipeline.layout={str(self)!r} needs {self.world_size} ranks, "
                              f"but torchrun started WORLD_SIZE={world_size}")

    # -- ranks ---------------------------------------------------------------------------
    def role(self, rank: int) -> str:
        return TARGET if rank < self.targets else DRAFTER

    def target_rank(self, t: int) -> int:
        return t

    def drafter_rank(self, d: int) -> int:
        return self.targets + d

    def drafter_index(self, rank: int) -> int:
        return rank - self.targets

    @property
    def drafter_ranks(self) -> list[int]:
        return list(range(self.targets, self.world_size))

    # -- batches -------------------------------------------------------------------------
    def batch_id(self, step: int, d: int) -> int:
        return step * self.drafters + d

    def producer(self, g: int) -> int:
        """Target index that makes batch g."""
        return g % self.targets

    def consumer(self, g: int) -> tuple[int, int]:
        """(drafter index, step) that trains on batch g."""
        return g % self.drafters, g // self.drafters

    def batches_of_target(self, t: int, start_step: int, end_step: int):
        """Batch ids target t makes, in the order it makes them (increasing id)."""
        g = start_step * self.drafters
        g += (t - g) % self.targets
        while g < end_step * self.drafters:
            yield g
            g += self.targets
