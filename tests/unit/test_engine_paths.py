"""The engine runs in a private cwd of its own (dflash/engine/runner.py): every path it is
handed is absolute, or a relative --out (runs/demo) names nothing there."""
import os

from dflash.engine.targets import engine_target


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
                             "eval.engine_eager=true", "model.target=tiny-qwen3"])
    steps = [{"prompt_ids": [i], "output_ids": [1, 2], "acceptance_lengths": [1, 2]} for i in range(5)]
    summary = {"eval_after": {"per_prompt_steps": steps, "block_size": 4, "dtype": "float32"},
               "export": {"out": str(tmp_path / "export")}}
    monkeypatch.setattr("dflash.engine.targets.engine_target", lambda spec, seed=0: "target-dir")
    verdict.after_training(SimpleNamespace(cfg=cfg, out=tmp_path), summary)
    assert seen["steps"] == steps[:2] and seen["drafters"][0]["steps"] == steps[:2]
    assert seen["batched"] is False and seen["eager"] is True
