"""Pressure steers the traffic (issue 13 item 3), measured: three real Plimsoll
workers behind HAProxy 2.6 (h2c, round robin, each worker's agent check), steady
client load through the gateway, and one worker squeezed to hard pressure in a child
memory cgroup of its own, then released.

Phases, each PLIMSOLL_STEERING_SECONDS long (default 4; the figures in
docs/scale-out.md come from a longer run):

1. healthy: all three take work (the baseline throughput);
2. hard: the cgroup limit is lowered until w3's usage sits between its hard mark and
   its ceiling; its agent answers `drain`, HAProxy stops sending it new requests;
3. recovered: the limit is raised again; after the readiness hold w3 says
   `up ready 100%` and takes its share again.

Measured: the share of new requests w3 receives while it is at hard (from the first
poll that saw HARD, so including the gateway's reaction time, and from the moment
HAProxy showed it drained), the requests lost (a request is lost when it never
completes; typed UNAVAILABLE / RESOURCE_EXHAUSTED / ABORTED ends are retried, as a
client following RetryInfo does), and throughput while w3 is out relative to three
healthy workers. Run with `pytest -s` for the figures.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest

from memory.levels import PressureLevel
from tools.harness.cgroup import CgroupUnavailable, ChildCgroup
from tools.harness.haproxy import HAPROXY, Backend, Haproxy, Worker, haproxy_version, start_haproxy
from tools.harness.server import ServerProcess, free_port, start_server, wait_all_serving
from tools.harness.steering import (
    ROOMY_LIMIT,
    LoadRun,
    Squeeze,
    memory_status,
    pin_default,
    worker_args,
)

PHASE_S = float(os.environ.get("PLIMSOLL_STEERING_SECONDS", "4"))
CLIENTS = int(os.environ.get("PLIMSOLL_STEERING_CLIENTS", "6"))
HOLD_S = 1.5
NAMES = ("w1", "w2", "w3")
SQUEEZED = "w3"

pytestmark = [
    pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed "
                       "(Debian: apt-get install haproxy; .ci/run installs it)"),
    pytest.mark.timeout(240 + 6 * PHASE_S),
]


@dataclass
class Farm:
    haproxy: Haproxy
    workers: dict[str, ServerProcess]
    squeeze: Squeeze


@pytest.fixture()
def farm(tmp_path, demo_path) -> Iterator[Farm]:
    try:
        cg = ChildCgroup.create(ROOMY_LIMIT)
    except CgroupUnavailable as exc:
        pytest.skip(f"needs a child memory cgroup: {exc.reason}")
    workers: dict[str, ServerProcess] = {}
    agents = {name: free_port() for name in NAMES}
    hap = None
    try:
        for name in NAMES:
            workers[name] = start_server(
                tmp_path, *worker_args(HOLD_S, agents[name]),
                prefix=cg.prefix() if name == SQUEEZED else None, wait=False)
        wait_all_serving(list(workers.values()))
        for w in workers.values():
            pin_default(w)
        hap = start_haproxy(tmp_path, [Backend("rr", [
            Worker(name, w.port, agents[name]) for name, w in workers.items()],
            agent_inter="250ms")])
        for name in NAMES:
            hap.wait_server("rr", name, lambda s: s.status == "UP" and s.weight == 100)
        yield Farm(hap, workers, Squeeze(workers[SQUEEZED], cg))
    except BaseException:
        if hap is not None:
            print(f"haproxy log tail:\n{hap.log()[-3000:]}")
        raise
    finally:
        if hap is not None:
            hap.stop()
        for w in workers.values():
            w.stop(timeout=10)
        cg.destroy()


@dataclass
class LevelPoller:
    """w3's level every 50 ms, with the time it was seen."""

    worker: ServerProcess
    points: list[tuple[float, int]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self) -> LevelPoller:
        threading.Thread(target=self._run, daemon=True, name="level-poller").start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(grpc.RpcError):
                self.points.append((time.monotonic(), memory_status(self.worker).level))
            self._stop.wait(0.05)

    def first(self, predicate, after: float) -> float | None:
        return next((t for t, lv in list(self.points) if t >= after and predicate(lv)), None)

    def levels_between(self, t0: float, t1: float) -> set[int]:
        return {lv for t, lv in list(self.points) if t0 <= t < t1}

    def stop(self) -> None:
        self._stop.set()


