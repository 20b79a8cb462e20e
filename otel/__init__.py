"""otel: a non-blocking OpenTelemetry layer for PyTorch pipelines.

Workers pay two timestamps and a tuple append (`tel.stage`); a background thread ships
raw records to an exporter subprocess that owns the OpenTelemetry SDK. See docs/otel.md.
Never imports torch or the OpenTelemetry SDK at import time.

Layout: otel.producer (training process), otel.exporter (exporter process or thread
mode), otel.transport (the only bridge), and shared modules at the top level.
"""
from otel.api import STAGE_ATTRIBUTE, DisabledTelemetry, StageHandle, TelemetryAPI
from otel.config import EXPORTER_NICE, WAIT_ATTRIBUTES, ExportConfig
from otel.idle import BUSY, IdleAccumulator, IdleRules, attribute_idle
from otel.producer.telemetry import Telemetry
from otel.readers import read_lines, read_metrics, read_spans

__all__ = ["Telemetry", "DisabledTelemetry", "TelemetryAPI", "StageHandle", "ExportConfig",
           "EXPORTER_NICE", "WAIT_ATTRIBUTES", "STAGE_ATTRIBUTE", "read_spans", "read_metrics",
           "read_lines", "IdleRules", "IdleAccumulator", "attribute_idle", "BUSY"]
