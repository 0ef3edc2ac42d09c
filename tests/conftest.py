"""Shared fixtures: a real Plimsoll server over loopback, on the real demo model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import control_pb2_grpc, inference_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    @contextmanager
    def stubs(self) -> Iterator[tuple[control_pb2_grpc.ControlServiceStub,
                                      inference_pb2_grpc.InferenceServiceStub]]:
        """(control, inference) stubs on one channel, closed afterwards."""
        with self.channel() as ch:
            yield (control_pb2_grpc.ControlServiceStub(ch),
                   inference_pb2_grpc.InferenceServiceStub(ch))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = 15, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_serving(port: int, proc: subprocess.Popen, log_path: Path,
                 timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{log_path.read_text()[-3000:]}")
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"server not SERVING after {timeout}s:\n{log_path.read_text()[-3000:]}")


def start_server(tmp: Path, *args: str, env: dict | None = None,
                 wait: bool = True, prefix: list[str] | None = None) -> ServerProcess:
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    cmd = [*(prefix or []), sys.executable, "-m", "service.cli", "serve",
           "--port", str(port), *args]
    full_env = {**os.environ, **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                env=full_env)
    server = ServerProcess(proc, port, log_path)
    if wait:
        try:
            wait_serving(port, proc, log_path)
        except BaseException:
            server.stop(9)
            raise
    return server


@contextmanager
def serving(tmp: Path, *args: str) -> Iterator[ServerProcess]:
    """A server for the duration of the block (module fixtures use this)."""
    srv = start_server(tmp, *args)
    try:
        yield srv
    finally:
        srv.stop()


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
