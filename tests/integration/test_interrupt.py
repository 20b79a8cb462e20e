"""A preempted run (SIGTERM, as Kubernetes and Slurm send) saves and exits within its grace
period: it skips the after-training eval and says how to run it."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

from helpers import ROOT, TINY


def test_sigterm_skips_after_training_eval_and_exits_quickly(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dflash", "train", "--out", str(out), "--target", "tiny-qwen3", "--steps", "400",
           "--eval", "--no-telemetry", *TINY, "--inject-delay", "optimizer_step=0.2"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    # tqdm redraws with \r; read characters so a progress line is seen before its newline
    reader = threading.Thread(target=lambda: lines.extend(iter(lambda: p.stderr.read(1), "")), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 400
        while "tau before training" not in "".join(lines) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert p.poll() is None, "".join(lines)[-3000:]
        time.sleep(3)  # now inside the training loop
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=120)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            p.kill()
    reader.join(timeout=5)
    err = "".join(lines)
    assert rc == 130, err[-3000:]
    assert took < 30, f"exit took {took:.1f} s after SIGTERM (a grace period is 30 s)"
    assert "eval after training skipped" in err and f"dflash eval --checkpoint {out / 'checkpoint'}" in err
    assert "tau after training" not in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and 0 < summary["steps"] < 400
    assert summary["eval_after"]["skipped"] == "interrupted"
    assert (out / "checkpoint" / "model.safetensors").is_file()
    assert os.path.getsize(out / "checkpoint" / "training_state.safetensors") > 0
