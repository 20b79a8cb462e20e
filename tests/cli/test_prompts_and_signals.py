"""Bounded prompts and a second signal that works: `--prompts-from` prompts are cut to
eval.max_prompt_len (said once), a prompt that cannot fit the target's context is one line,
and a second SIGINT/SIGTERM ends a command within seconds even when its main thread is deep
in one long C call, saying what was kept."""
import json
import signal
import subprocess
import sys
import time

import pytest

from helpers import ROOT, last_json, run_dflash, served_drafter

# The main thread in one long C call that releases the GIL and never checks for signals,
# as a forward over a huge prompt is: a recursive SQLite query counting to 10^11.
_STUCK = """
import sqlite3, sys
from dflash.errors import on_hard_stop, stop_on_signal
on_hard_stop(lambda: "stuck: stopped by a second signal; nothing was saved")
with stop_on_signal():
    print("ready", flush=True)
    sqlite3.connect(":memory:").execute("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
                                        "WHERE x < 100000000000) SELECT count(*) FROM c").fetchall()
print("the query returned", flush=True)
"""


@pytest.mark.timeout(120)
def test_a_second_signal_ends_a_main_thread_stuck_in_c_code():
    p = subprocess.Popen([sys.executable, "-c", _STUCK], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        # the first: "finish, then report" (its Python handler cannot run yet); the second must
        # end it, stuck or not. Two sent at once may reach it as one, so: again until it ends
        rc = None
        while rc is None:
            p.send_signal(signal.SIGTERM)
            try:
                rc = p.wait(0.5)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if p.poll() is None:
            p.kill()
    err = p.stderr.read()
    assert rc == 130 and "stuck: stopped by a second signal; nothing was saved" in err, err
    assert "the query returned" not in p.stdout.read()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_drafter(tmp_path_factory.mktemp("served") / "drafter")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_200k_token_file_prompt_is_cut_and_said_once(tmp_path, served):
    prompts = tmp_path / "huge.jsonl"
    with open(prompts, "w") as f:
        for i in range(2):
            f.write(json.dumps({"id": f"huge{i}", "prompt": "hello " * 200_000}) + "\n")
        f.write(json.dumps({"id": "small", "prompt": "Say hello."}) + "\n")
    p = run_dflash("eval", "--checkpoint", served, "--target", "tiny-qwen3", "--prompts-from", prompts,
                   "--max-new-tokens", 8, "--baseline", "none", "--json", timeout=280)
    res = last_json(p.stdout)
    assert res["prompts"] == 3 and res["prompts_cut"] == 2, res
    said = [ln for ln in p.stderr.splitlines() if "cut to max_prompt_len" in ln]
    assert len(said) == 1 and "'huge0'" in said[0] and "128 tokens" in said[0], p.stderr[-2000:]
    assert all(len(s["prompt_ids"]) <= 128 for s in res["per_prompt_steps"]), [len(s["prompt_ids"])
                                                                                for s in res["per_prompt_steps"]]


@pytest.mark.slow
def test_a_prompt_that_cannot_fit_the_targets_context_is_one_line(tmp_path, served):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt": "hello " * 5000}) + "\n")
    p = run_dflash("eval", "--checkpoint", served, "--target", "tiny-qwen3", "--prompts-from", prompts,
                   "--max-prompt-len", 5000, "--max-new-tokens", 8, "--baseline", "none", check=False)
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("dflash eval: error")]
    assert p.returncode == 2 and len(lines) == 1, p.stderr[-2000:]
    assert "prompt 'long'" in lines[0] and "context of 4096 tokens" in lines[0], lines


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_signal_stops_eval_and_says_what_was_kept(tmp_path, served):
    prompts = tmp_path / "many.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"Count to {i} slowly."}) + "\n"
                               for i in range(500)))
    err_path = tmp_path / "eval.err"
    p = subprocess.Popen([sys.executable, "-m", "dflash", "eval", "--checkpoint", str(served), "--target", "tiny-qwen3",
                          "--prompts-from", str(prompts), "--max-new-tokens", "64"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=open(err_path, "w"), text=True)
    try:
        deadline = time.monotonic() + 240
        while "dflash eval: prompts:" not in err_path.read_text():  # decoding under the handlers now
            assert p.poll() is None and time.monotonic() < deadline, err_path.read_text()[-2000:]
            time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        while "interrupt: finishing" not in err_path.read_text():
            assert p.poll() is None and time.monotonic() < deadline, err_path.read_text()[-2000:]
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        rc = p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
    err = err_path.read_text()
    # 130 wherever the second lands, the last moments of teardown included (cli.main ignores
    # a signal once the exit code is chosen: tests/cli/test_nothing_outlives_dflash.py)
    assert rc == 130, (rc, err[-2000:])
    # the second signal stopped it, or the current prompt ended first and eval reported it
    assert "no figures were reported" in err or "interrupted after" in err, err[-2000:]
    assert "run it again: dflash eval" in err or "run it again for all: dflash eval" in err, err[-2000:]
