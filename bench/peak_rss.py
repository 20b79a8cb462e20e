"""A command's own peak resident set, as the kernel measured it: run it from this small process
and write wait4's ru_maxrss (bytes) to a file.

    python bench/peak_rss.py PEAK_FILE -- COMMAND [ARG...]

Why a process in between: Linux carries a process's resident set from before its exec into
its ru_maxrss (the signal struct's maxrss outlives exec, and a fork's or vfork's copy of the
parent counts), so a child spawned straight from a large parent reports the parent's size if
that is larger than its own peak. Measured: a Python parent holding 1.5 GB, its child
`python -c pass` reports ru_maxrss 1.5 GB. The test tier's pytest process holds ~1.6 GiB by
the integration tier, and a 0.9 GiB `dflash train` child measured 1.59 GiB there (CI,
tests/integration/test_memory_peak.py). Spawned from here, the floor is this process's ~10 MB.

Exits as the command did: a death by signal is passed on as the same signal (an OOM kill still
reads -9 / 137). SIGTERM and SIGHUP sent here are passed on to the command; SIGINT is left to
the command alone (a terminal's Ctrl-C reaches the whole process group, the command included,
and a second one would hard-stop it); the command starts with the SIGINT disposition and signal
mask this process started with. If this process dies, the command gets SIGKILL.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import signal
import subprocess
import sys

_FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def _in_the_command(sigint, mask, reaper: int):
    """In the command, before its exec: the signal state it would have had without us, as it
    was when we started (an ignored disposition and a blocked mask both survive exec), and
    SIGKILL when this process dies (PR_SET_PDEATHSIG; if it died before that was set, at once)."""
    def restore() -> None:
        signal.signal(signal.SIGINT, sigint)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
        if os.getppid() != reaper:  # the reaper is already gone: the death signal would never come
            os.kill(os.getpid(), signal.SIGKILL)
    return restore


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: bench/peak_rss.py PEAK_FILE -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    peak_file, cmd = argv[0], argv[2:]
    sigint = signal.getsignal(signal.SIGINT)
    sigint = signal.SIG_DFL if sigint is None else sigint  # None: set outside Python; default is what exec gives
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # held until the command exists, so a signal in between is passed on, not lost or fatal
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _FORWARDED)
    p = subprocess.Popen(cmd, preexec_fn=_in_the_command(sigint, mask, os.getpid()))

    def forward(n, _frame) -> None:
        # os.kill, not p.send_signal: that polls first, and a poll that reaps an exited command
        # loses its status and rusage to wait4 below. A signal that lands as wait4 returns runs
        # this after the reap: the command is gone, nothing to pass on (pids are handed out in
        # order, so the next process does not get its pid within that instant)
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, n)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _, status, usage = os.wait4(p.pid, 0)
    with open(peak_file, "w") as f:
        f.write(f"{usage.ru_maxrss * 1024}\n")  # KiB on Linux
    if os.WIFSIGNALED(status):  # die of the same signal, so the caller reads it as the command's
        sig = os.WTERMSIG(status)
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be handled, nor reset
            signal.signal(sig, signal.SIG_DFL)
        # a SIGSEGV or SIGABRT passed on must not dump a second core over the command's
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [sig])
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
