"""How a failure reaches the user.

- Bad input (a ``UserError``: ``ConfigError``, ``DatasetError``, ``TargetSpecError``,
  ``CheckpointError``, ``LayoutError``): one line naming the value, exit code 2. Nothing to
  debug, so no traceback.
- Anything else is a bug or a broken environment: the full traceback (a worker's own,
  chained under the ``WorkerError`` that ended the run), the worker and the stage it came
  from, also written to ``OUT/error.txt``; exit code 1.

The stage is known because an exception leaving `tel.stage(...)` carries that stage's name
(otel sets it, the innermost stage wins, with telemetry on or off).

Signals are here too: SIGTERM and SIGHUP (a closed terminal or ssh session) reach the
commands as Ctrl-C does (`raise_on_sigterm`, `stop_on_signal`), and how an interrupted
command ends is part of how a run stops.
Torch-free, and light: every floor of dflash/ imports it for UserError and ConfigError.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from pathlib import Path


class UserError(ValueError):
    """Bad input: a one-line message that names the value and what was expected; the
    command exits 2 with it, no traceback. Every bad-input error derives from it."""


class ConfigError(UserError):
    """Bad user input: one line, names the value and what was expected."""


class WorkerError(RuntimeError):
    """A worker (thread) of the run failed; the original exception is its ``__cause__``."""

    def __init__(self, message: str, worker: str | None = None, stage: str | None = None):
        super().__init__(message)
        self.worker, self.stage = worker, stage

    @classmethod
    def from_failure(cls, worker: str, err: BaseException) -> "WorkerError":
        stage = stage_of(err)
        where = f"worker {worker} failed" + (f" in stage {stage}" if stage else "")
        return cls(f"{where}: {type(err).__name__}: {err}", worker=worker, stage=stage)


def stage_of(err: BaseException) -> str | None:
    """The stage an exception escaped from (None: it was raised outside every stage). The
    telemetry's Stage names it on the exception, enabled or not (otel.STAGE_ATTRIBUTE)."""
    from otel import STAGE_ATTRIBUTE  # here, not at the top: config.py imports this module

    return getattr(err, STAGE_ATTRIBUTE, None)


def user_error(err: BaseException) -> BaseException | None:
    """The bad-input error behind ``err`` (itself, or what a worker raised), else None."""
    for e in (err, err.__cause__ if isinstance(err, WorkerError) else None):
        if isinstance(e, UserError):
            return e
    return None


def error_file(out: str | os.PathLike) -> Path:
    """``OUT/error.txt``; under torchrun, ranks other than 0 write ``OUT/error.rankN.txt``."""
    rank = os.environ.get("RANK", "0")
    return Path(out) / ("error.txt" if rank in ("", "0") else f"error.rank{rank}.txt")


def report(err: BaseException, out: str | os.PathLike | None) -> tuple[str, Path | None]:
    """The full traceback as text, written to OUT/error.txt when OUT is known.

    Returns (text, path written or None)."""
    head = []
    if isinstance(err, WorkerError):
        head = [f"worker: {err.worker}", f"stage: {err.stage or '(outside any stage)'}"]
    text = "\n".join(head + ["".join(traceback.format_exception(err))])
    if out is None:
        return text, None
    path = error_file(out)
    try:
        from otel.confined import write_text

        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)  # a link in its place is refused, never followed
    except OSError:
        return text, None
    return text, path


# -- signals -------------------------------------------------------------------------------
# Signals for the commands, in one place (torch-free).
#
# The stop signals (`stop_signals`): SIGINT, SIGTERM, and SIGHUP unless it is ignored (nohup:
# the user asked to outlive the terminal).
# - `raise_on_sigterm`: SIGTERM (what job runners send) and SIGHUP raise like Ctrl-C does, so
#   a set-up phase (model load, regeneration) stops at once with 130 and a line saying how to
#   go on, rather than dying silently with 143 (129);
# - `stop_on_signal`: inside a loop that can stop cleanly (an eval between verify steps),
#   a stop signal sets an event instead; a second one raises.
# - `watch_second_signal`: a second signal ends the process within seconds even when the
#   main thread is deep in one long C call (a forward over a huge prompt) and so never
#   gets to run a Python handler: the signal is seen through the wakeup fd, written by the
#   interpreter's C handler at once, and read by a thread of its own.
# - `ignore_stop_signals`: once the command has chosen its exit code (cli.main), a late
#   signal (the second of a pair, landing in the teardown) cannot change it.
# The training loop has its own graceful handler (run/trainer.py): finish the step, save.

_STOPPING = {signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)}
SECOND_SIGNAL_GRACE_S = 3.0   # the main thread's own way out first: it says the same, and tidies
_last_word = None             # () -> the line a hard stop prints (the CLI's: what was saved, what next)
_said = threading.Event()     # the CLI has said how the command ended: nothing more to say
_signals_seen = [0]
_watching = [False]


