"""bench/gpu_check.py must be ready for a session that has a GPU: on a CPU-only machine it
skips cleanly, refuses bad input with exit 2, and its pipeline part runs as a CPU smoke."""
import json
import subprocess
import sys

import pytest

from helpers import ROOT

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: run the real check instead")


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "bench/gpu_check.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_skips_cleanly_without_cuda():
    p = _run()
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"skipped": "CUDA is not available"}


def test_bad_targets_exit_2():
    p = _run("--targets", "gpt5")
    assert p.returncode == 2 and "gpt5" in p.stderr


@pytest.mark.slow
def test_cpu_smoke_runs_the_pipeline_check():
    p = _run("--cpu-smoke")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])["cpu_smoke"]
    assert res["ok"] and res["rounds"] == 1 and res["tokens_per_s_on"] and res["tokens_per_s_off"]
    assert res["telemetry_on_off_ratio"] > 0 and res["model_forward_tflops"] > 0
    assert res["checkpoint"]["drafter_thread_s"] >= 0 and "checkpoint_write" in res["stage_p50_ms"]
    assert res["syncs_in_dflash_or_otel"] == {}
    # 2 x 50.3M params x 3072 tokens + causal attention, for one 1.5B-shaped layer
    assert 300 < res["one_layer_1.5b_shape_forward_gflops_8x384"] < 330
