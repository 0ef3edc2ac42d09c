"""Traces as a collector sees them (docs/tracing.md).

In process, the session's in-memory exporter (`captured`) holds every span:

- a client's W3C `traceparent` (built by hand, or injected by the OTel propagator
  from a client span) parents the server span the gRPC interceptor opens, and that
  span parents `plimsoll.generate`, which carries the request's figures;
- a real eviction (scripted readings at soft pressure, the governor's own tick, a
  real engine thread unloaded) is a `plimsoll.memory.evict` span with the model,
  the reason and the bytes freed, under the tick's span, with the unload under it.

As a subprocess, `serve --otlp-endpoint` (and the OTEL_EXPORTER_OTLP_ENDPOINT
variable) sends the same spans over OTLP/gRPC to a receiver in this test, as the
recipe in docs/tracing.md sends them to a collector.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace
from opentelemetry.proto.collector.metrics.v1 import (
    metrics_service_pb2,
    metrics_service_pb2_grpc,
)
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from memory.actions import REASON_SOFT_LRU
from memory.config import MemoryConfig
from memory.levels import PressureLevel, Tier
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.server import PlimsollServer, ServerConfig
from telemetry import names
from tests.support.memory_fakes import ScriptedReader, readings
from tools.harness.server import free_port, serving

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
GENERATE_RPC = "/plimsoll.v1.InferenceService/Generate"
ADMIT_RPC = "/plimsoll.v1.ControlService/Admit"


@pytest.fixture()
def exporter(captured) -> InMemorySpanExporter:
    captured.spans.clear()
    return captured.spans


def hex_trace(span) -> str:
    return format(span.context.trace_id, "032x")


def hex_span(span_id: int) -> str:
    return format(span_id, "016x")


def named(spans, name: str) -> list:
    return [s for s in spans if s.name == name]


async def serve_demo(demo_path, **kwargs) -> PlimsollServer:
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)], **kwargs))
    await server.start()
    await server.load_initial_models()
    return server


async def test_a_generate_trace_continues_the_clients_traceparent(demo_path, exporter):
    """traceparent in the metadata → the interceptor's SERVER span (remote parent: the
    client's span id) → plimsoll.generate, with the request's id, model and counts."""
    server = await serve_demo(demo_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            call = stub.Generate(
                inference_pb2.GenerateRequest(text="trace me", max_tokens=3, ignore_eos=True),
                metadata=(("traceparent", TRACEPARENT),),
            )
            msgs = [m async for m in call]
    finally:
        await server.drain()
    start, end = msgs[0].start, msgs[-1].end
    spans = [s for s in exporter.get_finished_spans() if hex_trace(s) == TRACE_ID]

    (rpc,) = named(spans, GENERATE_RPC)
    assert rpc.kind is SpanKind.SERVER
    assert rpc.parent is not None and rpc.parent.is_remote
    assert hex_span(rpc.parent.span_id) == PARENT_ID
    assert rpc.attributes["rpc.system"] == "grpc"
    assert rpc.attributes["rpc.service"] == "plimsoll.v1.InferenceService"
    assert rpc.attributes["rpc.method"] == "Generate"
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]

    (gen,) = named(spans, names.SPAN_GENERATE)
    assert gen.parent.span_id == rpc.context.span_id
    assert not gen.parent.is_remote
    attrs = gen.attributes
    assert attrs[names.ATTR_REQUEST_ID] == start.request_id
    assert attrs[names.ATTR_MODEL] == start.model_id
    assert attrs[names.ATTR_PROMPT_TOKENS] == start.prompt_tokens
    assert attrs[names.ATTR_CACHED_TOKENS] == 0
    assert attrs[names.ATTR_COMPLETION_TOKENS] == end.usage.completion_tokens == 3
    assert attrs[names.ATTR_FINISH_REASON] == "length"

    # Every span of the trace hangs off the client's span: nothing starts a trace of
    # its own under the same id, and the tree has no orphan.
    ids = {s.context.span_id for s in spans}
    for s in spans:
        assert s.parent is not None
        assert s.parent.span_id in ids or hex_span(s.parent.span_id) == PARENT_ID, s.name


async def test_the_otel_propagator_carries_a_client_span_into_generate_and_admit(
        demo_path, exporter):
    """A client span's context, injected with the global propagator (W3C trace context),
    parents the server spans of a streaming and a unary RPC; health stays untraced."""
    tracer = trace.get_tracer("docs.client")
    server = await serve_demo(demo_path)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            inference = inference_pb2_grpc.InferenceServiceStub(ch)
            control = control_pb2_grpc.ControlServiceStub(ch)
            with tracer.start_as_current_span("client.turn", kind=SpanKind.CLIENT) as client:
                carrier: dict[str, str] = {}
                propagate.inject(carrier)
                assert "traceparent" in carrier
                metadata = tuple(carrier.items())
                request = inference_pb2.GenerateRequest(text="hello", max_tokens=2,
                                                        ignore_eos=True)
                admit = await control.Admit(control_pb2.AdmitRequest(request=request),
                                            metadata=metadata)
                assert admit.verdict == control_pb2.ADMIT_VERDICT_ADMIT
                _ = [m async for m in inference.Generate(request, metadata=metadata)]
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
    finally:
        await server.drain()
    client_trace = format(client.get_span_context().trace_id, "032x")
    client_id = client.get_span_context().span_id
    spans = exporter.get_finished_spans()
    for rpc_name in (GENERATE_RPC, ADMIT_RPC):
        (rpc,) = [s for s in named(spans, rpc_name) if hex_trace(s) == client_trace]
        assert rpc.kind is SpanKind.SERVER
        assert rpc.parent.span_id == client_id and rpc.parent.is_remote
    (gen,) = [s for s in named(spans, names.SPAN_GENERATE) if hex_trace(s) == client_trace]
    (rpc,) = [s for s in named(spans, GENERATE_RPC) if hex_trace(s) == client_trace]
    assert gen.parent.span_id == rpc.context.span_id
    assert not [s for s in spans if s.name.startswith("/grpc.health")]


# Custom tier, 10 GiB: soft 8.5, hard 9.5 GiB.
CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=10, idle_poll_s=3600,
                      empty_poll_s=3600, active_poll_s=3600, load_warmup_s=0)
OK_GIB, SOFT_GIB = 4.0, 9.0


async def test_a_governor_eviction_is_a_span_with_model_reason_and_bytes_freed(
        demo_path, exporter):
    """Two idle models, soft pressure: the governor's tick evicts the least recently used
    one (a real engine thread stops). One plimsoll.memory.evict span says which model,
    why, at what level and how many bytes came back; it sits under the tick's span and
    the pool's unload span sits under it. A subscriber sees the same eviction."""
    reader = ScriptedReader(readings(OK_GIB))
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)], memory=CONFIG),
                            reader=reader)
    await server.start()
    await server.load_initial_models()
    svc = server.service
    pool, gov = svc.pool, svc.governor
    await pool.load(str(demo_path), "extra-1")
    gov.stop()  # the test runs every tick itself
    await gov.tick()
    assert gov.level is PressureLevel.OK
    pool.touch(pool.get(""))  # the default model was used last: extra-1 is the LRU
    events: list = []
    got_snapshot = asyncio.Event()

    async def watch() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            call = control_pb2_grpc.ControlServiceStub(ch).WatchPressure(
                control_pb2.WatchPressureRequest(include_actions=True))
            try:
                async for m in call:
                    events.append(m)
                    got_snapshot.set()
            except grpc.aio.AioRpcError:
                pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait_for(got_snapshot.wait(), 10)
        exporter.clear()
        reader.current = readings(SOFT_GIB)
        await gov.tick()
        assert gov.level is PressureLevel.SOFT
        assert pool.get("extra-1").engine is None
        assert pool.get("").engine is not None  # the last non-pinned model stays at soft
        await asyncio.sleep(0.2)
    finally:
        await server.drain()
        await asyncio.gather(watcher, return_exceptions=True)

    spans = exporter.get_finished_spans()
    (evict,) = named(spans, names.SPAN_EVICT)
    attrs = evict.attributes
    assert names.ATTR_SKIPPED not in attrs
    assert attrs[names.ATTR_MODEL] == "extra-1"
    assert attrs[names.ATTR_REASON] == REASON_SOFT_LRU == "soft_pressure_idle_lru"
    assert attrs[names.ATTR_LEVEL] == "soft"
    assert attrs[names.ATTR_USAGE] == readings(SOFT_GIB).process_bytes
    assert attrs[names.ATTR_TARGET] == pool.get("extra-1").measured_bytes > 0
    freed = attrs[names.ATTR_BYTES_FREED]
    assert isinstance(freed, int) and freed > 0  # the weights came back

    (tick,) = [s for s in named(spans, names.SPAN_ENFORCER_TICK)
               if s.context.span_id == evict.parent.span_id]
    assert tick.parent is None  # a tick is a trace of its own
    assert tick.attributes[names.ATTR_LEVEL] == "soft"
    (unload,) = named(spans, names.SPAN_MODEL_UNLOAD)
    assert unload.parent.span_id == evict.context.span_id
    assert unload.attributes[names.ATTR_MODEL] == "extra-1"
    assert unload.attributes[names.ATTR_REASON] == REASON_SOFT_LRU
    assert unload.attributes[names.ATTR_BYTES_FREED] == freed
    (transition,) = named(spans, names.SPAN_LEVEL_TRANSITION)
    assert (transition.attributes[names.ATTR_FROM_LEVEL],
            transition.attributes[names.ATTR_LEVEL]) == ("ok", "soft")

    actions = [m.action for m in events if m.WhichOneof("event") == "action"
               and m.action.kind == control_pb2.ENFORCER_ACTION_KIND_EVICT_MODEL]
    assert [(a.model_id, a.bytes_freed) for a in actions] == [("extra-1", freed)]


