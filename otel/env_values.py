"""Values in the environment, both ways.

- Read: numbers. A value that is not one, or out of its range, is one line on stderr (once
  per variable and process) and the default is used, as the OpenTelemetry spec asks of an
  SDK: a setting never stops the program it observes. The telemetry layer's variables
  (OTEL_*) and its user's (dflash's DFLASH_*) read through here.
- Written: `resource_attributes`, the `key=value,...` list of OTEL_RESOURCE_ATTRIBUTES for a
  child, percent-encoded as the spec asks, so that a value (a path holding `,` or `=`) stays
  one value and adds no attribute of its own.
"""
from __future__ import annotations

import math
import os
import sys
from urllib.parse import quote

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


# OTEL_RESOURCE_ATTRIBUTES is W3C Baggage without properties: `key=value` pairs split on `,`;
# the SDKs split each on its first `=` and percent-decode the value. Characters outside
# baggage-octet (controls, space, `"`, `,`, `;`, `\`, non-ASCII) must be percent-encoded;
# `%` is too (it starts an escape) and so is `=` (allowed by the grammar, but encoded it cannot
# be read as a separator by a reader that splits on every `=`).
_BAGGAGE_SAFE = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in '",;\\%=')


def resource_attributes(attrs: dict) -> str:
    """``{key: value}`` as an OTEL_RESOURCE_ATTRIBUTES value: keys and values percent-encoded
    (UTF-8) outside baggage-octet, `%` and `=` included. Keys are meant to be plain
    (`dflash.drafter`): the SDKs decode values only, so an encoded key would stay encoded."""
    return ",".join(f"{quote(str(k), safe=_BAGGAGE_SAFE)}={quote(str(v), safe=_BAGGAGE_SAFE)}"
                    for k, v in attrs.items())
