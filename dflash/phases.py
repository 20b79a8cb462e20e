"""The run's phases: every command's long steps (checking inputs, loading, preparing and
regenerating data, building the drafter, training, checkpoints, evals, export, the engine)
as spans of one trace per run (otel/producer/phases.py), from the process's first second
to its last. Per-step work stays in `tel.stage` (the batch traces); this is what happens
around it, where users lose their hours and no per-step trace looks.

One per process (a command runs one run):
- `phase(name, **attrs)` anywhere marks a step (`with phase("load_target", target=spec):`).
  Before the command's telemetry exists (its input checks, the data set read, torch's
  import: what runs before a command knows where telemetry goes), the step is remembered
  and recorded, with its own times, once the telemetry starts;
- `use(tel)` hands the command's telemetry over (`dflash train`, `dflash capture`: their
  run dirs), or `start(command)` makes one for a command without a run dir: spans go to
  `--telemetry-dir` or the OTLP endpoint the OTEL_* variables name, and with neither, only
  the phase table is kept (no exporter process for nothing to export);
- `finish(error)` ends the run's root span with the command's outcome (cli.py, for every
  command) and shuts the telemetry down; idempotent.
The root span starts when the process did (/proc), so the interpreter's own start-up and
imports are in the trace too.

Testing dashboards and the stall report's start-up section: `--inject-delay PHASE=SECONDS`
(or `PHASE@RANK=SECONDS`, one rank) sleeps inside a set-up phase (INJECTABLE).
"""
from __future__ import annotations

import os
import sys
import threading
import time

# the set-up phases --inject-delay can slow down (on every rank, or on one: PHASE@RANK)
INJECTABLE = ("read_data", "load_target", "prepare_data", "regen_batch", "build_drafter", "join_ranks")


def _process_start_ns() -> int:
    """perf_counter_ns of this process's start (Linux: its start time in /proc, 10 ms ticks),
    else of this module's import."""
    now = time.perf_counter_ns()
    try:
        with open("/proc/self/stat", "rb") as f:
            start_ticks = int(f.read().rsplit(b")", 1)[1].split()[19])
        with open("/proc/uptime", "rb") as f:
            uptime_s = float(f.read().split()[0])
        ago = uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
        if 0 <= ago < 3600:  # a sane reading (a container's /proc may lie): else the import time
            return now - int(ago * 1e9)
    except (OSError, ValueError, IndexError):
        pass
    return now


PROCESS_T0 = _process_start_ns()
IMPORTED_T = time.perf_counter_ns()

_current = None          # the command's telemetry (otel Telemetry or PhaseTable), once known
_early: list = []        # phases finished before it: (name, t0, t1, attrs, error)
_inject: dict = {}       # phase -> seconds (this rank's --inject-delay on set-up phases)
_command = None
_fallback = None         # (command, file dir): where the spans go if the command stops before its telemetry starts
_start_ns = PROCESS_T0   # where this command began: the process's start, or (a second command in one
                         # process: tests, benches) its own cli.main call


class _EarlyPhase:
    """A phase before the telemetry exists: its times and attributes, kept for use()."""

    __slots__ = ("name", "attrs", "t0")

    def __init__(self, name, attrs):
        self.name, self.attrs = name, attrs

    def __enter__(self):
        self.t0 = time.perf_counter_ns()
        return self

    def __exit__(self, exc_type, exc, tb):
        from otel.producer.phases import _error
        _early.append((self.name, self.t0, time.perf_counter_ns(), self.attrs,
                       _error(exc) if exc is not None else None))
        return False

    def set(self, **attrs):
        self.attrs.update(attrs)

    def event(self, name, **attrs):
        pass

    def progress(self, done, total=None):
        self.attrs["progress.done"] = done
        if total is not None:
            self.attrs["progress.total"] = total

    @property
    def traceparent(self) -> str:
        return os.environ.get("TRACEPARENT", "")


class _Injected:
    """A phase with an injected delay inside it (--inject-delay PHASE=SECONDS)."""

    def __init__(self, inner, secs):
        self.inner, self.secs = inner, secs

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def __enter__(self):
        ph = self.inner.__enter__()
        ph.set(injected_delay_s=self.secs)
        time.sleep(self.secs)
        return ph

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class _Named:
    """A phase the main thread is in, named for the line a signal prints (`innermost`)."""

    def __init__(self, inner, name):
        self.inner, self.name = inner, name

    def __getattr__(self, attr):  # set, event, progress, traceparent: the phase's own (held un-entered too)
        return getattr(self.inner, attr)

    def __enter__(self):
        main = threading.current_thread() is threading.main_thread()
        if main:
            _main_open.append(self.name)
            _left_by_error.clear()  # an error handled before: the command went on past it
        try:
            return self.inner.__enter__()  # an injected delay sleeps in here: a signal may land in it
        except BaseException:
            if main:
                _main_open.pop()
                _left_by_error[:] = _left_by_error or [self.name]
            raise

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread() and _main_open and _main_open[-1] == self.name:
            _main_open.pop()
            if exc[0] is None:
                _left_by_error.clear()  # ended well: whatever an inner one raised was handled
            elif not _left_by_error:  # the innermost a signal or a crash left
                _left_by_error.append(self.name)
        return self.inner.__exit__(*exc)


