"""The tracker bridge (dflash/trackers) against the real things: TensorBoard's own reader
(EventAccumulator), a real `mlflow server` on loopback (SQLite backend, temp artifact
dir) read back with MlflowClient, an MLflow server killed in the middle of a run, a local
MLflow store served by `dflash watch`, and headless Chromium (Debian's) on both web UIs.
The W&B sink keeps its own tests (test_wandb.py)."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import ROOT, TINY, cli_before_torch, free_port, last_json, run_dflash

FAKE_TOKEN = "dflashtok-" + "0123456789abcdef" * 2          # MLFLOW_TRACKING_TOKEN
FAKE_PASSWORD = "dflashpw-" + "fedcba9876543210"            # MLFLOW_TRACKING_PASSWORD
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STEPS = 6


def _get(url, timeout=5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _clean_env(**extra) -> dict:
    """No tracker/OTel settings of the caller's; spans to the run's files."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "MLFLOW_", "WANDB_"))}
    return env | {"DFLASH_TRACKER_INTERVAL_S": "0.5"} | extra


def _train_args(out, steps, *extra):
    return ["train", "--out", out, "--target", "tiny-qwen3", "--steps", steps, *TINY,
            "--set", "telemetry.console_interval_s=0", *extra]


def _popen_dflash(args, env, log: Path):
    return subprocess.Popen([sys.executable, "-m", "dflash", *map(str, args)], cwd=ROOT, env=env,
                            stdout=open(log.with_suffix(".out"), "w"), stderr=open(log.with_suffix(".err"), "w"),
                            start_new_session=True)


def _no_secret_in(*texts_or_dirs):
    for t in texts_or_dirs:
        if isinstance(t, Path):
            for p in t.rglob("*"):
                if p.is_file():
                    data = p.read_bytes()
                    assert FAKE_TOKEN.encode() not in data and FAKE_PASSWORD.encode() not in data, p
        else:
            assert FAKE_TOKEN not in t and FAKE_PASSWORD not in t


# -------------------------------------------------------------------- fast: no tracker server

def test_tracker_names_are_checked_before_torch(tmp_path):
    out, err = cli_before_torch(*_train_args(tmp_path / "run", 2, "--tracker", "tensorboard,tensorbord"))
    assert out == {"rc": 2, "torch": False} and len(err) == 1, err
    assert "unknown tracker 'tensorbord'" in err[0] and "wandb, tensorboard, mlflow" in err[0]
    out, err = cli_before_torch(*_train_args(tmp_path / "run", 2, "--set", "telemetry.trackers=mlflow,nope"))
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and "'nope'" in err[0], err
    out, err = cli_before_torch("eval", "--checkpoint", tmp_path / "none", "--tracker", "mlflw")
    assert out == {"rc": 2, "torch": False} and len(err) == 1 and "'mlflw'" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_tracker_package_that_is_missing_is_one_line(monkeypatch):
    import importlib.util

    from dflash.errors import ConfigError
    from dflash.trackers import check_installed

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    check_installed(["tensorboard"])
    with pytest.raises(ConfigError, match=r"--tracker mlflow: the mlflow package is not installed \(pip install"):
        check_installed(["tensorboard", "mlflow"])


def test_mlflow_secrets_are_never_printed(monkeypatch):
    from dflash.trackers.redaction import redact, sanitize, strip_credentials

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", FAKE_TOKEN)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "dflash")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", FAKE_PASSWORD)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://ci-bot:uri-secret-42@mlflow.internal:5000/")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws" + "k" * 30)
    msg = redact(f"401 from https://ci-bot:uri-secret-42@mlflow.internal:5000/api (Bearer {FAKE_TOKEN}, "
                 f"basic dflash:{FAKE_PASSWORD}, s3 key {'aws' + 'k' * 30}; other https://u:p4ss@h.example/)")
    for s in (FAKE_TOKEN, FAKE_PASSWORD, "uri-secret-42", "k" * 30, "p4ss"):
        assert s not in msg, msg
    assert "mlflow.internal:5000" in msg  # what is not secret stays readable
    assert strip_credentials("https://ci-bot:uri-secret-42@mlflow.internal:5000/") == "https://mlflow.internal:5000/"
    cfg = sanitize({"eval": {"max_new_tokens": 48}, "data": {"regen_max_new_tokens": 96},
                    "mlflow_token": "x", "hf_token": "y", "note": f"uri {os.environ['MLFLOW_TRACKING_URI']}"})
    assert cfg == {"eval": {"max_new_tokens": 48}, "data": {"regen_max_new_tokens": 96},
                   "note": "uri https://***@mlflow.internal:5000/"}


