"""Server assembly: grpc.aio server, servicers, health, reflection, telemetry, draining."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection, reflection_pb2
from grpc_reflection.v1alpha._async import ReflectionServicer
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

from engine import allocator, blas
from engine.demo_models import ensure_demo_model
from engine.errors import DRAINING, PlimsollError, Unavailable
from engine.model_engine import EngineSettings, wait_threads_gone
from engine.pool import ModelPool, ModelState
from memory.config import MemoryConfig
from memory.protocols import ReadingsSource
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.assembly import Service, ServiceSettings
from service.auth import Access, AccessConfig, demo_dir
from service.control_servicer import ControlServicer
from service.decode_guard import DecodeGuard
from service.inference_servicer import DEFAULT_STALL_TIMEOUT_S, InferenceServicer
from service.lifecycle import settle_heap
from service.pressure_broker import DEFAULT_MAX_SUBSCRIBERS, PressureBroker, PressurePublisher
from service.readiness import DEFAULT_HOLD_S, ReadinessWatch
from service.smg_worker import SERVICE_NAME as SMG_MLX_ENGINE
from service.smg_worker import add_to_server as add_smg_worker
from telemetry.prometheus import MetricsServer, start_metrics_server
from telemetry.setup import TelemetrySettings, setup

if TYPE_CHECKING:
    from service.web_dashboard import WebDashboard

log = logging.getLogger(__name__)

INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
CONTROL = control_pb2.DESCRIPTOR.services_by_name["ControlService"].full_name
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
REFLECTION_V1ALPHA = reflection.SERVICE_NAME
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
MiB = 1024 * 1024
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Streams one client connection may have open at once (--max-streams-per-connection).
DEFAULT_STREAMS_PER_CONNECTION = 100

# Drain: how often to look at the streams still running, how long streams cut at the
# end of the grace get to send their status, and the gRPC stop's own grace after that.
DRAIN_POLL_S = 0.05
CUT_WAIT_S = 5.0
CUT_REPEAT_S = 0.5
STOP_GRACE_S = 1.0
THREAD_EXIT_TIMEOUT_S = 30.0

_T = TypeVar("_T")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    models: list[str] = field(default_factory=list)  # empty: the embedded demo model
    demo_size: str = "tiny"
    cache_dir: Path | None = None
    max_message_bytes: int = 64 * MiB
    # A Generate whose client reads nothing this long ends ABORTED / CLIENT_STALLED.
    stream_stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S
    max_watchers: int = DEFAULT_MAX_SUBSCRIBERS  # WatchPressure streams open at once
    max_streams_per_connection: int = DEFAULT_STREAMS_PER_CONNECTION
    drain_grace_s: float = 30.0
    engine: EngineSettings = field(default_factory=EngineSettings)
    service: ServiceSettings = field(default_factory=ServiceSettings)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: off, 0: any port
    http_host: str = "127.0.0.1"
    http_port: int | None = None  # the web dashboard (service.web_dashboard); None: off, 0: any
    access: AccessConfig = field(default_factory=AccessConfig)  # TLS, tokens, model roots
    agent_host: str = "127.0.0.1"
    agent_port: int | None = None  # HAProxy agent check (service.agent_check); None: off
    unready_hold_s: float = DEFAULT_HOLD_S  # below hard this long before SERVING again
    # MLX may keep this much of freed buffers for reuse (engine/allocator.py), within
    # its share of the ceiling; 0 leaves MLX's own limit.
    mlx_pool_bytes: int = allocator.MLX_POOL_BYTES


class _MethodAwarePool:
    """The default descriptor pool, able to find the file of a method symbol.

    upb's `FindFileContainingSymbol` does not know method names
    (a known gap of the upb backend), so `grpcurl describe pkg.Service.Method` would answer
    "Symbol not found"; fall back to the service that owns the method.
    """

    def __init__(self) -> None:
        self._pool = descriptor_pool.Default()

    def __getattr__(self, name: str):
        return getattr(self._pool, name)

    def FindFileContainingSymbol(self, symbol: str):  # noqa: N802 - protobuf's name
        try:
            return self._pool.FindFileContainingSymbol(symbol)
        except KeyError:
            service, _, method = symbol.rpartition(".")
            svc = self._pool.FindServiceByName(service)  # KeyError when unknown too
            if method not in svc.methods_by_name:
                raise
            return svc.file


class Health(HealthServicer):
    """grpc.health.v1.Health with List, which the package's aio servicer lacks."""

    async def List(self, request, context) -> health_pb2.HealthListResponse:  # noqa: N802
        return health_pb2.HealthListResponse(statuses={
            name: health_pb2.HealthCheckResponse(status=status)
            for name, status in self._server_status.items()
        })


