"""OTEL_SDK_DISABLED=true: the same API, a near-free no-op, no exporter process."""

import psutil

import otel


def test_sdk_disabled_makes_stage_a_near_free_noop(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    children_before = {p.pid for p in psutil.Process().children()}
    tel = otel.Telemetry.from_env(service_name="dflash", gpu_indices=[0], file_dir="/nonexistent")
    assert isinstance(tel, otel.DisabledTelemetry) and not tel.enabled
    assert {p.pid for p in psutil.Process().children()} == children_before

    for i in range(1000):  # its cost is measured in bench/otel/hot_path.py, not asserted here
        with tel.stage("model_forward", trace=("batch", i), worker="t0") as st:
            st.set(tokens=1)
            st.event("e")

    tel.add("c", 1)
    tel.record("h", 1.0)
    tel.declare("c", "counter")
    tel.observable_gauge("g", lambda: [(1, {})])

    @tel.staged("x")
    def f():
        return 7

    assert f() == 7
    assert tel.summary()["health"]["spans_recorded"] == 0
    assert tel.flush() is True
    tel.shutdown()
    # one shared no-op stage per name (it names an exception leaving it: test_otel_stage_errors.py)
    assert otel.Telemetry.disabled().stage("a") is tel.stage("a")


def _public(cls) -> dict:
    import inspect
    return {name: inspect.signature(getattr(cls, name)) for name in dir(cls)
            if not name.startswith("_") and callable(getattr(cls, name)) and name not in ("from_env", "disabled")}


def test_enabled_and_disabled_share_one_public_api():
    """Code written against one works against the other, as with OpenTelemetry's tracer
    and no-op tracer: same public methods, same signatures, both satisfy the Protocol."""
    from otel.api import TelemetryAPI

    real, noop = _public(otel.Telemetry), _public(otel.DisabledTelemetry)
    assert real.keys() == noop.keys()
    for name in real:
        assert list(real[name].parameters) == list(noop[name].parameters), name
    assert set(real) >= {n for n in dir(TelemetryAPI) if not n.startswith("_")} - {"enabled", "mode", "run_id"}
    assert isinstance(otel.Telemetry.disabled(), TelemetryAPI)
