"""The run's telemetry, made in one place for every placement: resource attributes, the
per-rank file dir and Prometheus port, the GPUs this process uses, who emits root spans."""
from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path

import torch
from otel.env_values import number_from_env

from ..analysis.idle_rules import DFLASH_RULES
from ..config import Config


LINGER_MAX_S = 3600.0  # DFLASH_PROMETHEUS_LINGER_S: a scrape interval is seconds to minutes


def make_telemetry(cfg: Config, out: Path, place, run_id: str, argv: list[str] | None = None):
    """The run's telemetry, made before the target loads (run/setup.py): its root span (the
    run trace, dflash/phases.py) starts when this process did; rank 0 emits it, every rank
    of a multi-process run hangs its own process span under it."""
    import otel

    from .. import phases

    if not cfg.telemetry.enabled:
        return otel.Telemetry.disabled()
    attrs = {"rank": place.rank, "world_size": place.world, "dflash.target": cfg.model.target}
    devices = place.target_devices + ([place.drafter_device] if place.drafter_device else [])
    if place.layout is not None:
        attrs |= {"role": place.role, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
                  "host.name": socket.gethostname(), "dflash.layout": str(place.layout)}
        # a batch's root span: on the rank that trains on it
        root_spans, console = place.has_drafter, False
    else:
        devices = cfg.pipeline.target_devices + cfg.pipeline.drafter_devices
        root_spans = console = place.rank == 0
    gpus = sorted({torch.device(d).index or 0 for d in devices if d.startswith("cuda")}) or None
    tdir = out / "telemetry" / (f"rank{place.rank}" if place.world > 1 else "")
    with rank_prometheus_port():
        tel = otel.Telemetry.from_env(
            service_name="dflash", run_id=run_id, file_dir=str(tdir), resource_attributes=attrs,
            console=console, console_interval_s=cfg.telemetry.console_interval_s or None,
            mode=cfg.telemetry.mode, gpu_indices=gpus, idle_rules=DFLASH_RULES, root_spans=root_spans,
            run_span="dflash train", run_root=place.rank == 0, run_start_ns=phases.run_start_ns(),
            process_span=f"dflash train rank {place.rank}" if place.world > 1 else None,
            run_attributes=phases.run_attributes("train", argv) | {"world_size": place.world})
    for name, (kind, unit, description) in METRICS.items():
        tel.declare(name, kind, unit, description)
    return tel


# the steps' own metrics (run/workers.py), with UCUM units: seconds as "s", counts of things as
# annotations ("{token}"), which Prometheus names leave out (its suffix for "s" is the _seconds
# the names already end with)
METRICS = {
    "dflash.queue.producer_blocked_seconds": ("counter", "s", "Time a target worker waited for room in the queue."),
    "dflash.queue.consumer_starved_seconds": ("counter", "s", "Time a drafter worker waited for a batch."),
    "dflash.worker.batches": ("counter", "{batch}", "Batches a target worker handed over."),
    "dflash.worker.tokens": ("counter", "{token}", "Tokens a target worker handed over."),
    "dflash.tokens": ("counter", "{token}", "Tokens the drafter trained on."),
    "dflash.train.steps": ("counter", "{step}", "Optimizer steps."),
    "dflash.train.nonfinite_steps": ("counter", "{step}", "Steps whose loss or gradient was not finite."),
    "dflash.train.loss": ("histogram", "1", "Training loss per step."),
    "dflash.train.grad_norm": ("histogram", "1", "Gradient norm per step, before clipping."),
    "dflash.batch.padding_ratio": ("histogram", "1", "Share of a batch's token slots that are padding."),
    "dflash.batch.sequence_length": ("histogram", "{token}", "Length of each sequence in a batch."),
}


def _prometheus_enabled() -> bool:
    return "prometheus" in os.environ.get("OTEL_METRICS_EXPORTER", "").replace(" ", "").split(",")


@contextlib.contextmanager
def rank_prometheus_port():
    """Under torchrun each rank serves its own scrape endpoint: port = base + LOCAL_RANK,
    base = OTEL_EXPORTER_PROMETHEUS_PORT (default 9464). Set only while the telemetry
    layer is built (it reads the environment then), so the base stays as the user gave it."""
    local = os.environ.get("LOCAL_RANK")
    if not _prometheus_enabled() or local is None:
        yield
        return
    key = "OTEL_EXPORTER_PROMETHEUS_PORT"
    before = os.environ.get(key)
    base = int(number_from_env(key, 9464, lo=0, lo_open=False, hi=65535, integer=True, who="dflash"))
    os.environ[key] = str(base + int(local))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before


def linger_for_scrape(tel) -> None:
    """DFLASH_PROMETHEUS_LINGER_S=N: keep the scrape endpoint up N s after the last step so
    Prometheus' last scrape sees the final counts (a pulled endpoint dies with the run)."""
    secs = number_from_env("DFLASH_PROMETHEUS_LINGER_S", 0.0, lo_open=False, hi=LINGER_MAX_S, unit="seconds",
                           who="dflash")
    if secs > 0 and _prometheus_enabled():
        tel.flush(timeout_s=2.0)
        time.sleep(secs)
