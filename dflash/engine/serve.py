"""`dflash serve`: vLLM's OpenAI-compatible server with an export as its DFlash drafter.

Checked before vLLM starts (one line, exit 2): the port is free on 127.0.0.1 (here), the
export is a drafter dir in the served format that fits the target (commands/serve.py's
check_drafter: hidden size, layer ids, mask row; from configs alone). Then the server runs
from `.venv-vllm` (engine/runner.py: `-I`, a cwd of its own, its own process group),
listening on 127.0.0.1 only. We wait for its /health, print the URL and a curl line, and stay
in front: Ctrl-C, SIGTERM or SIGHUP stops the whole server process tree, removes its scratch
dir and exits 130; a server that dies on its own exits 1 with its log's last line (or the
signal that killed it), the log kept. Killed outright (SIGKILL), we take the server with us:
it is tethered to us (runner.py), its scratch dir swept by a later start.

Traces: `--otlp ENDPOINT`, else the standard OTEL_EXPORTER_OTLP_TRACES_ENDPOINT /
OTEL_EXPORTER_OTLP_ENDPOINT, go to vLLM's own OTLP tracing, with `service.name` dflash-serve
and the drafter's dir and run as resource attributes, so its requests land in the same
Collector (and Jaeger) as the run that trained the drafter.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path

from ..errors import ConfigError
from . import runner


def check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port={port}: expected a port in 1..65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ConfigError(f"--port={port}: 127.0.0.1:{port} is busy ({e.strerror or e}); choose another "
                              "with --port") from None


def otlp_endpoint(flag: str | None) -> str | None:
    return flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT") or None


def server_args(*, target: str, export: str, k: int, port: int, dtype: str, max_model_len: int,
                name: str, otlp: str | None) -> list[str]:
    spec = {"method": "dflash", "model": str(Path(export).resolve()), "num_speculative_tokens": k}
    args = ["--model", target, "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--speculative-config", json.dumps(spec), "--no-enable-prefix-caching"]
    if otlp:
        args += ["--otlp-traces-endpoint", otlp]
    return args


def wait_ready(proc, url: str, log: Path, timeout_s: float) -> None:
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise runner.EngineFailed(f"the server {runner.exited(proc.returncode, log, ' before it was ready')}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise runner.EngineFailed(f"the server was not ready after {timeout_s:.0f} s (its log: {log})")
        time.sleep(0.5)


def serve(*, export: str, target_spec: str, target_seed: int, port: int, k: int, dtype: str,
          max_model_len: int, otlp: str | None, log: str | None, ready_timeout_s: float) -> int:
    from .targets import engine_target

    target = engine_target(target_spec, target_seed)
    work = Path(runner.scratch_dir("serve"))
    log_path = Path(log).resolve() if log else work / "vllm-serve.log"
    env = runner.engine_env(offline=runner.is_local(target))
    endpoint = otlp_endpoint(otlp)
    if endpoint:
        env.setdefault("OTEL_SERVICE_NAME", "dflash-serve")
        attrs = f"dflash.drafter={Path(export).resolve()},dflash.target={target_spec}"
        env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(x for x in (env.get("OTEL_RESOURCE_ATTRIBUTES", ""), attrs) if x)
    name = target_spec
    proc = runner.start("vllm.entrypoints.openai.api_server", server_args(target=target, export=export, k=k, port=port, dtype=dtype,
                                    max_model_len=max_model_len, name=name, otlp=endpoint),
                        log=log_path, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    stopped = False  # by us (a signal): nothing to keep; else the log a failure names is kept
    try:
        print(f"dflash serve: starting vLLM (target {target_spec}, drafter {export}, k={k}); log: {log_path}",
              file=sys.stderr)
        wait_ready(proc, url, log_path, ready_timeout_s)
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
        print(f"dflash serve: ready at {url}/v1 (OpenAI API; traces: {endpoint or 'off'})", flush=True)
        print(f"curl {url}/v1/chat/completions -H 'Content-Type: application/json' -d '{body}'", flush=True)
        proc.wait()  # until it exits on its own, or a signal interrupts us (the caller: 130)
        print(f"dflash serve: the server {runner.exited(proc.returncode, log_path)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        stopped = True
        raise
    finally:
        runner.stop_group(proc)
        (runner.remove_scratch if stopped or log_path.parent != work else runner.keep_scratch)(work)
