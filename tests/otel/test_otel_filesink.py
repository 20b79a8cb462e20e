"""The file sink writes the Collector's OTLP/JSON file format, one request per line."""
import base64
import json
import re

import pytest
from otel_test_helpers import MODES
from google.protobuf.json_format import ParseDict
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

import otel
from otel.trace_ids import trace_id_for

_HEX_IDS = {"traceId": 32, "spanId": 16, "parentSpanId": 16}


def _ids_back_to_base64(node, found):
    """OTLP/JSON uses hex ids; protobuf's JSON parser wants base64. Check and convert."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in _HEX_IDS and isinstance(v, str):
                assert re.fullmatch(f"[0-9a-f]{{{_HEX_IDS[k]}}}", v), (k, v)
                found.append(k)
                node[k] = base64.b64encode(bytes.fromhex(v)).decode()
            else:
                _ids_back_to_base64(v, found)
    elif isinstance(node, list):
        for v in node:
            _ids_back_to_base64(v, found)
    return node


@pytest.mark.parametrize("mode", MODES)
def test_file_sink_lines_parse_as_otlp_json(tmp_path, mode, make_tel):
    tel = make_tel(mode=mode, file_dir=str(tmp_path), run_id="run-F")
    with tel.stage("model_forward", trace=("batch", 1), worker="t0") as st:
        st.event("queue_empty", wait_s=0.1)
    with tel.stage("optimizer_step", links=[("batch", 1)]):
        pass
    tel.add("dflash.tokens", 5)
    assert tel.flush(timeout_s=10.0)
    tel.shutdown()

    lines = (tmp_path / "traces.jsonl").read_text().splitlines()
    assert lines
    for line in lines:
        d = json.loads(line)
        assert "resourceSpans" in d and "scopeSpans" in d["resourceSpans"][0]
        span = d["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
        assert "startTimeUnixNano" in span and isinstance(span["kind"], int)  # enums as integers
        found = []
        ParseDict(_ids_back_to_base64(d, found), ExportTraceServiceRequest())
        assert "traceId" in found and "spanId" in found
    mlines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert mlines
    for line in mlines:
        ParseDict(_ids_back_to_base64(json.loads(line), []), ExportMetricsServiceRequest())

    spans = otel.read_spans(str(tmp_path / "traces.jsonl"))
    fwd, = [s for s in spans if s["name"] == "model_forward"]
    assert fwd["trace_id"] == f"{trace_id_for('run-F', 'batch', 1):032x}"
    assert fwd["attributes"] == {"worker": "t0"} and fwd["events"][0]["name"] == "queue_empty"
    assert fwd["resource"]["service.name"] == "dflash" and fwd["end_ns"] >= fwd["start_ns"]
    opt, = [s for s in spans if s["name"] == "optimizer_step"]
    assert opt["links"][0]["span_id"] in {s["span_id"] for s in spans}

    # a crash mid-write leaves at most a torn last line; readers skip it
    with open(tmp_path / "traces.jsonl", "ab") as f:
        f.write(b'{"resourceSpans":[{"reso')
    assert len(otel.read_spans(str(tmp_path))) == len(spans)
    assert any(p["name"] == "dflash.tokens" and p["value"] == 5
               for p in otel.read_metrics(str(tmp_path)))


@pytest.mark.parametrize("mode", MODES)
def test_failing_stage_carries_an_exception_event(tmp_path, mode, make_tel):
    """OpenTelemetry's exception conventions: ERROR status plus an `exception` event with
    type, message and stack trace, so the failure is readable in Jaeger."""
    tel = make_tel(mode=mode, file_dir=str(tmp_path))

    def deep():
        raise RuntimeError("expected scalar type Float but found BFloat16")

    with pytest.raises(RuntimeError):
        with tel.stage("drafter_forward", worker="drafter0"):
            deep()
    tel.shutdown()
    (span,) = otel.read_spans(str(tmp_path))
    assert span["status"]["code"] == 2  # STATUS_CODE_ERROR
    assert span["status"]["message"].startswith("RuntimeError: expected scalar type")
    (ev,) = [e for e in span["events"] if e["name"] == "exception"]
    assert ev["attributes"]["exception.type"] == "RuntimeError"
    assert ev["attributes"]["exception.message"] == "expected scalar type Float but found BFloat16"
    assert "in deep" in ev["attributes"]["exception.stacktrace"]
