"""The metric instruments a training process declares, and the gauges it observes.

Declarations are shipped to the exporter side once (`take_new`); gauge callbacks read
the training process's own state (a queue's depth, ...), so they run here, on the
background thread, about once per metric export interval, and only their values travel.
"""
from __future__ import annotations

import sys
import threading

KINDS = ("counter", "histogram", "updown")


class Instruments:
    def __init__(self):
        self._lock = threading.Lock()
        self._specs: dict = {}
        self._new: dict = {}
        self._gauges: dict = {}
        self.gauge_errors = 0

    def declare(self, name, kind="counter", unit="1", description="") -> None:
        if kind not in KINDS + ("gauge",):
            raise ValueError(f"kind must be counter, histogram or updown, not {kind!r}")
        with self._lock:
            self._specs[name] = self._new[name] = (kind, unit, description)

    def observable_gauge(self, name, callback, unit="1", description="") -> None:
        self._gauges[name] = callback
        self.declare(name, "gauge", unit, description)

    def take_new(self) -> dict:
        """Declarations made since the last call."""
        with self._lock:
            new, self._new = self._new, {}
        return new

    def observe(self) -> dict:
        """name -> [(value, attrs)]; a failing callback is reported once, then counted."""
        out = {}
        for name, callback in list(self._gauges.items()):
            try:
                out[name] = [(v, dict(a or {})) for v, a in callback()]
            except Exception as e:
                self.gauge_errors += 1
                if self.gauge_errors == 1:
                    print(f"otel: gauge callback {name!r} failed: {e!r}", file=sys.stderr)
        return out
