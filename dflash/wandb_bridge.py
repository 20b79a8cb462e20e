"""The W&B bridge under its first name (`dflash train --wandb`): now one sink of the
generic tracker bridge in dflash/trackers/ (see bridge.py and wandb_sink.py). Kept so that
code and tests written against this module keep working; new code imports dflash.trackers.
"""
from __future__ import annotations

from .trackers import log_eval as _log_eval
from .trackers.bridge import Bridge as WandbBridge  # the default sinks: W&B alone
from .trackers.redaction import redact, sanitize
from .trackers.report import (idle_from_spans, idle_from_stages, idle_from_telemetry, run_summary,
                              telemetry_metrics)
from .trackers.wandb_sink import FALLBACK, RUN_FILE
from .trackers.wandb_sink import settings as _settings
from .trackers.wandb_sink import teardown as _teardown


def start(spec, state):
    """The bridge for this run (every tracker it names), or None."""
    from .trackers import start as _start
    return _start(spec, state)


def log_eval(run_dir, res: dict, timeout_s: float = 60.0, summary: dict | None = None) -> dict:
    """Add tau to the training run's W&B summary (resumed by id), else to the fallback."""
    return _log_eval(run_dir, res, ("wandb",), timeout_s=timeout_s, summary=summary)


__all__ = ["FALLBACK", "RUN_FILE", "WandbBridge", "idle_from_spans", "idle_from_stages", "idle_from_telemetry",
           "log_eval", "redact", "run_summary", "sanitize", "start", "telemetry_metrics", "_settings", "_teardown"]
