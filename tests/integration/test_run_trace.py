"""The whole run in the trace (dflash/phases.py): every command's root span starts with its
process and its phases fill the wall, across ranks, through a signal, into `dflash stalls`.

Coverage is measured here, against the wall this test sees (the process from start to exit):
the union of the root's direct children (the phases) over that wall."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import NO_OTEL_ENV, ROOT, TINY, free_port, run_dflash
from dflash.analysis import startup
from otel import read_metrics, read_spans

FAST_EVAL = ["--set", "eval.prompts=1", "--set", "eval.max_new_tokens=8", "--set", "eval.before=false"]


def run_spans(tdir) -> list[dict]:
    return [s for f in sorted(tdir.rglob("traces.jsonl")) for s in read_spans(str(f))
            if (s.get("attributes") or {}).get("otel.kind")]


def coverage(spans, t0_s: float, t1_s: float) -> tuple[float, float]:
    """(share of [t0, t1] inside the root's phases, the longest stretch outside them)."""
    c = startup.coverage(spans, int(t0_s * 1e9), int(t1_s * 1e9))
    return c["share"], c["longest_gap_s"]


def timed(*args, env=None, timeout=600):
    t0 = time.time()
    p = run_dflash(*args, env=env, timeout=timeout)
    return p, t0, time.time()


def test_train_eval_capture_and_eval_are_traced_from_first_second_to_last(tmp_path, tmp_cache):
    """A tiny `train --eval`, then `capture` and `eval` of what it made: each command's phases
    cover >= 95% of its wall, in one trace per command, with the set-up's phases by name; the
    profile is of the steps alone; `dflash stalls` has a start-up section."""
    env = NO_OTEL_ENV | {"OMP_NUM_THREADS": "1"}
    run = tmp_path / "run"
    p, t0, t1 = timed("train", "--out", run, "--target", "tiny-qwen3", "--steps", 3, *TINY, *FAST_EVAL, "--eval",
                      env=env)
    spans = run_spans(run / "telemetry")
    share, gap = coverage(spans, t0, t1)
    assert share >= 0.95, (share, gap)
    names = {s["name"] for s in spans}
    assert {"dflash train", "check_inputs", "read_data", "import_torch", "load_target", "prepare_data",
            "regenerate", "regen_batch", "build_drafter", "train", "checkpoint", "eval_after", "export"} <= names
    assert len({s["trace_id"] for s in spans}) == 1
    root = next(s for s in spans if s["name"] == "dflash train")
    assert root["attributes"]["dflash.command"] == "train" and not root["status"].get("code")
    # the phase table printed once at the end, and the profile's wall is the steps', not the run's
    assert p.stderr.count("dflash train: phases of the run") == 1
    summary = json.loads((run / "summary.json").read_text())
    train = next(s for s in spans if s["name"] == "train")
    assert summary["telemetry"]["wall_s"] <= (train["end_ns"] - train["start_ns"]) / 1e9 + 1.0
    assert {r["phase"] for r in summary["telemetry"]["run"]["phases"]} >= {"load_target", "train"}
    units = {m["name"]: m["unit"] for m in read_metrics(str(run / "telemetry"))}  # UCUM: seconds are "s"
    assert units["dflash.queue.consumer_starved_seconds"] == "s" and units["dflash.tokens"] == "{token}"
    # batch traces lead to the run: their roots link to its root span
    batch_roots = [s for f in (run / "telemetry").rglob("traces.jsonl") for s in read_spans(str(f))
                   if s["attributes"].get("otel.root")]
    assert batch_roots and all(r["links"][0]["span_id"] == root["span_id"] for r in batch_roots)
    st = run_dflash("stalls", run, "--json")
    rep = json.loads(st.stdout.strip().splitlines()[-1])
    assert rep["startup"]["ranks"][0]["first_step_s"] > 0 and "load_target" in rep["startup"]["ranks"][0]["phases"]
    assert "start-up (the run's own trace" in st.stdout

    feats = tmp_path / "feats"
    _, t0, t1 = timed("capture", "--out", feats, "--target", "tiny-qwen3", *TINY, env=env)
    spans = run_spans(feats / "telemetry")
    share, gap = coverage(spans, t0, t1)
    assert share >= 0.95, (share, gap)
    assert {"dflash capture", "load_target", "prepare_data", "capture", "capture_shard"} <= {s["name"] for s in spans}
    prep = next(s for s in spans if s["name"] == "prepare_data")["attributes"]  # the data's counts, as train's
    assert prep["data.records_read"] > 0 and prep["samples"] > 0

    tel = tmp_path / "eval-telemetry"
    _, t0, t1 = timed("eval", "--checkpoint", run / "checkpoint", "--prompts", 1, "--max-new-tokens", 8,
                      "--telemetry-dir", tel, env=env)
    spans = run_spans(tel)
    share, gap = coverage(spans, t0, t1)
    assert share >= 0.95, (share, gap)
    assert {"dflash eval", "load_target", "load_drafter", "eval_drafter"} <= {s["name"] for s in spans}


def test_a_sigterm_during_regeneration_keeps_every_span_marks_the_open_phases_and_exits_130(tmp_path, tmp_cache):
    """The regeneration's batch is held (an injected delay inside it) until the live phase
    gauge shows it open; then SIGTERM: every span until then is on disk and at the collector,
    the open phases and the root end marked with the signal, exit 130."""
    sys.path.append(str(ROOT / "tests" / "otel"))
    from otlp_receivers import OtlpGrpcReceiver

    run = tmp_path / "run"
    with OtlpGrpcReceiver() as rx:
        env = {k: str(v) for k, v in (dict(os.environ) | NO_OTEL_ENV | {
            "OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
            "OTEL_TRACES_EXPORTER": "otlp,file", "OTEL_METRICS_EXPORTER": "otlp,file", "OMP_NUM_THREADS": "1",
            "DFLASH_CACHE": os.environ["DFLASH_CACHE"]}).items()}
        p = subprocess.Popen([sys.executable, "-m", "dflash", "train", "--out", str(run), "--target", "tiny-qwen3",
                              "--steps", "3", *TINY, "--set", "data.regen_workers=1",
                              "--inject-delay", "regen_batch=120"],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 300
            while True:  # the batch is open once its live gauge is exported (no timing luck)
                assert p.poll() is None and time.monotonic() < deadline, p.poll()
                pts = [m for f in (run / "telemetry").rglob("metrics.jsonl") for m in read_metrics(str(f))]
                if any(m["name"] == "dflash.run.phase.elapsed" and m["attributes"].get("phase") == "regen_batch"
                       for m in pts):
                    break
                time.sleep(0.2)
            p.send_signal(signal.SIGTERM)
            _, err = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 130, err[-2000:]
        got = rx.wait_for_spans(lambda s: any(x["name"] == "dflash train" for x in s), timeout_s=20)
    on_disk = {s["name"]: s for s in run_spans(run / "telemetry")}
    at_collector = {s["name"] for s in got}
    for name in ("dflash train", "load_target", "prepare_data", "regenerate", "regen_batch"):
        assert name in on_disk and name in at_collector, name
    assert not on_disk["load_target"]["status"].get("code")
    for name in ("regen_batch", "regenerate", "prepare_data", "dflash train"):
        assert on_disk[name]["status"].get("code") == 2, name
    ev = on_disk["regen_batch"]["events"][0]["attributes"]
    assert ev["exception.message"] == "SIGTERM"


@pytest.mark.torchrun
def test_two_ranks_share_one_run_trace_and_stalls_names_the_rank_the_others_waited_for(tmp_path, tmp_cache):
    """2 ranks under torchrun, rank 1's data read slowed by 3 s: one trace holds both ranks'
    start-up (rank 0's root, each rank's process span), and `dflash stalls` says that rank 0
    waited ~3 s for rank 1 at the first collective (the join)."""
    run = tmp_path / "run"
    env = {k: str(v) for k, v in (dict(os.environ) | NO_OTEL_ENV | {"OMP_NUM_THREADS": "1"}).items()}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                        str(free_port()), "-m", "dflash", "train", "--out", str(run), "--target", "tiny-qwen3",
                        "--steps", "2", *TINY, "--inject-delay", "read_data@1=3"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    spans = run_spans(run / "telemetry")
    assert len({s["trace_id"] for s in spans}) == 1, "one trace for the whole run, both ranks"
    root = next(s for s in spans if s["attributes"]["otel.kind"] == "run")
    procs = {s["resource"]["rank"]: s for s in spans if s["attributes"]["otel.kind"] == "process"}
    assert set(procs) == {0, 1} and all(s["parent_span_id"] == root["span_id"] for s in procs.values())
    reads = {s["resource"]["rank"]: s for s in spans if s["name"] == "read_data"}
    assert reads[1]["attributes"]["injected_delay_s"] == 3 and reads[1]["parent_span_id"] == procs[1]["span_id"]
    st = run_dflash("stalls", run, "--json")
    fc = json.loads(st.stdout.strip().splitlines()[-1])["startup"]["first_collective"]
    assert fc["phase"] == "join_ranks" and fc["last_rank"] == 1
    assert fc["waits_s"]["0"] >= 2.5, fc
    assert "the ranks waited for rank 1" in st.stdout
