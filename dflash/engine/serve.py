"""`dflash serve`: vLLM's OpenAI-compatible server with an export as its DFlash drafter.

Checked before vLLM starts (one line, exit 2): the port is free on 127.0.0.1 (here), the
OTLP endpoint parses, the --log file is a regular file we can append to, named as given
(`check_log`: never resolved, a link there refused), the
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
and the drafter's dir and the target as resource attributes, so its requests land in the same
Collector (and Jaeger) as the run that trained the drafter.

Ready means ours: vLLM binds its port only after its imports (about a minute on 2 cores), so
another process (a second `dflash serve` on the same port) can take the port after our check
and answer /health. A /health answer counts only when the listener on the port is a socket of
our server's process group (/proc/net/tcp, /proc/PID/fd); else we wait, and our engine's
failure to bind is the error, naming the port taken (`wait_ready`).

Names and paths stay what they are: the curl line is shell-quoted word by word (the served
name is the --target as given; a path can hold quotes or `$(...)`), the resource attributes
are percent-encoded (otel/env_values.py: a `,` or `=` in a path adds no attribute), and the
port check binds as vLLM does (SO_REUSEADDR: a port whose last connections sit in TIME_WAIT
is free).
"""
from __future__ import annotations

import json
import os
import shlex
import socket
import stat
import sys
import time
import urllib.request
from pathlib import Path

from otel.env_values import resource_attributes

from ..errors import ConfigError
from ..phases import phase
from . import runner


def check_port(port: int) -> None:
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port={port}: expected a port in 1..65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # as servers bind (vLLM's uvicorn too): a port whose last connections sit in TIME_WAIT
        # (our own /health polls of the previous serve, ~60 s) is free; a listener still is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ConfigError(f"--port={port}: 127.0.0.1:{port} is busy ({e.strerror or e}); choose another "
                              "with --port") from None


def otlp_endpoint(flag: str | None) -> str | None:
    return flag or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT") or None


def check_otlp(flag: str | None) -> None:
    """The endpoint vLLM would be given (--otlp, else the OTEL_* variables), parsed now: a
    malformed one is one line before vLLM starts, not vLLM's failure after its model loaded."""
    from otel.exporter_choice import endpoint_error, shown_endpoint

    value = otlp_endpoint(flag)
    if value is None:
        return
    where = "--otlp" if flag else next(n for n in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
                                       if os.environ.get(n))
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "").strip() or "grpc"  # what vLLM reads
    if protocol not in ("grpc", "http/protobuf"):
        raise ConfigError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r}: expected grpc or http/protobuf "
                          "(what vLLM's tracing takes)")
    err = endpoint_error(value, protocol)
    if err:
        raise ConfigError(f"{where}={shown_endpoint(value)}: {err}")


def check_log(log: str | None) -> None:
    """`--log FILE`, checked before vLLM starts and opened as given: a symbolic link there is
    refused, never followed (otel/confined.py), and anything but a regular file we can append
    to (a directory, a missing dir, a FIFO, a device, /proc or /sys) is one line."""
    from otel.confined import LinkRefused, open_for_write

    if log is None:
        return
    path = Path(log).absolute()  # absolute, links left as they are (no resolve())
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise ConfigError(f"--log {log!r}: cannot be reached ({e.strerror or e}); expected a file to append "
                          "vLLM's log to") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"--log {log!r}: a symbolic link, never followed when writing a log; name the file itself")
    if st is not None and (not stat.S_ISREG(st.st_mode) or _pseudo_fs(st)):
        raise ConfigError(f"--log {log!r}: not a regular file; expected a file to append vLLM's log to")
    try:
        with open_for_write(path, "ab") as f:
            os.write(f.fileno(), b"")  # a write of nothing: refused where a pseudo-file takes no writes
    except LinkRefused:  # made a link since the lstat above
        raise ConfigError(f"--log {log!r}: a symbolic link, never followed when writing a log; "
                          "name the file itself") from None
    except FileNotFoundError:
        raise ConfigError(f"--log {log!r}: its directory {str(path.parent)!r} does not exist; expected a file "
                          "in an existing directory") from None
    except OSError as e:
        raise ConfigError(f"--log {log!r}: cannot append to it ({e.strerror or e}); expected a writable file "
                          "in an existing directory") from None


def _pseudo_fs(st) -> bool:
    """A file of /proc or /sys (regular to stat, but the kernel's, not a log's place)."""
    for root in ("/proc", "/sys"):
        try:
            if os.stat(root).st_dev == st.st_dev:
                return True
        except OSError:
            pass
    return False


def curl_line(url: str, name: str) -> str:
    """The request a user can paste to try the server; every word quoted for a shell (the
    served name is the --target as given: a path can hold quotes, `$(...)`, anything)."""
    body = json.dumps({"model": name, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64})
    return shlex.join(["curl", f"{url}/v1/chat/completions", "-H", "Content-Type: application/json", "-d", body])


