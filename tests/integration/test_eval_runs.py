"""`dflash eval` and `dflash train --eval` on a trained tiny drafter (conftest's `trained`
run): the JSON holds prompt lookup's baseline and the per-position acceptance, the baseline
equals lookup computed from the target's greedy outputs, an export carries the run's
held-out prompts, prompt files and bench sets, and a copy head's run still headlines the
served drafter. The in-process parts: tests/unit/test_eval_baseline.py."""
from __future__ import annotations

import json

import pytest

from dflash.decode.spec_decode import greedy_generate
from helpers import TINY, last_json, lookup_steps_from_output, run_dflash


@pytest.fixture(scope="module")
def evaluated(trained):
    """conftest's trained run (`train --eval`, 2 held-out prompts of 12 tokens) and `dflash eval --json`
    of its checkpoint."""
    res = last_json(run_dflash("eval", "--checkpoint", trained / "checkpoint", "--json",
                               env={"OMP_NUM_THREADS": "1"}).stdout)
    return trained, res


def test_eval_json_holds_the_baseline_and_per_position_acceptance(evaluated):
    _, res = evaluated
    B = res["block_size"]
    b = res["baseline"]
    assert b["method"] == "prompt_lookup" and {"acceptance_length", "per_prompt", "histogram", "tokens_per_s"} <= set(b)
    for r in (res, b):
        pos = r["per_position_acceptance"]
        assert len(pos) == B - 1 and all(0 <= x <= 1 for x in pos) and pos == sorted(pos, reverse=True)
    assert res["prompts"] == 2 and res["prompt_source"]["kind"] == "held_out"


def test_baseline_tau_equals_lookup_computed_from_the_greedy_outputs(evaluated, tiny):
    """From the eval's own prompts and the target's greedy outputs (decoded here, a block past
    the eval's end), prompt lookup's steps follow without decoding with it: they must be the
    baseline's, prompt by prompt."""
    _, res = evaluated
    model, _ = tiny  # the run's target: tiny-qwen3, weights seeded 0
    B, n, eos = res["block_size"], res["max_new_tokens"], set(res["stop_token_ids"])
    taus = []
    for mine, theirs in zip(res["per_prompt_steps"], res["baseline"]["per_prompt_steps"]):
        out = greedy_generate(model, mine["prompt_ids"], max_new_tokens=n + B)
        assert theirs["output_ids"] == mine["output_ids"]  # both lossless: the target's own output
        steps = lookup_steps_from_output(mine["prompt_ids"], out, n, B, eos)
        assert steps == theirs["acceptance_lengths"]
        taus.append(sum(steps) / len(steps))
    assert res["baseline"]["acceptance_length"] == pytest.approx(sum(taus) / len(taus), abs=1e-4)


def test_the_export_carries_the_runs_held_out_prompts_and_its_figure_is_the_headline(evaluated):
    """`eval --checkpoint RUN/export` decodes the same prompt ids as `eval --checkpoint
    RUN/checkpoint`, with the run's eval settings, and its tau is the one `train --eval`
    reported: the served drafter's, beside prompt lookup's."""
    run, res = evaluated
    exp = run / "export"
    assert (exp / "eval_prompts.jsonl").is_file() and (exp / "eval_settings.json").is_file()
    served = last_json(run_dflash("eval", "--checkpoint", exp, "--json", env={"OMP_NUM_THREADS": "1"}).stdout)
    assert [s["prompt_ids"] for s in served["per_prompt_steps"]] == [s["prompt_ids"] for s in res["per_prompt_steps"]]
    assert served["prompt_source"]["kind"] == "export" and served["max_new_tokens"] == 12
    after = json.loads((run / "summary.json").read_text())["eval_after"]
    assert after["served"] and after["baseline"]["method"] == "prompt_lookup"
    assert served["per_prompt_steps"] == after["per_prompt_steps"]
    assert served["acceptance_length"] == after["acceptance_length"]
    assert served["baseline"]["acceptance_length"] == after["baseline"]["acceptance_length"]
    assert (run / "learning_curve.png").stat().st_size > 10_000


