"""The facade: `Telemetry.from_env(...)`, `tel.stage(...)`, counters, histograms, gauges,
summary/profile table, flush and shutdown. See docs/otel.md."""
from __future__ import annotations

import atexit
import functools
import os
import secrets
import sys
import threading
import time
import weakref

from otel.api import DisabledTelemetry
from otel.config import EXPORTER_NICE, WAIT_ATTRIBUTES, ExportConfig
from otel.health import health as span_health
from otel.producer.background import BackgroundThread
from otel.producer.hot_path import ADD, RECORD, BufferRegistry, CudaEventPool, Stage, bound_stage_class
from otel.producer.instruments import Instruments
from otel.producer.phases import RunTrace
from otel.summary import format_table, with_shares
from otel.transport import InProcessTransport, ProcessTransport

LOCAL_DRAIN_S = 60.0  # shutdown with a local sink: how long a background cycle in progress is waited for
_TRUE = ("true",)  # the spec's booleans: only "true", in any case, is true
DEFAULT_METRIC_EXPORT_INTERVAL_S = 1.0


def metric_interval_from_env() -> float:
    """OTEL_METRIC_EXPORT_INTERVAL in seconds (the variable holds milliseconds), else the
    1 s default. A value that is not a positive number is reported on one line and ignored,
    as the OpenTelemetry spec asks of an SDK (telemetry never stops a run)."""
    raw = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
    if not raw:
        return DEFAULT_METRIC_EXPORT_INTERVAL_S
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not ms > 0 or ms == float("inf"):
        print(f"otel: OTEL_METRIC_EXPORT_INTERVAL={raw!r} ignored: expected a positive number of milliseconds; "
              f"using {DEFAULT_METRIC_EXPORT_INTERVAL_S * 1000:.0f}", file=sys.stderr)
        return DEFAULT_METRIC_EXPORT_INTERVAL_S
    return ms / 1000.0
__all__ = ["Telemetry", "EXPORTER_NICE"]


