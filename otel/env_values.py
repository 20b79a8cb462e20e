"""Numbers read from the environment: a value that is not one, or out of its range, is one
line on stderr (once per variable and process) and the default is used, as the
OpenTelemetry spec asks of an SDK: a setting never stops the program it observes. The
telemetry layer's variables (OTEL_*) and its user's (dflash's DFLASH_*) read through here.
"""
from __future__ import annotations

import math
import os
import sys

_said: set[str] = set()


def number_from_env(name: str, default: float, *, lo: float = 0.0, hi: float = math.inf, lo_open: bool = True,
                    integer: bool = False, unit: str = "", who: str = "otel") -> float:
    """The variable ``name`` as a finite number in (lo, hi] ([lo, hi] when not ``lo_open``;
    an integer when ``integer``), else ``default``; unset or empty: ``default``, silently."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw) if integer else float(raw)
    except ValueError:
        v = None
    if v is None or not math.isfinite(v) or (v <= lo if lo_open else v < lo) or v > hi:
        if name not in _said:
            _said.add(name)
            kind = "an integer" if integer else "a number"
            bound = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi != math.inf else "")
            print(f"{who}: {name}={raw!r} ignored: expected {kind} {bound}{f' ({unit})' if unit else ''}; "
                  f"using {default:g}", file=sys.stderr)
        return default
    return v
