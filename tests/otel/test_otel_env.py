"""The standard OTEL_METRIC_EXPORT_INTERVAL sets the metric export period (milliseconds)."""
import pytest

from otel import Telemetry
from otel.producer.telemetry import DEFAULT_METRIC_EXPORT_INTERVAL_S, metric_interval_from_env


@pytest.mark.parametrize("raw, seconds", [("", DEFAULT_METRIC_EXPORT_INTERVAL_S), ("60000", 60.0), (" 250 ", 0.25)])
def test_metric_interval_read_in_milliseconds(monkeypatch, raw, seconds):
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", raw)
    assert metric_interval_from_env() == seconds


@pytest.mark.parametrize("raw", ["abc", "0", "-5", "inf", "nan"])
def test_bad_metric_interval_is_named_and_ignored(monkeypatch, capsys, raw):
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", raw)
    assert metric_interval_from_env() == DEFAULT_METRIC_EXPORT_INTERVAL_S
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"OTEL_METRIC_EXPORT_INTERVAL={raw!r}" in err and "milliseconds" in err


def test_from_env_uses_it_unless_given(monkeypatch):
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "30000")
    for given, expected in ((None, 30.0), (0.5, 0.5)):
        kw = {} if given is None else {"metric_export_interval_s": given}
        tel = Telemetry.from_env("env-test", mode="thread", console=False, **kw)
        try:
            assert tel.config.metric_export_interval_s == expected
        finally:
            tel.shutdown(timeout_s=5.0)
