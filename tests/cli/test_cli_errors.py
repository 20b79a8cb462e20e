"""Bad input: one line naming the value, exit code 2, before any model loads; a second run
on a run dir in use is one line naming the holder."""
import json
import subprocess
import sys
import time

import pytest

from dflash.errors import UserError
from helpers import ROOT, cli_before_torch, run_dflash


@pytest.mark.parametrize("args,needle", [
    (["--set", "train.nope=1"], "train.nope"),
    (["--set", "train.lr=fast"], "train.lr='fast'"),
    (["--target", "./no/such/model"], "./no/such/model"),
    (["--set", "data.path=/nonexistent/sharegpt.json"], "/nonexistent/sharegpt.json"),
    (["--set", "model.block_size=1"], "model.block_size=1"),
    (["--steps", "-1"], "train.steps=-1"),
    (["--inject-delay", "warp_drive=1"], "warp_drive"),
    (["--config", "/nonexistent.yaml"], "/nonexistent.yaml"),
])
def test_bad_train_input_exits_2_fast_with_one_line(tmp_path, args, needle):
    t0 = time.perf_counter()
    p = run_dflash("train", "--out", tmp_path / "run", *args, check=False, timeout=120)
    took = time.perf_counter() - t0
    assert p.returncode == 2, p.stderr
    lines = [ln for ln in p.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert not (tmp_path / "run").exists(), "nothing may be written for bad input"
    assert took < 60  # generous: the point is that no model was loaded (that takes far longer)


def test_unreadable_dataset_file(tmp_path):
    bad = tmp_path / "garbage.json"
    bad.write_text("this is not json {")
    p = run_dflash("train", "--out", tmp_path / "run", "--set", f"data.path={bad}", check=False)
    assert p.returncode == 2 and str(bad) in p.stderr


def test_bad_input_leaves_existing_run_untouched(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint").mkdir(parents=True)
    (run / "checkpoint" / "config.json").write_text(json.dumps({"keep": True}))
    p = run_dflash("train", "--out", run, "--set", "model.block_size=0", check=False)
    assert p.returncode == 2
    assert json.loads((run / "checkpoint" / "config.json").read_text()) == {"keep": True}


def test_eval_missing_checkpoint(tmp_path):
    p = run_dflash("eval", "--checkpoint", tmp_path / "nope", check=False)
    assert p.returncode == 2 and str(tmp_path / "nope") in p.stderr


@pytest.mark.parametrize("args,needle", [
    (["--set", "model.block_size=1"], "model.block_size=1"),
    (["--steps", "-1"], "train.steps=-1"),
    (["--target", "./no/such/model"], "./no/such/model"),
    (["--set", "data.path=/nonexistent/sharegpt.json"], "/nonexistent/sharegpt.json"),
])
def test_bad_input_fails_without_importing_torch(tmp_path, args, needle):
    """Bad input in milliseconds: every check runs before torch / transformers are imported."""
    out, lines = cli_before_torch("train", "--out", tmp_path / "run", *args, heavy=True, timeout=120)
    assert out == {"rc": 2, "heavy": []}, (out, lines)
    assert needle in "\n".join(lines)


@pytest.mark.parametrize("args,needle", [
    (["train", "--out", "{tmp}/run", "--tracker", ""], "--tracker '': expected one or more names"),
    (["eval", "--checkpoint", "{tmp}", "--tracker", ","], "--tracker ',': expected one or more names"),
    (["stalls", "{tmp}", "--jaeger", "http://127.0.0.1:1"], "and --jaeger http://127.0.0.1:1: expected one of them"),
    (["stalls", "/etc/hostname"], "/etc/hostname: not a directory (expected a run directory"),
])
def test_a_source_or_a_list_that_says_nothing_is_one_line(tmp_path, args, needle):
    """An empty --tracker ran with no tracker, a RUN_DIR beside --jaeger was never read, and a
    file given as RUN_DIR was "no such run directory": each is named now."""
    p = run_dflash(*[a.replace("{tmp}", str(tmp_path)) for a in args], check=False, timeout=120)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, (p.returncode, lines)
    assert needle in lines[0], lines


_HOLD = """
import sys
from dflash.preflight import run_dir
run_dir.claim(sys.argv[1], resume=False, overwrite=False)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_second_run_gets_one_line_naming_the_holder(tmp_path):
    from dflash.preflight import run_dir

    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match=rf"in use by another dflash run \(pid {holder.pid} "):
            run_dir.claim(str(tmp_path), resume=True, overwrite=False)
        p = run_dflash("train", "--out", tmp_path, "--overwrite", "--target", "tiny-qwen3", check=False, timeout=120)
        lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
        assert p.returncode == 2 and len(lines) == 1 and f"pid {holder.pid}" in lines[0], p.stderr
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    run_dir.claim(str(tmp_path), resume=False, overwrite=True)  # the lock went with its process
