"""The public surface of the telemetry layer: the `TelemetryAPI` Protocol and, beside it,
its no-op implementation `DisabledTelemetry`, as OpenTelemetry keeps its no-op tracer
with the API. `Telemetry` (otel.producer.telemetry, the real one) and `DisabledTelemetry`
both satisfy the Protocol, and a test keeps their public methods and signatures identical.
Code that takes "a telemetry" should annotate with `TelemetryAPI`.

Plain Python only: importing this module loads neither the SDK nor torch, and the no-op
needs neither a thread nor a process."""
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

    def phase(self, name, parent=None, **attrs) -> StageHandle:
        """A span of the run's own trace (loading, data, evals: the run's long steps)."""

    def record_phase(self, name, t0_ns, t1_ns, parent=None, error=None, **attrs) -> int: ...

    def traceparent(self) -> str: ...

    def end_run(self, error=None) -> None: ...

    def phase_table(self) -> str: ...

    def begin_profile(self) -> None: ...

    def summary(self) -> dict: ...

    def profile_table(self) -> str: ...

    def end_profile(self, timeout_s=2.0) -> None: ...

    def flush(self, timeout_s=2.0, network=True) -> bool: ...

    def shutdown(self, timeout_s=2.0) -> None: ...


# an exception leaving a stage carries the stage's name under this attribute
STAGE_ATTRIBUTE = "otel_stage"


def name_exception(exc, name) -> None:
    """An exception leaving a stage carries the stage's name as `exc.otel_stage`, unless a
    stage inside already named it (the innermost stage wins). An exception type that
    refuses attributes (`__slots__`) stays unnamed. Only ever runs on the error path."""
    if exc is not None and getattr(exc, STAGE_ATTRIBUTE, None) is None:
        try:
            setattr(exc, STAGE_ATTRIBUTE, name)
        except (AttributeError, TypeError):
            pass


class NullStage:
    """The disabled layer's stage: does nothing but name an exception leaving it (see
    name_exception). One instance per stage name, shared (DisabledTelemetry.stage)."""

    __slots__ = ("name",)

    def __init__(self, name=None):
        self.name = name

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            name_exception(exc, self.name)
        return False

    def set(self, **attrs) -> None:
        pass

    def event(self, name: str, **attrs) -> None:
        pass


class NullPhase(NullStage):
    """The disabled layer's phase: names an exception leaving it, takes progress, and hands
    a child the trace context this process was given (if any)."""

    __slots__ = ()

    def progress(self, done, total=None) -> None:
        pass

    @property
    def traceparent(self) -> str:
        import os
        return os.environ.get("TRACEPARENT", "")


class NullStages(dict):
    """name -> its shared NullStage, made on first use. Past `max_names` distinct names
    (names built from data) each call gets a fresh one instead of growing the cache."""

    __slots__ = ("max_names",)

    def __init__(self, max_names: int = 4096):
        super().__init__()
        self.max_names = max_names

    def __missing__(self, name):
        stage = NullStage(name)
        if len(self) < self.max_names:
            self[name] = stage
        return stage


_NULL_STAGES = NullStages()


class DisabledTelemetry:
    """Same API, does nothing (OTEL_SDK_DISABLED=true, or Telemetry.disabled())."""

    enabled = False
    mode = "disabled"
    run_id = "disabled"

    def stage(self, name, trace=None, links=None, stream=None, **attrs):
        try:
            return _NULL_STAGES[name]   # shared per name: it names an exception leaving it
        except TypeError:               # an unhashable name
            return NullStage(name)

    def staged(self, name=None, **stage_kwargs):
        return lambda fn: fn

    def add(self, name, value=1, **attrs):
        pass

    def record(self, name, value, **attrs):
        pass

    def declare(self, name, kind="counter", unit="1", description=""):
        pass

    def observable_gauge(self, name, callback, unit="1", description=""):
        pass

    def prepare_cuda(self, pool_size=None, factory=None, devices=()):
        pass

    def phase(self, name, parent=None, **attrs):
        return NullPhase(name)

    def record_phase(self, name, t0_ns, t1_ns, parent=None, error=None, **attrs) -> int:
        return 0

    def traceparent(self) -> str:
        import os
        return os.environ.get("TRACEPARENT", "")

    def end_run(self, error=None) -> None:
        pass

    def phase_table(self) -> str:
        return "telemetry disabled"

    def begin_profile(self) -> None:
        pass

    def summary(self) -> dict:
        return {"wall_s": 0.0, "stages": {}, "health": {"spans_recorded": 0, "spans_exported": 0,
                                                       "spans_dropped": 0, "export_failures": 0}}

    def profile_table(self) -> str:
        return "telemetry disabled"

    def end_profile(self, timeout_s=2.0) -> None:
        pass

    def flush(self, timeout_s=2.0, network=True) -> bool:
        return True

    def shutdown(self, timeout_s=2.0) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
