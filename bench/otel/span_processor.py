"""Our span queue (otel/exporter/sdk_pipeline.py `ExportPipeline`: one entry per shipped
batch, an export thread per exporter, counts committed batch by batch) against the SDK's
`BatchSpanProcessor` behind a counting exporter that keeps the same per-batch accounting
(`done_seq`: every span of every batch up to it is exported or dropped), side by side:

  throughput  spans/s from the first enqueue until every span is exported, through an
              exporter that encodes OTLP protobuf (what an OTLP export costs per span)
  gil         a busy Python thread's iteration gaps while 5,000 spans/s go through
              (bench/otel/gil_stall.py's measure; median round by max gap)
  dead        a collector that refuses every export (after 20 ms): 20,000 spans in 40
              batches into a 4,096-span queue; after shutdown: does exported + dropped
              equal recorded, and did done_seq reach the last batch?

Both build the same SDK ReadableSpans (ExportPipeline.build_spans). Last line: one JSON
object.

    .venv/bin/python bench/otel/span_processor.py [--rounds 3] [--seconds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import deque

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ["OTEL_TRACES_EXPORTER"] = "none"     # the exporter under test is set below
os.environ["OTEL_METRICS_EXPORTER"] = "none"

from gil_stall import TICK_S, measure  # noqa: E402
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans  # noqa: E402
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult  # noqa: E402

from otel.config import ExportConfig  # noqa: E402
from otel.exporter.sdk_pipeline import ExportPipeline  # noqa: E402

CHUNK = 512


class EncodingExporter(SpanExporter):
    """Encodes each export to OTLP protobuf bytes, as an OTLP exporter does before sending;
    fail_s: a dead collector that answers FAILURE after that long."""

    def __init__(self, fail_s: float | None = None):
        self.fail_s = fail_s
        self.spans = 0

    def export(self, spans):
        if self.fail_s is not None:
            time.sleep(self.fail_s)
            return SpanExportResult.FAILURE
        encode_spans(spans).SerializeToString()
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def _config(max_queue: int) -> ExportConfig:
    return ExportConfig(service_name="bench", run_id="bench", epoch_offset_ns=0, start_epoch_s=time.time(),
                        max_queue=max_queue, export_chunk=CHUNK, idle_attribution=False)


class Ours:
    name = "ExportPipeline"

    def __init__(self, exporter, max_queue):
        self.p = ExportPipeline(_config(max_queue))
        self.p.add_span_exporter("otlp", exporter)  # a network lane, as the benchmark's collector is

    def enqueue(self, seq, spans):
        self.p.enqueue(seq, spans, len(spans), 0)

    def flush(self, timeout_s):
        return self.p.flush(timeout_s)

    def shutdown(self, timeout_s):
        self.p.shutdown(timeout_s)
        st = self.p.final_status()
        return {"done_seq": st["done_seq"], "exported": st["spans_exported"],
                "dropped": sum(st["dropped"].values()), "accounted": st["spans_done"]}


class CountingExporter(SpanExporter):
    """Wraps the real exporter and keeps ExportPipeline's accounting: a batch (seq) is done
    once each of its spans was exported or refused. It can only count what reaches it."""

    def __init__(self, exporter):
        self.exporter = exporter
        self.lock = threading.Lock()
        self.seq_of: dict = {}      # span id -> seq
        self.left: dict = {}        # seq -> spans not accounted for yet
        self.order: deque = deque()
        self.done_seq = self.exported = self.failed = 0

    def register(self, seq, spans):
        with self.lock:
            for s in spans:
                self.seq_of[s.context.span_id] = seq
            self.left[seq] = len(spans)
            self.order.append(seq)

    def export(self, spans):
        try:
            ok = self.exporter.export(spans) is SpanExportResult.SUCCESS
        except Exception:
            ok = False
        with self.lock:
            for s in spans:
                self.left[self.seq_of.pop(s.context.span_id)] -= 1
            if ok:
                self.exported += len(spans)
            else:
                self.failed += len(spans)
            while self.order and self.left[self.order[0]] == 0:
                self.done_seq = self.order.popleft()
                del self.left[self.done_seq]
        return SpanExportResult.SUCCESS if ok else SpanExportResult.FAILURE

    def shutdown(self):
        self.exporter.shutdown()


class Sdk:
    name = "BatchSpanProcessor"

    def __init__(self, exporter, max_queue):
        self.p = ExportPipeline(_config(max_queue))   # builds the spans; its own queue stays unused
        self.counting = CountingExporter(exporter)
        self.bsp = BatchSpanProcessor(self.counting, max_queue_size=max_queue, max_export_batch_size=CHUNK,
                                      schedule_delay_millis=100)

    def enqueue(self, seq, spans):
        built = self.p.build_spans(spans)
        self.counting.register(seq, built)
        for s in built:
            self.bsp.on_end(s)

    def flush(self, timeout_s):
        return self.bsp.force_flush(int(timeout_s * 1000))

    def shutdown(self, timeout_s):
        self.bsp.shutdown()
        self.p.shutdown(0.1)
        c = self.counting
        return {"done_seq": c.done_seq, "exported": c.exported, "dropped": c.failed,
                "accounted": c.exported + c.failed}


_rng = random.Random(1)


def make_spans(n: int) -> list:
    t = time.time_ns()
    return [("model_forward", _rng.getrandbits(128) or 1, _rng.getrandbits(64) or 1, 0, t, t + 1000,
             {"worker": "t0", "batch_id": i, "tokens": 512}, None, None, None, None) for i in range(n)]


def throughput(impl_cls, total=20_000, per_batch=500) -> float:
    impl = impl_cls(EncodingExporter(), 65536)
    batches = [make_spans(per_batch) for _ in range(total // per_batch)]
    t0 = time.perf_counter()
    for seq, spans in enumerate(batches, 1):
        impl.enqueue(seq, spans)
    impl.flush(60.0)
    dt = time.perf_counter() - t0
    st = impl.shutdown(5.0)
    assert st["exported"] == total, st
    return total / dt


def gil(impl_cls, seconds, rounds) -> dict:
    per_tick = int(5000 * TICK_S)
    out = []
    for _ in range(rounds):
        if impl_cls is None:
            out.append(measure(seconds, lambda: make_spans(per_tick)))
            continue
        impl = impl_cls(EncodingExporter(), 65536)
        seq = [0]

        def tick():
            seq[0] += 1
            impl.enqueue(seq[0], make_spans(per_tick))
        out.append(measure(seconds, tick))
        impl.shutdown(5.0)
    out.sort(key=lambda r: r["max_gap_ms"])
    return out[len(out) // 2]


def dead(impl_cls, total=20_000, batches=40, max_queue=4096) -> dict:
    impl = impl_cls(EncodingExporter(fail_s=0.02), max_queue)
    per = total // batches
    for seq in range(1, batches + 1):
        impl.enqueue(seq, make_spans(per))
    t0 = time.perf_counter()
    st = impl.shutdown(2.0)
    st["shutdown_s"] = round(time.perf_counter() - t0, 3)
    st["recorded"] = total
    st["unaccounted"] = total - st["exported"] - st["dropped"]
    st["last_seq"] = batches
    st["exact"] = st["unaccounted"] == 0 and st["done_seq"] == batches
    return st


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0)
    args = ap.parse_args()
    import logging
    logging.getLogger("opentelemetry.sdk._shared_internal").setLevel(logging.ERROR)  # "Queue full" per span

    res = {"throughput_spans_per_s": {}, "gil": {}, "dead_collector": {}}
    for cls in (Ours, Sdk):
        res["throughput_spans_per_s"][cls.name] = round(throughput(cls))
    res["gil"]["none"] = gil(None, args.seconds, args.rounds)
    for cls in (Ours, Sdk):
        res["gil"][cls.name] = gil(cls, args.seconds, args.rounds)
    for cls in (Ours, Sdk):
        res["dead_collector"][cls.name] = dead(cls)

    tp, g, d = res["throughput_spans_per_s"], res["gil"], res["dead_collector"]
    print(f"{'':24}{'ExportPipeline':>16}{'BatchSpanProcessor':>20}{'ratio':>8}")
    a, b = tp["ExportPipeline"], tp["BatchSpanProcessor"]
    print(f"{'throughput spans/s':24}{a:>16}{b:>20}{a / b:>8.2f}")
    for k in ("iterations", "p999_gap_ms", "max_gap_ms"):
        a, b = g["ExportPipeline"][k], g["BatchSpanProcessor"][k]
        print(f"{'busy thread ' + k:24}{a:>16.6g}{b:>20.6g}{a / b:>8.2f}")
    print(f"{'  (no telemetry)':24}{g['none']['iterations']:>16} iterations, max gap {g['none']['max_gap_ms']:.2f} ms")
    for k in ("exported", "dropped", "unaccounted", "done_seq", "shutdown_s", "exact"):
        print(f"{'dead collector ' + k:24}{str(d['ExportPipeline'][k]):>16}{str(d['BatchSpanProcessor'][k]):>20}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
