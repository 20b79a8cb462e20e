"""`dflash watch RUN` (`make watch RUN=...`): a run's curves in a browser, on 127.0.0.1.

Starts TensorBoard on RUN/tensorboard (`--tracker tensorboard`) and, when the run has a
local MLflow store (`--tracker mlflow` with no MLFLOW_TRACKING_URI), MLflow's UI on it;
prints their URLs once they answer, and stops both on Ctrl-C / SIGTERM. Both UIs ship in
their wheels (the `trackers` extra): no network needed. torch-free; bad input is one line
and exit 2.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from otel.confined import keep_scratch, remove_scratch, scratch_dir, start_python, stop_group

from ..errors import ConfigError

READY_S = 120.0  # a cold MLflow server imports for a while on a busy 2-core machine


def _port(wanted: int) -> int:
    """wanted if it is free on 127.0.0.1, else one that is."""
    for p in ((wanted, 0) if wanted else (0,)):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                continue
            return s.getsockname()[1]
    raise ConfigError("no free port on 127.0.0.1")


def _ready(url: str, proc, deadline: float, log: Path) -> None:
    import urllib.request

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            module = proc.args[proc.args.index("-m") + 1]
            raise RuntimeError(f"{module} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {READY_S:.0f} s:\n{log.read_text()[-3000:]}")


def server_env() -> dict:
    """An MLflow UI needs no job runner (7 huey processes, and a slow stop): off unless asked."""
    return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"} | dict(os.environ)


def servers(run_dir: Path, port: int = 6006, mlflow_port: int = 5000) -> list[tuple[str, list[str], str, str]]:
    """(name, module and its arguments, URL to print, URL that answers once ready) for what
    the run has."""
    from .mlflow_sink import LOCAL_DIR, local_uri
    from .tensorboard_sink import DIR

    out = []
    if (run_dir / DIR).is_dir():
        p = _port(port)
        out.append(("TensorBoard", ["tensorboard.main", "--logdir", str((run_dir / DIR).resolve()),
                                    "--host", "127.0.0.1", "--port", str(p)],
                    f"http://127.0.0.1:{p}/", f"http://127.0.0.1:{p}/data/runs"))
    if (run_dir / LOCAL_DIR / "mlflow.db").is_file():
        db = run_dir / LOCAL_DIR / "mlflow.db"
        with open(db, "rb") as f:  # a damaged store: one line here, not MLflow's SQLAlchemy traceback
            head = f.read(16)
        if head and head != b"SQLite format 3\x00":
            raise ConfigError(f"{db}: not an SQLite database (the run's local MLflow store is damaged); move it "
                              "away to watch the rest")
        p = _port(mlflow_port)
        out.append(("MLflow", ["mlflow", "server", "--backend-store-uri", local_uri(run_dir),
                               "--host", "127.0.0.1", "--port", str(p), "--workers", "1"],
                    f"http://127.0.0.1:{p}/", f"http://127.0.0.1:{p}/health"))
    return out


def serve(a) -> int:
    import importlib.util

    run_dir = Path(a.run_dir).expanduser()
    if not run_dir.is_dir():
        raise ConfigError(f"{a.run_dir!r}: no such run directory")
    for name, v in (("--port", a.port), ("--mlflow-port", a.mlflow_port)):
        if not 0 <= v <= 65535:
            raise ConfigError(f"{name}={v}: expected a port, 0..65535")
    todo = servers(run_dir, a.port, a.mlflow_port)
    if not todo:
        raise ConfigError(f"{a.run_dir}: no tensorboard/ nor mlflow/ store in it (train with "
                          f"--tracker tensorboard,mlflow; a run logged to an MLflow server is on that server)")
    for name, cmd, *_ in todo:
        mod = cmd[0].split(".")[0]
        if importlib.util.find_spec(mod) is None:
            raise ConfigError(f"dflash watch: {name} needs the {mod} package (pip install 'dflash-otel[trackers]')")
    logs = Path(scratch_dir("watch"))  # swept by a later start if we are killed
    procs = []
    keep = False  # the logs a failure names
    try:
        deadline = time.monotonic() + READY_S
        for name, cmd, url, probe in todo:
            log = logs / f"{name.lower()}.log"
            # its own session: a Ctrl-C in this terminal reaches us, and we stop it; tethered:
            # it stops when we end, however. Nothing in the cwd or the run dir is importable in
            # it, nor in what it starts (MLflow's `python -m uvicorn`): otel.confined gives it
            # an empty cwd of its own
            with open(log, "w") as out:
                proc = start_python(sys.executable, cmd[0], cmd[1:], stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, tethered=True, env=server_env())
            procs.append((name, proc, url, probe, log))
        for name, proc, url, probe, log in procs:
            _ready(probe, proc, deadline, log)
            print(f"{name}: {url}", flush=True)
        print(f"(logs: {logs}; Ctrl-C stops)", file=sys.stderr, flush=True)
        while all(p.poll() is None for _, p, *_ in procs):
            time.sleep(0.5)
        name, proc = next((n, p) for n, p, *_ in procs if p.poll() is not None)
        print(f"dflash watch: {name} exited with {proc.returncode} (log: {logs / (name.lower() + '.log')})",
              file=sys.stderr)
        keep = True
        return 1
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM or SIGHUP (dflash.errors): the normal way to stop
        return 0
    finally:
        for _, proc, *_ in procs:
            stop_group(proc)
        (keep_scratch if keep else remove_scratch)(logs)
