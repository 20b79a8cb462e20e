"""The test tiers and the fixtures more than one test file needs.

Tiers, by folder; each folder's tests carry the folder's name as a marker, so `-m` picks
tiers (`-m unit`, `-m "cli or otel"`):

  unit/         in-process: the code called directly (data inspect on the formats it reads)
  cli/          the command line in a fresh interpreter: bad input, one line, exit 2
  otel/         the telemetry layer alone, against OTLP receivers on loopback
  integration/  training runs, the pipeline, torchrun             -> marked `slow` too
  backends/     real Collector, Jaeger, Prometheus, MLflow, browser
  engine/       real vLLM engines (.venv-vllm, `make vllm`)

A test that starts torchrun is marked `torchrun`, one that reaches the package index
`network`, and one inside a quick tier that trains, regenerates or draws thousands of
samples `slow`, each where it is defined.
`make test-fast` deselects all five; `make test` runs everything.

This directory is on sys.path (pytest's rootdir-relative imports), so every tier imports
the shared `helpers` module; subprocess scripts are found by path from helpers.ROOT.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# every tier folder's tests carry its name as a marker (`-m unit`, `-m "cli or otel"`);
# integration/ is `slow` too, so the quick selection (`make test-fast`) leaves it out
TIER_MARKERS = {"unit": ("unit",), "cli": ("cli",), "otel": ("otel",), "integration": ("integration", "slow"),
                "backends": ("backends",), "engine": ("engine",)}

# the OTLP receivers (tests/otel/otlp_receivers.py) serve the pipeline's tests too; appended, so
# that nothing in tests/otel/ shadows an installed module
sys.path.append(str(TESTS / "otel"))


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            tier = item.path.relative_to(TESTS).parts[0]
        except ValueError:   # a test file outside tests/, named on the command line
            continue
        for marker in TIER_MARKERS.get(tier, ()):
            item.add_marker(marker)


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch):
    """DFLASH_CACHE in the test's own tmp dir: nothing read from or left in the shared cache."""
    monkeypatch.setenv("DFLASH_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tok():
    """The tiny-qwen3 tokenizer."""
    from dflash.model.target import load_tokenizer
    return load_tokenizer("tiny-qwen3")


@pytest.fixture(scope="module")
def tiny():
    """The tiny-qwen3 target (seed 0, float32, CPU) and its tokenizer: ``(model, tok)``."""
    from dflash.model.target import load_target
    return load_target("tiny-qwen3", seed=0)


TRAINED_STEPS = 40


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """One tiny-qwen3 drafter trained `TRAINED_STEPS` steps on helpers.TINY (block 8) with
    `--eval` after training (2 held-out prompts of 12 tokens), on one thread: its run dir
    (checkpoint/, export/, summary.json, config.yaml). Shared by every test that reads a
    trained run, so it is read-only: a test that writes to a run copies it first."""
    from helpers import TINY, run_dflash
    run = tmp_path_factory.mktemp("trained") / "run"
    run_dflash("train", "--out", run, "--target", "tiny-qwen3", "--steps", TRAINED_STEPS, "--no-telemetry", *TINY,
               "--eval", "--set", "eval.before=false", "--set", "eval.prompts=2", "--set", "eval.max_new_tokens=12",
               env={"OMP_NUM_THREADS": "1"})
    return run


# ----------------------------------------------------------------------------- time by tier
# `make test` ends with the wall time each tier took (setup, call and teardown of its tests),
# so a CI run says where its minutes went; `--durations=15` names the slowest tests.
_tier_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    parts = report.nodeid.split("::")[0].split("/")  # rootdir-relative: a test that chdirs cannot move it
    tier = parts[1] if len(parts) > 2 and parts[0] == TESTS.name else "other"
    _tier_seconds[tier] = _tier_seconds.get(tier, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if _tier_seconds:
        parts = ", ".join(f"{t} {s / 60:.1f} min" for t, s in sorted(_tier_seconds.items(), key=lambda kv: -kv[1]))
        terminalreporter.write_line(f"time by tier: {parts}")
