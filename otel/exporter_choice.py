"""Which exporters the standard OTEL_* variables select. No SDK import: the training
process reads this too (to know whether its shutdown bound applies; see otel.transport)."""
from __future__ import annotations

import os

LOCAL_EXPORTERS = frozenset({"file", "console"})


def env(*names, default=None):
    for n in names:
        v = os.environ.get(n)
        if v:
            return v.strip()
    return default


def selected_exporters(signal: str, file_dir) -> list[str]:
    """OTEL_TRACES_EXPORTER / OTEL_METRICS_EXPORTER, defaulting to otlp when an endpoint is
    configured, else the file sink when a directory was given, else nothing."""
    names = env(f"OTEL_{signal.upper()}_EXPORTER")
    if names:
        chosen = [n.strip().lower() for n in names.split(",") if n.strip()]
        return [n for n in chosen if n != "none"]
    if env("OTEL_EXPORTER_OTLP_ENDPOINT", f"OTEL_EXPORTER_OTLP_{signal.upper()}_ENDPOINT"):
        return ["otlp"]
    return ["file"] if file_dir else []


def spans_local_only(file_dir) -> bool:
    """True when every span exporter writes locally (files, console): such a sink is
    always drained completely, however long it takes."""
    return set(selected_exporters("traces", file_dir)) <= LOCAL_EXPORTERS