def test_eval_figures_flow_through_by_name():
    """Figures the eval gains later (a baseline, per-position acceptance, anything numeric
    at the top level) reach the trackers without the bridge knowing their names."""
    from dflash.trackers.report import eval_metrics

    res = {"acceptance_length": 2.5, "prompts": 3, "block_size": 8, "lossless": True, "temperature": 0.0,
           "tokens_per_s": None, "per_prompt": [2.0, 3.0], "histogram": {"1": 4}, "dtype": "float32",
           "baseline": {"method": "prompt lookup", "acceptance_length": 1.6, "tokens_per_s": 50.0},
           "per_position_acceptance": [0.9, 0.6, 0.25], "a_figure_added_later": 7}
    m = eval_metrics(res, {"compare/0/tau": 2.5})
    assert m["tau"] == 2.5 and m["eval/acceptance_length"] == 2.5 and m["eval/a_figure_added_later"] == 7
    assert m["baseline/acceptance_length"] == 1.6 and m["baseline/tokens_per_s"] == 50.0
    assert [m[f"per_position_acceptance/{k}"] for k in (1, 2, 3)] == [0.9, 0.6, 0.25]
    assert m["eval/lossless"] is True and m["compare/0/tau"] == 2.5
    assert not any(k.endswith(("per_prompt", "histogram", "dtype", "tokens_per_s")) and k.startswith("eval/")
                   for k in m), m
    ppa = eval_metrics({"acceptance_length": 2.0, "per_position_acceptance": {"1": 0.8, "2": 0.5}})
    assert ppa["per_position_acceptance/2"] == 0.5


class _Flaky:
    """A tracker that is down for its first `down` calls (an MLflow server restarting),
    or hangs in log() while `hang` is set: the sink interface (trackers/sink.py)."""
    per_step, retry, label, verb_log = True, True, "Flaky", "flaky.log"

    def __init__(self, name, down=0, hang=None):
        self.name, self.down, self.hang = name, down, hang
        self.fallback = f"{name}_fallback.jsonl"
        self.steps, self.calls, self.summary = [], 0, None

    def why_open_failed(self, e):
        return f"{e}"

    def open(self, runner):
        pass

    def log(self, metrics, rows, estimates, step):
        self.calls += 1
        if self.hang is not None:
            self.hang.wait(30)
        if self.calls <= self.down:
            raise ConnectionError(f"down (token {FAKE_TOKEN})")
        self.steps += [r[0] for r in rows]

    def finish(self, summary, raw):
        if self.hang is not None:
            self.hang.wait(30)
        self.summary = summary

    def teardown(self, timeout_s):
        pass

    def describe(self):
        return {}


def _fake_run(tmp_path):
    """(spec, state, telemetry summary): what a bridge reads of a run."""
    from dflash.config import Config

    stages = {s: {"count": 2, "total_s": 0.2, "p50_s": 0.1, "p95_s": 0.1, "p99_s": 0.1, "max_s": 0.1, "share": 0.1}
              for s in ("queue_get", "backward")}
    tel = {"wall_s": 2.0, "stages": stages, "health": {"spans_dropped": 0, "export_failures": 0}}
    spec = SimpleNamespace(out=tmp_path, cfg=Config(), world_size=1, rank=0, start_step=0)
    state = SimpleNamespace(tel=SimpleNamespace(summary=lambda: tel, run_id="r1"), tokens=0,
                            train_step=SimpleNamespace(step=0), history=[], estimate=None)
    return spec, state, tel


