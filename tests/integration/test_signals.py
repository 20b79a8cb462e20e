"""SIGTERM at every phase (what job runners send): set-up, either eval. The process exits
130 within 30 s, says what to run to continue, and never presents a partial figure as
whole. (Training itself and the saving path: tests/integration/test_interrupt.py.)"""
import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import ROOT, TINY, last_json, run_dflash


class Proc:
    """A dflash process whose stderr is read as it comes (tqdm redraws with \\r)."""

    def __init__(self, *args):
        self.p = subprocess.Popen([sys.executable, "-m", "dflash", *map(str, args)], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.reader = threading.Thread(target=lambda: self.err.extend(iter(lambda: self.p.stderr.read(1), "")),
                                       daemon=True)
        self.reader.start()

    def wait_for(self, cond, timeout=300):
        deadline = time.monotonic() + timeout
        while not cond() and self.p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert self.p.poll() is None, f"ended before the moment to signal:\n{self.stderr[-3000:]}"

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def term(self) -> tuple[int, float, str]:
        t0 = time.monotonic()
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(timeout=120)
        finally:
            if self.p.poll() is None:
                self.p.kill()
        took = time.monotonic() - t0
        self.reader.join(timeout=5)
        return self.p.returncode, took, self.p.stdout.read()


def test_sigterm_during_set_up_exits_130_and_says_how_to_go_on(tmp_path):
    out = tmp_path / "run"
    # a seed no other test uses: its replies are not cached, so set-up regenerates for a while
    proc = Proc("train", "--out", out, "--target", "tiny-qwen3", "--steps", 5, "--no-telemetry", *TINY,
                "--seed", 90417)
    proc.wait_for(lambda: (out / ".dflash-run").exists())
    rc, took, _ = proc.term()
    err = proc.stderr
    assert rc == 130 and took < 30, err[-3000:]
    assert "Traceback" not in err
    # the phase it was in by name (load_target, regenerate, ...), and the advice for a run with no checkpoint
    assert "interrupted during " in err and "no checkpoint was saved yet; run it again: dflash train" in err
    assert "--overwrite" in err
    assert not (out / "summary.json").exists()  # nothing presented as a result


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("sig") / "run"
    run_dflash("train", "--out", out, "--target", "tiny-qwen3", "--steps", 2, "--no-telemetry", *TINY)
    return out / "checkpoint"


def test_sigterm_during_dflash_eval_reports_partial_figures_as_partial(checkpoint):
    proc = Proc("eval", "--checkpoint", checkpoint, "--prompts", 8, "--max-new-tokens", 96, "--json")
    proc.wait_for(lambda: "eval:" in proc.stderr)
    rc, took, stdout = proc.term()
    assert rc == 130 and took < 30, proc.stderr[-3000:]
    res = last_json(stdout)
    assert res["interrupted"] is True and res["prompts"] < 8
    assert "[interrupted: partial]" in stdout and "run it again for all: dflash eval" in proc.stderr


def test_sigterm_during_the_after_training_eval_is_not_exit_0(checkpoint, tmp_path):
    """... nor an OK run in its trace: the root and the eval's phase say it was interrupted."""
    out = tmp_path / "run"
    proc = Proc("train", "--out", out, "--target", "tiny-qwen3", "--steps", 2, *TINY, "--eval",
                "--set", "eval.before=false", "--set", "eval.prompts=8", "--set", "eval.max_new_tokens=96")
    proc.wait_for(lambda: "eval:" in proc.stderr)  # eval.before=false: the only eval is the one after
    rc, took, _ = proc.term()
    err = proc.stderr
    assert rc == 130 and took < 30, err[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["eval_after"]["interrupted"] is True
    assert summary["eval_after"]["command"] == f"dflash eval --checkpoint {out / 'checkpoint'}"
    assert "eval after training interrupted" in err and (out / "checkpoint" / "config.json").is_file()
    from otel import read_spans
    spans = {s["name"]: s for s in read_spans(str(out / "telemetry" / "traces.jsonl"))
             if (s.get("attributes") or {}).get("otel.kind")}
    assert spans["dflash train"]["status"].get("code") == 2, spans["dflash train"]  # not an OK run
    assert spans["eval_after"]["attributes"].get("interrupted") is True
