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