def test_a_tracker_that_comes_back_gets_every_step_and_a_hung_one_blocks_no_other(tmp_path, monkeypatch, capfd):
    from dflash.trackers.bridge import Bridge

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", FAKE_TOKEN)
    spec, state, tel = _fake_run(tmp_path)
    release = threading.Event()
    flaky, hung = _Flaky("flaky", down=3), _Flaky("hung", hang=release)
    bridge = Bridge(spec, state, [flaky, hung], interval_s=0.05, join_s=0.5, write_s=1.0).start()
    try:
        for s in range(40):  # the training: one history row per step
            state.history.append((s, 5.0 - 0.1 * s, 0.5, 1.0))
            state.train_step.step, state.tokens = s + 1, 100 * (s + 1)
            deadline = time.monotonic() + 10
            while flaky.calls < s // 4 + 1 and time.monotonic() < deadline:  # the bridge keeps up meanwhile
                time.sleep(0.01)
        assert flaky.calls > 3 and hung.calls == 1, (flaky.calls, hung.calls)  # one stuck, the other carried on
        t0 = time.monotonic()
        final = bridge.close({"steps": 40, "tokens": 4000, "telemetry": tel})
        assert time.monotonic() - t0 < bridge.join_s + 2 * bridge.write_s + 1.0
    finally:
        release.set()
    assert flaky.steps == list(range(40)), "a step lost or sent twice across the outage"
    assert flaky.summary == final
    st = bridge.status()
    assert st["flaky"]["delivered"] and st["flaky"]["failures"] == 3
    assert not st["hung"]["delivered"] and st["hung"]["failures"] == 1
    recs = [json.loads(line) for line in (tmp_path / "flaky_fallback.jsonl").read_text().splitlines()]
    assert recs[0]["type"] == "config" and {r["type"] for r in recs[1:]} == {"log"}
    assert sorted(s for r in recs[1:] for s, *_ in r["rows"]) == sorted(set(s for r in recs[1:] for s, *_ in r["rows"]))
    hung_recs = [json.loads(line) for line in (tmp_path / "hung_fallback.jsonl").read_text().splitlines()]
    assert hung_recs[-1]["type"] == "summary" and hung_recs[-1]["failures"] == 1
    err = capfd.readouterr().err
    assert err.count("Flaky bridge") == 3, err  # flaky: one warning, one "reachable again"; hung: one warning
    assert "reachable again after 3 failed call(s)" in err and FAKE_TOKEN not in err
    _no_secret_in(tmp_path)


def test_a_local_store_still_starting_at_the_end_gets_the_run_but_a_remote_one_does_not_wait(tmp_path):
    """Importing mlflow and creating a SQLite store can take seconds on a busy host: local
    work, so the end of a short run waits for it (patience_s); a tracker that is stuck on
    the network does not get that wait."""
    from dflash.trackers.bridge import Bridge

    class SlowStart(_Flaky):
        def __init__(self, name, patience):
            super().__init__(name)
            self.started, self.patience = threading.Event(), patience

        def open(self, runner):
            self.started.set()
            time.sleep(1.5)

        def patience_s(self):
            return self.patience

    for sink in (SlowStart("local", 30.0), SlowStart("remote", 0.0)):
        spec, state, tel = _fake_run(tmp_path)
        bridge = Bridge(spec, state, [sink], interval_s=5, join_s=0.2, write_s=0.3).start()
        assert sink.started.wait(10)
        state.history += [(s, 1.0, 0.5, 1.0) for s in range(3)]  # a short run: over before the tracker opened
        t0 = time.monotonic()
        final = bridge.close({"steps": 3, "tokens": 300, "telemetry": tel})
        took = time.monotonic() - t0
        if sink.name == "local":
            assert sink.summary == final and sink.steps == [0, 1, 2] and bridge.status()["local"]["delivered"]
        else:
            assert sink.summary is None and not bridge.status()["remote"]["delivered"]
            assert took < bridge.join_s + 2 * bridge.write_s + 1.0, took  # the documented bound
            recs = [json.loads(line) for line in (tmp_path / "remote_fallback.jsonl").read_text().splitlines()]
            assert recs[-1]["type"] == "summary" and recs[-1]["summary"] == json.loads(json.dumps(final))


def test_overwrite_removes_what_the_trackers_wrote_and_nothing_else(tmp_path):
    from dflash.preflight.run_dir import clear_earlier_run

    written = ["tensorboard/run/events.out.tfevents.1.host.1.0", "mlflow/mlflow.db", "mlflow_run.json",
               "mlflow/artifacts/abc123/artifacts/learning_curve.png",
               "mlflow/artifacts/abc123/artifacts/export/README.md", "mlflow_fallback.jsonl",
               "tensorboard_fallback.jsonl"]
    mine = ["tensorboard/notes.txt", "mlflow/keep.me"]
    for f in written + mine:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    clear_earlier_run(tmp_path)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == sorted(mine)
    assert not (tmp_path / "mlflow" / "artifacts").exists() and not (tmp_path / "tensorboard" / "run").exists()


