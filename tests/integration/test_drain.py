"""Drain, health and reflection, as probes and clients see them over real gRPC.

The drain test runs the real server (`plimsoll serve`) on the medium demo model with six
streams mid-decode, sends SIGTERM and checks what a load balancer and the clients see:
health NOT_SERVING for every service while the listener stays open, new Generates
refused with UNAVAILABLE and RetryInfo, the streams still running through the grace and
then cut with a typed UNAVAILABLE, and a clean exit (status 0, not SIGABRT).
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from grpc_status import rpc_status

from engine.demo_models import ensure_demo_model
from engine.errors import DOMAIN
from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from service.server import (
    CONTROL,
    INFERENCE,
    REFLECTION_V1,
    REFLECTION_V1ALPHA,
    PlimsollServer,
    ServerConfig,
)
from tests.support.processes import run_side_by_side
from tools.harness.server import ROOT, start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", INFERENCE, CONTROL)
GRACE_S = 3.0
STREAMS = 6


@dataclass
class Stream:
    """One Generate stream, read on its own thread."""

    messages: list = field(default_factory=list)
    error: grpc.RpcError | None = None
    ended_at: float | None = None
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)

    def read(self, address: str, prompt: str) -> None:
        try:
            with grpc.insecure_channel(address) as ch:
                stub = inference_pb2_grpc.InferenceServiceStub(ch)
                for m in stub.Generate(inference_pb2.GenerateRequest(
                        text=prompt, max_tokens=4000, ignore_eos=True), timeout=120):
                    self.messages.append(m)
                    if m.WhichOneof("event") == "chunk":
                        self.started.set()
        except grpc.RpcError as err:
            self.error = err
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            self.done.set()


def details(err: grpc.RpcError) -> tuple[error_details_pb2.ErrorInfo | None,
                                          error_details_pb2.RetryInfo | None]:
    """The ErrorInfo and RetryInfo of a rich status, None where absent."""
    status = rpc_status.from_call(err)
    info = retry = None
    for d in status.details if status is not None else ():
        if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            d.Unpack(info)
        elif d.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            d.Unpack(retry)
    return info, retry


def wait_health(stub, service: str, want: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    status = -1
    while time.monotonic() < deadline:
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
        if status == want:
            break
        time.sleep(0.02)
    return status


@pytest.fixture(scope="module")
def medium_path() -> Path:
    return ensure_demo_model("medium")


def test_sigterm_drains_then_cuts_streams_and_exits_cleanly(tmp_path, medium_path):
    srv = start_server(tmp_path, "--demo-size", "medium", "--drain-seconds", str(GRACE_S))
    streams = [Stream() for _ in range(STREAMS)]
    threads = [threading.Thread(target=s.read, args=(srv.address, f"drain {i}"), daemon=True)
               for i, s in enumerate(streams)]
    try:
        for t in threads:
            t.start()
        for s in streams:
            assert s.started.wait(60), "a stream never got its first chunk"
        assert not any(s.done.is_set() for s in streams), [s.error for s in streams]
        received_at_signal = [len(s.messages) for s in streams]
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)

        with grpc.insecure_channel(srv.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            # Probes see the drain through the open listener, before any stream ends.
            assert wait_health(health, "", NOT_SERVING, GRACE_S / 2) == NOT_SERVING
            for service in SERVICES:
                r = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                assert r.status == NOT_SERVING, service
            listed = health.List(health_pb2.HealthListRequest(), timeout=2).statuses
            assert {k: v.status for k, v in listed.items()} == dict.fromkeys(
                SERVICES, NOT_SERVING)

            with pytest.raises(grpc.RpcError) as refused:
                list(inference_pb2_grpc.InferenceServiceStub(ch).Generate(
                    inference_pb2.GenerateRequest(text="late", max_tokens=2), timeout=10))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            info, retry = details(refused.value)
            assert retry is not None and retry.retry_delay.ToTimedelta().total_seconds() > 0
            assert info is not None and info.domain == DOMAIN
        assert time.monotonic() - signalled < GRACE_S
        assert not any(s.done.is_set() for s in streams), "a stream ended inside the grace"

        for s in streams:
            assert s.done.wait(GRACE_S + 30)
        rc = srv.proc.wait(60)
    finally:
        srv.stop(signal.SIGKILL)
    log = srv.log()
    assert rc == 0, f"server exited {rc}:\n{log[-3000:]}"
    assert "terminate called" not in log

    for s, before in zip(streams, received_at_signal, strict=True):
        assert len(s.messages) > before, "the stream did not run on through the grace"
        assert s.ended_at - signalled >= GRACE_S - 0.1, "cut before the grace ended"
        err = s.error
        assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE, err
        info, retry = details(err)
        assert info is not None, f"a bare transport error, not a typed status: {err}"
        assert info.domain == DOMAIN and info.reason == "DRAINING"
        assert retry is not None
        assert f"drain grace of {GRACE_S:g}s ended" in err.details()


# A thread runs compiled MLX (its thread-local compile cache holds Python objects),
# ends, and the interpreter exits right after. With a plain join this aborts or
# crashes in about half the runs; waiting until the OS thread is gone never does.
_THREAD_EXIT = """
import asyncio, threading
import mlx.core as mx
from engine.model_engine import wait_threads_gone

