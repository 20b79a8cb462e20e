"""Fixtures for the otel tests: real OTLP receivers on loopback, a clean OTEL_* env, and
a Telemetry factory that always shuts down."""
from __future__ import annotations

import os

import pytest
from otlp_receivers import OtlpGrpcReceiver, OtlpHttpReceiver

import otel


@pytest.fixture(autouse=True)
def clean_otel_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith("OTEL_") or key in ("TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES"):
            monkeypatch.delenv(key, raising=False)
    yield


@pytest.fixture
def grpc_receiver():
    with OtlpGrpcReceiver() as rx:
        yield rx


@pytest.fixture
def http_receiver():
    with OtlpHttpReceiver() as rx:
        yield rx


@pytest.fixture(params=["grpc", "http/protobuf"])
def receiver(request):
    cls = OtlpGrpcReceiver if request.param == "grpc" else OtlpHttpReceiver
    with cls() as rx:
        yield rx


@pytest.fixture
def make_tel():
    made = []

    def make(**kwargs):
        kwargs.setdefault("service_name", "dflash")   # the service these tests stand in for
        kwargs.setdefault("console", False)
        kwargs.setdefault("export_interval_s", 0.05)
        kwargs.setdefault("metric_export_interval_s", 0.2)
        tel = otel.Telemetry.from_env(**kwargs)
        made.append(tel)
        return tel

    yield make
    for tel in made:
        tel.shutdown(timeout_s=2.0)

