"""`make vllm` on a CPU vLLM's wheel was not compiled for (deploy/vllm_env.py): the import dies
with SIGILL. The venv is marked, `make vllm` succeeds, and dflash answers with that line where
it would start an engine (the engine tier then skips with it), instead of CI failing at set-up."""
from __future__ import annotations

import importlib.util
import stat
from pathlib import Path

import pytest

from dflash.engine import runner

ROOT = Path(__file__).resolve().parents[2]


def _vllm_env():
    spec = importlib.util.spec_from_file_location("vllm_env", ROOT / "deploy" / "vllm_env.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _venv(tmp_path: Path, body: str) -> Path:
    """A venv whose python is a shell script standing in for the engine's import."""
    py = tmp_path / "venv" / "bin" / "python"
    py.parent.mkdir(parents=True)
    py.write_text(f"#!/bin/sh\n{body}\n")
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    return py


def test_an_engine_that_dies_with_sigill_marks_its_venv_and_dflash_names_it(tmp_path, monkeypatch):
    env = _vllm_env()
    assert env.CANNOT_RUN == runner.CANNOT_RUN   # one mark, written by the script, read by dflash
    py = _venv(tmp_path, "kill -ILL $$")
    venv = py.parent.parent
    assert env.probe(py, venv) is False
    line = (venv / env.CANNOT_RUN).read_text()
    assert "SIGILL" in line and "cannot run on this CPU" in line and "avx2" in line
    monkeypatch.setenv("DFLASH_VLLM_PYTHON", str(py))
    with pytest.raises(runner.EngineError, match="cannot run on this CPU"):
        runner.engine_python()
    # the same venv where the import loads (a rebuilt or moved one): the mark goes
    py.write_text("#!/bin/sh\nexit 0\n")
    assert env.probe(py, venv) is True
    assert not (venv / env.CANNOT_RUN).exists()
    assert runner.engine_python() == py


def test_any_other_failure_of_the_engines_import_still_fails_the_build(tmp_path):
    import subprocess

    env = _vllm_env()
    py = _venv(tmp_path, "exit 1")
    with pytest.raises(subprocess.CalledProcessError):
        env.probe(py, py.parent.parent)
    assert not (py.parent.parent / env.CANNOT_RUN).exists()
