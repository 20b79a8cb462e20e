"""Helpers shared by the otel tests (a uniquely named module: `conftest` may be shadowed
by other test directories' conftest files)."""
from __future__ import annotations

import socket

MODES = ["process", "thread"]


def point_env_at(monkeypatch, rx) -> None:
    """Standard OTEL_* variables that send traces and metrics to receiver rx."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rx.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", rx.protocol)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def closed_port_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"


def point_env_at_dead_collector(monkeypatch) -> None:
    """OTLP/gRPC to a closed port, with a short export timeout: every export fails fast."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", closed_port_endpoint())
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")
