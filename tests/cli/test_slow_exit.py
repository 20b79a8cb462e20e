"""After the run's root span ends nothing is traced: `dflash`'s exit (cli._exit_now) says in one
line when it took longer than SLOW_EXIT_S, naming what it waited for (a thread, the exit
handlers), so an untraced stretch at the end of a run has a name (a demo once spent 8.5 s
there)."""
from __future__ import annotations

import subprocess
import sys

from helpers import ROOT

SCRIPT = '''
import atexit, threading, time
from dflash import cli

atexit.register(time.sleep, 2.0)                      # an exit handler that takes its time
threading.Thread(target=time.sleep, args=(1.5,), name="slow-writer").start()   # and a thread
cli._exit_now(3, time.monotonic())
'''


def test_a_slow_exit_is_one_line_naming_what_it_waited_for():
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 3  # the exit code stands
    lines = [ln for ln in p.stderr.splitlines() if "the exit took" in ln]
    assert len(lines) == 1, p.stderr
    assert "untraced" in lines[0] and "thread slow-writer" in lines[0] and "the exit handlers" in lines[0], lines