# -------------------------------------------------------------------- slow: the real things

class MlflowServer:
    """A real `mlflow server` on a free loopback port: SQLite backend, temp artifact dir,
    no job runner; in its own session so that stop()/kill() reach its uvicorn child."""

    def __init__(self, tmp: Path):
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "mlflow-server.log"
        self.db = tmp / "mlflow.db"
        env = _clean_env(MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{self.db}",
             "--artifacts-destination", str(tmp / "artifacts"), "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"], cwd=tmp, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT,
            start_new_session=True)
        deadline = time.monotonic() + 180  # a cold start imports a lot on a busy 2-core machine
        while time.monotonic() < deadline:
            try:
                if _get(self.url + "/health", 2).strip() == "OK":
                    return
            except OSError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.kill()
        raise AssertionError(f"mlflow server did not become ready:\n{self.log.read_text()[-3000:]}")

    def client(self):
        from mlflow.tracking import MlflowClient
        return MlflowClient(tracking_uri=self.url)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    pytest.importorskip("mlflow")
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    yield server
    server.stop()


def _server_env(server, **extra):
    return _clean_env(MLFLOW_TRACKING_URI=server.url, MLFLOW_EXPERIMENT_NAME="dflash-tests",
                      MLFLOW_TRACKING_TOKEN=FAKE_TOKEN, MLFLOW_TRACKING_USERNAME="dflash",
                      MLFLOW_TRACKING_PASSWORD=FAKE_PASSWORD, **extra)


@pytest.fixture(scope="module")
def served_run(mlflow_server, tmp_path_factory):
    """One short tiny-qwen3 training with --tracker tensorboard,mlflow into the real server."""
    pytest.importorskip("tensorboard")
    out = tmp_path_factory.mktemp("served") / "served-run"
    p = run_dflash(*_train_args(out, STEPS, "--tracker", "tensorboard,mlflow"), env=_server_env(mlflow_server))
    summary = json.loads((out / "summary.json").read_text())
    info = json.loads((out / "mlflow_run.json").read_text())
    return SimpleNamespace(out=out, summary=summary, info=info, stdout=p.stdout, stderr=p.stderr)


