"""Shared fixtures: a real Plimsoll server over loopback, on the real demo model.

The server subprocess itself is `tools.harness.server`, shared with the benchmarks.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2_grpc, inference_pb2_grpc
from telemetry.setup import setup
from tools.harness.server import ROOT, ServerProcess, serving, start_server

# Tests written before the harness moved import these from here; new ones import them
# from tools.harness.server.
__all__ = ["ROOT", "ServerProcess", "serving", "start_server"]


@dataclass(frozen=True)
class Captured:
    spans: InMemorySpanExporter
    metrics: InMemoryMetricReader


_CAPTURED = Captured(InMemorySpanExporter(), InMemoryMetricReader())


@pytest.fixture(scope="session", autouse=True)
def captured() -> Captured:
    """The process's OpenTelemetry providers, installed once before any in-process
    server does (OTel allows one set), with in-memory span and metric capture."""
    setup(extra_span_processors=[SimpleSpanProcessor(_CAPTURED.spans)],
          extra_metric_readers=[_CAPTURED.metrics])
    return _CAPTURED


@pytest.fixture(scope="session")
def demo_path() -> Path:
    return ensure_demo_model("tiny")


@pytest.fixture(scope="session")
def server(tmp_path_factory, demo_path) -> Iterator[ServerProcess]:
    """One server for the session, serving the tiny demo model."""
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture()
def channel(server) -> Iterator[grpc.Channel]:
    with server.channel() as ch:
        yield ch


@pytest.fixture()
def inference(channel) -> inference_pb2_grpc.InferenceServiceStub:
    return inference_pb2_grpc.InferenceServiceStub(channel)


@pytest.fixture()
def control(channel) -> control_pb2_grpc.ControlServiceStub:
    return control_pb2_grpc.ControlServiceStub(channel)
