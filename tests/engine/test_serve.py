"""`dflash serve`: vLLM's OpenAI server with our export as its drafter, on 127.0.0.1 only;
its request traces reach an OTLP receiver (the Collector's place); Ctrl-C stops the whole
server process tree and exits 130, and a SIGKILL of dflash takes that tree along (the
stand-in engine's faster variants: tests/cli/test_nothing_outlives_dflash.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil

from helpers import ROOT, free_port, live
from otlp_receivers import OtlpGrpcReceiver


def _wait_line(proc, stream, marker: str, timeout_s: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            if proc.poll() is not None:
                break
            continue
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"no {marker!r} from dflash serve (exit {proc.poll()}):\n{''.join(lines)[-3000:]}")


def test_serve_answers_a_chat_completion_traces_it_and_stops_its_tree(tiny_export):
    port = free_port()
    with OtlpGrpcReceiver() as rx:
        proc = subprocess.Popen([sys.executable, "-m", "dflash", "serve", str(tiny_export), "--target", "tiny-qwen3",
                                 "--port", str(port), "--max-model-len", "512", "--otlp", rx.endpoint],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            out = _wait_line(proc, proc.stdout, "ready at", 900)
            curl = _wait_line(proc, proc.stdout, "curl ", 10)[-1]
            assert f"http://127.0.0.1:{port}/v1" in out[-1] and "/v1/chat/completions" in curl
            body = json.dumps({"model": "tiny-qwen3", "messages": [{"role": "user", "content": "Hello!"}],
                               "max_tokens": 16}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                answer = json.loads(r.read())
            assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] == 16
            spans = rx.wait_for_spans(lambda s: any(x["resource"].get("service.name") == "dflash-serve" for x in s),
                                      timeout_s=60)
            mine = [s for s in spans if s["resource"].get("service.name") == "dflash-serve"]
            assert mine[0]["resource"]["dflash.drafter"] == str(tiny_export.resolve())
            tree = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
            assert tree, "the server runs as a child of dflash serve"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=180) == 130  # vLLM winds its tree down slowly on a loaded 2-core host
        finally:
            if proc.poll() is None:
                proc.kill()
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in tree):
            assert time.monotonic() < deadline, "vLLM processes outlived dflash serve"
            time.sleep(0.5)


def test_serve_killed_by_sigkill_takes_vllms_tree_along(tiny_export, tmp_path):
    """vLLM's API server, EngineCore and worker stop when dflash serve is killed outright: they
    neither keep serving on the port nor hold their gigabytes; the scratch dir is swept later."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-m", "dflash", "serve", str(tiny_export), "--target", "tiny-qwen3",
                             "--port", str(port), "--max-model-len", "512"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    tree = []
    try:
        _wait_line(proc, proc.stdout, "ready at", 900)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert len(tree) >= 3, [q.cmdline()[:4] for q in tree]  # the keeper, the API server, its EngineCore
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 60
        while live(tree):
            assert time.monotonic() < deadline, f"outlived dflash serve: {[q.cmdline()[:4] for q in live(tree)]}"
            time.sleep(0.5)
        code = ("from otel.confined import remove_scratch, scratch_dir, scratch_root; import os; "
                "remove_scratch(scratch_dir('next')); print(os.listdir(scratch_root()))")
        left = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
        assert "serve-" not in left, left
    finally:
        if proc.poll() is None:
            proc.kill()
        for q in live(tree):
            q.kill()
