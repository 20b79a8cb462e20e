"""Nothing outlives dflash: the engine's process tree and its scratch dirs, whatever ends dflash
(SIGKILL, SIGHUP, a second signal in its teardown), and whichever of the tree dies first.

The engine here is a stand-in for `.venv-vllm`'s python (DFLASH_VLLM_PYTHON), a fault
injected in the shape vLLM has: an engine process that starts a worker in its own process
group (vLLM's EngineCore) and runs until it is stopped; given --port it answers /health, as
vLLM's API server does. The real engine killed the same way: tests/engine/test_serve.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import ROOT, free_port, live, served_drafter

STANDIN = '''#!{python}
import http.server, subprocess, sys, time
argv = sys.argv[1:]
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])  # its worker, in its group
if "--port" in argv:
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("stand-in engine: serving", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), Health).serve_forever()
print("stand-in engine: working", flush=True)
time.sleep(3600)
'''

# the `dflash` script's way (`sys.exit(main())`), with one more thing to do at the interpreter's
# very end, after it has put its signal handlers back to the defaults: a signal lands there
# the process's last act before it exits (dflash's exit runs the atexit handlers, then ends
# without the interpreter's teardown: cli._exit_now): a signal landing there must change nothing
CONSOLE_SCRIPT = '''
import atexit, sys, time
from dflash.cli import main

def last_word(sleep=time.sleep, stdout=sys.stdout):
    stdout.write("tearing down\\n")
    stdout.flush()
    sleep(5)

atexit.register(last_word)
sys.exit(main())
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    return served_drafter(tmp_path_factory.mktemp("served") / "drafter")


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """tiny-qwen3's config alone: all serve reads of a local target before the engine starts."""
    from dflash.model.target import _tiny_config, load_tokenizer

    d = tmp_path_factory.mktemp("target") / "tiny-qwen3"
    _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3")).save_pretrained(d)
    return d


@pytest.fixture
def env(tmp_path):
    standin = tmp_path / "engine-python"
    standin.write_text(STANDIN.format(python=sys.executable))
    standin.chmod(0o755)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return dict(os.environ, DFLASH_VLLM_PYTHON=str(standin), TMPDIR=str(tmp), PYTHONUNBUFFERED="1")


