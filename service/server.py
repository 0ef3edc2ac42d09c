"""Server assembly: grpc.aio server, servicers, health, reflection, telemetry, draining."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from opentelemetry.instrumentation.grpc import aio_server_interceptor, filters

from engine import allocator
from engine.demo_models import ensure_demo_model
from engine.model_engine import EngineSettings
from engine.pool import ModelPool
from memory.config import MemoryConfig
from memory.protocols import ReadingsSource
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.assembly import Service, ServiceSettings
from service.control_servicer import ControlServicer
from service.inference_servicer import InferenceServicer
from service.lifecycle import settle_heap
from service.pressure_broker import PressureBroker, PressurePublisher
from telemetry.setup import TelemetrySettings, setup

log = logging.getLogger(__name__)

INFERENCE = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name
CONTROL = control_pb2.DESCRIPTOR.services_by_name["ControlService"].full_name
MiB = 1024 * 1024


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    models: list[str] = field(default_factory=list)  # empty: the embedded demo model
    demo_size: str = "tiny"
    cache_dir: Path | None = None
    max_message_bytes: int = 64 * MiB
    drain_grace_s: float = 30.0
    engine: EngineSettings = field(default_factory=EngineSettings)
    service: ServiceSettings = field(default_factory=ServiceSettings)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    telemetry: TelemetrySettings = field(default_factory=TelemetrySettings)


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


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
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
        self.health = HealthServicer()
        self._server: grpc.aio.Server | None = None
        self.service: Service | None = None
        self.broker = PressureBroker()
        self.publisher = PressurePublisher(self.broker)
        self._enforcer_task: asyncio.Task | None = None
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        setup(self.config.telemetry)
        allocator.release_large_allocations_on_free()
        loop = asyncio.get_running_loop()
        pool = ModelPool(loop, self.config.engine)
        self.service = svc = Service(pool, self.config.service, self.config.memory,
                                     sink=self.publisher, reader=self._reader)
        pool.listeners.append(self._on_pool_change)
        server = grpc.aio.server(
            # Health and reflection stay untraced: they are noise, and their aio
            # servicers write to the context, which the tracing interceptor cannot wrap.
            interceptors=[aio_server_interceptor(filter_=filters.negate(filters.any_of(
                filters.service_prefix("grpc.health"),
                filters.service_prefix("grpc.reflection"),
            )))],
            options=grpc_options(2 * self.config.max_message_bytes),
        )
        inference_pb2_grpc.add_InferenceServiceServicer_to_server(
            InferenceServicer(svc.pipeline, self.config.max_message_bytes), server
        )
        control_pb2_grpc.add_ControlServiceServicer_to_server(
            ControlServicer(svc, self.publisher), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (INFERENCE, CONTROL, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME),
            server,
            pool=_MethodAwarePool(),
        )
        for name in ("", INFERENCE):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.health.set(CONTROL, health_pb2.HealthCheckResponse.SERVING)
        self.port = server.add_insecure_port(f"{self.config.host}:{self.config.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self.config.host}:{self.config.port}")
        await svc.governor.tick()  # a first snapshot before anyone subscribes
        await server.start()
        self._server = server
        self._enforcer_task = asyncio.create_task(svc.governor.run())
        log.info("listening on %s:%d", self.config.host, self.port)
        return self.port

    async def load_initial_models(self) -> None:
        sources = list(self.config.models)
        if not sources:
            path = await asyncio.to_thread(
                ensure_demo_model, self.config.demo_size, self.config.cache_dir
            )
            await self.service.pool.load(str(path), f"demo-{self.config.demo_size}", default=True)
            return
        for i, source in enumerate(sources):
            await self.service.pool.load(source, default=(i == 0))

    def _on_pool_change(self) -> None:
        if self.service is None or self.service.draining:
            return
        state = (
            health_pb2.HealthCheckResponse.SERVING
            if self.service.pool.any_ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", INFERENCE):
            asyncio.ensure_future(self.health.set(name, state))

    async def drain(self) -> None:
        """Stop taking work, let in-flight streams finish (up to the grace), then exit."""
        svc = self.service
        if svc is None or svc.draining:
            return
        log.info("draining: %d request(s) in flight", svc.pipeline.in_flight)
        svc.lifecycle.draining = True
        await self.health.enter_graceful_shutdown()
        self.broker.close_all()  # watch streams end; in-flight Generates finish
        if self._server is not None:
            await self._server.stop(self.config.drain_grace_s)
        svc.governor.stop()
        if self._enforcer_task is not None:
            self._enforcer_task.cancel()
        await svc.pool.close()
        self._stopped.set()

    async def wait(self) -> None:
        await self._stopped.wait()


async def serve(config: ServerConfig, ready: asyncio.Event | None = None) -> None:
    """Runs until SIGTERM or SIGINT, then drains."""
    server = PlimsollServer(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    await server.start()
    await server.load_initial_models()
    settle_heap()
    log.info("ready: %s", ", ".join(e.model_id for e in server.service.pool.entries()))
    if ready is not None:
        ready.set()
    await server.wait()
