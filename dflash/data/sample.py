"""One training sample, held compactly: int32 token ids and a uint8 loss mask.

Published drafters train on 0.3-0.8 M samples of up to a few thousand tokens, and every rank
holds all of them (rank 0 prepares and broadcasts them). As Python lists a token costs about
44 bytes (a pointer plus an int object per id, a pointer per mask entry); as two numpy
arrays it costs 5, and pickling them for the broadcast copies buffers instead of walking
objects (`python bench/sample_memory.py` measures both side by side).

`input_ids` and `loss_mask` still read as lists, for code that edits, prints or compares
them; the paths that touch every sample use `len()`, `loss_tokens` and the arrays (`ids`,
`mask`) instead, so no list is built there.
"""
from __future__ import annotations

import numpy as np


class Sample:
    __slots__ = ("ids", "mask")

    def __init__(self, input_ids, loss_mask):
        # int32 holds every vocabulary there is (numpy raises on a Python int that does not
        # fit; ids arrive as lists from the tokenizer or as int32 from a capture's shards)
        self.ids = np.asarray(input_ids, dtype=np.int32)
        self.mask = np.asarray(loss_mask, dtype=np.uint8)
        if self.ids.ndim != 1 or self.ids.shape != self.mask.shape:
            raise ValueError(f"a sample needs one loss-mask entry per token id "
                             f"(got shapes {self.ids.shape} and {self.mask.shape})")

    @property
    def input_ids(self) -> list[int]:
        return self.ids.tolist()

    @property
    def loss_mask(self) -> list[int]:
        return self.mask.tolist()

    @property
    def loss_tokens(self) -> int:
        return int(self.mask.sum(dtype=np.int64))

    def __len__(self) -> int:
        return int(self.ids.shape[0])

    def cut(self, max_len: int) -> "Sample":
        """The first ``max_len`` tokens, as a copy: a view would keep the whole sample alive."""
        return self if len(self) <= max_len else Sample(self.ids[:max_len].copy(), self.mask[:max_len].copy())

    def windows(self, max_len: int) -> list["Sample"]:
        """Consecutive pieces of at most ``max_len`` tokens (copies), the last one shorter."""
        return [Sample(self.ids[a:a + max_len].copy(), self.mask[a:a + max_len].copy())
                for a in range(0, len(self), max_len)]

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sample):
            return NotImplemented
        return np.array_equal(self.ids, other.ids) and np.array_equal(self.mask, other.mask)

    __hash__ = None  # mutable arrays inside, like the lists it replaced

    def __reduce__(self):
        # pickled as its two arrays (raw buffers); a slice of a shard is copied, not its shard
        return Sample, (np.ascontiguousarray(self.ids), np.ascontiguousarray(self.mask))

    def __repr__(self) -> str:
        return f"Sample({len(self)} tokens, {self.loss_tokens} with loss)"
