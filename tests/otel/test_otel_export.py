"""Spans and metrics reach real OTLP receivers (gRPC and HTTP), in both modes."""
import time

import pytest
from otel_test_helpers import MODES, point_env_at

from otel.trace_ids import root_span_id_for, trace_id_for


def _by_name(spans, name):
    return [s for s in spans if s["name"] == name]


@pytest.mark.parametrize("mode", MODES)
def test_spans_and_metrics_reach_receiver(receiver, mode, monkeypatch, make_tel):
    point_env_at(monkeypatch, receiver)
    monkeypatch.setenv("OTEL_SERVICE_NAME", "dflash-test")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,team=ml")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=secret42")
    # OTEL_SERVICE_NAME names the resource; the metrics keep the name the code gave (docs/otel.md, Metrics)
    tel = make_tel(service_name="given-in-code", run_id="run-A", mode=mode,
                   resource_attributes={"rank": 0, "world_size": 2})
    assert tel.run_id == "run-A"

    with tel.stage("model_forward", trace=("batch", 17), worker="target0", device="cpu",
                   batch_id=17, step=3) as st:
        time.sleep(0.01)
        st.set(tokens=123)
        st.event("queue_empty", wait_s=0.31)
    for i in range(200):
        with tel.stage("pack_hidden", trace=("batch", i % 4), worker="target0"):
            pass
    with tel.stage("optimizer_step", links=[("batch", 17), ("batch", 1)], worker="drafter0"):
        pass
    tel.declare("dflash.tokens", kind="counter", unit="{token}", description="tokens seen")
    tel.add("dflash.tokens", 100, worker="target0")
    tel.add("dflash.tokens", 23, worker="target0")
    tel.record("dflash.queue.wait", 0.25, queue="hidden")
    tel.observable_gauge("dflash.queue.depth", lambda: [(3, {"queue": "hidden"})], unit="{item}")
    assert tel.flush(timeout_s=10.0)

    spans = receiver.wait_for_spans(
        lambda s: _by_name(s, "optimizer_step") and len(_by_name(s, "pack_hidden")) == 200
        and _by_name(s, "batch 17"))

    fwd, = _by_name(spans, "model_forward")
    dur_ms = (fwd["end_ns"] - fwd["start_ns"]) / 1e6
    assert 8 <= dur_ms <= 60, dur_ms
    assert abs(fwd["start_ns"] / 1e9 - time.time()) < 60  # epoch clock, not perf_counter
    assert fwd["attributes"] == {"worker": "target0", "device": "cpu", "batch_id": 17, "step": 3, "tokens": 123}
    ev, = fwd["events"]
    assert ev["name"] == "queue_empty" and ev["attributes"] == {"wait_s": 0.31}
    assert fwd["start_ns"] <= ev["time_ns"] <= fwd["end_ns"]

    res = fwd["resource"]
    assert res["service.name"] == "dflash-test"
    assert res["deployment.environment"] == "test" and res["team"] == "ml"
    assert res["rank"] == 0 and res["world_size"] == 2 and res["run.id"] == "run-A"

    # deterministic trace: the batch's stages share a trace whose root has a known span id
    tid17 = f"{trace_id_for('run-A', 'batch', 17):032x}"
    root17 = f"{root_span_id_for('run-A', 'batch', 17):016x}"
    assert fwd["trace_id"] == tid17 and fwd["parent_span_id"] == root17
    root, = _by_name(spans, "batch 17")
    assert root["span_id"] == root17 and root["trace_id"] == tid17 and root["parent_span_id"] == ""
    assert root["start_ns"] <= fwd["start_ns"] and fwd["end_ns"] <= root["end_ns"]
    assert {s["trace_id"] for s in _by_name(spans, "pack_hidden")} == {
        f"{trace_id_for('run-A', 'batch', i):032x}" for i in range(4)}

    # links point at the (real) root spans of the consumed batches
    opt, = _by_name(spans, "optimizer_step")
    assert opt["trace_id"] not in {tid17}
    assert opt["links"] == [
        {"trace_id": tid17, "span_id": root17},
        {"trace_id": f"{trace_id_for('run-A', 'batch', 1):032x}",
         "span_id": f"{root_span_id_for('run-A', 'batch', 1):016x}"}]
    root_ids = {(s["trace_id"], s["span_id"]) for s in spans}
    assert all((l["trace_id"], l["span_id"]) in root_ids for l in opt["links"])

    # batching: many spans per export request
    per_request = [sum(len(ss.spans) for rs in r.resource_spans for ss in rs.scope_spans)
                   for r in receiver.trace_requests]
    assert max(per_request) >= 50, per_request
    assert any(h.get("x-api-key") == "secret42" for h in receiver.headers)

    points = receiver.wait_for_metrics(lambda p: any(
        x["name"] == "given-in-code.stage.duration" and x["attributes"].get("stage") == "model_forward"
        for x in p) and any(x["name"] == "dflash.queue.depth" for x in p))
    hist = [p for p in points if p["name"] == "given-in-code.stage.duration"
            and p["attributes"]["stage"] == "model_forward"][-1]
    assert hist["unit"] == "s" and hist["type"] == "histogram"
    assert hist["attributes"] == {"stage": "model_forward", "clock": "host", "worker": "target0", "device": "cpu"}
    assert hist["explicit_bounds"][0] == pytest.approx(0.0001) and hist["explicit_bounds"][-1] == pytest.approx(10.0)
    assert hist["count"] == 1 and 0.008 <= hist["sum"] <= 0.06
    tokens = [p for p in points if p["name"] == "dflash.tokens"][-1]
    assert tokens["value"] == 123 and tokens["unit"] == "{token}" and tokens["attributes"] == {"worker": "target0"}
    wait = [p for p in points if p["name"] == "dflash.queue.wait"][-1]
    assert wait["count"] == 1 and wait["sum"] == pytest.approx(0.25)
    depth = [p for p in points if p["name"] == "dflash.queue.depth"][-1]
    assert depth["value"] == 3 and depth["attributes"] == {"queue": "hidden"}
    names = {p["name"] for p in points}
    assert {"otel.spans.recorded", "otel.spans.exported", "otel.spans.dropped", "otel.export.failures"} <= names

    health = tel.summary()["health"]
    assert health["spans_recorded"] >= 202 and health["spans_dropped"] == 0


