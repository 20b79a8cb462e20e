"""otel/exporter/sdk_pipeline.py's lanes: each span exporter has its own queue and thread, so a
collector that hangs or refuses never costs the file sink beside it a span, not even beyond the
queue's bound (the network lane sheds its own oldest); every batch is accounted for once every
lane is done with it, and done_seq never passes a batch still open."""
import time

import pytest
from opentelemetry.sdk.trace.export import SpanExportResult

from otel.config import ExportConfig
from otel.exporter.sdk_pipeline import ExportPipeline


class Stub:
    def __init__(self, delay: float, ok: bool):
        self.delay, self.ok, self.n = delay, ok, 0

    def export(self, spans):
        time.sleep(self.delay)
        if self.ok:
            self.n += len(spans)
            return SpanExportResult.SUCCESS
        return SpanExportResult.FAILURE

    def shutdown(self):
        pass


def _pipeline(monkeypatch, max_queue=100):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    return ExportPipeline(ExportConfig(service_name="t", run_id="t", epoch_offset_ns=0, start_epoch_s=time.time(),
                                       max_queue=max_queue, export_chunk=512, idle_attribution=False))


def _spans(n, start):
    return [("s", 1, start + i, 0, 0, 10, {}, (), (), None, None) for i in range(n)]


def test_a_dead_collector_never_costs_the_file_a_span_even_past_the_bound(monkeypatch):
    p = _pipeline(monkeypatch, max_queue=100)
    dead, file = Stub(0.3, False), Stub(0.0, True)
    p.add_span_exporter("otlp", dead)
    p.add_span_exporter("file", file)
    for seq in range(1, 11):  # 500 spans through a 100-span bound
        p.enqueue(seq, _spans(50, seq * 100), 50, 0)
        time.sleep(0.02)
        st = p.status()
        open_seqs = [e[0] for e, _ in p._open.values()]
        assert st["done_seq"] < min(open_seqs, default=seq + 1), (st["done_seq"], open_seqs)
    p.shutdown(0.5)
    st = p.final_status()
    assert file.n == 500 and st["spans_exported"] == 500 and st["done_seq"] == 10, st
    assert st["spans_done"] == 500 and sum(st["dropped"].values()) == 0
    assert st["exporters"]["file"] == {"exported": 500, "dropped": {}}
    assert st["exporters"]["otlp"]["exported"] == 0 and sum(st["exporters"]["otlp"]["dropped"].values()) == 500


def test_lanes_are_added_once_each_before_any_span(monkeypatch):
    p = _pipeline(monkeypatch)
    p.add_span_exporter("file", Stub(0.0, True))
    with pytest.raises(ValueError):
        p.add_span_exporter("file", Stub(0.0, True))
    p.enqueue(1, _spans(5, 0), 5, 0)
    with pytest.raises(ValueError):
        p.add_span_exporter("otlp", Stub(0.0, True))  # batch 1 would wait for it forever
    p.shutdown(1.0)
    assert p.final_status()["spans_exported"] == 5


def test_roots_a_file_wrote_while_a_hung_collector_holds_their_batch_count_as_recorded(monkeypatch):
    """The profile's health line read `recorded 32 exported 8 queued 24` beside `file: exported
    39`: a batch's roots (the run's own spans) counted only once every lane was done with it."""
    from otel.health import health

    p = _pipeline(monkeypatch)
    hung, file = Stub(2.0, True), Stub(0.0, True)
    p.add_span_exporter("otlp", hung)
    p.add_span_exporter("file", file)
    p.enqueue(1, _spans(5, 100), 3, 2)  # 3 stage records, 2 of the run's own spans
    deadline = time.monotonic() + 30
    while file.n < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    st = p.status()
    h = health(0, 0, 3, st)
    assert st["exporters"]["file"]["exported"] == 5 and h["spans_recorded"] == 5, (h, st)
    assert h["spans_recorded"] == h["spans_exported"] + h["spans_dropped"] + h["spans_queued"], h
    p.shutdown(5.0)
    h = health(0, 0, 3, p.final_status())
    assert h["spans_recorded"] == 5 and h["spans_queued"] == 0, h
