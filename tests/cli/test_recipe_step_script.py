"""bench/recipe_step.py must be ready for a session that is lent an H200: it refuses bad input
with exit 2, and `--cpu-smoke` runs its whole path (random target dir written and loaded, the
product's capture, TrainStep, stage clocks, FLOP model, every CPU arm) on a tiny shape."""
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT


def _run(*args, timeout=600):
    return subprocess.run([sys.executable, "bench/recipe_step.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_bad_shape_or_arm_exits_2():
    p = _run("--shapes", "70b")
    assert p.returncode == 2 and "70b" in p.stderr
    p = _run("--arms", "baseline,turbo")
    assert p.returncode == 2 and "turbo" in p.stderr


@pytest.mark.parametrize("args,needle", [
    (["--threads", "-1"], "--threads=-1"),
    (["--paired", "-1"], "--paired=-1"),
    (["--warmup", "-1"], "--warmup=-1"),
    (["--batch", "-2"], "--batch=-2"),
    (["--max-len", "-5"], "--max-len=-5"),
    (["--chunk", "0"], "--chunk=0"),
    (["--peak-tflops", "0"], "--peak-tflops=0.0"),
    (["--peak-tflops", "nan"], "--peak-tflops=nan"),
    (["--budget-s", "inf"], "--budget-s=inf"),
    (["--device", "tpu"], "--device='tpu'"),
    (["--device", "cuda"], "--device='cuda': this host has no CUDA device"),
    (["--out", "/nonexistent-dir/r.json"], "--out='/nonexistent-dir/r.json'"),
    (["--out", "/"], "--out='/'"),
])
def test_bad_arguments_are_one_line_and_exit_2_before_any_work(args, needle):
    """Issue 54: these ended in tracebacks (some written into the JSON after the target had
    loaded), and a --out into a missing dir failed only after the whole run, its figures lost."""
    p = subprocess.run([sys.executable, "bench/recipe_step.py", "--shapes", "tiny", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and needle in lines[0] and p.stdout == "", (p.returncode, p.stderr)


@pytest.mark.slow
def test_cpu_smoke_runs_every_cpu_arm():
    p = _run("--cpu-smoke")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    arms = res["tiny"]["arms"]
    ran = {k for k, a in arms.items() if "stages" in a}
    assert ran == {"baseline", "chunked_loss", "stop_early", "fill"}, arms
    assert {k for k, a in arms.items() if "skipped" in a} == {"flex", "compile"}  # CUDA only
    # the same weights and batches in every arm: the same first loss, whatever the lever
    assert len({round(a["loss_first"], 4) for k, a in arms.items() if k in ran}) == 1
    assert arms["chunked_loss"]["chunked_head"] and not arms["baseline"]["chunked_head"]
    assert arms["stop_early"]["layers_run"] < arms["baseline"]["layers_run"]
    for a in (arms[k] for k in ran):
        assert a["drafter_step"]["tflops"] > 0 and a["stages"]["target_forward"]["tflops"] > 0
        assert 0 < a["queue_share_one_gpu"] < 1 and a["whole_step"]["tokens_per_s"] > 0
