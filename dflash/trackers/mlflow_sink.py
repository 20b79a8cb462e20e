"""MLflow (`--tracker mlflow`).

Where: MLFLOW_TRACKING_URI (a server, `databricks`, a database URI) when set, else a
local store under the run dir (RUN/mlflow/mlflow.db, artifacts in RUN/mlflow/artifacts;
`dflash watch RUN` serves it). MLflow's own variables are honoured as MLflow reads them
(MLFLOW_TRACKING_TOKEN, MLFLOW_TRACKING_USERNAME / _PASSWORD, MLFLOW_EXPERIMENT_NAME or
_ID, MLFLOW_TRACKING_INSECURE_TLS, ...); dflash never prints or stores a token, a
password or the credentials of a URI (redaction.py). The experiment is
MLFLOW_EXPERIMENT_NAME (default "dflash"), the run is named after the run dir.

What goes in: the flattened config as params; per step train/loss, train/acc,
train/grad_norm (one value per step); the held-out estimates; every interval the
telemetry's view (stage percentiles, busy fractions, health) at the step reached; at the
end the summary's numbers as metrics (its words as tags), summary.json, the config, the
learning curve and the export README as artifacts, and the run's status (FINISHED, or
KILLED when interrupted). RUN/mlflow_run.json keeps the run's id so that `dflash eval
--tracker mlflow` and `dflash train --resume` add to the same run.

A server that is down or slow never stalls training (bridge.py): unless you set them,
MLFLOW_HTTP_REQUEST_TIMEOUT is 10 s and MLFLOW_HTTP_REQUEST_MAX_RETRIES 1 in this process
(MLflow's own defaults, 120 s and 7 retries with back-off, would hold a call for minutes);
the bridge tries again every interval and sends the steps the server missed once it
answers.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from pathlib import Path

from otel.confined import write_text

from .redaction import redact, strip_credentials
from .report import flatten, numeric
from .sink import Sink, inside_run_dir

RUN_FILE = "mlflow_run.json"
LOCAL_DIR = "mlflow"
_PER_STEP = ("train/loss", "train/acc", "train/grad_norm", "train/step")
_BAD_NAME = re.compile(r"[^\w./\- :]")  # what MLflow accepts in a param, metric or tag name


def configure() -> None:
    """Bounded HTTP calls and a quiet MLflow logger, unless the user chose otherwise."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    # MLflow's own knob, read when it is imported: no "Creating initial MLflow database tables..."
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("alembic").setLevel(logging.WARNING)


def local_uri(run_dir: Path) -> str:
    return f"sqlite:///{(Path(run_dir) / LOCAL_DIR / 'mlflow.db').resolve()}"


def tracking_uri(run_dir: Path) -> tuple[str, bool]:
    """(the URI, whether it is this run's local store)."""
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env, False
    local = inside_run_dir(run_dir, Path(run_dir) / LOCAL_DIR)  # MLflow opens its files itself
    for name in ("mlflow.db", "artifacts"):
        inside_run_dir(run_dir, local / name)
    local.mkdir(parents=True, exist_ok=True)
    return local_uri(run_dir), True


def _experiment(client, run_dir: Path, local: bool) -> str:
    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "dflash"
    exp = client.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    where = (Path(run_dir) / LOCAL_DIR / "artifacts").resolve().as_uri() if local else None
    try:
        return client.create_experiment(name, artifact_location=where)
    except Exception:  # another run created it meanwhile
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _name(key: str) -> str:
    return _BAD_NAME.sub("_", key)


def _metrics_batches(items, step_default=None):
    """[Metric] in chunks MLflow takes in one call (1000)."""
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    ms = [Metric(_name(k), float(v), now, int(s if s is not None else step_default or 0)) for k, v, s in items]
    return [ms[i:i + 1000] for i in range(0, len(ms), 1000)]


