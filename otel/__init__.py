"""otel: a non-blocking OpenTelemetry layer for PyTorch pipelines.

Workers pay two timestamps and a tuple append (`tel.stage`); a background thread ships
raw records to an exporter subprocess that owns the OpenTelemetry SDK. See docs/otel.md.
Never imports torch at import time.
"""
from otel.telemetry import DisabledTelemetry, Telemetry

__all__ = ["Telemetry", "DisabledTelemetry"]
