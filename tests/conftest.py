"""Shared fixtures: a real Plimsoll server over loopback, on the real demo model.

The server subprocess itself is `tools.harness.server`, shared with the benchmarks.
"""

from __future__ import annotations

import compileall
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.cache_dir import cache_root
from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2_grpc, inference_pb2_grpc
from telemetry.setup import setup
from tools.harness.page_cache import pinned_model_files
from tools.harness.server import ROOT, ServerProcess, serving, start_server

# Tests written before the harness moved import these from here; new ones import them
# from tools.harness.server.
__all__ = ["ROOT", "ServerProcess", "serving", "start_server"]


def pytest_sessionstart(session: pytest.Session) -> None:
    """Byte-compile the project once. The suite starts a few hundred servers and CLI
    processes; where PYTHONDONTWRITEBYTECODE is set (as on CI) none of them writes its
    .pyc, so each compiled every project module it imported again (0.1-0.2 s each)."""
    for folder in ("engine", "memory", "proto", "service", "sessions", "telemetry", "tools"):
        compileall.compile_dir(ROOT / folder, quiet=1)


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


@pytest.fixture(scope="session", autouse=True)
def model_file_pins() -> Iterator[None]:
    """The demo models' files stay in memory once a test has read them, for the rest of the
    run (tools/harness/page_cache): they are loaded again and again, minutes apart."""
    with pinned_model_files([cache_root() / "demo-models", cache_root() / "bench-models"],
                            budget_bytes=2 << 30):
        yield


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