@pytest.mark.slow
def test_a_real_mlflow_server_holds_the_run(served_run, mlflow_server):
    from dflash.trackers.redaction import sanitize
    from dflash.trackers.report import flatten

    r, client = served_run, mlflow_server.client()
    assert r.summary["trackers"]["mlflow"]["delivered"] and r.summary["trackers"]["mlflow"]["failures"] == 0
    assert r.info["tracking_uri"] == mlflow_server.url
    run = client.get_run(r.info["run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "served-run"
    assert client.get_experiment(run.info.experiment_id).name == "dflash-tests"
    # params: the flattened config (what config.yaml says), plus the run id and world size
    import yaml
    cfg = yaml.safe_load((r.out / "config.yaml").read_text())
    want = {k: str(v) for k, v in flatten(sanitize(cfg)).items()}
    assert {k: v for k, v in run.data.params.items() if k in want} == want
    assert run.data.params["train.steps"] == str(STEPS) and run.data.params["telemetry.trackers"] == \
        "['tensorboard', 'mlflow']"
    # one loss value per step: summary.json's loss history
    hist = sorted(client.get_metric_history(r.info["run_id"], "train/loss"), key=lambda m: m.step)
    assert [m.step for m in hist] == list(range(STEPS))
    assert [round(m.value, 6) for m in hist] == [v for _, v in r.summary["loss_history"]]
    for key in ("train/acc", "train/grad_norm"):
        assert len(client.get_metric_history(r.info["run_id"], key)) == STEPS
    m = run.data.metrics
    assert m["tokens_per_s"] == r.summary["tokens_per_s"] and m["steps"] == STEPS
    assert m["stage/backward/p50_s"] == r.summary["telemetry"]["stages"]["backward"]["p50_s"]
    assert "idle_fraction/drafter0" in m and "telemetry/spans_dropped" in m
    assert run.data.tags["dflash.idle_source"] in ("telemetry", "spans")
    arts = {a.path for a in client.list_artifacts(r.info["run_id"])}
    assert {"learning_curve.png", "summary.json", "config.yaml", "export"} <= arts, arts
    assert {a.path for a in client.list_artifacts(r.info["run_id"], "export")} == {"export/README.md"}
    png = Path(client.download_artifacts(r.info["run_id"], "learning_curve.png", str(r.out.parent)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    _no_secret_in(r.stdout, r.stderr, r.out, mlflow_server.db)
    # the trackers' end-of-run summary is a phase of the run's trace (a slow tracker's wait has a name)
    from otel import read_spans
    closing = [s for s in read_spans(str(r.out / "telemetry")) if s["name"] == "trackers"]
    assert [s["attributes"].get("trackers") for s in closing] == ["tensorboard,mlflow"], closing


@pytest.mark.slow
def test_tensorboards_reader_returns_the_runs_scalars(served_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = served_run
    assert r.summary["trackers"]["tensorboard"]["delivered"]
    dirs = [d for d in (r.out / "tensorboard").iterdir()]
    assert [d.name for d in dirs] == ["served-run"]  # `tensorboard --logdir RUN/tensorboard` names the run
    ea = EventAccumulator(str(dirs[0]), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    loss = ea.Scalars("train/loss")
    assert [e.step for e in loss] == list(range(STEPS))
    assert [e.value for e in loss] == pytest.approx([v for _, v in r.summary["loss_history"]], rel=1e-6)
    s, tel = r.summary, r.summary["telemetry"]

    def last(tag):
        return ea.Scalars(tag)[-1].value

    assert last("summary/tokens_per_s") == pytest.approx(s["tokens_per_s"])
    assert last("summary/loss_last") == pytest.approx(s["loss_last"])
    assert last("summary/steps") == STEPS
    for stage in ("model_forward", "backward", "queue_get"):
        for q in ("p50_s", "p95_s"):
            assert last(f"summary/stage/{stage}/{q}") == pytest.approx(tel["stages"][stage][q], rel=1e-6)
    assert last("summary/telemetry/spans_dropped") == tel["health"]["spans_dropped"]
    tags = set(ea.Tags()["scalars"])
    assert {"train/acc", "train/grad_norm", "train/tokens_per_s", "stage/backward/p95_s",
            "summary/idle_fraction/drafter0", "summary/busy_fraction/target0"} <= tags, sorted(tags)
    assert {"config/text_summary", "summary/text_summary"} <= set(ea.Tags()["tensors"])
    assert b"tiny-qwen3" in ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0]


@pytest.mark.slow
def test_eval_adds_tau_to_the_runs_trackers(served_run, mlflow_server):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    r = served_run
    p = run_dflash("eval", "--checkpoint", r.out / "checkpoint", "--prompts", "1", "--max-new-tokens", "8",
                   "--json", "--tracker", "tensorboard,mlflow", env=_server_env(mlflow_server))
    res = last_json(p.stdout)
    m = mlflow_server.client().get_run(r.info["run_id"]).data.metrics
    assert m["tau"] == res["acceptance_length"] and m["eval/prompts"] == 1
    hist = mlflow_server.client().get_metric_history(r.info["run_id"], "tau")
    assert [h.step for h in hist] == [STEPS]  # on the training's step axis, at its end
    ea = EventAccumulator(str(r.out / "tensorboard" / "served-run"), size_guidance={"scalars": 0})
    ea.Reload()
    assert ea.Scalars("eval/tau")[-1].value == pytest.approx(res["acceptance_length"])
    assert ea.Scalars("eval/tau")[-1].step == STEPS
    assert not list(r.out.glob("*_fallback.jsonl"))
    _no_secret_in(p.stdout, p.stderr)


def _browser():
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH (apt-get install chromium; .ci/run does it)")
    pw = pytest.importorskip("playwright.sync_api", reason="the playwright package (test extra) drives Chromium")
    return pw


def _watch(run_dir: Path, log: Path, *args):
    """`dflash watch RUN` as a user runs it: the URLs it prints, once they answer."""
    proc = _popen_dflash(["watch", run_dir, "--port", "0", "--mlflow-port", "0", *args], _clean_env(), log)
    urls, deadline = {}, time.monotonic() + 240
    out = log.with_suffix(".out")
    while time.monotonic() < deadline and proc.poll() is None:
        urls = dict(line.split(": ", 1) for line in out.read_text().splitlines() if ": http" in line)
        if "(logs:" in log.with_suffix(".err").read_text():  # printed after every URL
            return proc, urls
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"dflash watch did not start:\n{log.with_suffix('.err').read_text()[-3000:]}")


def _stop_watch(proc):
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


@pytest.mark.slow
def test_chromium_shows_the_runs_curves_in_tensorboard_and_mlflow(served_run, mlflow_server, tmp_path):
    """Headless Chromium on TensorBoard's time series (served by `dflash watch`) and on the
    MLflow run's metric charts: the pages rendered the run's name and its metric names, and
    drew the loss line; the screenshots are kept in the test's tmp dir."""
    pw = _browser()
    r = served_run
    watch, urls = _watch(r.out, tmp_path / "watch")
    try:
        assert set(urls) == {"TensorBoard"}  # the run's MLflow store is the server, not a local one
        assert json.loads(_get(urls["TensorBoard"] + "data/runs")) == ["served-run"]
        with pw.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, args=[
                "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--no-first-run"])
            try:
                page = browser.new_page(viewport={"width": 1200, "height": 800})
                # TensorBoard: SVG lines (headless Chromium has no WebGL for its default renderer)
                page.goto(urls["TensorBoard"] + "?forceSVG=true#timeseries")
                page.locator("input[placeholder='Filter tags (regex)']").fill("train/(loss|acc)$")
                page.keyboard.press("Escape")  # the tag suggestions would cover the charts
                page.wait_for_selector("text=train/loss", timeout=60_000)
                page.wait_for_function("() => [...document.querySelectorAll('line-chart svg path')]"
                                       ".some(p => (p.getAttribute('d') || '').length > 20)", timeout=60_000)
                # the rendered text, not the HTML: a card's title may split a tag's path over spans, and
                # cards render lazily, so wait for all three names rather than read them once
                page.wait_for_function("names => { const t = document.body.innerText.replace(/\\s+/g, '');"
                                       " return names.every(n => t.includes(n)); }",
                                       arg=["train/loss", "train/acc", "served-run"], timeout=60_000)
                page.screenshot(path=str(tmp_path / "tensorboard.png"))
                # MLflow: the run's metric charts, narrowed to the training curves
                page.goto(f"{mlflow_server.url}/#/experiments/{r.info['experiment_id']}/runs/{r.info['run_id']}"
                          "/model-metrics")
                page.get_by_placeholder("Search metric charts").fill("train/")
                page.wait_for_selector("text=served-run (train/loss)", timeout=90_000)
                page.wait_for_function("() => document.querySelectorAll('.js-plotly-plot path.js-line').length > 0",
                                       timeout=60_000)
                page.screenshot(path=str(tmp_path / "mlflow.png"))
                dom = page.content()
                assert "served-run" in dom and "train/loss" in dom and "train/grad_norm" in dom
            finally:
                browser.close()
    finally:
        _stop_watch(watch)
    for name in ("tensorboard.png", "mlflow.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"\nscreenshots: {tmp_path / 'tensorboard.png'} {tmp_path / 'mlflow.png'}")


@pytest.mark.slow
def test_mlflow_killed_mid_run_the_run_completes_and_counts_the_failures(tmp_path):
    pytest.importorskip("mlflow")
    server = MlflowServer(tmp_path / "server")
    steps, out = 16, tmp_path / "run"
    try:  # ~0.5 s more per step: the run outlives MLflow's start in the bridge thread on a busy host
        proc = _popen_dflash(_train_args(out, steps, "--tracker", "mlflow,tensorboard",
                                         "--inject-delay", "backward=0.5"), _server_env(server), tmp_path / "train")
        client, deadline, seen = server.client(), time.monotonic() + 300, []
        while time.monotonic() < deadline and proc.poll() is None and not seen:  # the server got a loss value
            if (out / "mlflow_run.json").is_file():
                seen = client.get_metric_history(json.loads((out / "mlflow_run.json").read_text())["run_id"],
                                                 "train/loss")
            time.sleep(0.2)
        assert seen, "the run never reached the server"
        server.kill()  # SIGKILL, mid-run
        assert proc.poll() is None, "precondition: killed while training"
        assert proc.wait(600) == 0
    finally:
        server.kill()
    err = (tmp_path / "train.err").read_text()
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == steps and [h[0] for h in s["loss_history"]] == list(range(steps))
    st = s["trackers"]["mlflow"]
    assert not st["delivered"] and st["failures"] >= 1 and st["fallback"].endswith("mlflow_fallback.jsonl")
    assert s["trackers"]["tensorboard"]["delivered"]  # the other tracker carried on
    recs = [json.loads(line) for line in (out / "mlflow_fallback.jsonl").read_text().splitlines()]
    assert recs[0]["type"] == "config" and recs[-1]["type"] == "summary"
    assert recs[-1]["failures"] == st["failures"] and recs[-1]["summary"]["steps"] == steps
    missed = {row[0] for r in recs if r["type"] == "log" for row in r["rows"]}
    assert steps - 1 in missed and missed <= set(range(steps)), missed  # what the server never got is here
    assert len(seen) + len(missed) >= steps
    assert sum("MLflow bridge" in line for line in err.splitlines()) == 1, err
    _no_secret_in(err, (tmp_path / "train.out").read_text(), out)


@pytest.mark.slow
def test_watch_serves_a_local_store(tmp_path):
    """No MLFLOW_TRACKING_URI: the run's own store (RUN/mlflow), served by `dflash watch`
    next to TensorBoard; Ctrl-C/SIGTERM stops both."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    out = tmp_path / "local-run"
    run_dflash(*_train_args(out, 2, "--tracker", "mlflow,tensorboard"), env=_clean_env())
    assert (out / "mlflow" / "mlflow.db").is_file()
    st = json.loads((out / "summary.json").read_text())["trackers"]
    assert st["mlflow"]["delivered"] and st["tensorboard"]["delivered"], st  # however slow their start was
    info = json.loads((out / "mlflow_run.json").read_text())
    watch, urls = _watch(out, tmp_path / "watch")
    try:
        assert set(urls) == {"TensorBoard", "MLflow"}
        assert json.loads(_get(urls["TensorBoard"] + "data/runs")) == ["local-run"]
        req = urllib.request.Request(urls["MLflow"] + "api/2.0/mlflow/runs/search", method="POST",
                                     data=json.dumps({"experiment_ids": [info["experiment_id"]]}).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            runs = json.loads(resp.read())["runs"]
        assert [r["info"]["run_name"] for r in runs] == ["local-run"]
        loss = [m for m in runs[0]["data"]["metrics"] if m["key"] == "train/loss"]
        assert loss and loss[0]["step"] == 1
    finally:
        _stop_watch(watch)
    for url in urls.values():  # both servers are gone
        with pytest.raises(OSError):
            _get(url, 2)


@pytest.mark.slow
def test_watch_runs_no_package_planted_in_the_run_dir(tmp_path):
    """`cd RUN && dflash watch .` in a shared run dir whose tensorboard/ and mlflow/ (there by
    design) and uvicorn/ (what MLflow's server starts) and otel/ hold an __init__.py: none of
    them runs in TensorBoard, MLflow's server or its uvicorn, and both UIs still answer."""
    pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from mlflow.tracking import MlflowClient

    from dflash.trackers.mlflow_sink import tracking_uri

    run = tmp_path / "shared-run"
    run.mkdir()
    client = MlflowClient(tracking_uri=tracking_uri(run)[0])  # RUN/mlflow/mlflow.db, as a run leaves it
    client.create_run(client.create_experiment("dflash"), run_name="shared-run")
    markers = []
    for name in ("tensorboard", "mlflow", "uvicorn", "otel", "gunicorn"):
        (run / name).mkdir(exist_ok=True)
        markers.append(tmp_path / f"{name}.ran")
        (run / name / "__init__.py").write_text(f"open({str(markers[-1])!r}, 'w').write('ran')\n")
    log = tmp_path / "watch"
    # as the `dflash` command starts (its script's dir first on sys.path, never the cwd)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "dflash", "watch", ".", "--port", "0", "--mlflow-port", "0"],
                            cwd=run, env=_clean_env(PYTHONPATH=str(ROOT)), stdout=open(log.with_suffix(".out"), "w"),
                            stderr=open(log.with_suffix(".err"), "w"), start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None and \
                "(logs:" not in log.with_suffix(".err").read_text():
            time.sleep(0.2)
        urls = dict(line.split(": ", 1) for line in log.with_suffix(".out").read_text().splitlines() if ": http" in line)
        assert set(urls) == {"TensorBoard", "MLflow"}, log.with_suffix(".err").read_text()[-3000:]
        assert _get(urls["MLflow"] + "health").strip() == "OK"
        json.loads(_get(urls["TensorBoard"] + "data/runs"))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    assert [m.name for m in markers if m.exists()] == []
