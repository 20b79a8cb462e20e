"""An unexpected failure inside a worker is debuggable: the worker's own traceback, its name
and stage on stderr and in OUT/error.txt (exit 1). Bad input stays one line (exit 2):
tests/cli/test_cli_errors.py."""
import pytest

from helpers import NO_OTEL_ENV, TINY, run_dflash



@pytest.mark.parametrize("stage,worker,frame,extra", [
    ("model_forward", "target0", "in make", []),             # a target thread (TargetWorker.make)
    ("backward", "drafter0", "in run", []),                  # the drafter, on the main thread (DrafterWorker.run)
    ("optimizer_step", "main", "in run", ["--reference"]),
])
def test_worker_fault_prints_traceback_worker_and_stage_and_writes_error_txt(tmp_path, stage, worker, frame, extra):
    run = tmp_path / "run"
    p = run_dflash("train", "--out", run, "--target", "tiny-llama", "--steps", 3, *TINY, *extra,
                   "--inject-fault", f"{stage}=1", env=NO_OTEL_ENV, check=False, timeout=300)
    assert p.returncode == 1, p.stderr[-3000:]
    message = f"InjectedFault: injected fault in {stage} at step 1"
    err = p.stderr
    assert "Traceback (most recent call last)" in err, err[-3000:]
    assert frame in err and 'workers.py", line' in err and "in inject" in err, err[-3000:]  # the worker's own frames
    assert "The above exception was the direct cause" in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("dflash train: error: ") and f"worker {worker} failed in stage {stage}" in last, last
    assert message in last and str(run / "error.txt") in last, last

    text = (run / "error.txt").read_text()
    assert f"worker: {worker}\nstage: {stage}\n" in text
    assert frame in text and message in text and "Traceback (most recent call last)" in text
    assert not (run / "checkpoint").exists(), "a failed run saves no checkpoint"

    # the failing span carries it too: an `exception` event per OpenTelemetry's conventions
    from otel import read_spans

    spans = [s for f in sorted((run / "telemetry").rglob("traces.jsonl")) for s in read_spans(f)]
    failed = [s for s in spans if s["name"] == stage and s["attributes"].get("step") == 1]
    assert len(failed) == 1, [(s["name"], s["attributes"].get("step")) for s in spans]
    span = failed[0]
    assert span["attributes"]["worker"] == worker and span["status"].get("code") == 2  # ERROR
    (event,) = [e for e in span["events"] if e["name"] == "exception"]
    attrs = event["attributes"]
    assert attrs["exception.type"] == "InjectedFault"
    assert attrs["exception.message"] == f"injected fault in {stage} at step 1"
    assert attrs["exception.stacktrace"].startswith("Traceback (most recent call last)")
    assert 'workers.py", line' in attrs["exception.stacktrace"] and "in inject" in attrs["exception.stacktrace"]
