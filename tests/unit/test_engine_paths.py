"""The engine runs in a private cwd of its own (dflash/engine/runner.py): every path it is
handed is absolute, or a relative --out (runs/demo) names nothing there."""
import os

import pytest

from dflash.engine.targets import engine_target
from helpers import TINY


def test_a_local_target_dir_goes_to_the_engine_absolute(tmp_path, monkeypatch):
    (tmp_path / "my-target").mkdir()
    monkeypatch.chdir(tmp_path)
    assert engine_target("my-target") == str(tmp_path / "my-target")
    assert os.path.isabs(engine_target("./my-target"))
    assert engine_target("Qwen/Qwen3-0.6B") == "Qwen/Qwen3-0.6B"  # a hub id as it is


def test_the_verdict_after_training_takes_the_first_engine_prompts(tmp_path, monkeypatch):
    """eval.engine_prompts / eval.engine_batched / eval.engine_eager reach the engine's job: the first N of the
    eval's prompts (ours on the same N), concurrency 1 only when batched is off."""
    from types import SimpleNamespace

    from dflash.config import load_config
    from dflash.engine import runner, verdict

    seen = {}
    monkeypatch.setattr(runner, "engine_python", lambda: "python")
    monkeypatch.setattr(verdict, "engine_verdict", lambda **kw: seen.update(kw) or {"methods": {}})
    monkeypatch.setattr(verdict, "table", lambda v: "")
    cfg = load_config(None, ["eval.engine=vllm", "eval.engine_prompts=2", "eval.engine_batched=false",
                             "eval.engine_eager=true", "eval.engine_rounds=3", "model.target=tiny-qwen3"])
    steps = [{"prompt_ids": [i], "output_ids": [1, 2], "acceptance_lengths": [1, 2]} for i in range(5)]
    summary = {"eval_after": {"per_prompt_steps": steps, "block_size": 4, "dtype": "float32"},
               "export": {"out": str(tmp_path / "export")}}
    monkeypatch.setattr("dflash.engine.targets.engine_target", lambda spec, seed=0: "target-dir")
    verdict.after_training(SimpleNamespace(cfg=cfg, out=tmp_path), summary)
    assert seen["steps"] == steps[:2] and seen["drafters"][0]["steps"] == steps[:2]
    assert seen["batched"] is False and seen["eager"] is True
    # the paired verdict: its rounds, k picked from the measurements and recorded in OUT/export (issue 55)
    assert seen["rounds"] == 3 and seen["auto_k"] is True and seen["record_k"] is True


def _verdict(lossless=True, within=2, prompts=2):
    drafter = {"lossless": lossless, "outputs_equal": prompts if lossless else 1,
               "agreement": {"prompts_within_1": within, "prompts": prompts, "max_abs_diff_accepted": 0}}
    return {"prompts": prompts, "methods": {"none": {"lossless": True}, "ngram": {"lossless": True},
                                            "runs/x/export": drafter}}


def test_what_makes_the_engines_verdict_a_failure():
    from dflash.engine.verdict import verdict_failures

    assert verdict_failures(None) == [] and verdict_failures(_verdict()) == []
    assert verdict_failures(_verdict(lossless=None)) == []  # T > 0: not a property of one output
    assert "the engine failed: boom" in verdict_failures({"error": "boom"})[0]
    assert "not lossless" in verdict_failures(_verdict(lossless=False))[0]
    assert "1/2" in verdict_failures(_verdict(within=1))[0]


@pytest.mark.parametrize("engine,rc", [({"error": "the server exited 3 before it was ready"}, 3),
                                       (_verdict(within=1), 3), (_verdict(), 0)])
def test_train_eval_exits_3_when_the_engines_verdict_fails(tmp_path, monkeypatch, capsys, engine, rc):
    """Issue 54: `train --eval` with eval.engine=vllm exited 0 whatever the verdict said. Now a
    failed verdict is said on the console and the exit code is 3 (trained, saved, exported;
    docs/commands.md), which a script can tell from 1 (the run failed) and 130 (interrupted).
    The trainer is replaced by the summary a run with that verdict returns."""
    from dflash import cli
    from dflash.commands import train as train_cmd
    from dflash.engine import runner
    from dflash.run import trainer

    monkeypatch.setattr(runner, "engine_python", lambda: "python")
    monkeypatch.setattr(trainer, "train", lambda cfg, **kw: {"engine": engine})
    argv = ["train", "--out", str(tmp_path / "run"), "--target", "tiny-qwen3", "--eval", "--set", "eval.engine=vllm",
            *TINY]
    a = cli._parser().parse_args(argv)
    a.argv, a.phase = argv[1:], "start-up"
    assert train_cmd.run(a) == rc
    err = capsys.readouterr().err
    assert ("the engine's verdict failed" in err and "exit 3" in err) == (rc == 3), err
