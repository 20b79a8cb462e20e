"""OTEL_METRICS_EXPORTER=prometheus serves conventional Prometheus names."""
import time
import urllib.request

import pytest
from otel_test_helpers import MODES, free_port


@pytest.mark.parametrize("mode", MODES)
def test_prometheus_scrape_endpoint(mode, monkeypatch, make_tel):
    port = free_port()
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(port))
    tel = make_tel(mode=mode)
    with tel.stage("model_forward", worker="target0", device="cpu"):
        time.sleep(0.002)
    tel.add("dflash.tokens", 7)
    tel.flush(timeout_s=5.0)
    deadline = time.monotonic() + 15
    body = ""
    while time.monotonic() < deadline:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
            if "dflash_stage_duration_seconds_bucket" in body and "otel_spans_recorded" in body:
                break
        except OSError:
            pass
        time.sleep(0.1)
    assert "dflash_stage_duration_seconds_bucket" in body, body[:2000]
    assert 'stage="model_forward"' in body and 'clock="host"' in body and 'le="0.0001"' in body
    assert "otel_spans_recorded_total" in body
    assert "dflash_tokens_total" in body


def test_taken_prometheus_port_is_reported_not_fatal(tmp_path, monkeypatch, make_tel):
    import socket
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        monkeypatch.setenv("OTEL_METRICS_EXPORTER", "prometheus,file")
        monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
        monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
        monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_PORT", str(busy.getsockname()[1]))
        tel = make_tel(mode="process", file_dir=str(tmp_path))
        with tel.stage("still_exported"):
            pass
        assert tel.flush(timeout_s=10.0)
        import otel
        assert [s["name"] for s in otel.read_spans(str(tmp_path))] == ["still_exported"]
        assert any("prometheus" in n for n in tel.summary().get("notes", []))
