"""The engine tier: vLLM (the CPU build, in .venv-vllm) run as users serve with it.

Each test here starts real vLLM engines (about a minute each on 2 cores), so the tier is
marked `engine` (tests/conftest.py) and left out of `make test-fast`; `make test` runs it
after `make vllm`. Without the engine venv the tests skip, saying how to get it."""
from __future__ import annotations

import pytest

from helpers import TINY, run_dflash


def _engine_python():
    from dflash.engine.runner import EngineError, engine_python
    try:
        return engine_python()
    except EngineError as e:
        return str(e)


@pytest.fixture(scope="session", autouse=True)
def engine_venv():
    py = _engine_python()
    if isinstance(py, str):
        pytest.skip(py)
    return py


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory):
    """A tiny-qwen3 drafter trained for 30 steps, and its served-format export (float32). It
    drafts from a vocabulary of its 2,048 most frequent training tokens (model.draft_vocab): the
    engine then reads its own head and `d2t` (the full-vocabulary path: the SmolLM2 test)."""
    run = tmp_path_factory.mktemp("engine") / "tiny"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", 30, "--no-telemetry", *TINY,
               "--set", "model.draft_vocab=2048", "--set", "train.loss_vocab=2048")
    export = run.parent / "tiny-export"
    run_dflash("export", "--checkpoint", run / "checkpoint", "--out", export, "--dtype", "float32")
    return export


@pytest.fixture(scope="session")
def tiny_swa_export(tmp_path_factory):
    """As tiny_export, with its one layer a sliding-window layer of window 16 (shorter than
    the prompts): trained, exported and so served with the window (docs/architectures.md)."""
    run = tmp_path_factory.mktemp("engine") / "tiny-swa"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", 30, "--no-telemetry", *TINY,
               "--set", "model.draft_vocab=2048", "--set", "train.loss_vocab=2048",
               "--set", "model.layer_types=sliding_attention", "--set", "model.sliding_window=16")
    export = run.parent / "tiny-swa-export"
    run_dflash("export", "--checkpoint", run / "checkpoint", "--out", export, "--dtype", "float32")
    return export
