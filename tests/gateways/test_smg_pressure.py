"""SMG steers around a worker at hard pressure. Two Plimsoll workers behind
`smg launch --policy round_robin`; one runs in a real child memory cgroup whose limit
is then lowered until the worker's own usage sits between its hard mark and its
ceiling (level HARD, not emergency). Its MlxEngine HealthCheck answers not healthy,
SMG's probe takes it out of routing, and new requests all go to the other worker:
the share the pressured worker receives and the number lost are measured (0 and 0).
Raising the limit again brings it back once the readiness hold has passed.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from smg_grpc_proto import mlx_engine_pb2 as mlx
from smg_grpc_proto import mlx_engine_pb2_grpc

from memory.levels import PressureLevel
from plimsoll.v1 import control_pb2, control_pb2_grpc
from tests.gateways.smg import FAST_HEALTH, SMG, Gateway, scrape, start_gateway
from tools.harness.cgroup import CgroupUnavailable, ChildCgroup, limit_for_ceiling
from tools.harness.server import free_port, start_server, wait_all_serving

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg gateway is not installed")

MODEL = "demo-tiny"
MAX_TOKENS = 4
GIB = 1 << 30
ROOMY_LIMIT = 4 * GIB  # ceiling ~3.6 GiB: a worker's few hundred MiB is level ok
SOFT, HARD = 0.3, 0.5
PRESSED = 0.7  # usage / ceiling once squeezed: above HARD, well under the ceiling
HOLD_S = 2.0  # below hard this long before the worker says healthy again
TOKENS = "plimsoll_tokens_generated_total"
WORKER_ARGS = ("--memory-guard-gb", "8", "--soft-fraction", str(SOFT), "--hard-fraction",
               str(HARD), "--poll-active", "0.25", "--poll-idle", "0.25", "--poll-empty",
               "0.25", "--unready-hold-seconds", str(HOLD_S))


def _memory(worker) -> control_pb2.GetMemoryStatusResponse:
    with worker.channel() as ch:
        return control_pb2_grpc.ControlServiceStub(ch).GetMemoryStatus(
            control_pb2.GetMemoryStatusRequest(), timeout=10)


def _healthy(worker) -> mlx.HealthCheckResponse:
    with worker.channel() as ch:
        return mlx_engine_pb2_grpc.MlxEngineStub(ch).HealthCheck(
            mlx.HealthCheckRequest(), timeout=10)


def _wait(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def _status(gateway: Gateway, address: str) -> str:
    return {w["url"]: w["status"] for w in gateway.workers()}.get(f"grpc://{address}", "")


def _burst(gateway: Gateway, n: int) -> list[tuple[int, str]]:
    def one(i: int) -> tuple[int, str]:
        a = gateway.post("/v1/completions", {
            "model": MODEL, "prompt": f"request {i} of a burst", "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}, timeout=60)
        return a.status, a.body
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(n)))


@pytest.fixture()
def squeezed_pair(tmp_path, demo_path):
    try:
        cg = ChildCgroup.create(ROOMY_LIMIT)
    except CgroupUnavailable as exc:
        pytest.skip(f"needs a child memory cgroup: {exc.reason}")
    ports = [free_port(), free_port()]
    started = []
    gateway = None
    try:
        calm = start_server(tmp_path, *WORKER_ARGS, "--metrics-port", str(ports[0]),
                            wait=False)
        started.append(calm)
        pressed = start_server(tmp_path, *WORKER_ARGS, "--metrics-port", str(ports[1]),
                               prefix=cg.prefix(), wait=False)
        started.append(pressed)
        wait_all_serving(started)
        with pressed.channel() as ch:  # at hard an idle unpinned model would be unloaded
            control_pb2_grpc.ControlServiceStub(ch).Pin(
                control_pb2.PinRequest(model_id=MODEL, owner="pressure-test"), timeout=30)
        gateway = start_gateway(tmp_path, [calm.address, pressed.address], demo_path,
                                "--policy", "round_robin", *FAST_HEALTH)
        yield gateway, calm, pressed, cg, ports
    finally:
        if gateway is not None:
            gateway.stop()
        for w in started:
            w.stop(timeout=10)
        cg.destroy()


def test_smg_sends_no_new_work_to_a_worker_at_hard_pressure(squeezed_pair):
    gateway, calm, pressed, cg, (calm_port, pressed_port) = squeezed_pair
    before = _burst(gateway, 8)
    assert all(s == 200 for s, _ in before), before
    assert scrape(pressed_port, TOKENS) > 0, "round robin used both workers before"

    usage = _memory(pressed).readings.process_bytes
    total = _memory(pressed).readings.system_total_bytes
    cg.set_limit(limit_for_ceiling(int(usage / PRESSED), total))
    _wait("level hard on the squeezed worker",
          lambda: _memory(pressed).level >= PressureLevel.HARD)
    health = _healthy(pressed)
    assert not health.healthy and "pressure hard" in health.message, health.message
    _wait("SMG to take the squeezed worker out",
          lambda: _status(gateway, pressed.address) not in ("", "ready"))

    tokens_before = (scrape(calm_port, TOKENS), scrape(pressed_port, TOKENS))
    burst = _burst(gateway, 20)
    calm_got = (scrape(calm_port, TOKENS) - tokens_before[0]) / MAX_TOKENS
    pressed_got = (scrape(pressed_port, TOKENS) - tokens_before[1]) / MAX_TOKENS
    lost = [b for s, b in burst if s != 200]
    level = _memory(pressed).level
    print(f"squeezed worker: {pressed_got:g} of {len(burst)} requests "
          f"({pressed_got / len(burst):.0%}), calm worker {calm_got:g}, lost {len(lost)}; "
          f"level {PressureLevel(level).label}")
    assert level == PressureLevel.HARD  # not emergency: nothing was aborted
    assert pressed_got == 0 and calm_got == len(burst)
    assert lost == []

    cg.set_limit(ROOMY_LIMIT)
    _wait("the squeezed worker back in routing",
          lambda: _status(gateway, pressed.address) == "ready", timeout=HOLD_S + 20)
    assert _healthy(pressed).healthy
    again = scrape(pressed_port, TOKENS)
    after = _burst(gateway, 8)
    assert all(s == 200 for s, _ in after), after
    assert scrape(pressed_port, TOKENS) > again, "back in round robin once relieved"
