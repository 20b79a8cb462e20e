"""Experiment trackers: W&B, TensorBoard and MLflow, fed through one bridge.

    dflash train --tracker tensorboard,mlflow ...   (--wandb: the same as naming wandb)
    dflash eval --checkpoint RUN/checkpoint --tracker tensorboard,mlflow

bridge.py        the thread per tracker, bounds, JSONL fallback, failure counts
report.py        what is sent (the same keys to every tracker)
redaction.py     secrets never printed or written
*_sink.py        one per tracker (sink.py: the small interface they implement)

This module imports nothing heavy: the command line checks names and packages here
before torch loads.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import threading
import time
from pathlib import Path

from otel.confined import open_for_write

from ..config import TRACKERS, check_trackers
from ..errors import ConfigError

PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}
LABELS = {"wandb": "W&B", "tensorboard": "TensorBoard", "mlflow": "MLflow"}  # in messages


def parse(text: str | None, where: str = "--tracker ") -> list[str]:
    """`--tracker wandb,tensorboard` -> names (unknown ones: ConfigError)."""
    names = [n.strip() for n in (text or "").split(",") if n.strip()]
    return check_trackers(names, where)


def check_installed(names: list[str], where: str = "--tracker") -> None:
    """Named on the command line but not installed: one line now, not a run with no curves."""
    for n in names:
        if importlib.util.find_spec(PACKAGES[n]) is None:
            raise ConfigError(f"{where} {n}: the {PACKAGES[n]} package is not installed "
                              f"(pip install 'dflash-otel[trackers]', or pip install {PACKAGES[n]})")


def wanted(cfg) -> list[str]:
    """The trackers a run config asks for: telemetry.trackers, plus wandb for telemetry.wandb."""
    names = list(cfg.telemetry.trackers)
    if cfg.telemetry.wandb and "wandb" not in names:
        names.insert(0, "wandb")
    return names


def start(spec, state):
    """The bridge for this run (its run/context.RunSpec and RunState), or None (no tracker
    asked for, or not the lead rank)."""
    names = wanted(spec.cfg)
    if not names or not spec.is_lead:
        return None
    from .bridge import Bridge

    return Bridge(spec, state, names).start()


# what a tracker needs, beside a training run dir, to know where an eval's figures go
_NO_RUN_DIR_NEEDS = {"mlflow": "MLFLOW_TRACKING_URI", "wandb": "WANDB_DIR"}


def check_eval_destination(run_dir: Path | None, names, drafter: str) -> None:
    """`dflash eval --tracker`: the figures go to the training run dir the user named (a run
    checkpoint's or an export's own run dir), or where the environment says; a drafter dir
    that is not inside a run dir is data and gets no tracker files. One line when a named
    tracker then has nowhere to go."""
    if run_dir is not None:
        return
    import os

    for n in names:
        need = _NO_RUN_DIR_NEEDS.get(n)
        if need is None or not os.environ.get(need):
            how = f"set {need}, or " if need else ""
            raise ConfigError(f"--tracker {n}: {drafter} is not inside a dflash training run dir, and eval writes "
                              f"no tracker files into a drafter dir; {how}evaluate the run's checkpoint (RUN/checkpoint)")


def _last_step(run_dir: Path | None) -> int:
    """The training's last step: where eval figures go on the trackers' step axis."""
    if run_dir is None:
        return 0
    for f, key in ((run_dir / "checkpoint" / "trainer_state.json", "step"), (run_dir / "summary.json", "steps")):
        try:
            return int(json.loads(f.read_text())[key])
        except Exception:
            continue
    return 0


def log_eval(run_dir, res: dict, names=("wandb",), timeout_s: float = 60.0, summary: dict | None = None,
             name: str = "") -> dict:
    """`dflash eval --tracker ...`: tau, the top-level figures, the baseline and the
    per-position acceptance (report.eval_metrics) into the training run's trackers, each in
    a thread of its own, all within timeout_s; a tracker that fails or does not answer in
    time gets the figures in RUN/<tracker>_fallback.jsonl instead (one warning each).
    `summary`: more keys (a side-by-side eval's per-drafter figures). `run_dir` None: no
    training run dir (check_eval_destination said where they go); `name` names the eval run."""
    from .redaction import redact
    from .report import eval_metrics
    from .wandb_sink import teardown

    run_dir = Path(run_dir) if run_dir is not None else None
    final = eval_metrics(res, summary)
    step = _last_step(run_dir)
    state = {n: {"done": threading.Event(), "err": []} for n in names}

    def push(name):
        try:
            if name == "wandb":
                from .wandb_sink import log_eval as f
            elif name == "tensorboard":
                from .tensorboard_sink import log_eval as f
            else:
                from .mlflow_sink import log_eval as f
            f(run_dir, final, step, name=name)
            state[name]["done"].set()
        except Exception as e:
            state[name]["err"].append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=push, args=(n,), name=f"{n}-eval", daemon=True) for n in names]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for n in names:
        if not state[n]["done"].is_set():
            err = state[n]["err"]
            why = err[0] if err else f"no answer within {timeout_s:.0f}s"
            if run_dir is None:  # nowhere of the user's to keep them: the table above has them
                print(f"dflash: {LABELS[n]} bridge: {redact(why)}; the figures are only in the output above",
                      file=sys.stderr)
                continue
            path = run_dir / f"{n}_fallback.jsonl"
            print(f"dflash: {LABELS[n]} bridge: {redact(why)}; writing {path} instead", file=sys.stderr)
            try:  # never through a link: it would append the figures anywhere
                with open_for_write(path, "a", inside=run_dir) as f:
                    f.write(redact(json.dumps({"type": "summary", "time": time.time(), "summary": final})) + "\n")
            except OSError as e:
                print(f"dflash: {LABELS[n]} bridge: cannot write {path}: {e}", file=sys.stderr)
    if "wandb" in names:
        teardown(10.0)
    return final


__all__ = ["TRACKERS", "parse", "check_installed", "wanted", "start", "log_eval", "check_eval_destination"]
