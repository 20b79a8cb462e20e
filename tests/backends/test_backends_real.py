"""The real backends: the pinned OpenTelemetry Collector and Jaeger v2, built from source
by deploy/build.sh (cached in ~/.cache/dflash/bin), and Debian's Prometheus, started as
local processes on free loopback ports by deploy/backends.py (what `make backends` runs)
and fed by real training runs over OTLP.

  - the pins: docker-compose.yml's images are the releases that deploy/ builds;
  - the repository's collector-config.yaml loads in the real Collector;
  - a run with a slowed target: Jaeger holds one trace per batch with all 8 stages and
    `stall` events on queue_get; `dflash stalls --jaeger` agrees with the run's files;
    Prometheus (scraping the Collector) has the span-metrics counts, the tokens and the
    Collector's sent-span count; the starved-drafter alert fires, and does not for an
    unperturbed run;
  - the Collector killed and restarted mid-run: the run completes, the gap's losses are
    counted, export resumes;
  - deploy/prometheus/alerts.yml passes `promtool check rules`.

Skipped only when Go is missing and the binaries were never built (CI has Go: .ci/run
builds them before the tests), or, for the Prometheus parts, when Prometheus is missing.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from helpers import ROOT, TINY, last_json, run_dflash

sys.path.insert(0, str(ROOT / "deploy"))
import backends as bk  # noqa: E402  (deploy/backends.py)

PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
STAGES = {"data_load", "model_forward", "pack_hidden", "cpu_copy_enqueue", "queue_get",
          "drafter_forward", "backward", "optimizer_step"}
SLOW_STEPS = 8
SLOW_TARGET = "model_forward=2.0"   # the drafter (~0.3-0.7 s/step on CPU) waits ~75% of the time
KILL_STEPS = 24
EXPORT_TIMEOUT_S = 5.0   # otel.Telemetry's export_timeout_s default: one OTLP request's retry budget
CALM_STEPS = 60   # ~15 s: the counters move across several 1 s scrapes (a 5 s run lands in one)


def _versions() -> dict:
    out = {}
    for line in (ROOT / "deploy" / "versions.env").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _requires(gomod: Path) -> dict:
    """module -> version from a go.mod's require lines."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^\s*(?:require\s+)?(\S+)\s+(v\S+)(?:\s+//.*)?$",
                                                        gomod.read_text(), re.M)}


# ------------------------------------------------------------------ pins (no Go needed)

def test_compose_images_are_the_releases_built_from_source():
    v = _versions()
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    col = compose["services"]["collector"]["image"]
    jae = compose["services"]["jaeger"]["image"]
    assert col == f"otel/opentelemetry-collector-contrib:{v['OTELCOL_CONTRIB_VERSION']}", col
    assert jae == f"jaegertracing/jaeger:{v['JAEGER_VERSION']}", jae

    # the Collector's Go modules: core at one release (v0.x with its stable v1.y twins),
    # contrib at the release the image is tagged with, same minor as core
    reqs = _requires(ROOT / "deploy" / "otelcol" / "go.mod")
    core = {m: ver for m, ver in reqs.items() if m.startswith("go.opentelemetry.io/collector")}
    contrib = {m: ver for m, ver in reqs.items() if m.startswith("github.com/open-telemetry/opentelemetry-collector-contrib/")}
    assert core and contrib
    unstable = {ver for ver in core.values() if ver.startswith("v0.")}
    stable = {ver for ver in core.values() if ver.startswith("v1.")}
    assert unstable == {f"v{v['OTELCOL_CORE_VERSION']}"}, unstable
    assert len(stable) == 1, f"core's stable modules at several releases: {stable}"
    assert set(contrib.values()) == {f"v{v['OTELCOL_CONTRIB_VERSION']}"}, contrib
    assert v["OTELCOL_CORE_VERSION"].split(".")[1] == v["OTELCOL_CONTRIB_VERSION"].split(".")[1]

    # Jaeger: the module is tagged v1.N and released together with v2.(N-63) (v1.76.0 / v2.13.0)
    jreqs = _requires(ROOT / "deploy" / "jaeger" / "go.mod")
    assert jreqs["github.com/jaegertracing/jaeger"] == f"v{v['JAEGER_MODULE_VERSION']}"
    assert "tool github.com/jaegertracing/jaeger/cmd/jaeger" in (ROOT / "deploy" / "jaeger" / "go.mod").read_text()
    m1, m2 = v["JAEGER_MODULE_VERSION"].split("."), v["JAEGER_VERSION"].split(".")
    assert m1[0] == "1" and m2[0] == "2" and int(m1[1]) - 63 == int(m2[1]) and m1[2] == m2[2], (m1, m2)