@mx.compile
def f(x):
    return mx.exp(x) * 2 + 1

t = threading.Thread(target=lambda: mx.eval(f(mx.ones((4,)))), daemon=True)
t.start()
t.join()
assert asyncio.run(wait_threads_gone([t], 10))
"""


def test_interpreter_exit_after_an_mlx_thread_is_gone_is_clean():
    # Four interpreters (an exit-time race shows in some runs only), side by side.
    for r in run_side_by_side([[sys.executable, "-c", _THREAD_EXIT]] * 4, cwd=ROOT):
        assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"


async def test_health_follows_the_default_model_and_lists(demo_path):
    server = PlimsollServer(ServerConfig(port=0))
    port = await server.start()
    pool = server.service.pool
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def statuses() -> dict[str, int]:
                r = await health.List(health_pb2.HealthListRequest(), timeout=5)
                return {k: v.status for k, v in r.statuses.items()}

            assert await statuses() == {"": NOT_SERVING, INFERENCE: NOT_SERVING,
                                        CONTROL: SERVING}
            await pool.load(str(demo_path), "main", default=True)
            await pool.load(str(demo_path), "other")
            await asyncio_settle()
            assert await statuses() == dict.fromkeys(SERVICES, SERVING)
            # Another model still serves, but a request naming none would be refused.
            await pool.unload("main")
            await asyncio_settle()
            assert await statuses() == {"": NOT_SERVING, INFERENCE: NOT_SERVING,
                                        CONTROL: SERVING}
            await pool.load(str(demo_path), "main")
            await asyncio_settle()
            assert await statuses() == dict.fromkeys(SERVICES, SERVING)
    finally:
        await server.drain()


async def test_health_waits_for_every_model_named_at_start(demo_path):
    """`serve --model a --model b`: SERVING only once both have loaded (a client told
    SERVING may name either), not as soon as the first, the default, has."""
    small = ensure_demo_model("small")
    server = PlimsollServer(ServerConfig(port=0, models=(str(demo_path), str(small))))
    port = await server.start()
    seen: list[tuple[int, tuple[str, ...]]] = []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            loading = asyncio.ensure_future(server.load_initial_models())
            while True:
                r = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                states = tuple(e.state.name for e in server.service.pool.entries())
                seen.append((r.status, states))
                if loading.done() and r.status == SERVING:
                    break
                await asyncio.sleep(0.005)
            await loading
    finally:
        await server.drain()
    assert any(len(st) == 2 and "READY" in st and "LOADING" in st for _, st in seen), seen
    assert all(st == ("READY", "READY") for status, st in seen if status == SERVING), seen


async def asyncio_settle() -> None:
    """Lets the health updates the pool listener scheduled run."""
    for _ in range(3):
        await asyncio.sleep(0)


async def test_reflection_v1_and_v1alpha_answer(demo_path):
    server = PlimsollServer(ServerConfig(port=0))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            for service in (REFLECTION_V1, REFLECTION_V1ALPHA):
                call = ch.stream_stream(
                    f"/{service}/ServerReflectionInfo",
                    request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                    response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
                )()
                await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                listed = await call.read()
                names = {s.name for s in listed.list_services_response.service}
                assert {INFERENCE, CONTROL, REFLECTION_V1, REFLECTION_V1ALPHA} <= names
                # The v1 service describes itself, and method symbols resolve.
                for symbol in (REFLECTION_V1, f"{INFERENCE}.Generate"):
                    await call.write(reflection_pb2.ServerReflectionRequest(
                        file_containing_symbol=symbol))
                    found = await call.read()
                    assert found.file_descriptor_response.file_descriptor_proto, symbol
                await call.done_writing()
    finally:
        await server.drain()