def share(attempts, worker: str) -> tuple[int, int]:
    """(attempts `worker` answered, attempts some worker answered)."""
    seen = [a.worker for a in attempts if a.worker]
    return sum(1 for w in seen if w == worker), len(seen)


def test_hard_pressure_steers_new_work_to_the_other_workers(farm: Farm):
    hap = farm.haproxy
    poller = LevelPoller(farm.workers[SQUEEZED]).start()
    load = LoadRun(hap.address("rr"), clients=CLIENTS).start()
    try:
        time.sleep(1.0)  # warm: every client has a connection and a first answer
        t_healthy = time.monotonic()
        time.sleep(PHASE_S)

        t_press = time.monotonic()
        limit = farm.squeeze.press()
        hap.wait_server("rr", SQUEEZED, lambda s: s.status.startswith("DRAIN"), timeout=30)
        t_drained = time.monotonic()
        time.sleep(PHASE_S)

        t_release = time.monotonic()
        farm.squeeze.release()
        hap.wait_server("rr", SQUEEZED, lambda s: s.status == "UP" and s.weight == 100,
                        timeout=HOLD_S + 30)
        t_back = time.monotonic()
        time.sleep(PHASE_S)
        t_end = time.monotonic()
    finally:
        load.stop()
        poller.stop()

    t_hard = poller.first(lambda lv: lv >= PressureLevel.HARD, t_press)
    t_calm = poller.first(lambda lv: lv < PressureLevel.HARD, t_release)
    assert t_hard is not None and t_hard <= t_drained + 0.1, "w3 never reached hard"
    hard_levels = poller.levels_between(t_hard, t_release)
    healthy_rate = len(load.completed_between(t_healthy, t_press)) / (t_press - t_healthy)
    out_rate = len(load.completed_between(t_drained, t_release)) / (t_release - t_drained)
    back_rate = len(load.completed_between(t_back, t_end)) / (t_end - t_back)
    got_hard, n_hard = share(load.started_between(t_hard, t_release), SQUEEZED)
    got_drained, n_drained = share(load.started_between(t_drained, t_release), SQUEEZED)
    got_healthy, n_healthy = share(load.started_between(t_healthy, t_press), SQUEEZED)
    got_back, n_back = share(load.started_between(t_back, t_end), SQUEEZED)
    failed = Counter(a.code.name for a in load.attempts if a.code != grpc.StatusCode.OK)
    print(
        f"\nHAProxy {haproxy_version()}, 3 workers, {CLIENTS} clients, phases of {PHASE_S:g}s;"
        f" w3's cgroup limit {limit >> 20} MiB while squeezed\n"
        f"w3 share healthy {got_healthy}/{n_healthy} ({got_healthy / max(1, n_healthy):.1%}),"
        f" while hard {got_hard}/{n_hard} ({got_hard / max(1, n_hard):.1%}),"
        f" once drained {got_drained}/{n_drained}, recovered {got_back}/{n_back}"
        f" ({got_back / max(1, n_back):.1%})\n"
        f"hard -> drained in HAProxy {t_drained - t_hard:.2f}s; below hard -> back"
        f" {t_back - (t_calm or t_release):.2f}s (hold {HOLD_S:g}s); levels while hard"
        f" {sorted(PressureLevel(lv).label for lv in hard_levels)}\n"
        f"requests {len(load.completed) + len(load.lost)}, completed {len(load.completed)},"
        f" lost {len(load.lost)}; failed attempts (retried) {dict(failed)}\n"
        f"throughput: healthy {healthy_rate:.1f}/s, w3 out {out_rate:.1f}/s"
        f" ({out_rate / healthy_rate:.2f}x), recovered {back_rate:.1f}/s"
        f" ({back_rate / healthy_rate:.2f}x)"
    )
    assert load.lost == [], f"lost requests: {load.lost}"
    assert PressureLevel.EMERGENCY not in hard_levels  # hard, not emergency: no aborts
    assert got_drained == 0 and n_drained > 0
    assert got_healthy > 0 and got_back > 0  # w3 took work before and after
    assert t_back - (t_calm or t_release) >= HOLD_S - 0.35  # the hold is kept
