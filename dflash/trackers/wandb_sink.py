"""Weights & Biases (`--tracker wandb`, `--wandb`).

Honours WANDB_MODE, WANDB_PROJECT (default "dflash"), WANDB_DIR (default: the run
directory). The API key (WANDB_API_KEY) is read by wandb itself and never written by
dflash. Metrics are logged as they were before the other trackers existed: every interval,
the telemetry layer's view plus train/{step,tokens,tokens_per_s,loss,acc,grad_norm} of the
latest step; the summary goes to run.summary. RUN/wandb_run.json keeps the run's id so
that `dflash eval --tracker wandb` adds tau to the same run.
"""
from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

from otel.confined import write_text

from .sink import Sink, failure, inside_run_dir

FALLBACK = "wandb_fallback.jsonl"
RUN_FILE = "wandb_run.json"        # id/project of the W&B run, for `dflash eval --wandb`


class WandbSink(Sink):
    name, label = "wandb", "W&B"
    verb_log = "wandb.log"

    def __init__(self):
        self._wandb = None
        self._run = None
        self._imported = False

    def why_open_failed(self, e):
        if self._imported:
            return f"wandb.init failed ({failure(e)})"
        return f"wandb is not available ({failure(e)})"  # missing or broken install

    def open(self, runner):
        import wandb

        self._imported = True
        out, config = runner.b.out, runner.b.config
        kw = dict(project=os.environ.get("WANDB_PROJECT") or "dflash", config=config,
                  name=out.name, group=config.get("run_id"), job_type="train", settings=settings(wandb))
        if not os.environ.get("WANDB_DIR"):
            kw["dir"] = str(out)
            inside_run_dir(out, out / "wandb")  # wandb writes there itself: never through a link
        run = wandb.init(**kw)
        self._wandb, self._run = wandb, run
        write_text(out / RUN_FILE, json.dumps({"id": run.id, "project": run.project,
                                               "dir": kw.get("dir") or os.environ.get("WANDB_DIR")}), inside=out)

    def log(self, metrics, rows, estimates, step):
        if metrics:
            self._wandb.log(metrics)

    def finish(self, summary, raw):
        self._run.summary.update(summary)
        self._run.finish()

    def teardown(self, timeout_s):
        teardown(timeout_s)

    def describe(self):
        return {"id": self._run.id, "project": self._run.project} if self._run is not None else {}


def settings(wandb):
    """Nothing that costs the training process: no console capture, no code/git/pip scan
    (system stats are sampled by wandb-core, another process)."""
    kw = dict(console="off", save_code=False, disable_git=True, silent=True, x_save_requirements=False)
    try:
        return wandb.Settings(**kw)
    except Exception:  # an older wandb without one of these settings
        kw.pop("x_save_requirements")
        return wandb.Settings(**kw)


def teardown(timeout_s: float) -> None:
    """wandb.teardown(): no wandb-core helper outlives the run (bounded)."""
    wandb = sys.modules.get("wandb")
    if wandb is None or not hasattr(wandb, "teardown"):
        return
    t = threading.Thread(target=lambda: _quiet(wandb.teardown), name="wandb-teardown", daemon=True)
    t.start()
    t.join(timeout_s)


def _quiet(fn):
    try:
        fn()
    except Exception:
        pass


def log_eval(run_dir: Path | None, metrics: dict, step: int | None = None, name: str = "") -> None:
    """The eval's figures into the training run's W&B summary (resumed by id; a new eval
    run when the training had none). Its files go to WANDB_DIR, else the run dir, never to a
    dir a file names. No run dir (a served drafter): WANDB_DIR must be set. Raises on failure
    (the caller bounds and falls back)."""
    import wandb

    f = Path(run_dir) / RUN_FILE if run_dir is not None else None
    try:
        info = json.loads(f.read_text()) if f is not None and f.is_file() and not f.is_symlink() else {}
    except ValueError:
        info = {}
    info = info if isinstance(info, dict) else {}
    kw = dict(project=os.environ.get("WANDB_PROJECT") or info.get("project") or "dflash", job_type="eval",
              settings=settings(wandb))
    if info.get("id"):
        kw.update(id=info["id"], resume="allow")
    if not os.environ.get("WANDB_DIR"):
        if run_dir is None:
            raise ValueError("no training run dir to log into, and WANDB_DIR is not set")
        kw["dir"] = str(inside_run_dir(run_dir, Path(run_dir) / "wandb").parent)
    run = wandb.init(**kw)
    run.summary.update(metrics)
    run.finish()