# -- OTLP out of a subprocess, into a receiver standing in for a collector -----------


class Receiver(trace_service_pb2_grpc.TraceServiceServicer,
               metrics_service_pb2_grpc.MetricsServiceServicer):
    """The OTLP/gRPC receiver of a collector, keeping what it is sent."""

    def __init__(self) -> None:
        self.traces: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.metrics = 0
        self.lock = threading.Lock()

    def Export(self, request, context):  # noqa: N802 - the OTLP name
        with self.lock:
            if isinstance(request, trace_service_pb2.ExportTraceServiceRequest):
                self.traces.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()
            self.metrics += 1
            return metrics_service_pb2.ExportMetricsServiceResponse()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received."""
        out = []
        with self.lock:
            for req in self.traces:
                for rs in req.resource_spans:
                    resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                    out.extend((resource, span) for ss in rs.scope_spans for span in ss.spans)
        return out


@pytest.fixture()
def receiver():
    port = free_port()
    recv = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(recv, server)
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(recv, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    recv.endpoint = f"http://127.0.0.1:{port}"
    yield recv
    server.stop(0)


@pytest.mark.parametrize("how", ["flag", "env"])
def test_otlp_endpoint_sends_the_generate_trace_to_a_collector(tmp_path, demo_path,
                                                                receiver, how):
    """`serve --otlp-endpoint http://HOST:4317` (or OTEL_EXPORTER_OTLP_ENDPOINT): the
    spans reach an OTLP/gRPC receiver, resource service.name=plimsoll, with the client's
    trace id; they are flushed at the latest when the server exits."""
    args = ("--otlp-endpoint", receiver.endpoint) if how == "flag" else ()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint} if how == "env" else None
    with serving(tmp_path, *args, env=env) as srv, srv.stubs() as (_, inference):
        msgs = list(inference.Generate(
            inference_pb2.GenerateRequest(text="to the collector", max_tokens=2,
                                          ignore_eos=True),
            metadata=(("traceparent", TRACEPARENT),), timeout=60))
        request_id = msgs[0].start.request_id
    # `serving` stopped the server with SIGTERM: its exit flushed the batch processor.
    got = [(res, s) for res, s in receiver.spans() if s.trace_id.hex() == TRACE_ID]
    by_name = {s.name: (res, s) for res, s in got}
    assert GENERATE_RPC in by_name and names.SPAN_GENERATE in by_name, sorted(by_name)
    res, rpc = by_name[GENERATE_RPC]
    assert res["service.name"] == "plimsoll"
    assert rpc.parent_span_id.hex() == PARENT_ID
    _, gen = by_name[names.SPAN_GENERATE]
    assert gen.parent_span_id == rpc.span_id
    attrs = {a.key: a.value for a in gen.attributes}
    assert attrs[names.ATTR_REQUEST_ID].string_value == request_id
    assert attrs[names.ATTR_COMPLETION_TOKENS].int_value == 2