def _reflection_v1_file() -> None:
    """Puts grpc/reflection/v1/reflection.proto in the default pool, so the v1 service
    can be described. grpcio-reflection ships only v1alpha; v1 has the same messages
    under another package, so the file is v1alpha's, renamed."""
    pool = descriptor_pool.Default()
    name = "grpc/reflection/v1/reflection.proto"
    try:
        pool.FindFileByName(name)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = proto.package, REFLECTION_V1.rpartition(".")[0]
    proto.name, proto.package = name, new
    proto.ClearField("options")
    for message in proto.message_type:
        for f in message.field:
            if f.HasField("type_name"):
                f.type_name = f.type_name.replace(f".{old}.", f".{new}.")
    for service in proto.service:
        for method in service.method:
            method.input_type = method.input_type.replace(f".{old}.", f".{new}.")
            method.output_type = method.output_type.replace(f".{old}.", f".{new}.")
    pool.AddSerializedFile(proto.SerializeToString())


def add_reflection(server: grpc.aio.Server, services: tuple[str, ...]) -> None:
    """Server reflection v1 and v1alpha, one servicer behind both: the two protocols
    are the same messages on the wire, so v1 reuses the v1alpha codecs."""
    _reflection_v1_file()
    servicer = ReflectionServicer((*services, REFLECTION_V1, REFLECTION_V1ALPHA),
                                  pool=_MethodAwarePool())
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(tuple(
        grpc.method_handlers_generic_handler(name, {"ServerReflectionInfo": handler})
        for name in (REFLECTION_V1, REFLECTION_V1ALPHA)
    ))


