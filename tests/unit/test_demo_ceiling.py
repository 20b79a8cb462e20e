"""bench/demo_ceiling.py's prompt-lookup reference: what copying from the context accepts."""
from __future__ import annotations

from types import SimpleNamespace

from helpers import load_bench

ceiling = load_bench("demo_ceiling")


def test_lookup_draft_prefers_the_longest_latest_match():
    ids = [5, 1, 2, 9, 1, 3, 7, 5, 1, 2]
    # the last 3 tokens (5 1 2) occurred at 0-2: draft what followed them
    assert ceiling.lookup_draft(ids, 9, 3) == [9, 1, 3]
    # only a 1-token match (1 at positions 1 and 4): the latest one wins
    assert ceiling.lookup_draft([4, 1, 8, 1, 6, 1], 5, 2) == [6, 1]
    assert ceiling.lookup_draft([1, 2, 3], 2, 3) == []
    # a match right before p copies only what is known at p, never the tokens being drafted
    assert ceiling.lookup_draft([3, 3, 3, 3, 3], 1, 3) == [3]


def test_lookup_tau_counts_accepted_plus_one_on_reply_tokens():
    ids = [7, 1, 2, 3, 1, 2, 3, 4]
    s = SimpleNamespace(input_ids=ids, loss_mask=[1] * len(ids))
    # p=4 (token 1): draft 2 3 1 -> 2 3 accepted, then 4 != 1; p=5: draft 3 1 2 -> 3; others: 0
    steps = {p: 1 for p in range(1, 7)} | {4: 3, 5: 2}
    assert ceiling.lookup_tau([s], 4) == sum(steps.values()) / len(steps)
