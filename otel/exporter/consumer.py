"""The receiving end of the shipped batches: everything that looks at records one by one.

It runs where the OpenTelemetry SDK runs (the exporter process, or the background thread
in "thread" mode), so the training process never pays per-record Python work beyond the
hot path's tuple append. Per batch it:
- feeds the stage records to the profile (console table, summary percentiles) and to the
  live idle attribution (busy / idle-by-cause counters and the busy-fraction gauge);
- sums counter points per (name, attributes) and records histogram points;
- builds span tuples (ids, epoch times, per-key roots) and queues them for export, with
  the batch's sequence number so that completion can be acknowledged batch by batch.

A batch (built by otel.producer.background):
  {"seq": int, "spans": [stage records], "cuda": [stage records, device seconds resolved],
   "points": [metric points], "buffer_full": int, "final": bool,
   "instruments": {...}, "gauges": {...}}
"""
from __future__ import annotations

import sys
import time

from otel.config import ExportConfig
from otel.exporter.profile import Profile
from otel.exporter.sdk_pipeline import ExportPipeline
from otel.exporter.span_builder import SpanBuilder, phase_spans
from otel.health import health
from otel.records import ADD, KIND, POINT_ATTRS, POINT_NAME, RECORD, VALUE
from otel.summary import format_table


def _key(name, attrs):
    key = name, tuple(sorted(attrs.items()))
    try:
        hash(key)
        return key
    except TypeError:  # an unhashable attribute value (a list, ...)
        return name, tuple(sorted((k, str(v)) for k, v in attrs.items()))


class BatchConsumer:
    def __init__(self, config: ExportConfig, pipeline: ExportPipeline | None = None):
        self.config = config
        self.pipeline = pipeline or ExportPipeline(config)
        self.builder = SpanBuilder(config.run_id, config.epoch_offset_ns, config.root_spans, config.run_link)
        self.profile = Profile(config.wait_attributes)
        self.epoch_offset_ns = int(config.epoch_offset_ns)
        self.start_epoch_s = float(config.start_epoch_s or time.time())
        self.end_epoch_s = None
        self.console_interval_s = config.console_interval_s or 0
        self.title = f"{config.service_name} telemetry profile ({config.mode} mode)"
        self._last_console = time.monotonic()
        self._received_at_print = 0      # records consumed when the last periodic table was printed
        self.metric_failures = 0
        self.received = 0                # stage records consumed
        self.idle = None
        if config.idle_attribution:
            from otel.exporter.idle_metrics import IdleMetrics
            rules = config.idle_rules
            self.idle = IdleMetrics(config.metric_name_prefix, **({"rules": rules} if rules else {}))
            self.pipeline.declare({
                self.idle.busy_name: ("counter", "s", "Worker time inside compute stages."),
                self.idle.idle_name: ("counter", "s", "Worker idle time by cause."),
            })
            self.pipeline.observable_gauge(self.idle.fraction_name, self.idle.fractions, "1",
                                           "Worker busy time / wall time so far.")

    # ------------------------------------------------------------ per batch
    def consume(self, batch: dict) -> None:
        final = bool(batch.get("final"))
        if batch.get("instruments"):
            self.pipeline.declare(batch["instruments"])
        records = batch.get("spans") or []
        if batch.get("cuda"):
            records = records + batch["cuda"]
        try:
            self._metrics(batch, records, final)
        except Exception as e:  # metrics must never cost the batch its spans
            self.metric_failures += 1
            if self.metric_failures == 1:
                print(f"otel exporter: metrics of a batch failed: {e!r}", file=sys.stderr, flush=True)
        self.received += len(records)
        if batch.get("profile_start_epoch_s"):  # Telemetry.begin_profile: the profile's wall starts there
            self.start_epoch_s = float(batch["profile_start_epoch_s"])
        spans = self.builder.build(records, final) if (records or final) else []
        if batch.get("phases"):  # the run's own trace: counted with the synthesized roots
            spans += phase_spans(batch["phases"], self.epoch_offset_ns)
        self.pipeline.enqueue(batch.get("seq", 0), spans, len(records), len(spans) - len(records),
                              int(batch.get("buffer_full", 0)))
        self._maybe_print()

    def _metrics(self, batch, records, final) -> None:
        if records:
            self.profile.add_records(records)
        adds: dict = {}
        for p in batch.get("points") or ():
            if p[KIND] == ADD:
                k = _key(p[POINT_NAME], p[POINT_ATTRS])
                adds[k] = adds.get(k, 0) + p[VALUE]
            elif p[KIND] == RECORD:
                self.pipeline.metric_point(p[POINT_NAME], "histogram", p[VALUE], p[POINT_ATTRS])
        if self.idle is not None:
            if records:
                self.idle.feed(records)
            # the records' clock: the training process's perf_counter_ns
            now_ns = time.time_ns() - self.epoch_offset_ns
            for name, attrs, secs in self.idle.deltas(now_ns, final):
                adds[(name, attrs)] = adds.get((name, attrs), 0) + secs
        for (name, attrs), value in adds.items():
            self.pipeline.metric_point(name, "counter", value, dict(attrs))
        if batch.get("gauges"):
            self.pipeline.set_gauges(batch["gauges"])

    def _maybe_print(self) -> None:
        ci = self.console_interval_s
        if ci and time.monotonic() - self._last_console >= ci:
            self._last_console = time.monotonic()
            if self.received == self._received_at_print:
                return  # nothing new since the last table (training over, an eval running): not again
            self._received_at_print = self.received
            st = self.pipeline.status()
            h = health(st["buffer_full"], 0, self.received, {**st, "dropped": dict(st["dropped"])})
            print(format_table({**self.summary(), "health": h}, self.title, self.config.wait_attributes),
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------ reporting
    def summary(self, final: bool = False) -> dict:
        """Stage percentiles and per-worker busy/idle, as of now (final: everything)."""
        wall = (self.end_epoch_s or time.time()) - self.start_epoch_s
        out = {"wall_s": wall, "stages": self.profile.summary(wall)}
        if self.idle is not None:
            out["workers"] = self.idle.summary(final=final)
        return out

    def status(self, final: bool = False) -> dict:
        """Export counts (committed batch by batch) plus the summary."""
        st = self.pipeline.final_status() if final else self.pipeline.status()
        st["summary"] = self.summary(final)
        return st

    def flush(self, timeout_s: float) -> bool:
        return self.pipeline.flush(timeout_s)

    def shutdown(self, network_timeout_s: float, end_epoch_s: float | None = None) -> dict:
        """Export everything local, network within the bound; returns the final status."""
        self.end_epoch_s = end_epoch_s or time.time()
        self.pipeline.shutdown(network_timeout_s)
        return self.status(final=True)
