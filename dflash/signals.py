"""Signals for the commands, in one place (torch-free).

- `raise_on_sigterm`: SIGTERM (what job runners send) raises like Ctrl-C does, so a set-up
  phase (model load, regeneration) stops at once with 130 and a line saying how to go on,
  rather than dying silently with 143;
- `stop_on_signal`: inside a loop that can stop cleanly (an eval between verify steps),
  SIGTERM / SIGINT set an event instead; a second one raises.
The training loop has its own graceful handler (run/trainer.py): finish the step, save.
"""
from __future__ import annotations

import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
    """SIGTERM, delivered as Ctrl-C is."""


def _raise(signum, frame):
    raise Interrupted()


def raise_on_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise)


class stop_on_signal:
    def __init__(self, what: str = "the current prompt"):
        self.what = what

    def __enter__(self) -> threading.Event:
        self.stop = threading.Event()
        self.prev = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

        def on_signal(signum, frame):
            if self.stop.is_set():
                raise Interrupted()
            print(f"\ninterrupt: finishing {self.what}, then reporting what was measured", file=sys.stderr)
            self.stop.set()

        if threading.current_thread() is threading.main_thread():
            for s in self.prev:
                signal.signal(s, on_signal)
        return self.stop

    def __exit__(self, *exc):
        if threading.current_thread() is threading.main_thread():
            for s, h in self.prev.items():
                signal.signal(s, h)
        return False