def test_prompts_from_a_file_with_turns_and_no_baseline(evaluated, tmp_path):
    run, _ = evaluated
    f = tmp_path / "mine.jsonl"
    f.write_text(json.dumps({"id": "t", "turns": ["Say a number.", "Say another."]}) + "\n"
                 + json.dumps({"conversations": [{"from": "human", "value": "List two colours."}]}) + "\n")
    p = run_dflash("eval", "--checkpoint", run / "checkpoint", "--prompts-from", f, "--baseline", "none",
                   "--max-new-tokens", 6, "--json", env={"OMP_NUM_THREADS": "1"})
    res = last_json(p.stdout)
    assert "baseline" not in res and res["prompts"] == 2 and len(res["per_turn"]) == 2
    assert res["prompt_source"] == {"kind": "file", "path": str(f), "records": 2, "skipped": 0}
    assert [(s["id"], s["turn"]) for s in res["per_prompt_steps"]] == [("t", 0), ("t", 1), ("1", 0)]
    assert f"prompts: {f}" in p.stderr


def test_bench_humaneval_and_mt_bench_offline(evaluated):
    run, _ = evaluated
    p = run_dflash("eval", "--checkpoint", run / "checkpoint", "--bench", "humaneval,mt-bench", "--prompts", 2,
                   "--max-new-tokens", 6, "--json", env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    res = last_json(p.stdout)
    sets = res["sets"]
    assert set(sets) == {"humaneval", "mt-bench"}
    for name, s in sets.items():
        assert s["prompts"] == 2 and s["acceptance_length"] >= 1.0 and s["baseline"]["acceptance_length"] >= 1.0
        assert len(s["per_prompt"]) == 2
    assert len(sets["mt-bench"]["per_turn"]) == 2 and len(sets["humaneval"]["per_turn"]) == 1
    assert res["acceptance_length"] == pytest.approx(
        (sets["humaneval"]["acceptance_length"] + sets["mt-bench"]["acceptance_length"]) / 2, abs=1e-3)
    table = p.stdout
    assert "humaneval" in table and "mt-bench" in table and table.count("prompt lookup") == 2


def test_with_a_copy_head_the_headline_is_still_the_served_drafter(tmp_path):
    """train --eval with model.copy_head: eval_after is the drafter an engine serves (no copy
    head) beside prompt lookup; the copy head gets its own figure, and the summary says both."""
    p = run_dflash("train", "--out", tmp_path, "--target", "tiny-qwen3", "--steps", 2, "--no-telemetry", *TINY,
                   "--set", "model.block_size=4", "--set", "model.copy_head=true", "--set", "eval.before=false",
                   "--set", "eval.prompts=1", "--set", "eval.max_new_tokens=8", "--eval", env={"OMP_NUM_THREADS": "1"})
    s = json.loads((tmp_path / "summary.json").read_text())
    after, copy = s["eval_after"], s["eval_after_copy_head"]
    assert after["served"] and after["copy_head"] is False and "baseline" in after
    assert copy["copy_head"] is True and "baseline" not in copy and copy["lossless"] is after["lossless"] is True
    assert "served drafter" in p.stderr and "prompt lookup" in p.stderr and "tau, copy head" in p.stderr


def test_eval_decode_false_walks_the_held_out_prompts_as_the_estimate_does(tmp_path):
    """eval.decode=false (the demo): the served drafter's figure after training is the walk over
    the held-out prompts, with eval's per-prompt steps (what the engine's verdict replays) and
    prompt lookup from the same outputs; its tau is the estimate's at the last step."""
    p = run_dflash("train", "--out", tmp_path, "--target", "tiny-qwen3", "--steps", 4, "--no-telemetry", *TINY,
                   "--set", "eval.decode=false", "--set", "eval.before=false", "--set", "train.estimate_every=4",
                   "--set", "train.estimate_samples=3", "--eval", env={"OMP_NUM_THREADS": "1"})
    s = json.loads((tmp_path / "summary.json").read_text())
    after = s["eval_after"]
    assert after["method"] == "walked" and after["lossless"] is None and after["prompts"] == 3
    assert [len(x["acceptance_lengths"]) > 0 for x in after["per_prompt_steps"]] == [True] * 3
    assert all(x["prompt_ids"] and x["output_ids"] for x in after["per_prompt_steps"])
    assert after["baseline"]["method"] == "prompt_lookup" and after["baseline"]["tokens_per_s"] is None
    assert after["tau_per_step"] == s["acceptance_estimate"]["last"]["tau"]
    assert "walked, not decoded" in p.stderr
