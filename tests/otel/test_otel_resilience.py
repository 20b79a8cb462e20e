"""Unreachable / hanging / restarted collectors: bounded shutdown, bounded memory,
export resumes."""
import socket
import time

import pytest
from otel_test_helpers import MODES, closed_port_endpoint, free_port, point_env_at_dead_collector
from otlp_receivers import OtlpGrpcReceiver, OtlpHttpReceiver


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("mode", MODES)
def test_shutdown_with_unreachable_collector_is_bounded(protocol, mode, monkeypatch, make_tel):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", closed_port_endpoint())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    tel = make_tel(mode=mode)
    for i in range(2000):
        with tel.stage("step", trace=("batch", i // 100)):
            pass
    time.sleep(0.3)  # exports are failing and retrying now
    t0 = time.monotonic()
    tel.shutdown(timeout_s=1.0)
    took = time.monotonic() - t0
    # bounded: without the bound an OTLP exporter retries for a minute; the slack is for a
    # loaded host (killing the exporter and joining threads take a time slice or two)
    assert took < 1.0 + 5.0, took
    tel.shutdown(timeout_s=1.0)  # idempotent


@pytest.fixture
def blackhole_endpoint():
    """A port that accepts connections (kernel backlog) but never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.mark.parametrize("mode", MODES)
def test_shutdown_with_hanging_collector_is_bounded(blackhole_endpoint, mode, monkeypatch, make_tel):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", blackhole_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    tel = make_tel(mode=mode)
    for i in range(500):
        with tel.stage("step"):
            pass
    time.sleep(0.3)
    t0 = time.monotonic()
    tel.shutdown(timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 5.0  # bounded (slack for a loaded host, as above)


@pytest.mark.parametrize("mode", MODES)
def test_dead_collector_drops_and_counts_instead_of_growing(mode, monkeypatch, make_tel):
    point_env_at_dead_collector(monkeypatch)
    tel = make_tel(mode=mode, max_queue=500)
    for i in range(5000):
        with tel.stage("step"):
            pass
        if i % 500 == 0:
            time.sleep(0.06)  # let the background thread drain the per-thread buffer
    tel.flush(timeout_s=0.5)
    # queue bound 500 plus at most one chunk in flight: the rest is dropped and counted
    # (the exporter runs at a low priority, so on a loaded machine this can take a while)
    expected_drops = 5000 - 500 - 512
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        h = tel.summary()["health"]
        if h["spans_dropped"] >= expected_drops and h["export_failures"] > 0:
            break
        time.sleep(0.1)
    h = tel.summary()["health"]
    assert h["spans_recorded"] == 5000
    assert h["spans_exported"] == 0
    assert h["export_failures"] >= 1
    assert h["spans_dropped"] >= expected_drops, h


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
@pytest.mark.parametrize("mode", MODES)
def test_collector_down_then_up_export_resumes(protocol, mode, monkeypatch, make_tel):
    port = free_port()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "3")
    tel = make_tel(mode=mode)
    with tel.stage("while_down"):
        pass
    deadline = time.monotonic() + 10
    while tel.summary()["health"]["export_failures"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tel.summary()["health"]["export_failures"] >= 1
    rx = (OtlpGrpcReceiver if protocol == "grpc" else OtlpHttpReceiver)(port).start()
    try:
        # export resumes: stages recorded after the collector came up arrive (the first
        # attempt may still hit the exporter's stale channel and be dropped, counted)
        deadline = time.monotonic() + 20
        while not any(x["name"] == "while_up" for x in rx.spans):
            assert time.monotonic() < deadline, "export did not resume"
            with tel.stage("while_up"):
                pass
            time.sleep(0.2)
        deadline = time.monotonic() + 5
        while tel.summary()["health"]["spans_exported"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tel.summary()["health"]["spans_exported"] >= 1
    finally:
        rx.stop()


@pytest.mark.parametrize("mode", MODES)
def test_a_hanging_collector_never_holds_up_the_file_sink_beside_it(blackhole_endpoint, mode, monkeypatch, make_tel,
                                                                    tmp_path):
    """An endpoint and a run dir, no OTEL_TRACES_EXPORTER: the collector and the files both
    (a collector that is down loses nothing `dflash stalls RUN` reads). Each exporter has its
    own lane: the file holds every span however long the collector hangs, the shutdown stays
    bounded, and the counts say the file kept them and the collector did not."""
    from otel import read_spans

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", blackhole_endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    tel = make_tel(mode=mode, file_dir=str(tmp_path))
    for i in range(400):
        with tel.stage("step", trace=("batch", i // 50)):
            pass
    time.sleep(0.3)
    t0 = time.monotonic()
    tel.shutdown(timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 8.0  # bounded (slack for a loaded host)
    spans = read_spans(str(tmp_path))
    assert sum(s["name"] == "step" for s in spans) == 400
    h = tel.summary()["health"]
    assert h["spans_exported"] == len(spans) == h["spans_recorded"] and h["spans_dropped"] == 0, h
