"""The telemetry settings the exporter side runs with: built once by the facade
(otel.producer.telemetry) from `Telemetry.from_env(...)`, handed to the transport, and, in
process mode, pickled over the pipe to the exporter process (plain fields only, plus the
optional `otel.idle.IdleRules`, itself a plain dataclass).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from otel.idle import IdleRules

# niceness increment of the exporter process (see docs/otel.md, "Exporter priority")
EXPORTER_NICE = 10
# span attributes that hold a stage's wait, in seconds (the profile shows work and wait apart)
WAIT_ATTRIBUTES = ("blocked_s", "wait_s")


@dataclass(frozen=True)
class ExportConfig:
    service_name: str
    run_id: str
    epoch_offset_ns: int            # perf_counter_ns of the training process -> epoch ns
    start_epoch_s: float
    mode: str = "process"           # "process" | "thread"
    # the resource's attributes given in code (OTEL_RESOURCE_ATTRIBUTES is merged by the
    # SDK's Resource on the exporter side; these win)
    resource_attributes: dict = field(default_factory=dict)
    file_dir: Optional[str] = None
    metric_attributes: tuple = ("worker", "device")
    metric_export_interval_s: float = 1.0
    max_queue: int = 65536
    export_timeout_s: float = 5.0
    exporter_nice: int = EXPORTER_NICE
    export_chunk: int = 512         # spans per export call
    # the synthesized per-key root spans; processes that share trace keys (ranks) let
    # exactly one of them emit, or the backend sees duplicate span ids
    root_spans: bool = True
    # live busy / idle-by-cause per worker, computed on the exporter side
    idle_attribution: bool = True
    idle_rules: Optional[IdleRules] = None   # None: the defaults
    wait_attributes: tuple = WAIT_ATTRIBUTES
    console_interval_s: float = 0.0  # 0: no periodic console table
    gpu_devices: Optional[list] = None   # otel.producer.devices.resolve_devices(...)
    # (trace id, span id) of the run's root span: every per-key root span links to it, so a
    # batch trace leads to the run it belongs to (otel/producer/phases.py)
    run_link: Optional[tuple] = None
    gpu_interval_s: float = 1.0

    # the prefix of the layer's own metric names (`{prefix}.stage.duration`): the service name the
    # code gave, never OTEL_SERVICE_NAME's (which renames the resource only: a dashboard's queries
    # stay valid, and a service name that is no valid instrument name cannot stop a run)
    metric_prefix: str = ""

    @property
    def metric_name_prefix(self) -> str:
        return valid_metric_prefix(self.metric_prefix or self.service_name)

    @property
    def stage_metric(self) -> str:
        """The stage duration histogram's name."""
        return f"{self.metric_name_prefix}.stage.duration"


def valid_metric_prefix(name: str) -> str:
    """``name`` as the start of an OpenTelemetry instrument name (a letter, then letters, digits,
    ``_ . - /``; 255 characters in all): other characters become ``_``, a name that does not start
    with a letter gets ``m_`` before it."""
    out = "".join(c if (c.isascii() and c.isalnum()) or c in "_.-/" else "_" for c in str(name or ""))[:200]
    if not out or not (out[0].isascii() and out[0].isalpha()):
        out = "m_" + out
    return out