_main_open: list[str] = []  # the main thread's open phases, outermost first
_left_by_error: list[str] = []  # the innermost phase an exception ended (at most one)


def innermost() -> str | None:
    """The phase the command's main thread is in now (`checkpoint`, `export`, ...), or the
    innermost one an exception on its way out (a Ctrl-C) has just ended; else None."""
    return _main_open[-1] if _main_open else (_left_by_error[0] if _left_by_error else None)


def phase(name: str, **attrs):
    """A step of the run, as a context manager (see the module doc)."""
    ph = _current.phase(name, **attrs) if _current is not None else _EarlyPhase(name, attrs)
    secs = _inject.get(name)
    return _Named(_Injected(ph, secs) if secs else ph, name)


def record(name: str, t0_ns: int, t1_ns: int, parent=None, **attrs) -> int:
    """A phase that already happened (perf_counter_ns times): a child process's own timing."""
    if _current is None:
        _early.append((name, t0_ns, t1_ns, attrs, None))
        return 0
    return _current.record_phase(name, t0_ns, t1_ns, parent, **attrs)


def traceparent() -> str:
    """The W3C traceparent a child process started now is handed (TRACEPARENT), so that its
    spans join this run's trace; the one this process was given while none exists."""
    return _current.traceparent() if _current is not None else os.environ.get("TRACEPARENT", "")


def child_env(env: dict | None = None) -> dict:
    """``env`` (default: ours) with TRACEPARENT set to the current phase, when there is one."""
    env = dict(os.environ if env is None else env)
    tp = traceparent()
    if tp:
        env["TRACEPARENT"] = tp
    return env


def current():
    """The command's telemetry (the disabled layer's no-op before one exists)."""
    if _current is None:
        from otel import DisabledTelemetry
        return DisabledTelemetry()
    return _current


def inject_delays(delays: dict, rank: int) -> None:
    """This rank's share of --inject-delay for set-up phases: PHASE=S (every rank) and
    PHASE@RANK=S (that rank only; it wins)."""
    _inject.clear()
    for key, secs in delays.items():
        name, _, who = key.partition("@")
        if name in INJECTABLE and (not who or int(who) == rank):
            if who or name not in _inject:
                _inject[name] = float(secs)


def use(tel) -> None:
    """The command's telemetry from here on; the phases that ran before it are recorded with
    their own times, the interpreter's start-up (process start to dflash's first import) first."""
    global _current
    _current = tel
    if _start_ns == PROCESS_T0 and IMPORTED_T - PROCESS_T0 > 1_000_000:  # the interpreter and its imports
        tel.record_phase("python_start", PROCESS_T0, IMPORTED_T)
    early, _early[:] = list(_early), []
    for name, t0, t1, attrs, error in early:
        tel.record_phase(name, t0, t1, error=error, **attrs)


def run_start_ns() -> int:
    """perf_counter_ns where the command's root span starts."""
    return _start_ns


def run_attributes(command: str, argv: list[str] | None = None) -> dict:
    line = ["dflash", *argv] if argv else ["dflash", command]
    return {"dflash.command": command, "process.pid": os.getpid(), "process.command_line": " ".join(line)[:1000]}


def start(command: str, *, file_dir: str | None = None, run_id: str | None = None, argv=None,
          enabled: bool = True, console: bool = True, rank: int = 0, world: int = 1, mode: str = "process"):
    """The telemetry of a command without a training run (capture, eval, export, serve, data
    inspect): spans to ``file_dir`` or the OTEL_* endpoint, else a phase table alone. Under
    torchrun (``world`` > 1) rank 0 emits the root and each rank its process span; the ranks
    share the trace through ``run_id`` (run/distributed.py early_run_id)."""
    import uuid

    import otel
    from otel.exporter_choice import selected_exporters

    global _command
    _command = command
    rid = run_id or os.environ.get("DFLASH_RUN_ID") or uuid.uuid4().hex
    attrs = run_attributes(command, argv)
    if enabled and selected_exporters("traces", file_dir):
        res = {"dflash.command": command} | ({"rank": rank, "world_size": world} if world > 1 else {})
        tel = otel.Telemetry.from_env(service_name="dflash", run_id=rid, file_dir=file_dir,
                                      console=console and rank == 0, mode=mode, resource_attributes=res,
                                      idle_attribution=False, run_span=f"dflash {command}", run_root=rank == 0,
                                      process_span=f"dflash {command} rank {rank}" if world > 1 else None,
                                      run_start_ns=_start_ns, run_attributes=attrs)
    else:
        tel = PhaseTable(rid, f"dflash {command}", attrs, console=console and enabled and rank == 0)
    use(tel)
    return tel


