"""Roles by rank under torchrun (CPU, gloo): target ranks feed drafter ranks through
torch.distributed point-to-point, credit-based. Real torchrun, real OTLP, real models."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from otel import read_spans
from helpers import ROOT, TINY, free_port
from otlp_receivers import OtlpGrpcReceiver

pytestmark = pytest.mark.torchrun   # every test here starts ranks with torchrun

STAGES = {"data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue", "queue_get",
          "drafter_forward", "backward", "optimizer_step"}
NO_OTEL = {"OTEL_TRACES_EXPORTER": "", "OTEL_METRICS_EXPORTER": "", "OTEL_EXPORTER_OTLP_ENDPOINT": ""}
FAST = ["--set", "train.lr=3e-3", "--set", "train.warmup_ratio=0"]


def _env(extra=None) -> dict:
    env = dict(os.environ) | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)} | (extra or {})
    return {k: str(v) for k, v in env.items()}


def _torchrun(nproc, *args, nnodes=None, node_rank=None, endpoint=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
    if nnodes:
        cmd += ["--nnodes", str(nnodes), "--node_rank", str(node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint]
    else:
        cmd += ["--master_port", str(free_port())]
    return cmd + ["-m", "dflash", "train", *map(str, args)]


def _run(cmd, env, timeout=600):
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def _spans(run: Path) -> list[dict]:
    return [s for f in sorted((run / "telemetry").rglob("traces.jsonl")) for s in read_spans(str(f))]


@pytest.mark.slow
def test_three_target_ranks_feed_two_drafter_ranks(tmp_path):
    run = tmp_path / "run"
    with OtlpGrpcReceiver() as rx:
        env = _env({"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
                    "OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "otlp",
                    "OTEL_METRIC_EXPORT_INTERVAL": "500"})
        _run(_torchrun(5, "--out", run, "--target", "tiny-llama", "--steps", 8, "--layout", "target:3,drafter:2",
                       *TINY, *FAST), env)
        spans = rx.wait_for_spans(lambda ss: {s["resource"].get("rank") for s in ss} >= set(range(5)),
                                  timeout_s=30)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["layout"] == "target:3,drafter:2"
    assert summary["loss_last"] < summary["loss_first"], summary["loss_history"]
    assert (run / "export" / "model.safetensors").is_file(), summary["export"]  # the lead drafter served it

    ranks = {r["rank"]: r for r in summary["ranks"]}
    assert [ranks[r]["role"] for r in range(5)] == ["target"] * 3 + ["drafter"] * 2
    for r in range(3):  # exactly one target replica, and nothing else, in each target process
        assert ranks[r]["held_parameters"] == ranks[r]["target_parameters"] > 0
        assert ranks[r]["batches"] in (5, 6)  # 16 batches round robin over 3 target ranks
    tparams = ranks[0]["target_parameters"]
    for r in (3, 4):  # drafter + its frozen embedding / lm_head copies; no target
        held = ranks[r]["held_parameters"]
        assert held == ranks[r]["drafter_parameters"] + ranks[r]["frozen_parameters"]
        assert ranks[r]["frozen_parameters"] < tparams

    stage_spans = [s for s in spans if s["name"] in STAGES]
    assert {s["name"] for s in stage_spans} == STAGES
    for s in stage_spans:
        res = s["resource"]
        assert res["role"] == ("target" if res["rank"] < 3 else "drafter")
        assert "local_rank" in res and res.get("host.name")
    # one trace per batch: its target rank's stages and its drafter rank's stages
    for g in range(16):
        mine = [s for s in stage_spans if s["attributes"].get("batch_id") == g]
        assert len({s["trace_id"] for s in mine}) == 1, g
        by_rank = {s["resource"]["rank"] for s in mine}
        assert by_rank == {g % 3, 3 + g % 2}, (g, by_rank)
        enq = next(s for s in mine if s["name"] == "cpu_copy_enqueue")
        assert enq["attributes"]["transport"] == "gloo"


@pytest.mark.slow
def test_layout_resume_reproduces_the_loss_history(tmp_path):
    common = ["--target", "tiny-llama", "--steps", 6, "--layout", "target:2,drafter:2", *TINY, *FAST]
    env = _env(NO_OTEL)
    straight, split = tmp_path / "straight", tmp_path / "split"
    _run(_torchrun(4, "--out", straight, *common, "--no-telemetry"), env)
    _run(_torchrun(4, "--out", split, *common, "--no-telemetry", "--set", "train.stop_after=3"), env)
    first = json.loads((split / "summary.json").read_text())
    assert first["steps"] == 3
    _run(_torchrun(4, "--out", split, *common, "--no-telemetry", "--resume"), env)
    a = json.loads((straight / "summary.json").read_text())["loss_history"]
    b = json.loads((split / "summary.json").read_text())["loss_history"]
    assert [s for s, _ in b] == list(range(6))
    assert b == a


@pytest.mark.slow
def test_two_nodes_on_one_machine_join_the_same_batch_traces(tmp_path):
    run = tmp_path / "run"
    endpoint = f"127.0.0.1:{free_port()}"
    env = _env(NO_OTEL)
    args = ["--out", run, "--target", "tiny-llama", "--steps", 4, "--layout", "target:1,drafter:1", *TINY]
    procs = [subprocess.Popen(_torchrun(1, *args, nnodes=2, node_rank=n, endpoint=endpoint), cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-4000:]
    spans = _spans(run)
    for g in range(4):
        mine = [s for s in spans if s["attributes"].get("batch_id") == g and s["name"] in STAGES]
        assert {s["resource"]["role"] for s in mine} == {"target", "drafter"}
        assert len({s["trace_id"] for s in mine}) == 1


def _wait_for(pred, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _started(run: Path, ranks) -> bool:
    return all((run / "ranks" / f"rank{r}.pid").is_file() for r in ranks) and any(
        s["name"] == "optimizer_step" for s in _spans(run)) if (run / "telemetry").is_dir() else False


def _signal_rank0_mid_run(run: Path, drafters: int, delay: float, sig) -> tuple[int, str, float]:
    """Start a 1-target layout, signal the target rank once training runs; (exit code, stderr,
    seconds from the signal to the end of the job)."""
    p = subprocess.Popen(_torchrun(1 + drafters, "--out", run, "--target", "tiny-llama", "--steps", 300,
                                   "--layout", f"target:1,drafter:{drafters}", *TINY,
                                   "--inject-delay", f"model_forward={delay}"),
                         cwd=ROOT, env=_env(NO_OTEL), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: _started(run, range(1 + drafters)), 300, "training to start")
        os.kill(int((run / "ranks" / "rank0.pid").read_text()), sig)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, err, time.monotonic() - t0


@pytest.mark.slow
def test_a_dead_target_rank_ends_every_rank_and_is_named(tmp_path):
    run = tmp_path / "run"
    returncode, err, took = _signal_rank0_mid_run(run, 1, 0.2, signal.SIGKILL)
    assert took < 60
    assert returncode != 0
    # ours ("rank 0 is gone ..."), unless torchrun stopped the drafter first; then its report names rank 0
    assert "rank 0 is gone" in err or "rank      : 0" in err, err[-3000:]
    assert not (run / "summary.json").exists()


@pytest.mark.slow
def test_sigterm_on_one_target_rank_stops_every_rank_at_the_same_step(tmp_path):
    run = tmp_path / "run"
    _, err, _ = _signal_rank0_mid_run(run, 2, 0.1, signal.SIGTERM)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["steps"] < 300, err[-3000:]
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == summary["steps"]
    last = {}
    for s in _spans(run):
        if s["name"] == "optimizer_step":
            r = s["resource"]["rank"]
            last[r] = max(last.get(r, -1), s["attributes"]["step"])
    assert last == {1: summary["steps"] - 1, 2: summary["steps"] - 1}
