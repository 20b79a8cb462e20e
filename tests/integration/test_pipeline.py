"""The pipelined trainer, observed through its telemetry: stage names, one trace per batch,
links, rank attributes, back-pressure and starvation, failure handling, torchrun."""
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

import pytest

from helpers import NO_OTEL_ENV, ROOT, TINY, free_port, run_dflash, steps_started
from otlp_receivers import OtlpGrpcReceiver
from otel import read_spans

STAGES = {"data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue", "queue_get",
          "drafter_forward", "backward", "optimizer_step"}


def _env(endpoint):
    return NO_OTEL_ENV | {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}


def _by_batch(spans):
    out = defaultdict(list)
    for s in spans:
        if s["name"] in STAGES:
            out[s["attributes"]["batch_id"]].append(s)
    return out


def test_stages_traces_links_and_resource_over_otlp(tmp_path):
    with OtlpGrpcReceiver() as rx:
        run_dflash("train", "--out", tmp_path / "run", "--target", "tiny-llama", "--steps", 4, *TINY,
                   env=_env(rx.endpoint))
        spans = rx.wait_for_spans(lambda s: {x["name"] for x in s} >= STAGES, timeout_s=20)
    assert {s["name"] for s in spans} >= STAGES
    batches = _by_batch(spans)
    assert sorted(batches) == [0, 1, 2, 3]
    for bid, ss in batches.items():
        assert {s["name"] for s in ss} == STAGES, f"batch {bid} misses stages"
        assert len({s["trace_id"] for s in ss}) == 1, f"batch {bid}: target and drafter stages in different traces"
        opt = [s for s in ss if s["name"] == "optimizer_step"][0]
        assert opt["links"] and opt["links"][0]["trace_id"] == ss[0]["trace_id"]
        fwd = [s for s in ss if s["name"] == "model_forward"][0]
        for k in ("worker", "device", "rank", "batch_id", "step", "tokens", "sequences", "padded_len"):
            assert k in fwd["attributes"], k
    assert len({ss[0]["trace_id"] for ss in batches.values()}) == 4
    res = spans[0]["resource"]
    assert res["service.name"] == "dflash" and res["rank"] == 0 and res["world_size"] == 1


def _read(run):
    files = sorted((run / "telemetry").rglob("traces.jsonl"))
    assert files, f"no traces.jsonl under {run / 'telemetry'}"
    return [s for f in files for s in read_spans(f)]


def test_slow_drafter_fills_queue_and_blocks_target(tmp_path):
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", "tiny-llama", "--steps", 6, *TINY,
               "--set", "pipeline.queue_size=1", "--inject-delay", "backward=0.4", env=NO_OTEL_ENV)
    spans = _read(run)
    enq = [s for s in spans if s["name"] == "cpu_copy_enqueue"]
    blocked = sum(s["attributes"].get("blocked_s", 0) for s in enq)
    assert blocked > 0.5, f"target side should wait on a full queue, blocked {blocked:.3f}s"
    assert any(e["name"] == "queue_full" for s in enq for e in s["events"])


def test_slow_target_starves_drafter_with_queue_empty_cause(tmp_path):
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", "tiny-llama", "--steps", 5, *TINY,
               "--inject-delay", "model_forward=0.8", env=NO_OTEL_ENV)
    spans = _read(run)
    gets = [s for s in spans if s["name"] == "queue_get"]
    causes = [e["attributes"].get("cause") for s in gets for e in s["events"]]
    # every wait is marked; how many steps wait depends on how loaded the host is (a busy
    # host slows the drafter too), so the count is not asserted beyond the first step's
    assert causes and set(causes) == {"queue_empty"}, causes
    summary = json.loads((run / "summary.json").read_text())
    assert summary["telemetry"]["stages"]["queue_get"]["total_s"] > 1.0
    # live idle attribution: exported as metrics and in the end-of-run summary
    workers = {w["worker"]: w for w in summary["telemetry"]["workers"]}
    assert workers["drafter0"]["top_idle_cause"] == "queue_empty"
    assert workers["target0"]["busy_fraction"] > 0.9
    from otel import read_metrics
    idle = {}
    for m in read_metrics(sorted((run / "telemetry").rglob("metrics.jsonl"))[0]):
        if m["name"] == "dflash.worker.idle":  # cumulative sums: the last point is the total
            idle[(m["attributes"]["worker"], m["attributes"]["cause"])] = m["value"]
    assert idle[("drafter0", "queue_empty")] == pytest.approx(workers["drafter0"]["idle_s"]["queue_empty"], rel=0.05)


