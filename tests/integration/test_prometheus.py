"""`plimsoll serve --metrics-port`: a real server's /metrics, its names and its values
under load; the listener stops with the drain."""

from __future__ import annotations

import asyncio
import http.client
import math
import socket
import threading
import time

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import blas
from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from service.metrics import register_blas_info
from service.server import PlimsollServer, ServerConfig
from telemetry import names
from telemetry.instruments import instruments
from telemetry.prometheus import metric_names
from tests.unit.test_grafana_dashboard import exprs, load, parse
from tools.harness.server import free_port, serving

STREAMS = 8
MAX_TOKENS = 400

GAUGES = (
    names.METRIC_MEMORY_USAGE, names.METRIC_MEMORY_CEILING, names.METRIC_SOFT_MARK,
    names.METRIC_HARD_MARK, names.METRIC_PRESSURE_LEVEL, names.METRIC_POOL_BYTES,
    names.METRIC_BANK_BYTES, names.METRIC_BANK_ENTRIES, names.METRIC_RESERVED_BYTES,
    names.METRIC_REQUESTS_RUNNING, names.METRIC_REQUESTS_WAITING,
    names.VLLM_REQUESTS_RUNNING, names.VLLM_REQUESTS_WAITING, names.VLLM_KV_CACHE_USAGE,
)
# Declared from the first scrape, whether or not anything has happened yet.
COUNTERS = (names.METRIC_EVICTIONS, names.METRIC_ABORTS, names.METRIC_SHRINKS,
            names.METRIC_ADMISSIONS, names.METRIC_TOKENS_GENERATED, names.METRIC_REFUSALS)


@pytest.fixture(scope="module")
def metrics_srv(tmp_path_factory, demo_path):
    port = free_port()
    with serving(tmp_path_factory.mktemp("prom"), "--memory-guard-gb", "8",
                 "--poll-active", "0.2", "--metrics-port", str(port)) as s:
        yield s, port


def get(port: int, path: str = "/metrics") -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type", ""), resp.read().decode()
    finally:
        conn.close()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(got: dict, name: str, **labels: str) -> float:
    """The sum of `name`'s samples whose labels include `labels` (0 when none)."""
    return sum(v for ls, v in got.get(name, []) if labels.items() <= ls.items())


def test_names_types_and_figures(metrics_srv):
    _, port = metrics_srv
    status, content_type, text = get(port)
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    got = samples(text)
    for name in GAUGES:
        assert len(got.get(name, [])) == 1, name
    types = {f.name: f.type for f in text_string_to_metric_families(text)}
    for name in COUNTERS:
        assert types[name.removesuffix("_total")] == "counter", name
    assert types[names.METRIC_TTFT] == "histogram"

    usage, hard = value(got, names.METRIC_MEMORY_USAGE), value(got, names.METRIC_HARD_MARK)
    soft, ceiling = value(got, names.METRIC_SOFT_MARK), value(got, names.METRIC_MEMORY_CEILING)
    assert usage > 0 and 0 < soft < hard < ceiling
    assert hard == pytest.approx(0.95 * ceiling, rel=1e-6)
    assert value(got, names.METRIC_PRESSURE_LEVEL) == 1
    # usage / hard mark, as the same scrape read them (a tick may land between the reads)
    assert value(got, names.VLLM_KV_CACHE_USAGE) == pytest.approx(usage / hard, rel=0.05)
    assert value(got, names.METRIC_MODEL_BYTES, model_id="demo-tiny") > 0


def test_only_metrics_path(metrics_srv):
    _, port = metrics_srv
    assert get(port, "/")[0] == 404


def test_dashboard_queries_exist_on_a_real_server(metrics_srv):
    _, port = metrics_srv
    exported = metric_names(get(port)[2])
    queried = {m for e in exprs(load()) for m in parse(e)[0]}
    assert queried - exported == set()


def test_values_move_under_load(metrics_srv):
    srv, port = metrics_srv
    before = samples(get(port)[2])
    done = threading.Event()
    errors: list[BaseException] = []

    def stream(i: int, stub: inference_pb2_grpc.InferenceServiceStub) -> None:
        try:
            req = inference_pb2.GenerateRequest(
                text=f"metrics stream {i}", max_tokens=MAX_TOKENS, ignore_eos=True)
            for _ in stub.Generate(req, timeout=60):
                pass
        except BaseException as err:  # noqa: BLE001 - reported by the test below
            errors.append(err)

    with grpc.insecure_channel(srv.address) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        threads = [threading.Thread(target=stream, args=(i, stub)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        watcher = threading.Thread(target=lambda: ([t.join() for t in threads], done.set()))
        watcher.start()
        seen_running = 0.0
        while not done.is_set():  # a picker's poll: every 50 ms
            got = samples(get(port)[2])
            running = value(got, names.METRIC_REQUESTS_RUNNING)
            assert running == value(got, names.VLLM_REQUESTS_RUNNING)
            seen_running = max(seen_running, running)
            time.sleep(0.05)
        watcher.join()
    assert not errors, errors
    assert seen_running > 0

    after = samples(get(port)[2])
    tokens = names.METRIC_TOKENS_GENERATED
    assert value(after, tokens) - value(before, tokens) == STREAMS * MAX_TOKENS
    admitted = names.METRIC_ADMISSIONS
    assert (value(after, admitted, plimsoll_verdict="admit")
            - value(before, admitted, plimsoll_verdict="admit")) == STREAMS
    ttft_count = names.METRIC_TTFT + "_count"
    assert value(after, ttft_count) - value(before, ttft_count) == STREAMS
    assert math.isfinite(value(after, names.METRIC_TTFT + "_sum"))


async def test_listener_stops_with_the_drain():
    server = PlimsollServer(ServerConfig(port=0, metrics_port=0))
    await server.start()
    try:
        port = server.metrics_server.port
        status, _, text = await asyncio.to_thread(get, port)
        assert status == 200 and names.VLLM_KV_CACHE_USAGE in text
    finally:
        await server.drain()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), 1).close()


def test_the_blas_info_series_stays_one_however_many_services_register_it():
    """Services built again in one process (the tests build many) each register the
    BLAS's info series: it stays one series valued 1, labelled as the process's BLAS."""
    register_blas_info()
    register_blas_info()
    ((key, value),) = instruments().blas_info.read().items()
    assert value == 1 and key[0] == blas.state().name
