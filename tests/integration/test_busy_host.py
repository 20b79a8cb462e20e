"""Telemetry works best when the host is busiest: a short run on a saturated machine
exports every span it recorded to the file sink, and `dflash stalls` reads the run."""
import json
import subprocess
import sys

import pytest

from helpers import TINY, last_json, run_dflash
from otel import read_spans
from test_stalls import NO_OTEL_ENV


@pytest.fixture
def burners():
    """Two CPU-burning processes for the test's duration (this machine has 2 cores), at
    the trainer's own priority."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    yield procs
    for p in procs:
        p.kill()
        p.wait()


@pytest.mark.slow
def test_busy_host_run_exports_every_span(tmp_path, burners):
    run = tmp_path / "run"
    run_dflash("train", "--out", run, "--target", "tiny-llama", "--steps", 6, *TINY,
               "--inject-delay", "model_forward=0.3", env=NO_OTEL_ENV, timeout=900)
    assert all(p.poll() is None for p in burners)  # the host was busy throughout
    health = json.loads((run / "summary.json").read_text())["telemetry"]["health"]
    spans = read_spans(str(run / "telemetry" / "traces.jsonl"))
    assert health["spans_dropped"] == 0 and health["spans_queued"] == 0, health
    assert len(spans) == health["spans_exported"] == health["spans_recorded"] > 6 * 8, health
    names = {s["name"] for s in spans}
    assert {"model_forward", "pack_hidden", "cpu_copy_enqueue", "queue_get",
            "drafter_forward", "backward", "optimizer_step"} <= names
    rep = last_json(run_dflash("stalls", run, "--json").stdout)
    drafter = next(w for w in rep["workers"] if w["worker"] == "drafter0")
    assert drafter["top_idle_cause"] == "queue_empty"  # the slowed target starves it
