"""OTEL_SDK_DISABLED=true: the same API, a near-free no-op, no exporter process."""
import time

import psutil

import otel


def test_sdk_disabled_makes_stage_a_near_free_noop(monkeypatch):
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    children_before = {p.pid for p in psutil.Process().children()}
    tel = otel.Telemetry.from_env(service_name="dflash", gpu_indices=[0], file_dir="/nonexistent")
    assert isinstance(tel, otel.DisabledTelemetry) and not tel.enabled
    assert {p.pid for p in psutil.Process().children()} == children_before

    n = 100_000
    t0 = time.perf_counter()
    for i in range(n):
        with tel.stage("model_forward", trace=("batch", i), worker="t0") as st:
            st.set(tokens=1)
            st.event("e")
    per_call_us = (time.perf_counter() - t0) / n * 1e6
    assert per_call_us < 3.0, per_call_us  # generous; ~0.3 us measured

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
    assert otel.Telemetry.disabled().stage("a") is tel.stage("b")
