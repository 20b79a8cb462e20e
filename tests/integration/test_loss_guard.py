"""Guard: the loss histories of every way to run training, bit for bit against histories
recorded before the trainer was restructured (tests/integration/data/loss_histories.json).

Exact floats come from the checkpoint's trainer_state.json (JSON floats round-trip). On
another CPU or torch build the bits may differ for reasons that have nothing to do with
the code; there the comparison falls back to 1e-6 relative and says so.

Record anew (only when a change is meant to alter training):
    DFLASH_RECORD_LOSS_GUARD=1 .venv/bin/python -m pytest tests/integration/test_loss_guard.py
"""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import ROOT, TINY, free_port, run_dflash

DATA = Path(__file__).parent / "data" / "loss_histories.json"
RECORD = os.environ.get("DFLASH_RECORD_LOSS_GUARD") == "1"
# the paper's loss (CE, fixed decay): the histories were recorded with it, before D-PACE became the default
COMMON = ["--target", "tiny-qwen3", "--steps", 6, "--no-telemetry", *TINY, "--set", "train.loss_weights=decay"]


def _machine() -> dict:
    flags = ""
    try:
        flags = next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"torch": torch.__version__, "cpu": flags.split(":", 1)[-1].strip() or platform.processor()}


def _history(run: Path) -> list:
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    return [[h[0], h[1]] for h in state["history"]]  # step, loss (exact)


def _layout(run: Path) -> None:
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port",
           str(free_port()), "-m", "dflash", "train", "--out", str(run), *map(str, COMMON),
           "--layout", "target:2,drafter:1"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]


def _run(kind: str, tmp: Path) -> list:
    run = tmp / kind
    if kind == "reference":
        run_dflash("train", "--out", run, *COMMON, "--reference")
    elif kind == "pipeline_1_target":
        run_dflash("train", "--out", run, *COMMON)
    elif kind == "pipeline_2_targets":
        run_dflash("train", "--out", run, *COMMON, "--target-devices", "cpu,cpu")
    elif kind == "layout_target2_drafter1":
        _layout(run)
    elif kind == "resume":
        run_dflash("train", "--out", run, *COMMON, "--set", "train.stop_after=3")
        run_dflash("train", "--out", run, *COMMON, "--resume")
    return _history(run)


KINDS = ["reference", "pipeline_1_target", "pipeline_2_targets", "resume",
         pytest.param("layout_target2_drafter1", marks=[pytest.mark.slow, pytest.mark.torchrun])]


@pytest.mark.parametrize("kind", KINDS)
def test_loss_history_is_unchanged(kind, tmp_path):
    got = _run(kind, tmp_path)
    assert [s for s, _ in got] == list(range(6))
    stored = json.loads(DATA.read_text()) if DATA.is_file() else {"machine": _machine(), "histories": {}}
    if RECORD:
        stored["machine"] = _machine()
        stored["histories"][kind] = got
        DATA.parent.mkdir(exist_ok=True)
        DATA.write_text(json.dumps(stored, indent=1) + "\n")
        return
    want = stored["histories"][kind]
    if stored["machine"] == _machine():
        assert got == want, f"{kind}: loss history differs from the recorded one (bit for bit)"
    else:  # another CPU / torch build: rounding may differ, the trajectory may not
        print(f"{kind}: recorded on {stored['machine']}, running on {_machine()}: comparing to 1e-6")
        assert all(a[0] == b[0] and math.isclose(a[1], b[1], rel_tol=1e-6) for a, b in zip(got, want)), (got, want)