def test_worker_error_ends_run_promptly_with_message(tmp_path):
    t0 = time.perf_counter()
    p = run_dflash("train", "--out", tmp_path / "run", "--target", "tiny-llama", "--steps", 50, *TINY,
                   "--inject-fault", "model_forward=2", "--no-telemetry", check=False, timeout=300)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "worker target0 failed" in p.stderr and "injected fault in model_forward at step 2" in p.stderr
    assert not (tmp_path / "run" / "checkpoint").exists(), "a failed run must not save a checkpoint"
    assert time.perf_counter() - t0 < 120


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_rank_torchrun_trains_and_both_ranks_report(tmp_path):
    with OtlpGrpcReceiver() as rx:
        env = dict(os.environ) | _env(rx.endpoint) | {"OMP_NUM_THREADS": "1"}
        p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                            "--master_port", str(free_port()), "-m", "dflash", "train", "--out", str(tmp_path / "run"),
                            "--target", "tiny-llama", "--steps", "3", *TINY],
                           cwd=ROOT, env={k: str(v) for k, v in env.items()}, capture_output=True, text=True,
                           timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        spans = rx.wait_for_spans(lambda s: {x["resource"].get("rank") for x in s} >= {0, 1}, timeout_s=20)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    for s in spans:
        assert s["resource"]["world_size"] == 2
    roots = [s for s in spans if s["attributes"].get("otel.root")]
    assert roots and {s["resource"]["rank"] for s in roots} == {0}, "exactly one rank emits the shared roots"
    assert len({s["span_id"] for s in roots}) == len(roots)
    # one trace per step across ranks: the straggler is visible in one view
    for step in range(3):
        fwd = [s for s in spans if s["name"] == "model_forward" and s["attributes"]["batch_id"] == step]
        assert {s["resource"]["rank"] for s in fwd} == {0, 1}
        assert len({s["trace_id"] for s in fwd}) == 1


def test_ctrl_c_saves_checkpoint_and_exits_quickly(tmp_path):
    import signal

    run = tmp_path / "run"
    env = dict(os.environ) | NO_OTEL_ENV
    p = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--out", str(run), "--target", "tiny-llama",
                          "--steps", "200", *TINY, "--inject-delay", "backward=0.2"],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not steps_started(run) and time.monotonic() < deadline:
        time.sleep(0.2)  # training has started once stage spans are being written
    time.sleep(1.0)
    p.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    _, err = p.communicate(timeout=60)
    assert time.monotonic() - t0 < 15, "Ctrl-C must stop the run within seconds"
    assert p.returncode == 130, err[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["steps"] < 200
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == summary["steps"]


@pytest.mark.torchrun
@pytest.mark.slow
def test_two_rank_ctrl_c_stops_all_ranks_at_the_same_step(tmp_path):
    """torchrun forwards Ctrl-C to every rank at slightly different moments; the ranks vote
    so they stop at one step (no rank left hanging in DDP's all-reduce) and rank 0 saves."""
    import signal

    run = tmp_path / "run"
    env = {k: str(v) for k, v in (dict(os.environ) | NO_OTEL_ENV | {"OMP_NUM_THREADS": "1"}).items()}
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", str(free_port()), "-m", "dflash", "train", "--out", str(run),
                          "--target", "tiny-llama", "--steps", "300", *TINY, "--inject-delay", "backward=0.2"],
                         cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not steps_started(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2.0)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=90)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["steps"] < 300, err[-2000:]
    state = json.loads((run / "checkpoint" / "trainer_state.json").read_text())
    assert state["step"] == summary["steps"]
    # both ranks' last optimizer step is the same one
    last = {}
    for f in (run / "telemetry").rglob("traces.jsonl"):
        for s in read_spans(f):
            if s["name"] == "optimizer_step":
                r = s["resource"]["rank"]
                last[r] = max(last.get(r, -1), s["attributes"]["step"])
    assert last[0] == last[1] == summary["steps"] - 1
