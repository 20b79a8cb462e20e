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

Exits as the command did (a signal's death is passed on as the same signal), so callers read
its exit code as the command's; SIGTERM and SIGINT sent here are passed on to the command.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: bench/peak_rss.py PEAK_FILE -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    peak_file, cmd = argv[0], argv[2:]
    p = subprocess.Popen(cmd)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda n, _f: p.send_signal(n))
    _, status, usage = os.wait4(p.pid, 0)
    with open(peak_file, "w") as f:
        f.write(f"{usage.ru_maxrss * 1024}\n")  # KiB on Linux
    if os.WIFSIGNALED(status):  # die of the same signal: a caller's rc of -9 / 137 still means a kill
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    return os.waitstatus_to_exitcode(status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