def test_alert_rules_pass_promtool_and_both_prometheus_configs_load_them(tmp_path):
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (apt-get install prometheus; .ci/run does it)")
    alerts = ROOT / "deploy" / "prometheus" / "alerts.yml"
    p = subprocess.run([PROMTOOL, "check", "rules", str(alerts)], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
    names = {r["alert"] for g in yaml.safe_load(alerts.read_text())["groups"] for r in g["rules"]}
    assert {"DflashDrafterStarved", "DflashTargetBlocked", "DflashTelemetryDroppingSpans",
            "DflashTelemetryExportFailing", "DflashGpuUnderused", "DflashNonFiniteSteps"} <= names

    # compose: prometheus.yml names /etc/prometheus/alerts.yml, which compose mounts from the repo
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    mounts = {v.split(":")[1]: ROOT / v.split(":")[0] for v in compose["services"]["prometheus"]["volumes"]
              if v.startswith("./")}
    cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    assert cfg["rule_files"] and all(mounts.get(f) == alerts for f in cfg["rule_files"]), (cfg["rule_files"], mounts)
    cfg["rule_files"] = [str(mounts[f]) for f in cfg["rule_files"]]
    (tmp_path / "compose.yml").write_text(yaml.safe_dump(cfg))
    # make backends: the config deploy/backends.py writes
    (tmp_path / "backends.yml").write_text(json.dumps(bk.Backends(tmp_path).prometheus_config()))
    assert bk.Backends(tmp_path).prometheus_config()["rule_files"] == [str(alerts)]
    for f in ("compose.yml", "backends.yml"):
        p = subprocess.run([PROMTOOL, "check", "config", str(tmp_path / f)], capture_output=True, text=True)
        assert p.returncode == 0 and "7 rules found" in p.stdout, f + ":\n" + p.stdout + p.stderr


# ------------------------------------------------------------------ the binaries

@pytest.fixture(scope="module")
def bins():
    try:
        otelcol, jaeger = bk.binary("otelcol"), bk.binary("jaeger")
    except RuntimeError as e:
        pytest.fail(str(e))
    if otelcol is None or jaeger is None:
        pytest.skip("Go is not installed, so the pinned Collector and Jaeger cannot be built "
                    "(deploy/build.sh; CI has Go and builds them in .ci/run)")
    return {"otelcol": otelcol, "jaeger": jaeger}


@pytest.mark.timeout(1800)   # a first build on 2 cores, when .ci/run has not built them already
def test_built_binaries_are_the_pinned_releases(bins):
    v = _versions()
    out = subprocess.run([bins["otelcol"], "--version"], capture_output=True, text=True, check=True).stdout
    assert v["OTELCOL_CONTRIB_VERSION"] in out, out
    out = subprocess.run([bins["jaeger"], "version"], capture_output=True, text=True, check=True).stdout
    assert f'v{v["JAEGER_VERSION"]}' in out, out


@pytest.mark.timeout(1800)
def test_repo_collector_config_loads_in_the_real_collector(bins, tmp_path):
    p = subprocess.run([bins["otelcol"], "validate", f"--config=file:{bk.COLLECTOR_CONFIG}"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    # the binary has exactly the components the config uses
    cfg = yaml.safe_load(bk.COLLECTOR_CONFIG.read_text())
    comps = yaml.safe_load(subprocess.run([bins["otelcol"], "components"], capture_output=True, text=True,
                                          check=True).stdout)
    for kind in ("receivers", "processors", "exporters", "connectors", "extensions"):
        used = {k.split("/")[0] for k in cfg.get(kind) or {}}
        built = {c["name"] for c in comps.get(kind) or []}
        assert used == built, f"{kind}: config uses {sorted(used)}, binary has {sorted(built)}"


@pytest.mark.timeout(1800)
def test_backends_up_and_down_leave_nothing_running(bins, tmp_path):
    """What `make backends` / `make backends-down` run (on free ports here)."""
    script = str(ROOT / "deploy" / "backends.py")
    p = subprocess.run([sys.executable, script, "up", "--dir", str(tmp_path), "--free-ports"],
                       capture_output=True, text=True, timeout=300)
    try:
        assert p.returncode == 0, p.stdout + p.stderr
        ports = json.loads((tmp_path / "ports.json").read_text())
        pids = {n: int((tmp_path / f"{n}.pid").read_text()) for n in ("jaeger", "otelcol")}
        assert bk.http_get(f"http://127.0.0.1:{ports['jaeger_query']}/api/services")[0] == 200
        assert bk.http_get(f"http://127.0.0.1:{ports['collector_health']}/")[0] == 200
        if PROMETHEUS:
            pids["prometheus"] = int((tmp_path / "prometheus.pid").read_text())
            assert bk.http_get(f"http://127.0.0.1:{ports['prometheus']}/-/ready")[0] == 200
        assert "already running" in subprocess.run([sys.executable, script, "up", "--dir", str(tmp_path)],
                                                   capture_output=True, text=True).stderr
    finally:
        d = subprocess.run([sys.executable, script, "down", "--dir", str(tmp_path)], capture_output=True, text=True)
    assert d.returncode == 0 and all(n in d.stdout for n in pids), d.stdout
    for n, pid in pids.items():
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text(), n
    assert not list(tmp_path.glob("*.pid"))


# ------------------------------------------------------------------ helpers for the runs

def _train_env(b: bk.Backends) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=b.otlp_http_endpoint,   # the Collector's OTLP/HTTP receiver
               OTEL_TRACES_EXPORTER="otlp,file",                   # the files too: `dflash stalls RUN_DIR`
               OTEL_METRICS_EXPORTER="otlp")
    return env


def _train_cmd(out: Path, steps: int, *extra) -> list[str]:
    return [sys.executable, "-m", "dflash", "train", "--out", str(out), "--target", "tiny-llama",
            "--steps", str(steps), *TINY, *extra]


def _train(b: bk.Backends, out: Path, steps: int, *extra) -> dict:
    p = subprocess.run(_train_cmd(out, steps, *extra), cwd=ROOT, env=_train_env(b), capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return _run_facts(out)


def _run_facts(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    spans = []
    for line in (out / "telemetry" / "traces.jsonl").read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            res = {a["key"]: a["value"] for a in rs["resource"]["attributes"]}
            for ss in rs["scopeSpans"]:
                spans += [(s, res) for s in ss["spans"]]
    run_id = {res["run.id"]["stringValue"] for _, res in spans}
    assert len(run_id) == 1, run_id
    return {"summary": summary, "run_id": run_id.pop(), "file_spans": [s for s, _ in spans], "dir": out}


def _jaeger_traces(b: bk.Backends, run_id: str) -> list[dict]:
    """The run's traces from Jaeger's query API (as `dflash stalls --jaeger` reads them)."""
    end = time.time_ns() // 1000
    q = urllib.parse.urlencode({"service": "dflash", "limit": 2000, "start": end - 3600 * 10**6, "end": end})
    status, body = bk.http_get(f"{b.jaeger_url}/api/traces?{q}", timeout=10)
    assert status == 200, body[:500]
    out = []
    for t in json.loads(body)["data"] or []:
        procs = {pid: {tag["key"]: tag["value"] for tag in p.get("tags", [])} for pid, p in t["processes"].items()}
        if any(p.get("run.id") == run_id for p in procs.values()):
            out.append(t)
    return out


def _wait_for(cond, what: str, deadline_s: float = 90.0, every: float = 0.5):
    """Poll cond() until it returns something truthy; fail with `what` after the deadline."""
    deadline = time.monotonic() + deadline_s
    last = None
    while time.monotonic() < deadline:
        last = cond()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {deadline_s:.0f} s waiting for {what} (last: {last!r})")


def _own_metric(b: bk.Backends, name: str, **labels) -> float:
    """Sum of one of the Collector's own counters from its :8888 endpoint (0 when absent)."""
    _, text = bk.http_get(f"http://127.0.0.1:{b.ports.collector_self}/metrics")
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{name}(?:_total)?(\{{[^}}]*\}})?\s+(\S+)", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


class Prom:
    def __init__(self, url):
        self.url = url

    def query(self, expr: str) -> list:
        status, body = bk.http_get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "success", body[:500]
        return doc["data"]["result"]

    def value(self, expr: str):
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else None

    def series(self, match: str) -> list[dict]:
        q = urllib.parse.urlencode({"match[]": match, "start": time.time() - 3600})
        status, body = bk.http_get(f"{self.url}/api/v1/series?{q}")
        assert status == 200, body[:500]
        return json.loads(body)["data"]

    def alerts(self, name: str) -> list[dict]:
        _, body = bk.http_get(f"{self.url}/api/v1/alerts")
        return [a for a in json.loads(body)["data"]["alerts"] if a["labels"].get("alertname") == name]


def _short_alerts(tmp: Path) -> Path:
    """deploy/prometheus/alerts.yml with every `for:` cut to 1 s (expressions unchanged), so
    that a run of seconds can take an alert from pending to firing."""
    doc = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())
    for g in doc["groups"]:
        for r in g["rules"]:
            if "for" in r:
                r["for"] = "1s"
    out = tmp / "alerts-short.yml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


# ------------------------------------------------------------------ the stack + a slowed-target run

@pytest.fixture(scope="module")
def stack(bins, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("backends")
    b = bk.Backends(tmp / "backends", bk.Ports.free(), scrape_interval="1s", evaluation_interval="1s",
                    alerts=_short_alerts(tmp), with_prometheus=PROMETHEUS is not None)
    b.start()
    try:
        yield b
    finally:
        b.stop()
        assert not b.procs


@pytest.fixture(scope="module")
def slow_run(stack, tmp_path_factory):
    """A run whose target sleeps in model_forward: the drafter starves on queue_empty.
    The Collector's own counters are read right after it, before any other run."""
    run = _train(stack, tmp_path_factory.mktemp("slow") / "run", SLOW_STEPS, "--inject-delay", SLOW_TARGET)
    health = run["summary"]["telemetry"]["health"]
    assert health["spans_dropped"] == 0 and health["export_failures"] == 0, health
    assert health["spans_recorded"] == health["spans_exported"] == len(run["file_spans"]), health
    # everything the run exported has gone through the Collector into Jaeger
    n = health["spans_recorded"]
    run["traces"] = _wait_for(
        lambda: (lambda ts: ts if sum(len(t["spans"]) for t in ts) >= n else None)(_jaeger_traces(stack, run["run_id"])),
        f"Jaeger to hold the run's {n} spans")
    # (the counter moves right after Jaeger's answer: wait for it, then compare exactly)
    _wait_for(lambda: _own_metric(stack, "otelcol_exporter_sent_spans", exporter="otlp_grpc/jaeger") >= n,
              "the Collector's otelcol_exporter_sent_spans to reach the run's spans", deadline_s=30)
    run["sent"] = _own_metric(stack, "otelcol_exporter_sent_spans", exporter="otlp_grpc/jaeger")
    run["accepted"] = _own_metric(stack, "otelcol_receiver_accepted_spans")
    return run


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_jaeger_holds_one_trace_per_batch_with_every_stage_and_stall_events(stack, slow_run):
    traces = slow_run["traces"]
    steps = slow_run["summary"]["steps"]
    assert steps == SLOW_STEPS
    batches = [t for t in traces if any(re.fullmatch(r"batch \d+", s["operationName"]) for s in t["spans"])]
    assert len(batches) == steps, f"{len(batches)} batch traces for {steps} steps"
    # the file sink and Jaeger hold the same traces and spans
    file_traces = {s["traceId"] for s in slow_run["file_spans"]}
    assert {t["traceID"] for t in traces} == file_traces
    assert sum(len(t["spans"]) for t in traces) == len(slow_run["file_spans"])
    stalls = 0
    for t in batches:
        names = {s["operationName"] for s in t["spans"]}
        assert STAGES <= names, f"trace {t['traceID']}: missing {STAGES - names}"
        for s in t["spans"]:
            if s["operationName"] != "queue_get":
                continue
            for log in s.get("logs", []):
                fields = {f["key"]: f["value"] for f in log["fields"]}
                if fields.get("event") == "stall":
                    assert fields.get("cause") == "queue_empty", fields
                    stalls += 1
    assert stalls >= steps - 1, f"only {stalls} stall events on queue_get spans"
    assert "deprecated" not in (stack.dir / "otelcol.log").read_text().lower()
    print(f"\nJaeger: {len(traces)} traces for run {slow_run['run_id'][:8]} ({len(batches)} batch traces, "
          f"{sum(len(t['spans']) for t in traces)} spans), {stalls} stall events on queue_get")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_dflash_stalls_from_real_jaeger_agrees_with_the_run_files(stack, slow_run):
    p = run_dflash("stalls", "--jaeger", stack.jaeger_url, "--run-id", slow_run["run_id"], "--json")
    via_jaeger = last_json(p.stdout)
    via_file = last_json(run_dflash("stalls", slow_run["dir"], "--json").stdout)
    assert via_jaeger["run_id"] == via_file["run_id"] == slow_run["run_id"]
    assert {w["label"] for w in via_jaeger["workers"]} == {w["label"] for w in via_file["workers"]}
    worst = 0.0
    for wf in via_file["workers"]:
        wj = next(w for w in via_jaeger["workers"] if w["label"] == wf["label"])
        assert wj["busy_fraction"] == pytest.approx(wf["busy_fraction"], rel=0.01), wf["label"]
        assert wj["busy_s"] == pytest.approx(wf["busy_s"], rel=0.01), wf["label"]
        for cause, secs in wf["idle_s"].items():   # within 1% of the worker's wall time
            assert abs(wj["idle_s"][cause] - secs) <= 0.01 * wf["wall_s"], (wf["label"], cause)
            if wf["wall_s"] > 0:
                worst = max(worst, abs(wj["idle_s"][cause] - secs) / wf["wall_s"])
        if wf["wall_s"] > 0:
            worst = max(worst, abs(wj["busy_s"] - wf["busy_s"]) / wf["wall_s"])
    drafter = next(w for w in via_file["workers"] if w["worker"].startswith("drafter"))
    assert drafter["top_idle_cause"] == "queue_empty"
    print(f"\nstalls --jaeger vs RUN_DIR: largest busy/idle difference {worst:.2e} of a worker's wall time; drafter busy "
          f"{drafter['busy_fraction']:.3f}, queue_empty {drafter['idle_s']['queue_empty']:.2f} s")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_collector_counts_what_the_run_recorded(stack, slow_run):
    recorded = slow_run["summary"]["telemetry"]["health"]["spans_recorded"]
    assert slow_run["accepted"] == recorded
    assert slow_run["sent"] == recorded, f"otelcol_exporter_sent_spans {slow_run['sent']} vs recorded {recorded}"


def _prom(stack) -> Prom:
    if not stack.with_prometheus:
        pytest.skip("the `prometheus` binary is not installed (apt-get install prometheus; .ci/run does it)")
    return Prom(stack.prometheus_url)


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_prometheus_scrapes_span_metrics_tokens_and_collector_health(stack, slow_run):
    prom = _prom(stack)
    rid, s = slow_run["run_id"], slow_run["summary"]
    steps = s["steps"]
    sel = f'span_name="backward",run_id="{rid}"'
    calls = _wait_for(lambda: prom.value(f"sum(max_over_time(traces_span_metrics_calls_total{{{sel}}}[10m]))") == steps
                      and steps, "span_metrics calls for backward == steps")
    count = prom.value(f"sum(max_over_time(traces_span_metrics_duration_seconds_count{{{sel}}}[10m]))")
    assert count == steps
    tokens = _wait_for(lambda: prom.value(f'sum(max_over_time(dflash_tokens_total{{run_id="{rid}"}}[10m]))')
                       == s["tokens"] and s["tokens"], "dflash_tokens_total == summary tokens")
    sent = _wait_for(lambda: prom.value('max(max_over_time({__name__=~"otelcol_exporter_sent_spans(_total)?",exporter="otlp_grpc/jaeger"}[10m]))'),
                     "otelcol_exporter_sent_spans in Prometheus")
    assert sent == slow_run["sent"] == s["telemetry"]["health"]["spans_recorded"]
    series = prom.series(f'{{run_id="{rid}"}}')
    span_series = [m for m in series if m["__name__"].startswith("traces_span_metrics_")]
    assert {m["span_name"] for m in span_series} >= STAGES
    series, span_series = len(series), len(span_series)
    print(f"\nPrometheus: span_metrics calls(backward) {calls and steps}, duration count {count:g}, "
          f"dflash_tokens_total {s['tokens']} (= summary), otelcol_exporter_sent_spans {sent:g}; "
          f"{series} series with the run's run_id ({span_series} from span_metrics)")


def _starved_ratio(prom: Prom, rid: str):
    rule = next(r for g in yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
                for r in g["rules"] if r["alert"] == "DflashDrafterStarved")
    expr = rule["expr"].rsplit(">", 1)[0]   # the ratio, without the threshold
    res = [r for r in prom.query(expr) if r["metric"].get("run_id") == rid]
    return float(res[0]["value"][1]) if res else None


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_starved_drafter_alert_fires_for_a_slow_target_and_not_for_a_calm_run(stack, slow_run, tmp_path):
    prom = _prom(stack)
    rid = slow_run["run_id"]
    firing = _wait_for(lambda: [a for a in prom.alerts("DflashDrafterStarved")
                                if a["labels"].get("run_id") == rid and a["state"] == "firing"],
                       "DflashDrafterStarved to fire for the slowed-target run")
    assert firing[0]["labels"]["worker"].startswith("drafter")
    slow_ratio = float(firing[0]["value"])

    calm = _train(stack, tmp_path / "calm", CALM_STEPS)
    crid = calm["run_id"]
    _wait_for(lambda: prom.value(f'sum(max_over_time(dflash_tokens_total{{run_id="{crid}"}}[10m]))')
              == calm["summary"]["tokens"], "Prometheus to scrape the calm run's final tokens")
    # let the rule see the whole run: its evaluations at 1 s cover the run's final samples
    t_end = time.time()
    _wait_for(lambda: all(g["lastEvaluation"] and _ts(g["lastEvaluation"]) > t_end + 2
                          for g in json.loads(bk.http_get(f"{stack.prometheus_url}/api/v1/rules")[1])["data"]["groups"]),
              "two more rule evaluations")
    calm_ratio = _starved_ratio(prom, crid)
    assert calm_ratio is not None and 0 <= calm_ratio < 0.5, calm_ratio   # (NaN: the counters never moved)
    assert not [a for a in prom.alerts("DflashDrafterStarved") if a["labels"].get("run_id") == crid]
    print(f"\nDflashDrafterStarved: firing for the slowed target (queue_empty share {slow_ratio:.2f}); "
          f"calm run share {calm_ratio:.3f}, no alert")


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_target_blocked_alert_fires_for_a_slow_drafter(stack, slow_run, tmp_path):
    prom = _prom(stack)
    run = _train(stack, tmp_path / "slow-drafter", SLOW_STEPS, "--inject-delay", "backward=1.0")
    rid = run["run_id"]
    firing = _wait_for(lambda: [a for a in prom.alerts("DflashTargetBlocked")
                                if a["labels"].get("run_id") == rid and a["state"] == "firing"],
                       "DflashTargetBlocked to fire for the slowed-drafter run")
    assert firing[0]["labels"]["worker"].startswith("target")
    assert not [a for a in prom.alerts("DflashDrafterStarved") if a["labels"].get("run_id") == rid]
    print(f"\nDflashTargetBlocked: firing for a slowed drafter (queue_full share {float(firing[0]['value']):.2f})")


def _ts(rfc3339: str) -> float:
    """Prometheus' lastEvaluation (RFC 3339 with nanoseconds) -> epoch seconds."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)", rfc3339)
    from datetime import datetime
    base = datetime.fromisoformat(m.group(1) + (m.group(3).replace("Z", "+00:00")))
    return base.timestamp() + float(m.group(2) or 0)


# ------------------------------------------------------------------ the Collector killed mid-run

@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_collector_killed_and_restarted_mid_run(bins, tmp_path):
    b = bk.Backends(tmp_path / "backends", bk.Ports.free(), scrape_interval="1s", evaluation_interval="1s",
                    alerts=_short_alerts(tmp_path), with_prometheus=PROMETHEUS is not None)
    b.start()
    try:
        _kill_and_restart_mid_run(b, tmp_path / "run")
    finally:
        b.stop()


def _kill_and_restart_mid_run(b: bk.Backends, out: Path):
    proc = subprocess.Popen(_train_cmd(out, KILL_STEPS, "--inject-delay", "model_forward=0.8"), cwd=ROOT,
                            env=_train_env(b), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def traces_in_jaeger():   # this backend holds only this run
            end = time.time_ns() // 1000
            q = urllib.parse.urlencode({"service": "dflash", "limit": 100, "start": end - 3600 * 10**6, "end": end})
            return [t for t in json.loads(bk.http_get(f"{b.jaeger_url}/api/traces?{q}")[1])["data"] or []]

        _wait_for(lambda: len(traces_in_jaeger()) >= 2 or proc.poll() is not None,
                  "the first traces in Jaeger", deadline_s=300)
        assert proc.poll() is None, "the run ended before the Collector could be killed"
        b.stop_one("otelcol", signal.SIGKILL)
        # the gap: nothing answers OTLP on the Collector's port; a bare socket there only
        # notes the trainer's span export attempts (and drops each connection, as a dead
        # peer would). The exporter retries one request for up to its export timeout
        # (5 s), so the restart waits until attempts have gone on for longer than that:
        # at least one batch of spans has then been given up.
        with _DeadPort(b.ports.otlp_http) as dead:
            _wait_for(lambda: dead.trace_posts >= 2 and dead.last - dead.first > EXPORT_TIMEOUT_S + 1.5
                      or proc.poll() is not None, "the trainer to give up exporting spans in the gap",
                      deadline_s=120)
        assert proc.poll() is None, "the run ended during the gap"
        b.start_collector()
        t_restart_ns = time.time_ns()
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    run = _run_facts(out)
    health = run["summary"]["telemetry"]["health"]
    assert run["summary"]["steps"] == KILL_STEPS
    # the Collector lost the gap's spans; the file beside it (its own lane) kept every one
    otlp = health["exporters"]["otlp"]
    assert sum(otlp["dropped"].values()) > 0 and health["export_failures"] > 0, health
    assert health["spans_exported"] == health["exporters"]["file"]["exported"] == health["spans_recorded"], health
    # export resumed: spans that started after the restart arrived in Jaeger through the new Collector
    after = _wait_for(lambda: [s for t in _jaeger_traces(b, run["run_id"]) for s in t["spans"]
                               if s["startTime"] * 1000 > t_restart_ns],
                      "spans started after the restart in Jaeger")
    accepted = _own_metric(b, "otelcol_receiver_accepted_spans")
    assert accepted >= len(after) > 0
    in_jaeger = _wait_for(lambda: (lambda n: n if n >= accepted else None)(
        sum(len(t["spans"]) for t in _jaeger_traces(b, run["run_id"]))), "Jaeger to hold what the new Collector accepted")
    assert in_jaeger < health["spans_recorded"]
    alert = "no Prometheus"
    if b.with_prometheus:   # the gap's failures reach Prometheus through the restarted Collector
        prom = Prom(b.prometheus_url)
        alerts = ["DflashTelemetryExportFailing"] + (["DflashTelemetryDroppingSpans"] if health["spans_dropped"] else [])
        for name in alerts:
            _wait_for(lambda: [a for a in prom.alerts(name)
                               if a["labels"].get("run_id") == run["run_id"] and a["state"] == "firing"],
                      f"{name} to fire")
        alert = " and ".join(alerts) + " firing"
    print(f"\nkill/restart: recorded {health['spans_recorded']}, exported {health['spans_exported']}, "
          f"dropped {health['spans_dropped']}, export failures {health['export_failures']}; "
          f"new Collector accepted {accepted:g}; Jaeger holds {in_jaeger} spans, {len(after)} started after the restart; {alert}")


class _DeadPort:
    """A listening socket on a dead Collector's port that reads each request line, counts
    `POST /v1/traces` and closes the connection without answering."""

    def __init__(self, port: int):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.trace_posts = 0
        self.first = self.last = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self):
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(2)
                try:
                    if conn.recv(64).startswith(b"POST /v1/traces"):
                        self.trace_posts += 1
                        self.last = time.monotonic()
                        self.first = self.first or self.last
                except OSError:
                    pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.sock.close()
