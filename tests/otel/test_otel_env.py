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


# ----------------------------------------------------------------------------- written for a child
HOSTILE_VALUES = ["/runs/a,service.name=evil", "k=v=w", "100% done", "tab\there", "quote\"semi;back\\slash",
                  "é ü 日本", "%2C already encoded", ""]


@pytest.mark.parametrize("value", HOSTILE_VALUES)
def test_resource_attributes_read_back_as_given_by_the_sdk(monkeypatch, value):
    """Encoded as the spec asks, a value holding `,` `=` `%` or anything else is one value to
    the SDK's own parser: nothing injected, nothing altered."""
    from opentelemetry.sdk.resources import OTELResourceDetector

    from otel.env_values import resource_attributes

    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", resource_attributes({"dflash.drafter": value, "dflash.target": "t"}))
    assert dict(OTELResourceDetector().detect().attributes) == {"dflash.drafter": value, "dflash.target": "t"}


@pytest.mark.parametrize("value,protocol,ok", [
    ("http://127.0.0.1:4317", "grpc", True), ("https://collector/v1/traces", "http/protobuf", True),
    ("localhost:4317", "grpc", True), ("localhost:4317", "http/protobuf", False),
    ("http://", "grpc", False), ("http://[::1", "grpc", False), ("http://h:99999", "grpc", False),
    ("ftp://h:1", "grpc", False), ("grpc://h:4317", "grpc", False), ("h:4317/x", "grpc", False),
    ("http://h:0", "grpc", False), ("http://a b:1", "grpc", False), ("", "grpc", False),
])
def test_otlp_endpoints_are_parsed(value, protocol, ok):
    from otel.exporter_choice import endpoint_error

    assert (endpoint_error(value, protocol) is None) == ok, endpoint_error(value, protocol)