def stop_signals() -> list[int]:
    """SIGINT, SIGTERM and SIGHUP (a closed terminal or ssh session), less SIGHUP where it is
    ignored (nohup): what stops a command."""
    sigs = [signal.SIGINT, signal.SIGTERM]
    hup = getattr(signal, "SIGHUP", None)
    if hup is not None and signal.getsignal(hup) is not signal.SIG_IGN:
        sigs.append(hup)
    return sigs


def ignore_stop_signals() -> None:
    """From here on the stop signals are ignored: the command has chosen its exit code and
    says how it ended, and the rest is teardown (telemetry's drain, which has its deadline;
    thread joins; the interpreter's exit). A Python handler there would raise into that
    teardown, and the interpreter's exit puts a Python handler back to the default one, so a
    signal landing late would end the process by the signal (-15) after its report. SIG_IGN
    is the one disposition the exit leaves alone. Main thread only (a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in stop_signals():
        signal.signal(s, signal.SIG_IGN)


def on_hard_stop(last_word) -> None:
    """The line printed when a second signal has to end the process (set by the CLI)."""
    global _last_word
    _last_word = last_word


def said_how_it_ended() -> None:
    _said.set()


def watch_second_signal() -> None:
    """From here on, a second stop signal (SIGINT, SIGTERM, SIGHUP) ends the process within
    SECOND_SIGNAL_GRACE_S + a moment, exit 130, whatever the main thread is doing. Called
    where a first signal means "stop cleanly" (an eval, the training loop); main thread only."""
    _signals_seen[0] = 0
    if _watching[0] or threading.current_thread() is not threading.main_thread():
        return
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except ValueError:  # not the main thread of the main interpreter
        os.close(r), os.close(w)
        return
    _watching[0] = True
    threading.Thread(target=_count_signals, args=(r,), name="second-signal", daemon=True).start()


def _count_signals(r: int) -> None:
    import time

    while _signals_seen[0] < 2:
        data = os.read(r, 64)
        if not data:
            return
        _signals_seen[0] += sum(b in _STOPPING for b in data)
    time.sleep(SECOND_SIGNAL_GRACE_S)
    if not _said.is_set():
        try:
            line = _last_word() if _last_word is not None else "stopped by a second signal"
        except Exception:
            line = "stopped by a second signal"
        print(f"\n{line}", file=sys.stderr)
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except Exception:
            pass
    os._exit(130)

class Interrupted(KeyboardInterrupt):
    """SIGTERM, delivered as Ctrl-C is."""


def _raise(signum, frame):
    try:  # the signal's name: what the run's open phase is marked with (dflash/phases.py)
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    raise Interrupted(name)


def raise_on_sigterm() -> None:
    """SIGTERM and SIGHUP (not ignored) raise Interrupted, as Ctrl-C raises KeyboardInterrupt."""
    if threading.current_thread() is threading.main_thread():
        for s in stop_signals():
            if s != signal.SIGINT:
                signal.signal(s, _raise)


def interruptible(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, run in a helper thread while the main thread waits for it in short slices.
    A call that blocks in C++ (joining the ranks: torch.distributed's rendezvous and first
    collective, waiting for a rank that has not come) keeps Python's signal handlers from
    running, so a SIGTERM (torchrun's, a job runner's) or a Ctrl-C would not stop the rank: the
    phase it waits in would never be marked, its trace never written, and torchrun would SIGKILL
    it 30 s later. Waiting here, the signal's exception leaves at once; the helper is a daemon
    and is left blocked as the process exits. The CUDA device current here is the helper's too
    (NCCL's object collectives stage through it); other thread-local state ``fn`` sets is the
    helper's alone."""
    if threading.current_thread() is not threading.main_thread():
        return fn(*args, **kwargs)
    box: dict = {}
    torch = sys.modules.get("torch")  # never imported here: only a process that has it can have a device
    cuda = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None

    def run():
        try:
            if device is not None:
                torch.cuda.set_device(device)
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 -- re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, name=f"dflash-{getattr(fn, '__name__', 'call')}", daemon=True)
    t.start()
    while t.is_alive():
        t.join(0.1)
    if "error" in box:
        raise box["error"]
    return box["value"]


class stop_on_signal:
    def __init__(self, what: str = "the current prompt"):
        self.what = what

    def __enter__(self) -> threading.Event:
        self.stop = threading.Event()
        self.prev = {s: signal.getsignal(s) for s in stop_signals()}

        def on_signal(signum, frame):
            if self.stop.is_set():
                raise Interrupted()
            print(f"\ninterrupt: finishing {self.what}, then reporting what was measured (a second signal "
                  f"stops now)", file=sys.stderr)
            self.stop.set()

        if threading.current_thread() is threading.main_thread():
            for s in self.prev:
                signal.signal(s, on_signal)
            watch_second_signal()
        return self.stop

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread():
            for s, h in self.prev.items():
                signal.signal(s, h)
        return False
