"""The public surface of the telemetry layer, as a Protocol: `Telemetry` (the real one)
and `DisabledTelemetry` (the no-op) both satisfy it, and a test keeps their public
methods and signatures identical, as OpenTelemetry does for its tracer and no-op tracer.
Code that takes "a telemetry" should annotate with this."""
from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol, runtime_checkable


@runtime_checkable
class StageHandle(Protocol):
    def __enter__(self) -> "StageHandle": ...

    def __exit__(self, exc_type, exc, tb) -> bool: ...

    def set(self, **attrs) -> None: ...

    def event(self, name: str, **attrs) -> None: ...


@runtime_checkable
class TelemetryAPI(Protocol):
    enabled: bool
    mode: str
    run_id: str

    def stage(self, name, trace=None, links=None, stream=None, **attrs) -> StageHandle:
        """An exception leaving the stage gets `otel_stage = name` unless already set."""

    def staged(self, name=None, **stage_kwargs) -> Callable: ...

    def add(self, name, value=1, **attrs) -> None: ...

    def record(self, name, value, **attrs) -> None: ...

    def declare(self, name, kind="counter", unit="1", description="") -> None: ...

    def observable_gauge(self, name, callback: Callable[[], Iterable[tuple[Any, dict]]], unit="1",
                         description="") -> None: ...

    def prepare_cuda(self, pool_size=None, factory=None, devices=()) -> None: ...

    def summary(self) -> dict: ...

    def profile_table(self) -> str: ...

    def flush(self, timeout_s=2.0) -> bool: ...

    def shutdown(self, timeout_s=2.0) -> None: ...
