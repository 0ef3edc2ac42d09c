"""Prometheus exposition: the `plimsoll_` catalogue and the vLLM gauges gateways route on.

One registry serves both listeners: `start_metrics_server` (`plimsoll serve
--metrics-port`) and whoever else mounts `/metrics` through `render()`.

- `metric_reader()` is OpenTelemetry's pull reader; `telemetry.setup` installs it
  with the one MeterProvider. It computes nothing until a scrape asks.
- The collector yields what the reader translated, then declares (HELP and TYPE,
  no sample) each catalogued instrument that has no sample yet, so a dashboard
  finds every name from the first scrape on.
- `vllm:*` gauges come from the same figures as `plimsoll_requests_*` and the
  memory gauges. OpenTelemetry instrument names cannot hold a colon, so they are
  built here, in the same registry (docs/metrics.md has the mapping).

Scrapes run on the listener's own threads, never on the event loop that streams
tokens. The text format 0.0.4 is served whatever the Accept header says:
prometheus_client's OpenMetrics encoder rewrites colons in sample names.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
from collections.abc import Callable, Iterable, Iterator
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from telemetry import names
from telemetry.instruments import Declared, Instruments, instruments

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the classic text format
METRICS_PATH = "/metrics"
_UNITS = {"By": "bytes", "s": "seconds"}  # as the OpenTelemetry exporter maps them

_lock = threading.Lock()
_otel = CollectorRegistry(auto_describe=False)  # the reader's output, wrapped below
_reader: PrometheusMetricReader | None = None


def metric_reader() -> PrometheusMetricReader:
    """The process's one Prometheus reader (for `telemetry.setup`)."""
    global _reader
    with _lock:
        if _reader is None:
            # Scope labels would repeat "plimsoll" on every series: one meter only.
            _reader = PrometheusMetricReader(scope_info_enabled=False, registry=_otel)
        return _reader


def _empty_family(d: Declared) -> Metric:
    unit = _UNITS.get(d.unit, "")
    if d.kind == "counter":
        return CounterMetricFamily(d.name, d.description, unit=unit)
    if d.kind == "histogram":
        return HistogramMetricFamily(d.name, d.description, unit=unit)
    return GaugeMetricFamily(d.name, d.description, unit=unit)


def _gauge(name: str, description: str, value: float | None) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, description)
    if value is not None:
        family.add_metric([], value)
    return family


def vllm_families(inst: Instruments) -> list[GaugeMetricFamily]:
    """The gauges the Gateway API inference extension's endpoint picker reads, for the
    whole server (one endpoint to the picker, whatever models it serves)."""
    usage, hard = inst.usage.read(), inst.hard_mark.read()
    kv = usage / hard if usage is not None and hard else None
    return [
        _gauge(names.VLLM_REQUESTS_RUNNING, "Requests decoding in a batch "
               f"(= {names.METRIC_REQUESTS_RUNNING})", inst.running.read()),
        _gauge(names.VLLM_REQUESTS_WAITING, "Requests waiting for admission or a slot "
               f"(= {names.METRIC_REQUESTS_WAITING})", inst.waiting.read()),
        _gauge(names.VLLM_KV_CACHE_USAGE, "Memory usage over the hard mark, a fraction "
               f"(= {names.METRIC_MEMORY_USAGE} / {names.METRIC_HARD_MARK})", kv),
    ]


class PlimsollCollector:
    """The OpenTelemetry reader's families, the catalogue's missing ones, the vLLM gauges."""

    def __init__(self, otel: CollectorRegistry,
                 inst: Callable[[], Instruments] = instruments) -> None:
        self._otel = otel
        self._inst = inst

    def collect(self) -> Iterator[Metric]:
        inst = self._inst()
        seen: set[str] = set()
        for family in self._otel.collect():
            seen.add(family.name)
            yield family
        for declared in inst.catalogue:
            family = _empty_family(declared)
            if family.name not in seen:
                yield family
        yield from vllm_families(inst)


REGISTRY = CollectorRegistry(auto_describe=False)
REGISTRY.register(PlimsollCollector(_otel))


def render() -> tuple[bytes, str]:
    """The exposition body and its content type. Runs every gauge's provider: call it
    off the event loop (a thread of the listener, or asyncio.to_thread)."""
    return generate_latest(REGISTRY), CONTENT_TYPE


def metric_names(body: bytes | str) -> set[str]:
    """Every metric name an exposition offers to a query: sample names, and for each
    declared family the names its samples take (`_total`; `_bucket`, `_sum`, `_count`)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = body.decode() if isinstance(body, bytes) else body
    out: set[str] = set()
    for family in text_string_to_metric_families(text):
        out.add(family.name)
        out.update(sample.name for sample in family.samples)
        if family.type == "counter":
            out.add(family.name + "_total")
        elif family.type == "histogram":
            out.update(family.name + suffix for suffix in ("_bucket", "_sum", "_count"))
    return out


# -- the listener -------------------------------------------------------------------------
def _app(environ: dict, start_response: Callable) -> Iterable[bytes]:
    if environ.get("PATH_INFO", "") != METRICS_PATH:
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [f"not found; metrics are at {METRICS_PATH}\n".encode()]
    body, content_type = render()
    start_response("200 OK", [("Content-Type", content_type),
                              ("Content-Length", str(len(body)))])
    return [body] if environ.get("REQUEST_METHOD") != "HEAD" else [b""]


class _Server(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper never holds up the exit
    allow_reuse_address = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        pass  # a scrape every 50 ms would flood the log


def _server_class(host: str, port: int) -> type[_Server]:
    """_Server for the host's address family (an IPv6 host needs AF_INET6)."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM,
                                flags=socket.AI_PASSIVE)[0][0]
    return type("_Server", (_Server,), {"address_family": family})


class MetricsServer:
    """`/metrics` on its own threads; `stop()` closes the socket and joins the thread."""

    def __init__(self, host: str, port: int) -> None:
        self._httpd = make_server(host, port, _app, server_class=_server_class(host, port),
                                  handler_class=_QuietHandler)
        self.host = host
        self.port = self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.1},
                                        name="plimsoll-metrics", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}{METRICS_PATH}"

    def stop(self) -> None:
        """Blocks until the serving thread is gone (up to a poll interval)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(host: str, port: int) -> MetricsServer:
    """Serves `/metrics` on host:port (0 picks a free port: see `.port`)."""
    try:
        server = MetricsServer(host, port)
    except OSError as err:
        raise OSError(f"cannot listen for metrics on {host}:{port}: {err}") from err
    log.info("metrics on %s", server.url)
    return server
