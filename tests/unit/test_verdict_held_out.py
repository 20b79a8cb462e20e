"""The verdict over every held-out prompt from the few it timed (engine/pairing.steps_interval,
engine/verdict.our_steps): time per step measured on the timed prompts, steps counted by our
side on all of them."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

from dflash.engine.pairing import interval, steps_interval
from dflash.engine.verdict import our_steps
from dflash.model.prompt_lookup import propose

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))


def _times(steps: list[int], per_step: float, jitter: float, rounds: int, rng) -> list[list[float]]:
    return [[x * per_step * (1 + rng.uniform(-jitter, jitter)) for _ in range(rounds)] for x in steps]


def test_times_proportional_to_steps_give_the_ratio_over_all_prompts():
    """Each method costs a fixed time per step: the estimate over 16 prompts from 6 timed ones
    is the ratio their full timing would give, where the timed six alone say something else."""
    rng = random.Random(1)
    none = [96] * 16
    drafter = [rng.randint(40, 90) for _ in range(16)]        # prompts the drafter helps a lot or little
    tb, to = [[x * 0.07] * 2 for x in none], [[x * 0.08] * 2 for x in drafter]
    full = sum(x * 0.07 for x in none) / sum(x * 0.08 for x in drafter)
    got = steps_interval(tb[:6], to[:6], none, drafter)
    assert got["point"] == pytest.approx(full, abs=1e-4)
    assert got["prompts"] == 16 and got["timed_prompts"] == 6 and got["enough"]
    assert got["low"] <= full <= got["high"]
    assert interval(tb[:6], to[:6])["point"] != pytest.approx(full, abs=1e-3), "the timed six alone differ"
    # the interval is the spread of the 16 prompts' steps, not of the six: narrower than the six alone
    assert got["half_width"] < interval(tb[:6], to[:6])["half_width"]


def test_the_cost_per_step_carries_the_machines_jitter():
    rng = random.Random(2)
    none, drafter = [96] * 16, [rng.randint(40, 90) for _ in range(16)]
    quiet = steps_interval(_times(none[:6], 0.07, 0.0, 2, rng), _times(drafter[:6], 0.08, 0.0, 2, rng), none, drafter)
    noisy = steps_interval(_times(none[:6], 0.07, 0.3, 2, rng), _times(drafter[:6], 0.08, 0.3, 2, rng), none, drafter)
    assert noisy["half_width"] > quiet["half_width"]
    # a cost per step without jitter adds nothing: the prompts' passes carry the whole width
    assert quiet["cost_share"] < 0.01 < 0.5 < noisy["cost_share"]
    assert steps_interval(_times(none[:6], 0.07, 0.3, 2, random.Random(3)), _times(drafter[:6], 0.08, 0.3, 2,
                          random.Random(3)), none, drafter) == steps_interval(
        _times(none[:6], 0.07, 0.3, 2, random.Random(3)), _times(drafter[:6], 0.08, 0.3, 2, random.Random(3)),
        none, drafter), "a fixed seed"


@pytest.mark.parametrize("bad", [
    dict(base_steps=[96] * 4, other_steps=[50] * 4),          # fewer held-out prompts than timed ones
    dict(base_steps=[96] * 8, other_steps=[50] * 7),          # the methods' steps on different prompts
    dict(base_steps=[96] * 8, other_steps=[50] * 7 + [0]),    # a prompt of no steps
])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(ValueError):
        steps_interval([[1.0, 1.0]] * 6, [[0.5, 0.5]] * 6, **bad)


def test_vllms_tie_break_is_the_earliest_longest_match():
    """Checked against the bench's own plain statement of both rules (bench/lookup_from_outputs.py)
    on random short alphabets, where matches and ties are many."""
    from lookup_from_outputs import lookup

    rng = random.Random(0)
    for _ in range(400):
        ids = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 5)
        assert propose(ids, k, earliest=True) == lookup(ids, k, earliest=True), ids
        assert propose(ids, k) == lookup(ids, k), ids
    loop = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]   # latest: the known tail only; earliest: a whole block
    assert propose(loop, 4) == [3, 1, 2] and propose(loop, 4, earliest=True) == [3, 1, 2, 3]


def test_our_steps_per_method():
    rec = {"prompt_ids": [5, 6, 7, 8], "output_ids": [5, 6, 7, 8, 5, 6, 7, 8, 9],
           "acceptance_lengths": [4, 1, 3]}                   # 8 tokens after the prompt's pass
    assert our_steps([rec], "none") == [9]
    assert our_steps([rec], "drafter", 3, 4) == [1 + 3]        # served at block_size - 1: its own steps
    assert our_steps([rec], "drafter", 1, 4) == [1 + 2 + 1 + 2]  # at k = 1 a step keeps 2 tokens at most
    # ngram at k = 3: the prompt repeats, so every step after the first drafts the repeat
    got = our_steps([rec], "ngram", 3)[0]
    assert 1 < got < 9


def test_passes_are_checked_exactly_for_a_drafter_and_within_k_for_ngram():
    """A drafter drafts every step: vLLM's passes are 1 + its verify steps. ngram's plain steps
    are not counted by vLLM, and its accepted drafts include those past max_tokens: its tokens
    less accepted drafts fall short of the true passes by 0..k."""
    from dflash.engine.verdict import _passes_check

    outputs = [[1] * 10, [2] * 8]
    drafter = {"outputs": outputs, "spec": [{"num_spec_steps": 6, "num_accepted_draft_tokens": 3},
                                            {"num_spec_steps": 4, "num_accepted_draft_tokens": 3}]}
    got = _passes_check(drafter, [7, 6, 99], 3, ngram=False)  # a third, untimed prompt is not compared
    assert (got["equal"], got["max_abs_diff"], got["vllm"], got["ours"]) == (1, 1, 12, 13)
    ngram = {"outputs": outputs, "spec": [{"num_spec_steps": 2, "num_accepted_draft_tokens": 5},
                                          {"num_spec_steps": 1, "num_accepted_draft_tokens": 1}]}
    got = _passes_check(ngram, [7, 9], 3, ngram=True)       # 10 - 5 = 5 (ours 2 more), 8 - 1 = 7 (ours 2 more)
    assert got["within_bound"] == 2 and got["diffs"] == [2, 2]
    assert _passes_check(ngram, [4, 12], 3, ngram=True)["within_bound"] == 0  # below vLLM's, or past the bound


def test_the_table_says_when_our_pass_counts_did_not_hold():
    from dflash.engine.verdict import _passes_warning

    fine = {"d": {"passes_vs_ours": {"prompts": 6, "ours": 391, "vllm": 387}},     # 1%: a k below block - 1
            "ngram": {"passes_vs_ours": {"prompts": 6, "within_bound": 6}}, "none": {}}
    assert _passes_warning(fine, ["d", "none", "ngram"]) == ""
    off = {"d": {"passes_vs_ours": {"prompts": 6, "ours": 420, "vllm": 387}},
           "ngram": {"passes_vs_ours": {"prompts": 6, "within_bound": 4}}, "none": {}}
    assert "for d, ngram differ" in _passes_warning(off, ["d", "none", "ngram"])
    assert _passes_warning(off, ["none"]) == "", "only the line whose methods are off"
