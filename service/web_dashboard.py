"""The web dashboard: one page, its assets, /api/status, /api/watch (Server-Sent Events)
and /metrics, on one HTTP listener (`plimsoll serve --http-port`).

Served by uvicorn as a task on the server's own event loop: the SSE bridge reads the
same in-process pressure stream WatchPressure does, with no thread hop. Each SSE
connection is one broker subscription, bounded like any subscriber: when it falls
`capacity` events behind, its stream ends with an `overflow` event and the page
reconnects. Event ids are the stream's sequence numbers and a reconnect's
Last-Event-ID is passed as `resume_after`, so what was missed is replayed before the
fresh snapshot. Everything the page needs is served from here; it fetches nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources

import uvicorn
from google.protobuf import json_format
from google.protobuf.message import Message
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.errors import PlimsollError
from plimsoll.v1 import control_pb2
from service.pressure_broker import PressurePublisher, Subscriber

log = logging.getLogger(__name__)

MAX_STREAMS = 32  # open SSE connections at once; more are refused (503)
HEARTBEAT_S = 15.0  # a comment line when idle this long: dead connections are noticed
RETRY_MS = 1000  # the browser's reconnect delay after a stream ends
START_TIMEOUT_S = 10.0
STOP_GRACE_S = 2  # uvicorn's own grace for connections still open at stop
STOP_TIMEOUT_S = 5.0

# The page's files, served from the package (service/web/), never from elsewhere.
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
# Nothing but our own origin: no CDN, no inline script.
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:",
    "Cache-Control": "no-cache",
}
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

StatusSource = Callable[[], Awaitable[control_pb2.GetMemoryStatusResponse]]


@dataclass
class DashboardSources:
    """What the dashboard reads: the pressure stream, the memory status, the drain."""

    publisher: PressurePublisher
    memory_status: StatusSource
    draining: Callable[[], bool]


@dataclass
class Streams:
    """The SSE subscriptions open now, so a stop can end them all at once."""

    limit: int = MAX_STREAMS
    open: set[Subscriber] = field(default_factory=set)
    closing: bool = False

    def close_all(self, publisher: PressurePublisher) -> None:
        self.closing = True
        for sub in list(self.open):
            publisher.broker.unsubscribe(sub)
            sub.wakeup.set()  # next() sees closed and returns None


def to_json(msg: Message) -> str:
    """The proto3 JSON mapping (lowerCamelCase, enums by name, 64-bit ints as strings),
    on one line, zero values included so the page need not guess defaults."""
    return json.dumps(json_format.MessageToDict(msg, always_print_fields_with_no_presence=True),
                      separators=(",", ":"))


def sse_event(msg: control_pb2.WatchPressureResponse) -> bytes:
    kind = msg.WhichOneof("event")
    return f"id: {msg.sequence}\nevent: {kind}\ndata: {to_json(msg)}\n\n".encode()


def _error(status: int, message: str, reason: str, retry_after_s: float | None = None
           ) -> JSONResponse:
    headers = {"Retry-After": f"{max(1, round(retry_after_s))}"} if retry_after_s else None
    return JSONResponse({"error": message, "reason": reason}, status_code=status,
                        headers=headers)


def resume_after(request: Request, last_sequence: int) -> int:
    """The sequence to replay after: the Last-Event-ID header (an EventSource's own
    reconnect) or else `last_event_id` (a page's fresh reconnect). A number past the
    last one published came from an earlier process: no replay."""
    raw = request.headers.get("last-event-id") or request.query_params.get("last_event_id")
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"Last-Event-ID must be a sequence number, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"Last-Event-ID must be >= 0, got {value}")
    return value if value <= last_sequence else 0


def _flag(request: Request, name: str) -> bool:
    return request.query_params.get(name, "1").lower() not in ("0", "false", "no")


async def _stream(publisher: PressurePublisher, streams: Streams, samples: bool,
                  actions: bool, resume: int, resume_instance: str = "") -> AsyncIterator[bytes]:
    # Subscribed here, when the response starts: a client gone before then leaves no
    # subscriber behind.
    sub = None if streams.closing else publisher.subscribe(samples, actions, resume,
                                                           resume_instance=resume_instance)
    if sub is None:
        return
    streams.open.add(sub)
    try:
        yield f"retry: {RETRY_MS}\n\n".encode()
        while True:
            try:
                msg = await asyncio.wait_for(sub.next(), HEARTBEAT_S)
            except TimeoutError:
                yield b": keep-alive\n\n"
                continue
            if msg is None:
                break
            yield sse_event(msg)
        if sub.overflowed:
            # The browser reconnects with Last-Event-ID: a replay, then a fresh snapshot.
            data = json.dumps({"reason": "SUBSCRIBER_OVERFLOW", "capacity": sub.capacity,
                               "message": f"fell {sub.capacity} events behind; reconnect"})
            yield f"event: overflow\ndata: {data}\n\n".encode()
    finally:
        publisher.broker.unsubscribe(sub)
        streams.open.discard(sub)


def _metrics_renderer() -> Callable[[], tuple[bytes, str]] | None:
    """telemetry.prometheus.render, when this build has it (imported on first use)."""
    try:
        module = importlib.import_module("telemetry.prometheus")
    except ModuleNotFoundError as err:
        if err.name != "telemetry.prometheus":
            raise
        return None
    return getattr(module, "render", None)


def build_app(sources: DashboardSources, streams: Streams) -> Starlette:
    web = resources.files("service") / "web"
    page = (web / "dashboard.html").read_bytes()
    assets = {name: (web / name).read_bytes() for name in ASSETS}
    publisher = sources.publisher

    async def index(request: Request) -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=PAGE_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in assets:
            return _error(404, f"no asset {name!r}", "NOT_FOUND")
        return Response(assets[name], media_type=ASSETS[name],
                        headers={"Cache-Control": "no-cache"})

    async def status(request: Request) -> Response:
        try:
            msg = await sources.memory_status()
        except PlimsollError as err:  # not measured yet: the page retries
            return _error(503, err.message, err.reason, err.retry_after_s or 1.0)
        return Response(to_json(msg), media_type="application/json")

    async def watch(request: Request) -> Response:
        if streams.closing or sources.draining():
            return _error(503, "server is shutting down", "DRAINING", 1.0)
        if len(streams.open) >= streams.limit:
            return _error(503, f"{streams.limit} event streams are open already",
                          "TOO_MANY_STREAMS", 5.0)
        try:
            resume = resume_after(request, publisher.broker.sequence)
        except ValueError as err:
            return _error(400, str(err), "BAD_LAST_EVENT_ID")
        if publisher.snapshot() is None:
            return _error(503, "memory could not be measured yet; retry",
                          "MEMORY_NOT_MEASURED", 1.0)
        # `instance`: the process that numbered last_event_id (a page's fresh reconnect);
        # another one's numbers replay nothing.
        body = _stream(publisher, streams, _flag(request, "samples"), _flag(request, "actions"),
                       resume, request.query_params.get("instance", ""))
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)

    async def metrics(request: Request) -> Response:
        render = _metrics_renderer()
        if render is None:
            return Response("Prometheus exposition is not in this build "
                            "(telemetry.prometheus.render)\n", status_code=404,
                            media_type="text/plain; charset=utf-8")
        body, content_type = await asyncio.to_thread(render)  # gauges read figures: off the loop
        return Response(body, media_type=content_type)

    return Starlette(routes=[
        Route("/", index),
        Route("/static/{name}", asset),
        Route("/api/status", status),
        Route("/api/watch", watch),
        Route("/metrics", metrics),
    ])


class _Uvicorn(uvicorn.Server):
    """uvicorn on our loop: SIGTERM and SIGINT stay the server's (its drain), so
    uvicorn installs no handlers of its own."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket, bound now so a taken port fails the start at once."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the web dashboard: {err}") from err
    return sock


class WebDashboard:
    """The HTTP listener, running as a task until `stop`."""

    def __init__(self, sources: DashboardSources, host: str, port: int) -> None:
        self.sources = sources
        self.streams = Streams()
        self._sock = bind(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            build_app(sources, self.streams), http="h11", ws="none", lifespan="off",
            log_config=None, log_level="warning", access_log=False,
            timeout_graceful_shutdown=STOP_GRACE_S,
        )
        self._server = _Uvicorn(config)
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]),
                                         name="web-dashboard")
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
        while not self._server.started:
            if self._task.done():
                await self._task  # its error, if it failed
                raise RuntimeError("the web dashboard stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("the web dashboard did not start")
            await asyncio.sleep(0.01)
        log.info("web dashboard on %s", self.url)

    async def stop(self) -> None:
        """Ends every SSE stream, then the listener; bounded however clients behave."""
        self.streams.close_all(self.sources.publisher)
        if self._task is None:
            self._sock.close()
            return
        self._server.should_exit = True
        try:
            await asyncio.wait_for(self._task, STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning("web dashboard did not stop in %gs; cancelled", STOP_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a drain goes on whatever the listener did
            log.exception("web dashboard failed while stopping")
        self._task = None


async def start_web_dashboard(sources: DashboardSources, host: str, port: int
                              ) -> WebDashboard:
    dashboard = WebDashboard(sources, host, port)
    await dashboard.start()
    return dashboard
