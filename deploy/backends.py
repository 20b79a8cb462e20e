#!/usr/bin/env python3
"""Local backends without Docker: the pinned OpenTelemetry Collector and Jaeger v2 (built
from source by deploy/build.sh, cached by version) and Debian's Prometheus, as plain
processes listening on 127.0.0.1 only.

    python deploy/backends.py up   [--dir runs/backends]   # make backends
    python deploy/backends.py down [--dir runs/backends]   # make backends-down
    python deploy/backends.py status [--dir runs/backends]

The Collector runs the repository's own collector-config.yaml; an overlay written next to
the logs changes only where things listen and the Jaeger endpoint (the compose service
name `jaeger` becomes the local Jaeger). Pids, logs and generated configs go under the
directory (default runs/backends/). The tests (tests/backends/test_backends_real.py) use the same
class with free ports and a temporary directory.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
COLLECTOR_CONFIG = ROOT / "collector-config.yaml"
JAEGER_CONFIG = DEPLOY / "jaeger" / "config.yaml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
JAEGER_EXPORTER = "otlp_grpc/jaeger"   # the exporter in collector-config.yaml that feeds Jaeger
NAMES = ("jaeger", "otelcol", "prometheus")


@dataclasses.dataclass
class Ports:
    """Every port the three programs listen on (all on 127.0.0.1). The defaults are what
    `make backends` uses: the trainer's usual OTLP ports and the UIs' usual ports; Jaeger's
    own OTLP receiver moves to 14317/14318 because the Collector has 4317/4318."""
    otlp_grpc: int = 4317          # Collector: where the trainer sends (gRPC)
    otlp_http: int = 4318          # Collector: where the trainer sends (HTTP)
    collector_health: int = 13133  # Collector: health_check extension
    collector_metrics: int = 8889  # Collector: prometheus exporter (trainer metrics + span metrics)
    collector_self: int = 8888     # Collector: its own telemetry (otelcol_*)
    jaeger_otlp_grpc: int = 14317  # Jaeger: OTLP in, from the Collector
    jaeger_otlp_http: int = 14318
    jaeger_query: int = 16686      # Jaeger: UI and query API (dflash stalls --jaeger)
    jaeger_query_grpc: int = 16685
    prometheus: int = 9090

    @classmethod
    def free(cls) -> "Ports":
        """Free loopback ports for every field (for tests running beside `make backends`)."""
        socks, ports = [], {}
        try:
            for f in dataclasses.fields(cls):
                s = socket.socket()
                s.bind(("127.0.0.1", 0))
                socks.append(s)
                ports[f.name] = s.getsockname()[1]
        finally:
            for s in socks:
                s.close()
        return cls(**ports)


def binary(name: str, build: bool = True) -> Path | None:
    """Path of the cached pinned binary (`otelcol` or `jaeger`); builds it when missing and
    `build` is true; None when it is missing and cannot be built (no Go)."""
    p = subprocess.run(["bash", str(DEPLOY / "build.sh"), name, "--print"], capture_output=True, text=True,
                       check=True)
    path = Path(p.stdout.strip())
    if path.is_file():
        return path
    if not build or shutil.which("go") is None:
        return None
    p = subprocess.run(["bash", str(DEPLOY / "build.sh"), name], stdout=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"deploy/build.sh {name} failed (exit {p.returncode})")
    return Path(p.stdout.strip().splitlines()[-1])


def jaeger_ui() -> Path | None:
    """Jaeger's web UI as built by `deploy/build.sh jaeger-ui` (`make backend-bins` does), or
    None when it is not built: then Jaeger serves the placeholder page a Go build embeds."""
    p = subprocess.run(["bash", str(DEPLOY / "build.sh"), "jaeger-ui", "--print"], capture_output=True, text=True,
                       check=True)
    path = Path(p.stdout.strip())
    return path if (path / "index.html").is_file() else None


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class Backends:
    def __init__(self, workdir: Path | str = ROOT / "runs" / "backends", ports: Ports | None = None,
                 scrape_interval: str = "5s", evaluation_interval: str = "5s",
                 alerts: Path | None = ALERTS, with_prometheus: bool = True):
        self.dir = Path(workdir).resolve()
        self.ports = ports or Ports()
        self.scrape_interval = scrape_interval
        self.evaluation_interval = evaluation_interval
        self.alerts = alerts
        self.with_prometheus = with_prometheus
        self.procs: dict[str, subprocess.Popen] = {}

    # -------------------------------------------------------------- URLs
    @property
    def otlp_http_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.otlp_http}"

    @property
    def otlp_grpc_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.otlp_grpc}"

    @property
    def jaeger_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.jaeger_query}"

    @property
    def prometheus_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.prometheus}"

    def log(self, name: str) -> Path:
        return self.dir / f"{name}.log"

    # -------------------------------------------------------------- generated configs
    def collector_overlay(self) -> dict:
        """Merged over collector-config.yaml (maps merge, lists are replaced): loopback
        listeners on our ports, and the local Jaeger instead of the compose service."""
        p = self.ports
        return {
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"127.0.0.1:{p.otlp_grpc}"},
                                                 "http": {"endpoint": f"127.0.0.1:{p.otlp_http}"}}}},
            "exporters": {JAEGER_EXPORTER: {"endpoint": f"127.0.0.1:{p.jaeger_otlp_grpc}"},
                          "prometheus": {"endpoint": f"127.0.0.1:{p.collector_metrics}"}},
            "extensions": {"health_check": {"endpoint": f"127.0.0.1:{p.collector_health}"}},
            "service": {"telemetry": {"metrics": {"readers": [
                {"pull": {"exporter": {"prometheus": {"host": "127.0.0.1", "port": p.collector_self}}}}]}}},
        }

    def prometheus_config(self) -> dict:
        p = self.ports
        cfg = {
            "global": {"scrape_interval": self.scrape_interval, "scrape_timeout": self.scrape_interval,
                       "evaluation_interval": self.evaluation_interval},
            "scrape_configs": [
                # the same jobs as deploy/prometheus/prometheus.yml, on loopback
                {"job_name": "dflash", "honor_labels": True,
                 "static_configs": [{"targets": [f"127.0.0.1:{p.collector_metrics}"]}]},
                {"job_name": "otel-collector",
                 "static_configs": [{"targets": [f"127.0.0.1:{p.collector_self}"]}]},
            ],
        }
        if self.alerts is not None:
            cfg["rule_files"] = [str(Path(self.alerts).resolve())]
        return cfg

    # -------------------------------------------------------------- processes
    def _spawn(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=self.dir, env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs[name] = proc
        (self.dir / f"{name}.pid").write_text(f"{proc.pid}\n")
        return proc

    def _wait(self, name: str, ready, deadline_s: float = 60.0) -> None:
        proc = self.procs[name]
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log ({self.log(name)}):\n"
                                   + self.log(name).read_text(errors="replace")[-3000:])
            try:
                if ready():
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{name} not ready after {deadline_s:.0f} s; its log ({self.log(name)}):\n"
                           + self.log(name).read_text(errors="replace")[-3000:])

    def start_jaeger(self) -> None:
        p = self.ports
        exe = binary("jaeger")
        if exe is None:
            raise RuntimeError("jaeger is not built and Go is missing (deploy/build.sh)")
        ui = jaeger_ui()
        self._spawn("jaeger", [str(exe), f"--config=file:{JAEGER_CONFIG}"], env={
            "JAEGER_QUERY_PORT": str(p.jaeger_query), "JAEGER_QUERY_GRPC_PORT": str(p.jaeger_query_grpc),
            "JAEGER_OTLP_GRPC_PORT": str(p.jaeger_otlp_grpc), "JAEGER_OTLP_HTTP_PORT": str(p.jaeger_otlp_http),
            **({"JAEGER_UI_ASSETS": str(ui)} if ui else {})})
        self._wait("jaeger", lambda: http_get(f"{self.jaeger_url}/api/services")[0] == 200
                   and port_open(p.jaeger_otlp_grpc))

    def start_collector(self) -> None:
        p = self.ports
        exe = binary("otelcol")
        if exe is None:
            raise RuntimeError("the collector is not built and Go is missing (deploy/build.sh)")
        overlay = self.dir / "otelcol-overlay.yaml"
        self.dir.mkdir(parents=True, exist_ok=True)
        overlay.write_text(json.dumps(self.collector_overlay(), indent=2) + "\n")   # JSON is YAML
        self._spawn("otelcol", [str(exe), f"--config=file:{COLLECTOR_CONFIG}", f"--config=file:{overlay}"])
        self._wait("otelcol", lambda: http_get(f"http://127.0.0.1:{p.collector_health}/")[0] == 200
                   and port_open(p.otlp_grpc) and port_open(p.otlp_http) and port_open(p.collector_metrics))

    def start_prometheus(self) -> bool:
        exe = shutil.which("prometheus")
        if exe is None:
            return False
        cfg = self.dir / "prometheus.yml"
        self.dir.mkdir(parents=True, exist_ok=True)
        cfg.write_text(json.dumps(self.prometheus_config(), indent=2) + "\n")
        self._spawn("prometheus", [exe, f"--config.file={cfg}", f"--storage.tsdb.path={self.dir / 'prometheus-data'}",
                                   f"--web.listen-address=127.0.0.1:{self.ports.prometheus}",
                                   "--web.enable-lifecycle"])
        self._wait("prometheus", lambda: http_get(f"{self.prometheus_url}/-/ready")[0] == 200)
        return True

    def start(self) -> "Backends":
        try:
            self.start_jaeger()
            self.start_collector()
            if self.with_prometheus:
                self.start_prometheus()
        except BaseException:
            self.stop()
            raise
        return self

    def stop_one(self, name: str, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            _terminate(proc.pid, sig, timeout, proc)
        (self.dir / f"{name}.pid").unlink(missing_ok=True)

    def stop(self) -> None:
        for name in ("prometheus", "otelcol", "jaeger"):
            self.stop_one(name)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def _terminate(pid: int, sig: int, timeout: float, proc: subprocess.Popen | None = None) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        elif not _alive(pid):
            return
        time.sleep(0.05)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    if proc is not None:
        proc.wait()


def down(workdir: Path) -> list[str]:
    """Stop what `up` started in `workdir` (by the pids it wrote, checked against the
    process' command line so a reused pid is never signalled)."""
    stopped = []
    for name in ("prometheus", "otelcol", "jaeger"):
        pidfile = workdir / f"{name}.pid"
        if not pidfile.exists():
            continue
        pid = int(pidfile.read_text().split()[0])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            cmdline = ""
        if cmdline and (name.replace("otelcol", "dflash-otelcol") in cmdline or name in cmdline):
            _terminate(pid, signal.SIGTERM, 15.0)
            stopped.append(f"{name} (pid {pid})")
        pidfile.unlink()
    return stopped


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="deploy/backends.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["up", "down", "status"])
    ap.add_argument("--dir", default=str(ROOT / "runs" / "backends"), help="pids, logs, configs (runs/backends)")
    ap.add_argument("--free-ports", action="store_true",
                    help="up: free loopback ports instead of the usual ones (written to DIR/ports.json)")
    a = ap.parse_args(argv)
    workdir = Path(a.dir).resolve()
    if a.action == "down":
        stopped = down(workdir)
        print("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))
        return 0
    if a.action == "status":
        for name in NAMES:
            pf = workdir / f"{name}.pid"
            pid = int(pf.read_text()) if pf.exists() else None
            print(f"{name:10s} " + (f"pid {pid} {'running' if _alive(pid) else 'DEAD'}" if pid else "not started"))
        return 0
    if any((workdir / f"{n}.pid").exists() and _alive(int((workdir / f"{n}.pid").read_text()))
           for n in NAMES):
        print(f"backends already running (pids in {workdir}); `make backends-down` first", file=sys.stderr)
        return 1
    b = Backends(workdir, Ports.free() if a.free_ports else None)
    taken = [f"{f.name}={getattr(b.ports, f.name)}" for f in dataclasses.fields(b.ports)
             if port_open(getattr(b.ports, f.name))]
    if taken:
        print("ports already in use on 127.0.0.1: " + ", ".join(taken), file=sys.stderr)
        return 1
    b.with_prometheus = shutil.which("prometheus") is not None
    t0 = time.monotonic()
    try:
        b.start()
    except RuntimeError as e:
        print(f"backends: {e}", file=sys.stderr)
        return 1
    for proc in b.procs.values():   # they outlive this command: `make backends-down` stops them
        proc.returncode = 0
    p = b.ports
    (workdir / "ports.json").write_text(json.dumps(dataclasses.asdict(p), indent=2) + "\n")
    print(f"backends up in {time.monotonic() - t0:.1f} s (pids and logs in {workdir}):")
    print(f"  Collector  OTLP gRPC 127.0.0.1:{p.otlp_grpc}, HTTP 127.0.0.1:{p.otlp_http}; "
          f"metrics :{p.collector_metrics}, own :{p.collector_self}, health :{p.collector_health}")
    print(f"  Jaeger     {b.jaeger_url}  (query API /api/traces; OTLP in on :{p.jaeger_otlp_grpc})"
          + ("" if jaeger_ui() else "; UI not built, a placeholder page: deploy/build.sh jaeger-ui"))
    if b.with_prometheus:
        print(f"  Prometheus {b.prometheus_url}  (rules: deploy/prometheus/alerts.yml)")
    else:
        print("  Prometheus not installed (apt-get install prometheus): skipped")
    print(f"then: OTEL_EXPORTER_OTLP_ENDPOINT={b.otlp_http_endpoint} dflash train --out runs/watch ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
