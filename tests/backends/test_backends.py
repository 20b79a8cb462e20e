"""Backends: a real Prometheus scraping a real training run, and the consistency of the
deployment files (collector-config.yaml, docker-compose.yml, deploy/) with what the
trainer sends and exports. No Docker needed."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from helpers import NO_OTEL_ENV, ROOT, TINY, free_port

STEPS = 6
PROMETHEUS = shutil.which("prometheus")


def _get(url, timeout=2.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


class Prometheus:
    """Debian's prometheus on a free loopback port, temp storage, scraping `target` every 1 s."""

    def __init__(self, tmp: Path, target: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = tmp / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "dflash", "scrape_interval": "1s", "scrape_timeout": "1s",
                                "static_configs": [{"targets": [target]}]}]}))
        self.log = open(tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if "Ready" in _get(self.url + "/-/ready"):
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"prometheus did not become ready:\n{(tmp / 'prometheus.log').read_text()[-2000:]}")

    def query(self, expr: str):
        doc = json.loads(_get(self.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert doc["status"] == "success", doc
        return doc["data"]["result"]

    def value(self, expr: str):
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def stop(self):
        if self.proc.poll() is None:
            try:
                urllib.request.urlopen(urllib.request.Request(self.url + "/-/quit", method="POST"), timeout=2)
                self.proc.wait(timeout=10)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def scraped_run(tmp_path_factory):
    """One short training run with OTEL_METRICS_EXPORTER=prometheus, scraped by a real
    Prometheus (when installed) and by this test itself (for the metric names)."""
    tmp = tmp_path_factory.mktemp("prom")
    port = free_port()
    prom = Prometheus(tmp, f"127.0.0.1:{port}") if PROMETHEUS else None
    run = tmp / "run"
    env = dict(os.environ) | NO_OTEL_ENV | {
        "OTEL_METRICS_EXPORTER": "prometheus", "OTEL_TRACES_EXPORTER": "file",
        "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1", "OTEL_EXPORTER_PROMETHEUS_PORT": str(port),
        "DFLASH_PROMETHEUS_LINGER_S": "3"}   # >= 2 scrapes at 1 s after the final flush
    cmd = [sys.executable, "-m", "dflash", "train", "--out", str(run), "--target", "tiny-llama",
           "--steps", str(STEPS), *TINY, "--inject-delay", "backward=0.3"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    scrapes = []
    try:
        while proc.poll() is None:
            try:
                scrapes.append(_get(f"http://127.0.0.1:{port}/metrics", timeout=1))
            except OSError:
                pass
            time.sleep(0.5)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        assert scrapes, "the trainer's scrape endpoint never answered"
        summary = json.loads((run / "summary.json").read_text())
        yield {"prom": prom, "summary": summary, "scrape": scrapes[-1], "scrapes": scrapes, "run": run}
    finally:
        if proc.poll() is None:
            proc.kill()
        if prom is not None:
            prom.stop()


# ------------------------------------------------------------------ real Prometheus

@pytest.mark.slow
def test_real_prometheus_sees_the_runs_own_numbers(scraped_run):
    prom = scraped_run["prom"]
    if prom is None:
        pytest.skip("the `prometheus` binary is not installed (apt-get install prometheus; .ci/run does it)")
    s = scraped_run["summary"]
    stages = s["telemetry"]["stages"]
    # Prometheus' first scrape lands ~5 s after start; the run lingers 3 s after its last step
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        tokens = prom.value("sum(max_over_time(dflash_tokens_total[10m]))")
        if tokens == s["tokens_this_run"]:
            break
        time.sleep(0.5)
    assert tokens == s["tokens_this_run"] == s["tokens"], (tokens, s["tokens_this_run"])
    for stage, st in stages.items():
        got = prom.value(f'sum(max_over_time(dflash_stage_duration_seconds_count{{stage="{stage}",clock="host"}}[10m]))')
        assert got == st["count"], f"{stage}: Prometheus {got} vs the run's profile {st['count']}"
    assert stages["optimizer_step"]["count"] == STEPS
    # the sum too: the histogram's total time per stage equals the profile's (exact, not sketched)
    got = prom.value('sum(max_over_time(dflash_stage_duration_seconds_sum{stage="backward",clock="host"}[10m]))')
    assert got == pytest.approx(stages["backward"]["total_s"], rel=1e-6)
    assert prom.value("sum(max_over_time(dflash_train_steps_total[10m]))") == STEPS
    assert prom.value("sum(max_over_time(otel_spans_dropped_total[10m]))") == 0
    q = 'sum(max_over_time(dflash_stage_duration_seconds_count{stage="backward",clock="host"}[10m]))'
    print(f"\nPrometheus: sum(max_over_time(dflash_tokens_total[10m])) = {tokens:g} "
          f"(summary.json tokens {s['tokens']}); {q} = {prom.value(q):g} (profile count "
          f"{stages['backward']['count']})")


# ------------------------------------------------------------------ per-rank scrape ports

def test_each_torchrun_rank_gets_its_own_prometheus_port(monkeypatch):
    from dflash.run.telemetry_setup import rank_prometheus_port

    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp,prometheus")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", "9500")
    for local in (0, 1, 3):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        with rank_prometheus_port():
            assert os.environ["OTEL_EXPORTER_PROMETHEUS_PORT"] == str(9500 + local)
        assert os.environ["OTEL_EXPORTER_PROMETHEUS_PORT"] == "9500"  # the base is left as given
    monkeypatch.delenv("OTEL_EXPORTER_PROMETHEUS_PORT")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with rank_prometheus_port():
        assert os.environ["OTEL_EXPORTER_PROMETHEUS_PORT"] == "9466"      # default base 9464
    assert "OTEL_EXPORTER_PROMETHEUS_PORT" not in os.environ
    monkeypatch.delenv("LOCAL_RANK")                                       # not under torchrun
    with rank_prometheus_port():
        assert "OTEL_EXPORTER_PROMETHEUS_PORT" not in os.environ


# ------------------------------------------------------------------ deployment files

def _load(rel):
    return yaml.safe_load((ROOT / rel).read_text())


def _host_port(endpoint: str):
    ep = re.sub(r"^[a-z]+://", "", endpoint).split("/")[0]
    host, _, port = ep.rpartition(":")
    return host, int(port)


def test_collector_pipelines_are_complete_and_listen_where_the_trainer_sends():
    c = _load("collector-config.yaml")
    compose = _load("docker-compose.yml")
    services = set(compose["services"])
    kinds = {k: set(c.get(k) or {}) for k in ("receivers", "processors", "exporters", "connectors", "extensions")}
    pipes = c["service"]["pipelines"]
    assert {"traces", "metrics"} <= set(pipes)
    used_as_exporter, used_as_receiver = set(), set()
    for name, p in pipes.items():
        for r in p["receivers"]:
            assert r in kinds["receivers"] | kinds["connectors"], f"{name}: receiver {r} not defined"
            used_as_receiver.add(r)
        for x in p.get("processors", []):
            assert x in kinds["processors"], f"{name}: processor {x} not defined"
        assert p["processors"][0].split("/")[0] == "memory_limiter", f"{name}: memory_limiter must come first"
        assert any(x.split("/")[0] == "batch" for x in p["processors"]), f"{name}: no batching"
        for e in p["exporters"]:
            assert e in kinds["exporters"] | kinds["connectors"], f"{name}: exporter {e} not defined"
            used_as_exporter.add(e)
    for conn in kinds["connectors"]:  # a connector links two pipelines
        assert conn in used_as_exporter and conn in used_as_receiver, conn
    for ext in c["service"].get("extensions", []):
        assert ext in kinds["extensions"], ext
    # current component names (deprecated aliases log warnings on 0.157)
    assert not {"logging", "otlp", "otlphttp"} & {e.split("/")[0] for e in kinds["exporters"]}
    assert any(k.split("/")[0] == "span_metrics" for k in kinds["connectors"])
    sm = next(v for k, v in c["connectors"].items() if k.split("/")[0] == "span_metrics")
    assert {d["name"] for d in sm["dimensions"]} >= {"worker", "rank"} and sm["exemplars"]["enabled"]

    # receivers: where the trainer sends by default (OTLP gRPC 4317 / HTTP 4318), all interfaces in the container
    protos = c["receivers"]["otlp"]["protocols"]
    assert _host_port(protos["grpc"]["endpoint"]) == ("0.0.0.0", 4317)
    assert _host_port(protos["http"]["endpoint"]) == ("0.0.0.0", 4318)
    published = {p.split(":")[-1] for p in compose["services"]["collector"]["ports"]}
    assert {"4317", "4318"} <= published
    doc = (ROOT / "docs" / "backends.md").read_text()
    assert "OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317" in doc

    # every client endpoint names a compose service; every server endpoint is scraped
    prom_cfg = _load("deploy/prometheus/prometheus.yml")
    scraped = {t for job in prom_cfg["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    for name, e in c["exporters"].items():
        if not isinstance(e, dict) or "endpoint" not in e:
            continue
        host, port = _host_port(e["endpoint"])
        if host in ("0.0.0.0", "", "::"):
            assert f"collector:{port}" in scraped, f"exporter {name} serves :{port} but nobody scrapes it"
        else:
            assert host in services, f"exporter {name} sends to {host!r}, not a compose service"
    own = c["service"]["telemetry"]["metrics"]["readers"][0]["pull"]["exporter"]["prometheus"]
    assert f"collector:{own['port']}" in scraped, "the collector's own telemetry is not scraped"
    for t in scraped:
        assert t.split(":")[0] in services, t


def test_compose_ports_loopback_images_pinned_files_exist():
    compose = _load("docker-compose.yml")
    assert {"collector", "jaeger", "prometheus", "grafana"} <= set(compose["services"])
    for name, svc in compose["services"].items():
        image = svc["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and re.fullmatch(r"v?\d+\.\d+\.\d+", tag), f"{name}: image {image!r} is not pinned to a version"
        for p in svc.get("ports", []):
            assert str(p).startswith("127.0.0.1:"), f"{name}: port {p!r} is not bound to 127.0.0.1"
        for v in svc.get("volumes", []):
            src = v.split(":")[0]
            if src.startswith("./"):
                assert (ROOT / src).exists(), f"{name}: volume source {src} missing"
    assert compose["services"]["collector"]["image"].startswith("otel/opentelemetry-collector-contrib:")
    assert compose["services"]["jaeger"]["image"].startswith("jaegertracing/jaeger:2.")  # v2
    jports = [str(p).split(":")[-1] for p in compose["services"]["jaeger"].get("ports", [])]
    assert "16686" in jports and not {"4317", "4318"} & set(jports), "Jaeger's OTLP ports stay internal"


def _grafana_mounts(compose):
    """container path -> repository path for Grafana's bind mounts."""
    out = {}
    for v in compose["services"]["grafana"]["volumes"]:
        parts = v.split(":")
        if parts[0].startswith("./"):
            out[parts[1]] = ROOT / parts[0]
    return out


def _to_repo(path: str, mounts: dict) -> Path:
    for cpath, rpath in sorted(mounts.items(), key=lambda kv: -len(kv[0])):
        if path == cpath or path.startswith(cpath.rstrip("/") + "/"):
            return rpath / os.path.relpath(path, cpath)
    raise AssertionError(f"{path} is not mounted into the grafana container")


def _dashboards():
    compose = _load("docker-compose.yml")
    mounts = _grafana_mounts(compose)
    prov = _to_repo("/etc/grafana/provisioning", mounts)
    files = []
    for f in sorted((prov / "dashboards").glob("*.y*ml")):
        for p in yaml.safe_load(f.read_text())["providers"]:
            d = _to_repo(p["options"]["path"], mounts)
            assert d.is_dir(), d
            files += sorted(d.glob("*.json"))
    return files


def test_grafana_provisioning_files_exist_and_parse():
    compose = _load("docker-compose.yml")
    services = set(compose["services"])
    mounts = _grafana_mounts(compose)
    prov = _to_repo("/etc/grafana/provisioning", mounts)
    ds_files = sorted((prov / "datasources").glob("*.y*ml"))
    assert ds_files
    ds = [d for f in ds_files for d in yaml.safe_load(f.read_text())["datasources"]]
    uids = {d["uid"]: d for d in ds}
    assert {d["type"] for d in ds} >= {"prometheus", "jaeger"}
    for d in ds:
        assert urllib.parse.urlparse(d["url"]).hostname in services, d["url"]
    for dest in uids["prometheus"]["jsonData"]["exemplarTraceIdDestinations"]:
        assert uids[dest["datasourceUid"]]["type"] == "jaeger"
    home = compose["services"]["grafana"]["environment"].get("GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH")
    if home:
        assert _to_repo(home, mounts).is_file()
    files = _dashboards()
    assert files
    for f in files:
        dash = json.loads(f.read_text())
        assert dash["panels"]
        for p in dash["panels"]:
            for t in p.get("targets", []):
                assert t["datasource"]["uid"] in uids, (p["title"], t["datasource"])
        assert any(t.get("exemplar") for p in dash["panels"] for t in p.get("targets", [])), "no exemplar panel"


# PromQL words that are not metric names
_PROMQL = {"sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values",
           "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset",
           "rate", "irate", "increase", "delta", "idelta", "deriv", "histogram_quantile", "max_over_time",
           "min_over_time", "avg_over_time", "sum_over_time", "last_over_time", "clamp_min", "clamp_max", "abs",
           "vector", "scalar", "time", "label_replace", "absent", "e", "inf", "nan"}


def _metric_refs(expr: str):
    """(plain metric names, __name__ regexes) referenced by a PromQL expression."""
    regexes = re.findall(r'__name__\s*=~\s*"([^"]*)"', expr)
    e = re.sub(r'"[^"]*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = {m.group(1) for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", e)
             if not m.group(2) and m.group(1).lower() not in _PROMQL and not m.group(1).startswith("$")}
    return names, regexes


def _nvml_names():
    """The NVML gauges' Prometheus names, made by the same exporter the trainer uses (no
    NVML on this machine, so a real run cannot show them)."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from opentelemetry.metrics import Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from prometheus_client import REGISTRY, generate_latest

    from otel.exporter import nvml

    specs = dict(nvml.GAUGES)
    for n in nvml.WINDOWED:
        specs[n + ".min"] = specs[n + ".max"] = nvml.GAUGES[n]
    specs[nvml.THROTTLE_GAUGE] = specs[nvml.AVAILABLE_GAUGE] = ("1", "")
    provider = MeterProvider(metric_readers=[PrometheusMetricReader()])
    try:
        meter = provider.get_meter("otel")
        for name, (unit, desc) in specs.items():
            meter.create_observable_gauge(name, [lambda o: [Observation(1.0, {"gpu.index": "0"})]], unit, desc)
        text = generate_latest(REGISTRY).decode()
    finally:
        provider.shutdown()  # unregisters its collector from the global registry
    return _names_in_exposition(text, prefix="hw_")


def _names_in_exposition(text: str, prefix=""):
    return {re.split(r"[{ ]", line, 1)[0] for line in text.splitlines()
            if line and not line.startswith("#") and line.startswith(prefix)}


# Produced by the collector, not the trainer: the span_metrics
# connector's series (from the trainer's spans; namespace from collector-config.yaml) and
# the collector's own health counters.
# The pinned Collector (0.165) exposes its counters without `_total` (seen in a real one:
# tests/backends/test_backends_real.py); the dashboard matches both spellings.
COLLECTOR_SELF = {"otelcol_receiver_refused_spans", "otelcol_exporter_send_failed_spans",
                  "otelcol_exporter_send_failed_metric_points"}


def _span_metric_names():
    c = _load("collector-config.yaml")
    sm = next(v for k, v in c["connectors"].items() if k.split("/")[0] == "span_metrics")
    ns = sm.get("namespace", "traces.span.metrics").replace(".", "_")
    unit = {"s": "seconds", "ms": "milliseconds"}[sm.get("histogram", {}).get("unit", "ms")]
    return {f"{ns}_duration_{unit}_{x}" for x in ("bucket", "sum", "count")} | {f"{ns}_calls_total"}


@pytest.mark.slow
def test_dashboard_queries_use_only_metric_names_the_trainer_exports(scraped_run):
    # every scrape's names: a gauge of the run's phases exists only while its phase is open
    exported = set().union(*(_names_in_exposition(x) for x in scraped_run["scrapes"]))
    assert {"dflash_stage_duration_seconds_bucket", "dflash_tokens_total", "dflash_queue_depth",
            "otel_spans_dropped_total"} <= exported, sorted(exported)
    known = exported | _nvml_names() | _span_metric_names() | COLLECTOR_SELF
    seen = set()
    for f in _dashboards():
        for p in json.loads(f.read_text())["panels"]:
            for t in p.get("targets", []):
                names, regexes = _metric_refs(t["expr"])
                assert names or regexes, t["expr"]
                for n in names:
                    assert n in known, f"{f.name} / {p['title']}: {n!r} is not a metric the trainer exports"
                for rx in regexes:
                    hits = {n for n in known if re.fullmatch(rx, n)}
                    assert hits, f"{f.name} / {p['title']}: {rx!r} matches no exported metric"
                    seen |= hits
                seen |= names
    # the dashboard covers what the issue asks for
    for needed in ("dflash_stage_duration_seconds_bucket", "dflash_tokens_total", "dflash_queue_depth",
                   "dflash_queue_producer_blocked_seconds_total", "dflash_queue_consumer_starved_seconds_total",
                   "dflash_worker_batches_total", "dflash_worker_idle_seconds_total", "hw_gpu_utilization_max", "hw_gpu_memory_usage_max_bytes",
                   "hw_power_max_watts", "hw_temperature_max_celsius", "otel_spans_dropped_total",
                   "otel_export_failures_total", "traces_span_metrics_duration_seconds_bucket",
                   "dflash_run_phase_elapsed_seconds"):
        assert needed in seen, f"no dashboard panel shows {needed}"
    assert any(n.startswith("dflash_queue_min_ready_ratio") for n in seen)
    assert any(n.startswith("dflash_run_phase_progress") for n in seen), "no panel shows the phases' progress"
