"""`dflash` — the command line: the parser built from the subcommands (dflash/commands/),
and the dispatch. Bad input exits 2 with one line, before any model loads (or torch is
imported); a failed run exits 1 with the traceback of the failing worker, its name and
stage, also written to OUT/error.txt (see errors.py)."""
from __future__ import annotations

import argparse
import sys

from . import phases  # first: the run's trace counts from the process's start (dflash/phases.py)


class _Parser(argparse.ArgumentParser):
    """argparse, with bad flags as one line (no usage block): the rule for every bad input."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    from .commands import NAMES, command

    p = _Parser(prog="dflash", description="Train and evaluate DFlash drafters.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in NAMES:
        command(name).add_parser(sub)
    return p


def main(argv=None) -> int:
    """The command line; ``argv`` None: this process's own (the `dflash` script, `python -m
    dflash`), whose exit code no late signal may change (below)."""
    from .commands import command
    from .errors import ignore_stop_signals, on_hard_stop, raise_on_sigterm, said_how_it_ended

    program = argv is None
    if program:
        _standard_streams()
    argv = list(sys.argv[1:] if argv is None else argv)
    phases.reset()
    with phases.phase("parse_args"):  # builds every command's parser: imports the command modules
        a = _parser().parse_args(argv)
    a.argv, a.phase = argv, "start-up"
    on_hard_stop(lambda: f"dflash {_named(a)}: stopped by a second signal during {_where(a)}; {_what_next(a)}")
    # a job runner's SIGTERM (or a closed terminal's SIGHUP) before the loop's own handler is in
    # place (model load, regeneration): stop now with 130 and say how to go on, not die
    # silently with 143
    raise_on_sigterm()
    ended = ignore_stop_signals if program else (lambda: None)
    failure = None
    try:
        try:
            rc = command(a.cmd).run(a)
        finally:
            # the exit code is chosen (or an exception is on its way to choose it): a signal
            # from here on, the second of a pair say, must not turn it into a death by the
            # signal, a traceback in the line below, or an exit code other than the one said
            ended()
    except KeyboardInterrupt as e:
        ended()  # one that landed just before the line above
        failure = e
        _say(f"dflash {_named(a)}: interrupted during {_where(a)}; {_what_next(a)}")
        rc = 130
    except BrokenPipeError as e:
        failure = e
        if _stdout_reader_gone():
            # the reader of our output left (`dflash stalls RUN | head -1`): what a C tool
            # does, killed by SIGPIPE, without a word: exit 141 (128 + SIGPIPE), no traceback
            _quiet_stdout()
            rc = 141
        else:  # another pipe (a child's, a socket's): a failure like any other
            rc = _report_failure(a, e)
    except Exception as e:
        failure = e
        rc = _report_failure(a, e)
    # the run's root span ends with how the command ended; spans on disk and at the collector.
    # A command that caught its own failure (an engine that did not start, a stop it handled)
    # and returns its code is not an OK run either
    if failure is None and rc:
        failure = ("KeyboardInterrupt" if rc == 130 else "ExitStatus", f"dflash {a.cmd} exited {rc}", "")
    import time
    ended_at = time.monotonic()  # from here to the exit nothing is traced: _exit_now says what took long
    phases.finish(failure)
    said_how_it_ended()  # the watch for a second signal (errors.py) has nothing more to say
    if program:
        _exit_now(rc, ended_at)
    return rc


# an exit longer than this after the run's end is said, with what took it (the telemetry's
# shutdown alone may take its 2 s bound; a usual exit takes 0.2-0.8 s)
SLOW_EXIT_S = 3.0


def _exit_now(rc: int, ended_at: float | None = None) -> None:
    """End the process as Python's own exit would (non-daemon threads joined, then the atexit
    handlers, the output flushed), minus the interpreter's teardown of its modules: with torch
    and transformers loaded that took 1.3-2.2 s here after the run had finished, time nobody
    can trace or use. Everything this program owns is closed before (telemetry, files,
    children). The root span has ended by then (the telemetry is shut down with it), so an
    exit that takes longer than SLOW_EXIT_S is one line on stderr naming what it waited for:
    the telemetry's shutdown, a thread, the exit handlers (a demo run once spent 8.5 s here;
    bad input, exit 2, stays one line)."""
    import atexit
    import os
    import threading
    import time

    now = time.monotonic()
    took = [("the run's end and the telemetry's shutdown", now - ended_at)] if ended_at is not None else []
    for t in threading.enumerate():
        if t is not threading.main_thread() and not t.daemon:
            t0 = time.monotonic()
            t.join()
            took.append((f"thread {t.name}", time.monotonic() - t0))
    t0 = time.monotonic()
    atexit._run_exitfuncs()
    took.append(("the exit handlers", time.monotonic() - t0))
    total = time.monotonic() - (ended_at if ended_at is not None else now)
    if total > SLOW_EXIT_S and rc != 2:  # bad input stays its one line
        parts = "; ".join(f"{what} {s:.1f} s" for what, s in took if s >= 0.1) or "none over 0.1 s"
        try:
            print(f"dflash: the exit took {total:.1f} s after the run ended, untraced ({parts})", file=sys.stderr)
        except (OSError, ValueError):
            pass
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed terminal (SIGHUP's), a reader gone: no more output
            pass
    os._exit(rc)


def _standard_streams() -> None:
    """Started with stdout or stderr closed (`dflash train ... >&-`, a daemon's spawn), Python
    leaves sys.stdout None and the first file this process opens takes fd 1 or 2, where any
    child's output would then land. /dev/null is put there instead: the output is dropped,
    as the caller asked, and the run goes on as with a terminal."""
    import os

    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDONLY if fd == 0 else os.O_WRONLY)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            if getattr(sys, name) is None:
                setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed (Linux polls it as POLLERR)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _quiet_stdout() -> None:
    """After a broken pipe: stdout onto /dev/null, so the flush at exit raises nothing more."""
    import os

    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass


def _say(line: str) -> None:
    """A last line to stderr; a closed terminal (SIGHUP's) cannot take it, and that is no error."""
    try:
        print(line, file=sys.stderr, flush=True)
    except OSError:
        pass


def _named(a) -> str:
    """The command as typed: `data inspect`, not `data`."""
    sub = getattr(a, "data_cmd", None)
    return f"{a.cmd} {sub}" if sub else a.cmd


def _where(a) -> str:
    """What the command was doing: its innermost phase (`checkpoint`, `export`), else its own word."""
    return phases.innermost() or a.phase


def _what_next(a) -> str:
    import shlex

    from .commands import command

    said = getattr(command(a.cmd), "what_next", lambda a: None)(a)
    return said or f"run it again: dflash {shlex.join(a.argv)}"


def _report_failure(a, e: Exception) -> int:
    """Bad input: one line, exit 2. Anything else: the traceback (the failing worker's own
    first), naming worker and stage, also in OUT/error.txt; exit 1."""
    from .errors import report, user_error

    user = user_error(e)
    if user is not None:
        print(f"dflash {_named(a)}: error: {user}", file=sys.stderr)
        return 2
    text, path = report(e, getattr(a, "resolved_out", None))
    print(text, file=sys.stderr, end="" if text.endswith("\n") else "\n")
    where = f" (traceback above, also in {path})" if path else " (traceback above)"
    print(f"dflash {_named(a)}: error: {e}{where}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