async def run_in_own_thread(fn: Callable[..., _T], *args) -> _T:
    """`fn(*args)` on a thread of its own, awaited until the thread is gone: MLX work
    (making a demo model) then leaves no worker behind with MLX thread-local state
    for the interpreter's exit to trip over (see engine.model_engine.thread_gone)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[_T] = loop.create_future()

    def settle(result: _T | None, exc: BaseException | None) -> None:
        if done.cancelled():
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    thread = threading.Thread(target=work, name=getattr(fn, "__name__", "worker"),
                              daemon=True)
    thread.start()
    try:
        return await done
    finally:
        await wait_threads_gone([thread], THREAD_EXIT_TIMEOUT_S)


def drain_cut_error(grace_s: float) -> Unavailable:
    return Unavailable(
        f"server is shutting down (drain grace of {grace_s:g}s ended); "
        "retry on another replica",
        reason=DRAINING,
        retry_after_s=1.0,
    )


def grpc_options(max_message_bytes: int,
                 max_streams_per_connection: int = DEFAULT_STREAMS_PER_CONNECTION
                 ) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: a connection's further calls wait in
        # its client until one of its streams ends (the server-wide bound is
        # --max-queued-requests, answered IN_FLIGHT_LIMIT).
        ("grpc.max_concurrent_streams", max_streams_per_connection),
        # A second server on a taken port fails to start instead of sharing it.
        ("grpc.so_reuseport", 0),
        # Idle WatchPressure streams must live: ping idle clients every minute,
        # and accept client keepalive pings down to every 10 s.
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class PlimsollServer:
    def __init__(self, config: ServerConfig, reader: ReadingsSource | None = None) -> None:
        """`reader`: where memory readings come from (default: this process and machine)."""
        self.config = config
        self._reader = reader
        self.port = 0
        self.health = Health()
        self._server: grpc.aio.Server | None = None
        self.service: Service | None = None
        self.broker = PressureBroker(max_subscribers=config.max_watchers)
        self.publisher = PressurePublisher(self.broker)
        self._enforcer_task: asyncio.Task | None = None
        self.metrics_server: MetricsServer | None = None
        self.web: WebDashboard | None = None  # with http_port
        self._stopped = asyncio.Event()
        self._cut_now = asyncio.Event()
        self.access: Access | None = None  # from start(); SIGHUP reloads it
        # Inference is not ready while the models named at start load, even once the
        # first has: a client told SERVING may name any of them.
        self._loading_initial_models = False
        self.readiness: ReadinessWatch | None = None  # health and agent check, from start()
        self.agent_server: asyncio.Server | None = None
        self.agent_port = 0

    async def start(self) -> int:
        setup(self.config.telemetry)
        allocator.release_large_allocations_on_free()
        loop = asyncio.get_running_loop()
        pool = ModelPool(loop, self.config.engine)
        self.service = svc = Service(pool, self.config.service, self.config.memory,
                                     sink=self.publisher, reader=self._reader)
        pool.listeners.append(self._on_pool_change)
        self.access = access = Access(self.config.access, demo_dir(self.config.cache_dir))
        server = grpc.aio.server(
            # Health and reflection stay untraced: they are noise, and their aio
            # servicers write to the context, which the tracing interceptor cannot wrap.
            interceptors=[
                *access.interceptors(),  # first: a refused call reaches nothing else
                aio_server_interceptor(filter_=filters.negate(filters.any_of(
                filters.service_prefix("grpc.health"),
                filters.service_prefix("grpc.reflection"),
            ))), DecodeGuard()],  # last: it wraps the servicers' own handlers
            options=grpc_options(2 * self.config.max_message_bytes,
                                 self.config.max_streams_per_connection),
        )
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(
            InferenceServicer(svc.pipeline, self.config.max_message_bytes,
                              self.config.stream_stall_timeout_s), server
        )
        control = ControlServicer(svc, self.publisher, sources=access.sources)
        control_pb2_grpc.add_ControlServiceServicer_to_server(control, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        # SMG's MLX worker protocol on the same port; its HealthCheck follows the same
        # readiness decision as grpc.health and the agent check.
        add_smg_worker(svc, server, serving=lambda: (
            self.readiness.refresh().serving if self.readiness is not None else None))
        add_reflection(server, (INFERENCE, CONTROL, HEALTH, SMG_MLX_ENGINE))
        # Inference waits for its default model; control answers from the start.
        for name in ("", INFERENCE):
            await self.health.set(name, NOT_SERVING)
        await self.health.set(CONTROL, SERVING)
        self.port = access.add_port(server, f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self.config.host}:{self.config.port}")
        if self.config.metrics_port is not None:  # its own threads, off this loop
            self.metrics_server = start_metrics_server(self.config.metrics_host,
                                                       self.config.metrics_port)
        await svc.governor.tick()  # a first snapshot before anyone subscribes
        self._size_mlx_pool()
        await self._start_readiness()
        if self.config.http_port is not None:
            await self._start_web(control)
        await server.start()
        self._server = server
        self._enforcer_task = asyncio.create_task(svc.governor.run())
        using = blas.state()
        log.log(logging.WARNING if using.problem else logging.INFO, "BLAS: %s", using.summary())
        log.info("listening on %s:%d", self.config.host, self.port)
        return self.port

    def _size_mlx_pool(self) -> None:
        """Before any model loads: each engine thread raises MLX's pool to this as it
        starts (MLX is touched on engine threads only)."""
        if self.config.mlx_pool_bytes <= 0:
            return
        limits = self.service.governor.limits
        wanted = allocator.mlx_pool_bytes(self.config.mlx_pool_bytes,
                                          limits.ceiling_bytes if limits else None)
        self.service.pool.settings.mlx_pool_bytes = wanted
        log.info("MLX buffer pool: up to %d MiB of freed buffers kept for reuse (MLX's "
                 "own limit where it is larger)", wanted >> 20)

    async def _start_web(self, control: ControlServicer) -> None:
        # Imported here: without --http-port no HTTP server is loaded, let alone started.
        from service.web_dashboard import DashboardSources, start_web_dashboard

        sources = DashboardSources(self.publisher, control.memory_status,
                                   lambda: self.service.draining)
        self.web = await start_web_dashboard(sources, self.config.http_host,
                                             self.config.http_port)

    async def _start_readiness(self) -> None:
        """Inference health from readiness and pressure (service.readiness), and the
        HAProxy agent check answering from the same decision."""
        svc = self.service
        self.readiness = ReadinessWatch(
            self.publisher, models_ready=self._models_ready,
            draining=lambda: svc.draining, apply=self._set_inference_health,
            hold_s=self.config.unready_hold_s)
        self.readiness.start()
        if self.config.agent_port is not None:
            # Imported here: without --agent-port no listener is made.
            from service.agent_check import bound_port, start_agent_check

            self.agent_server = await start_agent_check(
                self.config.agent_host, self.config.agent_port, self.readiness.agent_line)
            self.agent_port = bound_port(self.agent_server)
            log.info("agent check on %s:%d", self.config.agent_host, self.agent_port)

    async def load_initial_models(self) -> None:
        self._loading_initial_models = True
        try:
            await self._load_initial_models()
        finally:
            self._loading_initial_models = False
        self._on_pool_change()

    async def _load_initial_models(self) -> None:
        sources = list(self.config.models)
        if not sources:
            path = await run_in_own_thread(
                ensure_demo_model, self.config.demo_size, self.config.cache_dir
            )
            await self.service.pool.load(str(path), f"demo-{self.config.demo_size}", default=True)
        for i, source in enumerate(sources):
            await self.service.pool.load(source, default=(i == 0))

    def _on_pool_change(self) -> None:
        if self.service is None or self.service.draining:
            return
        if self.readiness is not None:
            self.readiness.refresh()

    def _models_ready(self) -> bool:
        # Inference serves once the models named at start have loaded and while its
        # default model is ready: a request naming no model would be refused otherwise.
        return (self.service is not None and not self._loading_initial_models
                and _default_ready(self.service.pool))

    async def _set_inference_health(self, serving: bool) -> None:
        # After a drain began, health.set is a no-op: the drain's NOT_SERVING stands.
        for name in ("", INFERENCE):
            await self.health.set(name, SERVING if serving else NOT_SERVING)

    async def drain(self) -> None:
        """Health goes NOT_SERVING with the listener still open; new Generates are
        refused (UNAVAILABLE, RetryInfo); in-flight streams run until they end or the
        grace does, then are cut with a typed UNAVAILABLE; only then the gRPC server
        stops and every engine thread is joined."""
        svc = self.service
        if svc is None:
            return
        if svc.draining:
            self._cut_now.set()  # a second signal: end the grace now
            return
        grace = self.config.drain_grace_s
        began = asyncio.get_running_loop().time()
        log.info("draining: %d request(s) in flight, grace %gs", svc.pipeline.in_flight,
                 grace)
        svc.lifecycle.draining = True
        await self.health.enter_graceful_shutdown()  # every service NOT_SERVING
        self.broker.close_all()  # watch streams end; in-flight Generates go on
        if not await self._streams_ended(grace, hurry=True):
            await self._cut_streams(drain_cut_error(grace))
        if self._server is not None:
            await self._server.stop(STOP_GRACE_S)
        svc.governor.stop()
        if self._enforcer_task is not None:
            self._enforcer_task.cancel()
            await asyncio.gather(self._enforcer_task, return_exceptions=True)
        await svc.pool.close()
        await asyncio.to_thread(svc.close_cold_tier)  # the bank's sessions to disk
        if self.web is not None:  # its event streams ended with the broker's, above
            await self.web.stop()
        if self.readiness is not None:
            await self.readiness.stop()
        if self.agent_server is not None:  # it said "down #draining" until now
            self.agent_server.close()
            await self.agent_server.wait_closed()
        if self.metrics_server is not None:  # scrapes see the drain until the end
            await asyncio.to_thread(self.metrics_server.stop)
        log.info("drained in %.1fs", asyncio.get_running_loop().time() - began)
        self._stopped.set()

    async def _streams_ended(self, timeout_s: float, hurry: bool = False) -> bool:
        """Waits up to `timeout_s` for the Generate streams in flight to end; with
        `hurry`, a second signal ends the wait too."""
        pipeline = self.service.pipeline
        deadline = asyncio.get_running_loop().time() + timeout_s
        while pipeline.in_flight > 0:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            if hurry and self._cut_now.is_set():
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    async def _cut_streams(self, error: PlimsollError) -> None:
        """Ends every running request in the engines with `error`, through each
        stream's own end (a final status, not a torn-down call). Repeated for a little
        while: a request past admission may reach its engine after the first cut."""
        pipeline = self.service.pipeline
        log.info("drain grace ended: cutting %d stream(s)", pipeline.in_flight)
        self.service.queue.close()  # those still waiting for admission end typed too
        deadline = asyncio.get_running_loop().time() + CUT_WAIT_S
        while pipeline.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
            for entry in self.service.pool.entries():
                if entry.engine is not None:
                    entry.engine.abort(error)
            await self._streams_ended(CUT_REPEAT_S)
        if pipeline.in_flight:
            log.warning("%d stream(s) still open after the cut; the gRPC stop ends them",
                        pipeline.in_flight)

    async def wait(self) -> None:
        await self._stopped.wait()


def _default_ready(pool: ModelPool) -> bool:
    try:
        entry = pool.get("")
    except PlimsollError:
        return False
    return entry.state == ModelState.READY and entry.engine is not None


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> None:
    """Runs until SIGTERM or SIGINT, then drains; returns once every engine thread
    is gone, so the interpreter exits with no MLX work running."""
    server = PlimsollServer(config)
    loop = asyncio.get_running_loop()
    draining: list[asyncio.Future] = []  # kept so the task is not collected
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: draining.append(asyncio.ensure_future(
            server.drain())))
    # SIGHUP re-reads the TLS files and the tokens (service/auth.py); set before start,
    # so an early SIGHUP does not end the process (its default action).
    loop.add_signal_handler(signal.SIGHUP, lambda: server.access is not None
                            and server.access.reload())
    await server.start()
    try:
        await server.load_initial_models()
    except PlimsollError:
        if not server.service.draining:
            raise
        # A signal arrived while loading: the drain has closed the pool.
    if not server.service.draining:
        settle_heap()
        log.info("ready: %s", ", ".join(e.model_id for e in server.service.pool.entries()))
    if ready is not None:
        ready.set()
    await server.wait()