def server_args(*, target: str, export: str, k: int, port: int, dtype: str, max_model_len: int,
                name: str, otlp: str | None) -> list[str]:
    spec = {"method": "dflash", "model": str(Path(export).resolve()), "num_speculative_tokens": k}
    args = ["--model", target, "--served-model-name", name,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype, "--max-model-len", str(max_model_len),
            "--speculative-config", json.dumps(spec), "--no-enable-prefix-caching"]
    if otlp:
        args += ["--otlp-traces-endpoint", otlp]
    return args


def listening_inodes(port: int) -> set[int] | None:
    """The socket inodes listening on TCP ``port`` (any address, IPv4 and IPv6), read from
    /proc/net (this network namespace); None where there is no /proc/net/tcp to read."""
    found: set[int] = set()
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            if path.endswith("tcp"):
                return None
            continue
        for ln in lines:  # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            f = ln.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(int(f[9]))
    return found


def socket_inodes(pids) -> set[int]:
    """The socket inodes open in these processes (their /proc/PID/fd links `socket:[N]`)."""
    out: set[int] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                out.add(int(link[8:-1]))
    return out


def answered_by_us(proc, port: int) -> bool:
    """Whether the listener on ``port`` belongs to our server's process group. vLLM binds its
    port only after its imports (about a minute on 2 cores), long after check_port: a second
    `dflash serve` on the same port, or anything else that bound it meanwhile, answers /health
    too, and a check of the answer alone took it for ours. Linux only (/proc); elsewhere the
    answer is trusted as before."""
    from otel.confined import group_members

    listening = listening_inodes(port)
    if listening is None:
        return True
    return bool(listening & socket_inodes(group_members(proc.pid)))


def wait_ready(proc, url: str, log: Path, timeout_s: float) -> None:
    """Until our server answers /health on its port: another process that answers there is
    not ready (said once); our server then fails to bind and exits, which is the error."""
    t0 = time.monotonic()
    port = int(url.rsplit(":", 1)[1])
    foreign = False
    while True:
        if proc.poll() is not None:
            taken = f" (another process took 127.0.0.1:{port} while vLLM started)" \
                if foreign else ""
            raise runner.EngineFailed(f"the server {runner.exited(proc.returncode, log, ' before it was ready')}"
                                      + taken)
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    if answered_by_us(proc, port):
                        return
                    if not foreign:
                        foreign = True
                        print(f"dflash serve: 127.0.0.1:{port} answers, but not from this server (another process "
                              "bound the port after it was checked); waiting for ours", file=sys.stderr)
        except OSError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise runner.EngineFailed(f"the server was not ready after {timeout_s:.0f} s (its log: {log})")
        time.sleep(0.5)


def serve(*, export: str, target_spec: str, target_seed: int, port: int, k: int, dtype: str,
          max_model_len: int, otlp: str | None, log: str | None, ready_timeout_s: float) -> int:
    from .targets import engine_target

    with phase("engine_target", target=target_spec):  # a tiny target written, a GGUF de-quantized: can take minutes
        target = engine_target(target_spec, target_seed)
    work = Path(runner.scratch_dir("serve"))
    log_path = Path(log).absolute() if log else work / "vllm-serve.log"  # opened as given: never resolve()
    endpoint = otlp_endpoint(otlp)
    name = target_spec
    url = f"http://127.0.0.1:{port}"
    stopped, proc = False, None  # stopped by us (a signal): nothing to keep; else the log a failure names is kept
    try:
        print(f"dflash serve: starting vLLM (target {target_spec}, drafter {export}, k={k}); log: {log_path}",
              file=sys.stderr)
        with phase("engine_start", port=port, k=k, log=str(log_path)):
            # the environment made inside the phase: the engine's TRACEPARENT names engine_start
            env = runner.engine_env(offline=runner.is_local(target))
            if endpoint:
                env.setdefault("OTEL_SERVICE_NAME", "dflash-serve")
                attrs = resource_attributes({"dflash.drafter": Path(export).resolve(), "dflash.target": target_spec})
                env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(x for x in (env.get("OTEL_RESOURCE_ATTRIBUTES", ""), attrs)
                                                           if x)
            proc = runner.start("vllm.entrypoints.openai.api_server",
                                server_args(target=target, export=export, k=k, port=port, dtype=dtype,
                                            max_model_len=max_model_len, name=name, otlp=endpoint),
                                log=log_path, env=env, cwd=work)
            wait_ready(proc, url, log_path, ready_timeout_s)
        print(f"dflash serve: ready at {url}/v1 (OpenAI API; traces: {endpoint or 'off'})", flush=True)
        print(curl_line(url, name), flush=True)
        stop = None
        with phase("serving", url=f"{url}/v1") as ph:
            try:
                proc.wait()  # until it exits on its own, or a signal interrupts us (the caller: 130)
            except KeyboardInterrupt as e:  # how a server is stopped: the phase ends well, the command says 130
                ph.set(stopped_by=str(e) or "SIGINT")
                stop = e
        if stop is not None:
            raise stop
        print(f"dflash serve: the server {runner.exited(proc.returncode, log_path)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        stopped = True
        raise
    finally:
        if proc is not None:
            runner.stop_group(proc)
        (runner.remove_scratch if stopped or log_path.parent != work else runner.keep_scratch)(work)