class MlflowSink(Sink):
    name, label = "mlflow", "MLflow"
    verb_log = "MLflow log_batch"
    per_step = True
    retry = True  # a server restarted: the bridge sends what it missed

    def __init__(self):
        self.client = None
        self.run_id = None
        self.experiment_id = None
        self.uri = None
        self.out: Path | None = None
        self._imported = False

    def open(self, runner):
        configure()
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self._imported = True
        out = self.out = runner.b.out
        uri, local = tracking_uri(out)
        self.uri = uri
        client = MlflowClient(tracking_uri=uri)
        run_id = self._resumable(client, runner)
        if run_id is None:
            self.experiment_id = _experiment(client, out, local)
            tags = {"dflash.out": str(out.resolve()), "dflash.run_id": str(runner.b.config.get("run_id") or ""),
                    "dflash.target": str(runner.b.config.get("model", {}).get("target", ""))}
            # started when the training did (the thread may get the run only later, on a busy host)
            run = client.create_run(self.experiment_id, start_time=int(runner.b.started * 1000), run_name=out.name,
                                    tags=tags)
            run_id = run.info.run_id
            params = [Param(_name(k), str(v)[:6000]) for k, v in flatten(runner.b.config).items()]
            for i in range(0, len(params), 100):
                client.log_batch(run_id, params=params[i:i + 100], synchronous=True)
        self.client, self.run_id = client, run_id
        write_text(out / RUN_FILE, json.dumps({"run_id": run_id, "experiment_id": self.experiment_id,
                                               "tracking_uri": strip_credentials(uri)}), inside=out)

    def _resumable(self, client, runner) -> str | None:
        """`dflash train --resume`: the earlier run of this dir, in the same store."""
        f = runner.b.out / RUN_FILE
        if getattr(runner.spec, "start_step", 0) <= 0 or not f.is_file():
            return None
        try:
            info = json.loads(f.read_text())
            if info.get("tracking_uri") != strip_credentials(self.uri):
                return None
            run = client.get_run(info["run_id"])
            client.update_run(info["run_id"], status="RUNNING")
            self.experiment_id = run.info.experiment_id
            return info["run_id"]
        except Exception:
            return None

    def log(self, metrics, rows, estimates, step):
        items = []
        for s, loss, acc, gnorm in rows:
            items += [(k, v, s) for k, v in (("train/loss", loss), ("train/acc", acc), ("train/grad_norm", gnorm))
                      if v is not None]
        for s, tau, slots, *rest in estimates:
            items.append(("estimate/tau", tau, s))
            if rest and rest[0] is not None:
                items.append(("estimate/tau_no_copy", rest[0], s))
            items += [(f"estimate/accepted_at_position/{k}", a, s) for k, a in enumerate(slots or [], 1)]
        items += [(k, v, step) for k, v in numeric({k: v for k, v in metrics.items() if k not in _PER_STEP}).items()]
        for batch in _metrics_batches(items):
            self.client.log_batch(self.run_id, metrics=batch, synchronous=True)

    def finish(self, summary, raw):
        from mlflow.entities import RunTag

        client, run_id, step = self.client, self.run_id, int(summary.get("steps") or 0)
        nums = numeric(summary)
        for batch in _metrics_batches([(k, v, step) for k, v in nums.items()]):
            client.log_batch(run_id, metrics=batch, synchronous=True)
        words = [RunTag(_name(f"dflash.{k}"), str(v)[:5000]) for k, v in summary.items()
                 if isinstance(v, str)]
        if words:
            client.log_batch(run_id, tags=words, synchronous=True)
        client.log_dict(run_id, json.loads(redact(json.dumps(summary, default=str))), "summary.json")
        out = self.out
        for path, where in ((out / "learning_curve.png", None), (out / "config.yaml", None),
                            (out / "export" / "README.md", "export")):
            if path.is_file():
                client.log_artifact(run_id, str(path), where)
        client.set_terminated(run_id, "KILLED" if raw.get("interrupted") else "FINISHED")

    def patience_s(self):
        """Still importing mlflow (seconds of CPU on a busy host), or a local store: local work."""
        uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
        return 60.0 if not self._imported or uri.startswith(("sqlite:", "file:", "/")) else 0.0

    def describe(self):
        if self.run_id is None:
            return {}
        return {"tracking_uri": strip_credentials(self.uri), "experiment_id": self.experiment_id,
                "run_id": self.run_id}


def log_eval(run_dir: Path | None, metrics: dict, step: int | None = None, name: str = "") -> None:
    """The eval's figures into the training run's MLflow run: numbers as metrics at the
    training's last step, words as tags. Raises on failure (the caller bounds and falls back).

    Where: MLFLOW_TRACKING_URI, else the run dir's own local store; never a URI read from a
    file (RUN/mlflow_run.json only says which run, and only when it names the same store).
    No run dir (a served drafter): MLFLOW_TRACKING_URI alone, a new run "<name> eval"."""
    configure()
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    info = {}
    if run_dir is not None:
        run_dir = Path(run_dir)
        f = run_dir / RUN_FILE
        try:
            info = json.loads(f.read_text()) if f.is_file() and not f.is_symlink() else {}
        except ValueError:
            info = {}
        info = info if isinstance(info, dict) else {}
    elif not os.environ.get("MLFLOW_TRACKING_URI"):
        raise ValueError("no training run dir to log into, and MLFLOW_TRACKING_URI is not set")
    uri, local = tracking_uri(run_dir)
    named = info.get("tracking_uri")
    if local and isinstance(named, str) and named.startswith("sqlite:///") and \
            named.endswith(f"/{LOCAL_DIR}/mlflow.db"):
        named = strip_credentials(uri)  # the run's own store, from before the run dir moved
    if named is not None and named != strip_credentials(uri):
        raise ValueError(f"{RUN_FILE} names the training's run on {named}, not on {strip_credentials(uri)}; "
                         f"set MLFLOW_TRACKING_URI to that store to add the eval to it")
    client = MlflowClient(tracking_uri=uri)
    run_id = info.get("run_id") if named is not None else None
    if not run_id:
        exp = _experiment(client, run_dir, local)
        run_id = client.create_run(exp, run_name=f"{run_dir.name if run_dir is not None else name} eval").info.run_id
    for batch in _metrics_batches([(k, v, step) for k, v in numeric(metrics).items()]):
        client.log_batch(run_id, metrics=batch, synchronous=True)
    words = [RunTag(_name(f"dflash.{k}"), str(v)[:5000]) for k, v in metrics.items() if isinstance(v, str)]
    if words:
        client.log_batch(run_id, tags=words, synchronous=True)
    if run_id != info.get("run_id"):
        client.set_terminated(run_id)
