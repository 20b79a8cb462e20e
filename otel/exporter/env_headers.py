"""OTEL_EXPORTER_OTLP_*HEADERS checked before the SDK reads them, so a secret never reaches
a log.

The SDK's own parser warns about a malformed entry by printing the entry, value and all
("authorization Bearer <token>", missing its "="), twice. Here each entry is tried with the
same parser, its warnings silenced; an entry it refuses is dropped from the variable and
reported by its position and key name only. Well-formed entries pass unchanged.
"""
from __future__ import annotations

import logging
import os
import sys

GENERIC = "OTEL_EXPORTER_OTLP_HEADERS"
VARIABLES = (GENERIC, "OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_METRICS_HEADERS")
EMPTIED: set = set()  # per-signal variables given whose every entry was dropped (own_headers_only)


def _parses(entry: str) -> bool:
    from opentelemetry.util.re import parse_env_headers

    log = logging.getLogger("opentelemetry.util.re")
    before = log.disabled
    log.disabled = True
    try:
        return bool(parse_env_headers(entry, liberal=True))
    finally:
        log.disabled = before


def _key_name(entry: str) -> str:
    """What may be shown of a bad entry: the text before '=' when it looks like a header
    name; nothing when there is no '=' (the whole entry may be the secret)."""
    key = entry.split("=", 1)[0].strip() if "=" in entry else ""
    return key if key and len(key) <= 64 and all(c.isalnum() or c in "-_." for c in key) else ""


def sanitize(environ=os.environ) -> list[str]:
    """Drop the malformed entries of the header variables in ``environ``; one note per
    variable that had some (no values in them)."""
    notes = []
    for var in VARIABLES:
        raw = environ.get(var)
        if raw is None:
            continue
        entries = [e for e in raw.split(",") if e.strip()]
        good, bad = [], []
        for i, e in enumerate(entries, start=1):
            (good if _parses(e) else bad).append((i, e))
        if not bad:
            continue
        named = ", ".join(f"entry {i}" + (f" (key {_key_name(e)!r})" if _key_name(e) else "") for i, e in bad)
        notes.append(f"{var}: {named} of {len(entries)} not key=value; dropped (values not shown)")
        if good:
            environ[var] = ",".join(e for _, e in good)
        else:  # the SDK reads an empty or missing per-signal variable as "use the generic one"
            del environ[var]
            if var != GENERIC:
                EMPTIED.add(var)
    return notes


def own_headers_only(exporter, signal: str, environ=os.environ):
    """A built ``signal`` exporter without the generic variable's headers, when that signal's own
    variable was given and every entry in it was dropped: the SDK reads a missing per-signal
    variable as "use the generic one", which would send its headers (another endpoint's
    credentials, maybe) where none were meant. The environment is never changed (other threads
    read it); the headers are taken off the exporter itself. Returns the exporter, or None
    (said) when this SDK keeps its headers where this cannot reach them: no exporter rather
    than a leak."""
    var = f"OTEL_EXPORTER_OTLP_{signal.upper()}_HEADERS"
    generic = environ.get(GENERIC)
    if var not in EMPTIED or not generic:
        return exporter
    from opentelemetry.util.re import parse_env_headers

    drop = {k.lower() for k in parse_env_headers(generic, liberal=True)}
    client = getattr(exporter, "_client", None)
    if isinstance(getattr(client, "_headers", None), dict):  # OTLP/HTTP
        for k in list(client._headers):
            if k.lower() in drop:
                del client._headers[k]
        return exporter
    if isinstance(getattr(exporter, "_headers", None), tuple):  # OTLP/gRPC: metadata pairs
        exporter._headers = tuple((k, v) for k, v in exporter._headers if k.lower() not in drop)
        return exporter
    print(f"otel: {var}: every entry dropped, and this SDK's {signal} exporter would send "
          f"{GENERIC}'s headers instead: not exporting {signal} over OTLP", file=sys.stderr)
    return None
