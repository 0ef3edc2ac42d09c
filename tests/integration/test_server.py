"""Server behaviour: health, reflection-independent drain, trace context, stubs, CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from service.server import CONTROL, INFERENCE, PlimsollServer, ServerConfig
from telemetry import names
from tools.harness.server import ROOT, start_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture()
def spans(captured) -> InMemorySpanExporter:
    return captured.spans


@pytest.fixture()
def metrics(captured) -> InMemoryMetricReader:
    return captured.metrics


def metric_points(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else []:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out.setdefault(m.name, []).extend(m.data.data_points)
    return out


async def test_request_and_memory_metrics(spans, metrics, demo_path):
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)]))
    port = await server.start()
    await server.load_initial_models()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            call = stub.Generate(inference_pb2.GenerateRequest(
                text="count me", max_tokens=5, ignore_eos=True))
            [m async for m in call]
            await server.service.governor.tick()
    finally:
        await server.drain()
    points = metric_points(metrics)
    verdicts = {p.attributes.get(names.ATTR_VERDICT) for p in points[names.METRIC_ADMISSIONS]}
    assert "admit" in verdicts
    assert sum(p.value for p in points[names.METRIC_TOKENS_GENERATED]) >= 5
    assert points[names.METRIC_TTFT][0].count >= 1
    assert points[names.METRIC_MEMORY_USAGE][0].value > 0
    assert points[names.METRIC_MEMORY_CEILING][0].value > 0
    assert names.METRIC_REQUESTS_RUNNING in points
    assert names.METRIC_BANK_BYTES in points


async def test_health_follows_readiness(spans, demo_path):
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)]))
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)

            async def status(service: str) -> int:
                r = await health.Check(health_pb2.HealthCheckRequest(service=service))
                return r.status

            assert await status("") == NOT_SERVING
            assert await status(INFERENCE) == NOT_SERVING
            assert await status(CONTROL) == SERVING
            watch = health.Watch(health_pb2.HealthCheckRequest(service=""))
            first = await watch.read()
            assert first.status == NOT_SERVING
            await server.load_initial_models()
            assert (await watch.read()).status == SERVING
            assert await status(INFERENCE) == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await health.Check(health_pb2.HealthCheckRequest(service="nope"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
            drain = asyncio.ensure_future(server.drain())
            assert (await watch.read()).status == NOT_SERVING
            await drain
    finally:
        await server.drain()


async def test_client_trace_context_parents_generate_span(spans, demo_path):
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)]))
    port = await server.start()
    await server.load_initial_models()
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    parent_id = "00f067aa0ba902b7"
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            call = stub.Generate(
                inference_pb2.GenerateRequest(text="trace me", max_tokens=3, ignore_eos=True),
                metadata=(("traceparent", f"00-{trace_id}-{parent_id}-01"),),
            )
            [m async for m in call]
    finally:
        await server.drain()
    generate = [s for s in spans.get_finished_spans() if s.name == names.SPAN_GENERATE
                and format(s.context.trace_id, "032x") == trace_id]
    assert len(generate) == 1
    rpc = [s for s in spans.get_finished_spans()
           if s.context.span_id == generate[0].parent.span_id]
    assert rpc and rpc[0].name.endswith("InferenceService/Generate")
    assert format(rpc[0].parent.span_id, "016x") == parent_id
    assert generate[0].attributes[names.ATTR_COMPLETION_TOKENS] == 3


def test_sigterm_drains_in_flight_streams(tmp_path, demo_path):
    srv = start_server(tmp_path)
    out: list = []
    started = threading.Event()

    def stream() -> None:
        with srv.channel() as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            for m in stub.Generate(inference_pb2.GenerateRequest(
                    text="drain", max_tokens=400, ignore_eos=True), timeout=120):
                started.set()
                out.append(m)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    srv.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with srv.channel() as ch, pytest.raises(grpc.RpcError) as info:
        list(inference_pb2_grpc.InferenceServiceStub(ch).Generate(
            inference_pb2.GenerateRequest(text="late", max_tokens=2), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    t.join(120)
    assert out[-1].WhichOneof("event") == "end"
    assert out[-1].end.usage.completion_tokens == 400
    assert srv.proc.wait(60) == 0


def test_committed_stubs_are_fresh(tmp_path):
    subprocess.run([sys.executable, "-m", "tools.gen_proto", "--out", str(tmp_path)],
                   cwd=ROOT, check=True)
    committed = ROOT / "proto" / "plimsoll" / "v1"
    generated = sorted((tmp_path / "plimsoll" / "v1").glob("*_pb2*.py*"))
    assert generated
    stale = [p.name for p in generated if p.read_bytes() != (committed / p.name).read_bytes()]
    assert not stale, f"stale stubs, run `python -m tools.gen_proto`: {stale}"


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "service.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ})


def test_cli_against_server(server):
    port = str(server.port)
    r = cli("generate", "--port", port, "--max-tokens", "5", "hello")
    assert r.returncode == 0, r.stderr
    assert "5 generated tokens" in r.stderr
    r = cli("models", "--port", port)
    assert r.returncode == 0 and "demo-tiny" in r.stdout
    r = cli("health", "--port", port)
    assert r.returncode == 0 and r.stdout.strip() == "SERVING"


def test_cli_errors_are_one_line(server):
    r = cli("generate", "--port", str(server.port), "--model", "nope", "hi")
    assert r.returncode == 1
    assert r.stderr.strip().count("\n") == 0 and "NOT_FOUND" in r.stderr
    r = cli("health", "--port", "1")
    assert r.returncode == 1
    assert r.stderr.strip() == "error: UNAVAILABLE: cannot reach a server at 127.0.0.1:1"
    r = cli("serve", "--max-num-seqs", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "--max-num-seqs must be" in r.stderr


def test_cli_help_explains_every_option():
    from service.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        for action in command._actions:
            assert action.help, f"plimsoll {name} {action.option_strings} has no help"
        assert command.format_help().startswith("usage: plimsoll")
    # One subprocess shows the real command prints it (each costs an interpreter start).
    r = cli("serve", "--help")
    assert r.returncode == 0 and "usage: plimsoll serve" in r.stdout


def test_memory_settings_are_validated_with_one_clear_line(tmp_path):
    bad = tmp_path / "memory.toml"
    bad.write_text('[memory]\ntier = "balanced"\nsoft_fraction = 0.99\nhard_fraction = 0.5\n'
                   'no_such_key = 1\n')
    r = cli("serve", "--memory-config", str(bad), "--port", "0")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("plimsoll: memory settings:") and "no_such_key" in r.stderr
    r = cli("serve", "--memory-guard", "custom", "--port", "0")
    assert r.returncode == 1 and "custom" in r.stderr and "Traceback" not in r.stderr
    r = cli("serve", "--soft-fraction", "0.97", "--hard-fraction", "0.9", "--port", "0")
    assert r.returncode == 1 and "soft" in r.stderr and "Traceback" not in r.stderr
