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
    ("unix:///run/otel.sock", "grpc", True), ("unix:///run/otel.sock", "http/protobuf", False), ("unix://", "grpc", False),
])
def test_otlp_endpoints_are_parsed(value, protocol, ok):
    from otel.exporter_choice import endpoint_error

    assert (endpoint_error(value, protocol) is None) == ok, endpoint_error(value, protocol)


def test_a_malformed_endpoint_is_named_once_without_its_secrets_and_the_file_keeps_every_span(
        monkeypatch, make_tel, tmp_path, capfd):
    """train built the SDK exporter from any value and failed every export after, the URL (its
    password and token) in the SDK's words; a query in the base endpoint mangled the path."""
    from otel import read_spans
    from otel.exporter_choice import endpoint_env_error

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://u:PW@127.0.0.1:1/?token=SECRETTOK")
    err = endpoint_env_error("traces", "http/protobuf")
    assert "***@127.0.0.1:1/?***" in err and "/v1/traces after it" in err and "PW" not in err
    from otel.exporter_choice import shown_endpoint
    assert shown_endpoint("https://user:pw@[::1:4318") == "'https://***@[::1:4318'"  # unparsable: still hidden
    assert shown_endpoint("https://KEY@host/v1") == "'https://***@host/v1'"  # a token as the user
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:1/v1/traces?token=x")
    assert endpoint_env_error("traces", "http/protobuf") is None  # the SDK sends to a signal's URL as it is
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "::not a url::")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    tel = make_tel(mode="thread", file_dir=str(tmp_path))
    for _ in range(5):
        with tel.stage("step"):
            pass
    tel.shutdown(timeout_s=5.0)
    out = capfd.readouterr().err
    assert out.count("traces exporter 'otlp' unavailable: OTEL_EXPORTER_OTLP_ENDPOINT='::not a url::'") == 1, out
    assert any("OTEL_EXPORTER_OTLP_ENDPOINT" in n for n in tel.summary()["notes"])
    assert len([s for s in read_spans(str(tmp_path)) if s["name"] == "step"]) == 5
    assert tel.summary()["health"]["export_failures"] == 0


@pytest.mark.parametrize("mode", ["process", "thread"])
@pytest.mark.parametrize("name", ["dflash trainer", "1svc", "ünï"])
def test_any_service_name_renames_the_resource_and_never_the_metrics(monkeypatch, make_tel, tmp_path, mode, name):
    """OTEL_SERVICE_NAME may be any string (the spec); it used to prefix the metric names, so a
    space or a leading digit made an invalid instrument name that killed the exporter and the
    run's end. Now the resource takes it and the metrics keep the code's prefix."""
    from otel import read_metrics, read_spans
    from otel.config import valid_metric_prefix

    monkeypatch.setenv("OTEL_SERVICE_NAME", name)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "file")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "file")
    tel = make_tel(mode=mode, file_dir=str(tmp_path))
    for _ in range(5):
        with tel.stage("step"):
            pass
    tel.shutdown(timeout_s=5.0)
    spans = read_spans(str(tmp_path))
    assert spans and {s["resource"]["service.name"] for s in spans} == {name}
    assert "dflash.stage.duration" in {m["name"] for m in read_metrics(str(tmp_path))}
    assert tel.summary()["health"]["spans_dropped"] == 0
    assert valid_metric_prefix("dflash trainer") == "dflash_trainer" and valid_metric_prefix("1svc") == "m_1svc"


def test_a_malformed_per_signal_header_variable_never_lets_the_generic_headers_through(monkeypatch):
    """Every entry of OTEL_EXPORTER_OTLP_TRACES_HEADERS malformed: the traces exporter (HTTP and
    gRPC) is built without OTEL_EXPORTER_OTLP_HEADERS' headers, which the SDK would send in its
    place (another endpoint's credentials); the metrics exporter keeps them; the environment,
    which other threads read, is left as it was."""
    import os

    from otel.exporter import env_headers, sdk_pipeline

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20GENERIC-SECRET")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant")
    monkeypatch.setattr(env_headers, "EMPTIED", set())
    notes = env_headers.sanitize()
    assert len(notes) == 1 and "OTEL_EXPORTER_OTLP_TRACES_HEADERS" in notes[0]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    exp = sdk_pipeline._make_span_exporter("otlp", None, 1.0)
    assert "authorization" not in {k.lower() for k in exp._client._headers}, exp._client._headers  # the SDK's own
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    exp = sdk_pipeline._make_span_exporter("otlp", None, 1.0)
    assert not any(k.lower() == "authorization" for k, _ in exp._headers), exp._headers
    reader = sdk_pipeline._make_metric_reader("otlp", None, 60.0, 1.0)
    assert any(k.lower() == "authorization" for k, _ in reader._exporter._headers)
    assert os.environ["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer%20GENERIC-SECRET"


def test_only_true_disables_the_sdk_and_an_unknown_protocol_is_said(monkeypatch, capsys):
    """The spec's booleans: `true` (any case) is true, anything else false (said when it is not
    `false`). An OTLP protocol the exporter does not speak is said once, and http/protobuf sent."""
    from otel.api import DisabledTelemetry
    from otel.exporter import sdk_pipeline

    monkeypatch.setenv("OTEL_SDK_DISABLED", "TRUE")
    assert isinstance(Telemetry.from_env("t", console=False), DisabledTelemetry)
    monkeypatch.setenv("OTEL_SDK_DISABLED", "1")
    tel = Telemetry.from_env("t", mode="thread", console=False)
    try:
        assert not isinstance(tel, DisabledTelemetry)
    finally:
        tel.shutdown(timeout_s=5.0)
    assert "OTEL_SDK_DISABLED='1' read as false" in capsys.readouterr().err
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    assert sdk_pipeline._protocol("traces") == "http/protobuf"
    assert "'http/json' is not one this exporter speaks" in capsys.readouterr().err