class Dflash:
    """A dflash process, its output in files (read as it comes), its process tree recorded."""

    def __init__(self, tmp_path: Path, env: dict, *args, argv=None):
        self.out, self.err = tmp_path / "out.txt", tmp_path / "err.txt"
        argv = argv or [sys.executable, "-m", "dflash"]
        # SIGHUP at its default, as from a terminal: a test run under nohup hands it down ignored,
        # and dflash rightly leaves an ignored SIGHUP ignored (errors.stop_signals)
        self.p = subprocess.Popen([*argv, *map(str, args)], cwd=ROOT, env=env, stdout=open(self.out, "w"),
                                  stderr=open(self.err, "w"),
                                  preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
        self.tree: list[psutil.Process] = []

    def text(self) -> str:
        return self.out.read_text() + self.err.read_text()

    def wait_for(self, marker: str, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while marker not in self.text():
            assert self.p.poll() is None and time.monotonic() < deadline, (marker, self.p.poll(), self.text()[-3000:])
            time.sleep(0.1)

    def record_tree(self, at_least: int, engine: bool = False, timeout_s: float = 60.0) -> list[psutil.Process]:
        """dflash's descendants, once there are ``at_least`` (the engine's tree is up); with
        ``engine``, ``at_least`` of the stand-in engine's own (itself and its worker)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.tree = psutil.Process(self.p.pid).children(recursive=True)
                mine = [q for q in self.tree if not engine or "engine-python" in " ".join(q.cmdline())
                        or "time.sleep(3600)" in " ".join(q.cmdline())]
            except psutil.NoSuchProcess:  # one ended while read: read again
                mine = []
            if len(mine) >= at_least:
                return self.tree
            assert self.p.poll() is None and time.monotonic() < deadline, (self.tree, self.text()[-3000:])
            time.sleep(0.1)

    def assert_tree_gone(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while live(self.tree):
            assert time.monotonic() < deadline, f"outlived dflash: {[q.cmdline() for q in live(self.tree)]}"
            time.sleep(0.2)

    def cleanup(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        for q in live(self.tree):  # what a failing run leaves: not left to the next test
            q.kill()


def _serve(tmp_path, env, served, target_dir, argv=None) -> Dflash:
    return Dflash(tmp_path, env, "serve", served, "--target", target_dir, "--port", free_port(),
                  "--max-model-len", 64, "--ready-timeout", 120, argv=argv)


def _scratch(env) -> list[str]:
    """What is in the scratch root (confined.scratch_root) after a later start (which sweeps)."""
    code = ("from otel.confined import remove_scratch, scratch_dir, scratch_root; remove_scratch(scratch_dir('next'));"
            "import os; print(*sorted(os.listdir(scratch_root())))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return out.split()


def _all_under(env) -> list[str]:
    return sorted(str(p.relative_to(env["TMPDIR"])) for p in Path(env["TMPDIR"]).rglob("*"))


def test_serve_killed_by_sigkill_takes_its_server_tree_along(tmp_path, env, served, target_dir):
    d = _serve(tmp_path, env, served, target_dir)
    try:
        d.wait_for("ready at")
        d.record_tree(2)  # the engine and its worker (and the keeper that leads their group)
        d.p.kill()
        d.p.wait()
        d.assert_tree_gone()
        assert any(name.startswith("serve-") for name in os.listdir(Path(env["TMPDIR"]) / f"dflash-{os.getuid()}"))
        assert _scratch(env) == [], "a later start sweeps what the SIGKILL left"
    finally:
        d.cleanup()


def test_a_killed_server_stops_its_whole_group_and_is_named_as_killed(tmp_path, env, served, target_dir):
    """The group's leader (vLLM's API server, OOM-killed say) dies first: its workers stop too,
    and the reason given is its death by SIGKILL, not whatever its log said last."""
    d = _serve(tmp_path, env, served, target_dir)
    try:
        d.wait_for("ready at")
        d.record_tree(2)
        engine = next(q for q in d.tree if "--port" in q.cmdline())
        engine.kill()
        assert d.p.wait(timeout=60) == 1, d.text()[-3000:]
        d.assert_tree_gone(timeout_s=5)
        said = [ln for ln in d.err.read_text().splitlines() if "the server exited" in ln]
        assert len(said) == 1 and "the server exited -9 (killed by SIGKILL" in said[0], d.text()[-3000:]
        assert "stand-in engine" not in said[0]  # its log's last line is no reason here
        assert "its log: " in said[0]
    finally:
        d.cleanup()


def test_a_closed_terminal_stops_serve_with_130_and_a_late_second_signal_changes_nothing(
        tmp_path, env, served, target_dir):
    """SIGHUP (a closed terminal or ssh session) stops serve as Ctrl-C does: 130, no process and
    no dir left. A second signal landing at the interpreter's very end, after it has put the
    signal handlers back to the defaults, must not then end it by the signal. Run as the
    installed `dflash` script runs it."""
    d = _serve(tmp_path, env, served, target_dir, argv=[sys.executable, "-c", CONSOLE_SCRIPT])
    try:
        d.wait_for("ready at")
        d.record_tree(2)
        d.p.send_signal(signal.SIGHUP)
        d.wait_for("tearing down", timeout_s=60)  # serve has returned: its exit code is chosen
        assert "dflash serve: interrupted; the server is stopped" in d.text()
        d.assert_tree_gone(timeout_s=5)  # stopped before serve returned
        assert _all_under(env) == [f"dflash-{os.getuid()}"], "serve's scratch dir is removed on a normal stop"
        d.p.send_signal(signal.SIGTERM)
        assert d.p.wait(timeout=60) == 130, d.text()[-3000:]
    finally:
        d.cleanup()


def test_no_temp_dir_or_session_of_dflash_escapes_the_one_place():
    """Every temp dir of dflash's is a scratch dir (swept when its owner is gone), and every
    child in a session of its own is tethered (otel/confined.py)."""
    import re

    found = []
    for f in (ROOT / "dflash").rglob("*.py"):
        text = f.read_text()
        for pattern in (r"mkdtemp\(prefix=f?[\"']dflash-", r"start_new_session\s*=\s*True", r"os\.setsid\("):
            found += [f"{f.relative_to(ROOT)}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert found == []


@pytest.mark.slow  # loads the tiny target and decodes before its engine starts
def test_eval_engine_killed_by_sigkill_takes_its_engine_tree_along(tmp_path, env, served):
    d = Dflash(tmp_path, env, "eval", "--checkpoint", served, "--target", "tiny-qwen3", "--prompts", 1,
               "--max-new-tokens", 4, "--baseline", "none", "--engine", "vllm", "--engine-k", 1)
    try:  # --engine-k 1: three engines (none, ngram, the drafter), which the memory check lets start
        d.record_tree(2, engine=True, timeout_s=300)  # the paired verdict's first engine is up
        d.p.kill()
        d.p.wait()
        d.assert_tree_gone()
        assert _scratch(env) == [], "a later start sweeps the export's copy and the engine's dir the SIGKILL left"
    finally:
        d.cleanup()


@pytest.mark.slow  # loads the tiny target and prepares its data before its engine starts
def test_capture_engine_killed_by_sigkill_takes_its_engine_tree_along(tmp_path, env):
    """`capture --engine vllm`: the engine's tree and the dir its hidden states go to (on a
    real target, the whole feature set) go with a SIGKILLed dflash."""
    d = Dflash(tmp_path, env, "capture", "--target", "tiny-qwen3", "--engine", "vllm", "--out", tmp_path / "feats",
               "--set", "data.num_conversations=24", "--set", "data.max_len=128", "--set", "data.regenerate=off",
               "--set", "model.block_size=4")
    try:
        d.wait_for("data:", timeout_s=300)  # prepared: the engine's job starts next
        d.record_tree(2, engine=True)
        assert any(n.startswith("hidden") for n in os.listdir(Path(env["TMPDIR"]) / f"dflash-{os.getuid()}")), \
            "the engine's scratch dir is where the sweep looks"
        d.p.kill()
        d.p.wait()
        d.assert_tree_gone()
        assert _scratch(env) == [], "a later start sweeps the hidden states' dir the SIGKILL left"
    finally:
        d.cleanup()
