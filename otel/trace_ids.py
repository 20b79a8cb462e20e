"""Deterministic trace/span ids, so every process of a run derives the same ids for a key.

A key is (kind, id), e.g. ("batch", 17). Its trace id and the span id of its root span
are hashes of (run_id, kind, id): the stages of one batch recorded by different threads,
devices and ranks join one trace, and a link to ("batch", 17) points at a real root span.
"""
from __future__ import annotations

import hashlib
import random

_rng = random.SystemRandom()


def _digest(run_id: str, kind: str, key_id, salt: bytes) -> bytes:
    data = f"{run_id}\x1f{kind}\x1f{key_id}".encode()
    return hashlib.blake2b(data, digest_size=16, person=salt).digest()


def trace_id_for(run_id: str, kind: str, key_id) -> int:
    """128-bit trace id of a key; never 0 (0 is the invalid id)."""
    return int.from_bytes(_digest(run_id, kind, key_id, b"otel.trace"), "big") or 1


def root_span_id_for(run_id: str, kind: str, key_id) -> int:
    """64-bit span id of the key's root span; never 0."""
    return int.from_bytes(_digest(run_id, kind, key_id, b"otel.root")[:8], "big") or 1


def random_trace_id() -> int:
    return _rng.getrandbits(128) or 1


def random_span_id(rng=random.Random()) -> int:
    # A seeded-at-import Mersenne generator is plenty for span ids and ~20x faster than
    # SystemRandom; uniqueness within a trace is all that matters.
    return rng.getrandbits(64) or 1


class KeyIds:
    """Small cache of key -> (trace_id, root_span_id); bounded so long runs don't grow."""

    def __init__(self, run_id: str, max_entries: int = 65536):
        self.run_id = run_id
        self._cache: dict = {}
        self._max = max_entries

    def __call__(self, key) -> tuple[int, int]:
        ids = self._cache.get(key)
        if ids is None:
            kind, key_id = key
            ids = (trace_id_for(self.run_id, kind, key_id), root_span_id_for(self.run_id, kind, key_id))
            if len(self._cache) >= self._max:
                self._cache.clear()
            self._cache[key] = ids
        return ids