def fallback(command: str, file_dir: str | None) -> None:
    """Where this command's spans go if it stops (a signal, a crash) before its telemetry starts
    (`train` and `capture` start theirs after torch's import and the ranks' agreement): the
    phases until then are written there rather than lost. ``file_dir`` None (set once the inputs
    are checked, before the run dir is claimed: a long data read): the OTLP endpoint the OTEL_*
    variables name, else the phase table on stderr; the dir once it is claimed."""
    global _fallback
    _fallback = (command, file_dir)


def reset() -> None:
    """A new command in this process (cli.main): no telemetry yet, nothing remembered."""
    global _current, _start_ns, _fallback
    _fallback = None
    if _current is not None:  # not the process's first command: it starts now
        _start_ns = time.perf_counter_ns()
    _current = None
    _early.clear()
    _inject.clear()
    _main_open.clear()
    _left_by_error.clear()


def finish(error: BaseException | tuple | None = None) -> None:
    """The command is over: its root span ends (marked with ``error``, a crash or a signal, or
    (type, message, stack) for a command that returned a failing exit code),
    the telemetry is shut down (files complete, the collector within its bound). Idempotent;
    never raises (the command's own exit code stands)."""
    tel = _current
    if (tel is None and _fallback is not None and _early and error is not None
            and (_fallback[1] or not _bad_input(error))):  # no dir yet: bad input is its one line
        try:  # stopped before the telemetry started: the phases so far, marked, where it would have gone
            rank, world = int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
            where = _fallback[1] and os.path.join(_fallback[1], f"rank{rank}" if world > 1 else "")
            tel = start(_fallback[0], file_dir=where, mode="thread", rank=rank, world=world)
        except Exception as e:  # noqa: BLE001 -- telemetry never changes how a command ends
            print(f"dflash: telemetry: {e!r}", file=sys.stderr)
            return
    if tel is None:
        return
    try:
        if _bad_input(error):
            tel.console = False  # bad input is one line (exit 2): no table after it
        tel.end_run(error)
        tel.shutdown(timeout_s=2.0)
    except Exception as e:  # noqa: BLE001 -- telemetry never changes how a command ends
        print(f"dflash: telemetry: {e!r}", file=sys.stderr)


def _bad_input(error) -> bool:
    from .errors import user_error
    return isinstance(error, Exception) and user_error(error) is not None


class PhaseTable:
    """The run trace without a sink: phases kept for the table printed at the end (and the
    summary), nothing exported, no exporter process. Same methods as the telemetry uses here."""

    enabled = False

    def __init__(self, run_id: str, root_name: str, attrs: dict, console: bool = True):
        from otel.producer.phases import RunTrace
        self.run_id = run_id
        self.run_trace = RunTrace(run_id, root_name, start_ns=_start_ns, attrs=attrs)
        self.console = console
        self._closed = False

    def phase(self, name, parent=None, **attrs):
        return self.run_trace.phase(name, parent, **attrs)

    def record_phase(self, name, t0_ns, t1_ns, parent=None, error=None, **attrs) -> int:
        return self.run_trace.record(name, t0_ns, t1_ns, parent, error, **attrs)

    def traceparent(self) -> str:
        # nothing of ours is exported: a child's spans hang where this process's would have (the
        # TRACEPARENT it was handed, if any), never under a span id no collector will see
        return os.environ.get("TRACEPARENT", "")

    def end_run(self, error=None) -> None:
        from otel.producer.phases import _error
        self.run_trace.end(_error(error) if isinstance(error, BaseException) else error)

    def phase_table(self) -> str:
        return self.run_trace.table(f"{self.run_trace.root_name}: phases of the run")

    def summary(self) -> dict:
        return {"run": {"wall_s": round(self.run_trace.wall_s(), 3), "phases": self.run_trace.rows(),
                        "trace_id": f"{self.run_trace.trace_id:032x}"}}

    def shutdown(self, timeout_s=2.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.run_trace.end()
        if self.console and self.run_trace.finished:
            print(self.phase_table(), file=sys.stderr, flush=True)


def add_telemetry_flag(parser) -> None:
    """`--telemetry-dir DIR` for the commands without a run dir of their own."""
    parser.add_argument("--telemetry-dir", metavar="DIR",
                        help="write this command's trace and metrics there (OTLP/JSON files, as a run's telemetry/); "
                             "default: the OTLP endpoint OTEL_* names, else only the phase table on stderr")


def check_telemetry_dir(path: str | None) -> None:
    """--telemetry-dir: a directory we can create or write in; one line (exit 2) if not."""
    if path is None:
        return
    from pathlib import Path

    from .errors import ConfigError

    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"--telemetry-dir {path!r}: not a directory; expected a directory for the telemetry files")
    parent = p if p.exists() else next((q for q in p.parents if q.exists()), None)
    if parent is None or not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--telemetry-dir {path!r}: cannot be written; expected a writable directory")
