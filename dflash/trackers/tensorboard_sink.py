"""TensorBoard (`--tracker tensorboard`): event files under RUN/tensorboard/<RUN's name>/,
so that `tensorboard --logdir RUN/tensorboard` shows the run under its name.

Written with `torch.utils.tensorboard` (needs the `tensorboard` package: the `trackers`
extra). What goes in:
- every step: train/loss, train/acc, train/grad_norm (the run's whole loss history,
  the same values as summary.json's `loss_history`);
- each held-out acceptance estimate (train.estimate_every): estimate/tau,
  estimate/tau_no_copy, estimate/accepted_at_position/<k>;
- every interval, at the step reached: tokens/s, stage p50/p95/..., busy fractions,
  telemetry health (the same names as W&B);
- at the end: the run summary as summary/<key> (summary/tokens_per_s,
  summary/idle_fraction/drafter0, summary/tau, ...), the config as text and as hparams.
`dflash eval --tracker tensorboard` adds eval/<key> at the training's last step.

Watch it: `dflash watch RUN` (or `tensorboard --logdir RUN/tensorboard`).
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from .report import flatten, numeric
from .sink import Sink, inside_run_dir

DIR = "tensorboard"
_PER_STEP = ("train/loss", "train/acc", "train/grad_norm", "train/step")


class TensorBoardSink(Sink):
    name, label = "tensorboard", "TensorBoard"
    verb_log = "writing TensorBoard events"
    per_step = True
    retry = True  # a full disk or a lost mount can come back

    def __init__(self):
        self._w = None
        self._config: dict = {}
        self._logdir: Path | None = None

    def open(self, runner):
        from torch.utils.tensorboard import SummaryWriter

        self._logdir = event_dir(runner.b.out)
        self._config = runner.b.config
        self._w = SummaryWriter(str(self._logdir), flush_secs=30)
        self._w.add_text("config", "```yaml\n" + yaml.safe_dump(self._config, sort_keys=False) + "```", 0)
        self._w.flush()

    def log(self, metrics, rows, estimates, step):
        w = self._w
        for s, loss, acc, gnorm in rows:
            for k, v in (("train/loss", loss), ("train/acc", acc), ("train/grad_norm", gnorm)):
                if v is not None:
                    w.add_scalar(k, v, s)
        for s, tau, slots, *rest in estimates:
            w.add_scalar("estimate/tau", tau, s)
            if rest and rest[0] is not None:
                w.add_scalar("estimate/tau_no_copy", rest[0], s)
            for k, a in enumerate(slots or [], 1):
                w.add_scalar(f"estimate/accepted_at_position/{k}", a, s)
        for k, v in numeric({k: v for k, v in metrics.items() if k not in _PER_STEP}).items():
            w.add_scalar(k, v, step)
        w.flush()

    def finish(self, summary, raw):
        from torch.utils.tensorboard.summary import hparams

        w, step = self._w, int(summary.get("steps") or 0)
        nums = numeric(summary)
        for k, v in nums.items():
            w.add_scalar(f"summary/{k}", v, step)
        w.add_text("summary", "```json\n" + json.dumps(summary, indent=1, default=str) + "\n```", step)
        # the HParams tab: the flattened config beside the figures it led to (one run, this dir)
        hp = {k: ("" if v is None else v) for k, v in flatten(self._config).items()}
        metric_keys = {f"summary/{k}": nums[k] for k in ("loss_last", "tokens_per_s", "tau") if k in nums}
        for ev in hparams(hp, metric_keys):
            w._get_file_writer().add_summary(ev)
        w.close()

    def patience_s(self):
        return 30.0  # importing tensorboard, then local files

    def describe(self):
        return {"logdir": str(self._logdir)} if self._logdir else {}


def event_dir(run_dir: Path) -> Path:
    """RUN/tensorboard/<name>: the one already there (a run dir renamed since), else a new one;
    never through a symbolic link (LinkRefused: the events go to the fallback file)."""
    base = inside_run_dir(run_dir, Path(run_dir) / DIR)
    there = [p for p in base.iterdir() if p.is_dir() or p.is_symlink()] if base.is_dir() else []
    return inside_run_dir(run_dir, there[0] if len(there) == 1 else base / Path(run_dir).resolve().name)


def log_eval(run_dir: Path | None, metrics: dict, step: int | None = None, name: str = "") -> None:
    """eval/<key> (and tau, baseline/..., per_position_acceptance/...) at the training's
    last step, in the same event directory (TensorBoard reads every file in it)."""
    from torch.utils.tensorboard import SummaryWriter

    if run_dir is None:
        raise ValueError("no training run dir to write events into")
    w = SummaryWriter(str(event_dir(run_dir)))
    try:
        for k, v in numeric(metrics).items():
            w.add_scalar(k if k.startswith(("eval/", "compare/")) else f"eval/{k}", v, step or 0)
        texts = {k: v for k, v in metrics.items() if isinstance(v, str)}
        if texts:
            w.add_text("eval", "\n".join(f"- {k}: {v}" for k, v in texts.items()), step or 0)
    finally:
        w.close()