class Telemetry:
    """Use Telemetry.from_env(); the constructor takes already-resolved settings."""

    enabled = True

    def __init__(self, *, service_name, run_id, resource_attributes, file_dir, console,
                 console_interval_s, mode, gpu_indices, metric_attributes, export_interval_s,
                 metric_export_interval_s, max_queue, export_timeout_s=5.0, cuda_pool_size=512,
                 exporter_nice=EXPORTER_NICE, idle_attribution=True, idle_rules=None, root_spans=True,
                 exporter_start_wait_s=3.0, exporter_stuck_s=15.0, wait_attributes=WAIT_ATTRIBUTES,
                 run_span=None, run_root=True, process_span=None, run_start_ns=None, run_attributes=None,
                 metric_prefix=None):
        if mode not in ("process", "thread"):
            raise ValueError(f"mode must be 'process' or 'thread', not {mode!r}")
        self.service_name = service_name
        self.run_id = run_id
        self.mode = mode
        self.console = console
        self._registry = BufferRegistry(max_queue)
        self._tls = self._registry.tls
        self._cuda_pool = None
        self._cuda_pool_size = cuda_pool_size
        self._cuda_lock = threading.Lock()
        self._instruments = Instruments()
        self._t0 = time.monotonic()
        self._t_end = None
        self._profile_epoch_s = None  # begin_profile(): the profile's wall starts there
        self._profile_printed = False
        self._closed = False

        # the run's own trace: a root span for the whole command, its phases as children
        self.run_trace = RunTrace(run_id, run_span or service_name, run_root=run_root, process_span=process_span,
                                  start_ns=run_start_ns, attrs=run_attributes, always=run_span is not None)
        gpu_devices = None
        if gpu_indices is not None:
            from otel.producer.devices import resolve_devices
            gpu_devices = resolve_devices(list(gpu_indices))
        self.config = ExportConfig(
            service_name=service_name, metric_prefix=metric_prefix or service_name, run_id=run_id, mode=mode,
            resource_attributes={**resource_attributes, "service.name": service_name, "run.id": run_id},
            # absolute: the exporter process runs in a cwd of its own (otel.confined)
            file_dir=os.path.abspath(file_dir) if file_dir else None, metric_attributes=tuple(metric_attributes),
            metric_export_interval_s=metric_export_interval_s, max_queue=max_queue,
            gpu_devices=gpu_devices, export_timeout_s=export_timeout_s, exporter_nice=exporter_nice,
            export_chunk=512 if mode == "process" else 64, root_spans=root_spans,
            idle_attribution=idle_attribution, idle_rules=idle_rules,
            wait_attributes=tuple(wait_attributes),
            console_interval_s=(console_interval_s or 0) if console else 0,
            epoch_offset_ns=BackgroundThread.epoch_offset_ns(), start_epoch_s=time.time(),
            run_link=(self.run_trace.trace_id, self.run_trace.root_id) if run_span is not None else None)
        self.stage_metric = self.config.stage_metric
        # the hot path: tel.stage(...) builds a Stage
        self.stage = bound_stage_class(self._registry, self._cuda_pool_or_create)
        self._transport = (ProcessTransport(self.config, start_wait_s=exporter_start_wait_s, stuck_s=exporter_stuck_s)
                           if mode == "process" else InProcessTransport(self.config))
        self._phase_gauges = False
        if run_span is not None:
            self._declare_phase_gauges()
        self._bg = BackgroundThread(self._registry, self._transport, self._instruments, self._cuda_pool_or_none,
                                    interval_s=export_interval_s, metric_interval_s=metric_export_interval_s,
                                    phases=self.run_trace)
        self._bg.start()
        atexit.register(self.shutdown)
        ref = weakref.ref(self)
        os.register_at_fork(after_in_child=lambda: (t := ref()) is not None and t._forget_after_fork())

    def _forget_after_fork(self):
        """In a forked child the background thread is gone: stop buffering, stay silent."""
        self._closed = True
        self.console = False
        self._registry.close()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_env(cls, service_name, run_id=None, resource_attributes=None, file_dir=None,
                 console=True, console_interval_s=None, mode="process", gpu_indices=None,
                 metric_attributes=("worker", "device"), export_interval_s=0.1,
                 metric_export_interval_s=None, max_queue=65536, **options):
        """Build the layer from the standard OTEL_* environment (see docs/otel.md).
        `service_name` is the caller's (the `service.name` resource attribute and the
        prefix of the layer's own metrics, e.g. `{service_name}.stage.duration`);
        OTEL_SERVICE_NAME, when set, wins over it for the resource, as the OpenTelemetry spec
        says, and leaves the metric names alone (a dashboard's queries stay valid, and a name
        with a space in it is a valid service name but no valid instrument name).
        Extra options: export_timeout_s (per export request, default 5), cuda_pool_size
        (CUDA events pre-allocated, default 512), exporter_nice (niceness increment of the
        exporter process, default EXPORTER_NICE; see docs/otel.md for the measurement), idle_attribution (live busy /
        idle-by-cause per worker, default on), idle_rules (otel.idle.IdleRules for the
        pipeline's stage names), root_spans (emit the per-key root spans; False on all but
        one of several processes that share trace keys), exporter_start_wait_s and
        exporter_stuck_s (at shutdown: how long an exporter process that is not ready yet,
        or that makes no progress, is waited for before this process exports the rest
        itself; default 3 and 15), wait_attributes (stage attributes holding seconds the
        stage spent waiting inside, shown apart from its work in the profile; default
        ("blocked_s", "wait_s")). OTEL_RESOURCE_ATTRIBUTES is merged into the resource
        by the SDK on the exporter side; `resource_attributes` given here win.
        `metric_export_interval_s` not given: OTEL_METRIC_EXPORT_INTERVAL (milliseconds, the
        spec's unit) when set, else 1 s (live dashboards; the spec's 60 s default would leave
        Prometheus a minute behind)."""
        disabled = os.environ.get("OTEL_SDK_DISABLED", "").strip().lower()
        if disabled in _TRUE:
            return cls.disabled()
        if disabled not in ("", "false"):
            print(f"otel: OTEL_SDK_DISABLED={os.environ['OTEL_SDK_DISABLED']!r} read as false: the spec's booleans "
                  "are true or false", file=sys.stderr)
        options.setdefault("metric_prefix", service_name)  # the code's name: OTEL_SERVICE_NAME renames the resource only
        service_name = os.environ.get("OTEL_SERVICE_NAME") or service_name
        run_id = str(run_id or os.environ.get("TORCHELASTIC_RUN_ID") or secrets.token_hex(8))
        if metric_export_interval_s is None:
            metric_export_interval_s = metric_interval_from_env()
        return cls(service_name=service_name, run_id=run_id, resource_attributes=dict(resource_attributes or {}),
                   file_dir=file_dir, console=console, console_interval_s=console_interval_s,
                   mode=mode, gpu_indices=gpu_indices, metric_attributes=metric_attributes,
                   export_interval_s=export_interval_s,
                   metric_export_interval_s=metric_export_interval_s, max_queue=max_queue, **options)

    @staticmethod
    def disabled() -> "DisabledTelemetry":
        return DisabledTelemetry()

    # ------------------------------------------------------------------ hot path
    def stage(self, name, trace=None, links=None, stream=None, **attrs) -> Stage:
        """`with tel.stage("model_forward", trace=("batch", 17), worker="t0") as st:`

        (Each instance replaces this method by its own Stage subclass, same signature.)"""
        return self.stage(name, trace, links, stream, **attrs)

    def staged(self, name=None, **stage_kwargs):
        """Decorator form: `@tel.staged("optimizer_step", worker="d0")`."""
        def wrap(fn):
            stage_name = name or fn.__qualname__

            @functools.wraps(fn)
            def inner(*args, **kwargs):
                with self.stage(stage_name, **stage_kwargs):
                    return fn(*args, **kwargs)
            return inner
        return wrap

    def add(self, name, value=1, **attrs) -> None:
        """Counter add: buffers a tuple; aggregated and exported off the hot path."""
        try:
            buf = self._tls.buf
        except AttributeError:
            buf = self._registry.get()
        if len(buf.points) < buf.cap:
            buf.points.append((ADD, name, value, attrs))
        else:
            buf.dropped_points += 1

    def record(self, name, value, **attrs) -> None:
        """Histogram record: buffers a tuple."""
        try:
            buf = self._tls.buf
        except AttributeError:
            buf = self._registry.get()
        if len(buf.points) < buf.cap:
            buf.points.append((RECORD, name, value, attrs))
        else:
            buf.dropped_points += 1

    # ------------------------------------------------------------------ registration
    def declare(self, name, kind="counter", unit="1", description="") -> None:
        if kind not in ("counter", "histogram", "updown"):
            raise ValueError(f"kind must be counter, histogram or updown, not {kind!r}")
        self._instruments.declare(name, kind, unit, description)

    def observable_gauge(self, name, callback, unit="1", description="") -> None:
        """callback() -> iterable of (value, attrs); called in the background thread about
        once per metric export; the values are shipped to the exporter."""
        self._instruments.observable_gauge(name, callback, unit, description)

    def _cuda_pool_or_create(self) -> CudaEventPool:
        if self._cuda_pool is None:
            with self._cuda_lock:
                if self._cuda_pool is None:
                    self._cuda_pool = CudaEventPool(self._cuda_pool_size)
        return self._cuda_pool

    def _cuda_pool_or_none(self):
        return self._cuda_pool

    def prepare_cuda(self, pool_size=None, factory=None, devices=()) -> None:
        """Pre-allocate the CUDA event pool now, one set of events per device index in
        `devices` (else: on a device's first stage with a stream). `factory` makes the
        events (tests inject fakes)."""
        with self._cuda_lock:
            self._cuda_pool = CudaEventPool(pool_size or self._cuda_pool_size, factory)
            for d in devices:
                self._cuda_pool.prepare(d)

    # ------------------------------------------------------------------ the run's trace
    def phase(self, name, parent=None, **attrs):
        """`with tel.phase("load target", target=spec) as ph:`: a span of the run's own trace
        (otel/producer/phases.py), for the run's long steps (loading, data, evals, export),
        never for per-step work (that is `stage`). Not for the hot path: it takes a lock."""
        return self.run_trace.phase(name, parent, **attrs)

    def record_phase(self, name, t0_ns, t1_ns, parent=None, error=None, **attrs) -> int:
        """A phase that already happened, with its perf_counter_ns times (before the
        telemetry started, or in a child that timed itself); returns its span id."""
        return self.run_trace.record(name, t0_ns, t1_ns, parent, error, **attrs)

    def traceparent(self) -> str:
        """W3C traceparent of the innermost open phase: hand it to a child process
        (`TRACEPARENT`) so that its spans join the run's trace."""
        return self.run_trace.traceparent()

    def end_run(self, error=None) -> None:
        """The run is over (``error``: an exception, or (type, message, stack)): open phases
        are closed with it, and the root span ends. shutdown() calls it if nobody did."""
        from otel.producer.phases import _error
        if error is not None and isinstance(error, BaseException):
            error = _error(error)
        self.run_trace.end(error)

    def phase_table(self) -> str:
        return self.run_trace.table(f"{self.run_trace.root_name}: phases of the run")

    def begin_profile(self) -> None:
        """The measured work starts now (training's steps, after the set-up): the profile's
        wall time, and so its shares, count from here."""
        if self._closed:
            return
        self._t0 = time.monotonic()
        self._profile_epoch_s = time.time()
        self._bg.profile_start_epoch_s = self._profile_epoch_s

    def _declare_phase_gauges(self) -> None:
        self._phase_gauges = True
        trace = self.run_trace
        svc = self.config.metric_name_prefix
        self._instruments.observable_gauge(
            f"{svc}.run.phase.elapsed", lambda: trace.observations()[0], "s",
            "Seconds since each open phase of the run began (one series per open phase).")
        self._instruments.observable_gauge(
            f"{svc}.run.phase.progress", lambda: trace.observations()[1], "1",
            "Done / total of the open phases that report progress (replies, shards).")

    # ------------------------------------------------------------------ reporting
    def summary(self) -> dict:
        """Stage percentiles, per-worker busy/idle and span health (otel/health.py), as the
        exporter side last reported them; final once shutdown() returned."""
        bg = self._bg
        wall = (self._t_end or time.monotonic()) - self._t0
        st = self._transport.status()
        remote = st.get("summary") or {}
        # the exporter's figures are as of its last report; shares are of this wall time
        stages = {name: with_shares(dict(st), wall) for name, st in (remote.get("stages") or {}).items()}
        out = {"wall_s": wall, "stages": stages,
               "health": span_health(bg.buffer_full, bg.spans_pending, bg.spans_shipped, st)
               | ({"exporters": st["exporters"]} if st.get("exporters") else {})}
        if self.config.idle_attribution:
            out["workers"] = remote.get("workers", [])
        notes = list(st.get("notes", []))
        if self._cuda_pool is not None and self._cuda_pool.exhausted:
            notes.append(f"CUDA event pool exhausted {self._cuda_pool.exhausted} times (host timing only)")
        points_dropped = self._registry.dropped_points()
        if points_dropped:
            notes.append(f"{points_dropped} counter/histogram values dropped (full per-thread buffer)")
        if notes:
            out["notes"] = notes
        out["run"] = {"wall_s": round(self.run_trace.wall_s(), 3), "phases": self.run_trace.rows(),
                      "trace_id": f"{self.run_trace.trace_id:032x}"}
        return out

    def profile_table(self) -> str:
        return format_table(self.summary(), f"{self.service_name} telemetry profile ({self.mode} mode)",
                            self.config.wait_attributes)

    def end_profile(self, timeout_s=2.0) -> None:
        """The measured work is over and other work follows (an eval, an engine's verdict):
        fold what is buffered into the profile, stop its wall clock here and print its table
        now (console), so its shares are of this work's wall time. It waits for the exporter to
        have consumed the records (the table counts them) but not for their export (a slow or
        dead collector would hold the run up to the bound, in time that no phase covers);
        shutdown() exports the rest without printing the table a second time. Once; bounded
        by ``timeout_s``."""
        if self._closed or self._t_end is not None:
            return
        deadline = time.monotonic() + timeout_s
        if self._bg.cycle(final=True, lock_timeout_s=timeout_s / 2):
            self._transport.flush(max(deadline - time.monotonic(), 0.01), network=False)
        self._t_end = time.monotonic()
        if self.console:
            print(self.profile_table(), file=sys.stderr, flush=True)
            self._profile_printed = True

    # ------------------------------------------------------------------ lifecycle
    def flush(self, timeout_s=2.0, network=True) -> bool:
        """Drain and export what is buffered now, within the bound (``network`` False: handed to
        the exporter, not waited for at a collector, as end_profile does)."""
        if self._closed:
            return False
        deadline = time.monotonic() + timeout_s
        if not self._bg.cycle(final=True, lock_timeout_s=timeout_s / 2):
            return False
        return self._transport.flush(max(deadline - time.monotonic(), 0.01), network=network)

    def shutdown(self, timeout_s=2.0) -> None:
        """Export everything and stop. Local files are always written completely; the
        bound applies to a network collector that does not answer. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.run_trace.end()  # no-op when end_run() was called; else the run ends here
        # with a local sink every record is written: wait for a cycle in progress to end (CPU work: a
        # thread-mode cycle consumes its batch), up to LOCAL_DRAIN_S (a gauge callback that blocks, or
        # a shutdown from inside a cycle, must not hang the process)
        whole = bool(getattr(self._transport, "drain_whole", False))
        wait_s = LOCAL_DRAIN_S if whole else timeout_s * 0.25
        self._bg.stop(join_timeout_s=wait_s if whole else min(0.5, wait_s))
        drained = False
        try:
            drained = self._bg.cycle(final=True, give_up_cuda=True, lock_timeout_s=wait_s)
        except Exception as e:
            print(f"otel: final drain failed: {e!r}", file=sys.stderr)
        if not drained:  # what is still in the lists is counted as dropped, never lost uncounted
            self._bg.buffer_full = self._registry.abandon() + self._bg.buffer_full
        self._registry.close()  # later records are counted as dropped, never kept
        if self._t_end is None:  # else end_profile() stopped the profile's clock
            self._t_end = time.monotonic()
        self._transport.shutdown(timeout_s, time.time())
        if self.console and not self._profile_printed and (self.summary().get("stages") or not self.run_trace.finished):
            print(self.profile_table(), file=sys.stderr, flush=True)  # (a run of phases alone has no profile)
        if self.console and self.run_trace.finished:
            print(self.phase_table(), file=sys.stderr, flush=True)
        try:
            atexit.unregister(self.shutdown)
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False