def test_ranks_in_two_processes_join_one_trace(grpc_receiver, monkeypatch, make_tel):
    """Two layers (as two ranks would: separate exporter processes) with one run id put the
    same batch's stages into one trace under one root span id."""
    point_env_at(monkeypatch, grpc_receiver)
    rank0 = make_tel(run_id="run-B", mode="process", resource_attributes={"rank": 0})
    rank1 = make_tel(run_id="run-B", mode="process", resource_attributes={"rank": 1})
    with rank0.stage("model_forward", trace=("batch", 5)):
        pass
    with rank1.stage("drafter_forward", trace=("batch", 5)):
        pass
    rank0.flush(5.0)
    rank1.flush(5.0)
    spans = grpc_receiver.wait_for_spans(
        lambda s: _by_name(s, "model_forward") and _by_name(s, "drafter_forward"))
    a, = _by_name(spans, "model_forward")
    b, = _by_name(spans, "drafter_forward")
    assert a["trace_id"] == b["trace_id"] and a["parent_span_id"] == b["parent_span_id"]
    assert {a["resource"]["rank"], b["resource"]["rank"]} == {0, 1}


@pytest.mark.parametrize("mode", MODES)
def test_error_status_and_decorator(grpc_receiver, mode, monkeypatch, make_tel):
    point_env_at(monkeypatch, grpc_receiver)
    tel = make_tel(mode=mode)

    @tel.staged("decorated", worker="w")
    def work(x):
        return x * 2

    assert work(21) == 42
    with pytest.raises(ValueError):
        with tel.stage("failing"):
            raise ValueError("boom")
    tel.flush(5.0)
    spans = grpc_receiver.wait_for_spans(lambda s: _by_name(s, "decorated") and _by_name(s, "failing"))
    assert _by_name(spans, "decorated")[0]["attributes"] == {"worker": "w"}
    assert _by_name(spans, "failing")[0]["status_code"] == 2  # STATUS_CODE_ERROR


@pytest.mark.parametrize("mode", MODES)
def test_metric_misuse_is_reported_not_fatal(tmp_path, mode, make_tel, capfd):
    tel = make_tel(mode=mode, file_dir=str(tmp_path))
    tel.declare("dflash.steps", kind="counter")
    tel.record("dflash.steps", 1.0)          # a histogram value for a counter
    tel.add("dflash.odd", 1, device=object())  # attribute value the SDK can't take: str()
    tel.add("dflash.odd2", 1, shape=[2, 3])     # unhashable attribute value
    with tel.stage("still_works"):
        pass
    assert tel.flush(timeout_s=10.0)
    import otel
    assert [s["name"] for s in otel.read_spans(str(tmp_path))] == ["still_works"]
    assert any("dflash.steps" in n for n in tel.summary().get("notes", []))
    odd = [p for p in otel.read_metrics(str(tmp_path)) if p["name"] == "dflash.odd"]
    assert odd and odd[-1]["attributes"]["device"].startswith("<object")
