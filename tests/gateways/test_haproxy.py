"""HAProxy 2.6 (h2c gRPC) in front of two real Plimsoll workers, steered by each
worker's agent check (`--agent-port`).

One worker runs in a child memory cgroup of its own; lowering its limit puts the
worker's usage between its hard mark and its ceiling (level HARD, not emergency).

- Drain and return (round robin): at hard the worker's inference health turns
  NOT_SERVING and its agent answers `drain`; HAProxy shows it DRAIN and sends every
  new request to the other worker. Raising the limit again brings the level back to
  ok; health and the agent wait out the readiness hold (`--unready-hold-seconds`),
  then say SERVING / `up ready 100%`, and HAProxy sends it work again.
- Sessions (`balance hdr(x-session-id)`, consistent hashing): a session's turns land
  on one worker and restore its KV (cached_tokens > 0); while that worker is drained
  the next turn goes to the other one and pays a cold prefill (cached_tokens 0); once
  it is back, the session's turns hash to it again.

Skipped with the reason where `haproxy` is not installed or no child memory cgroup
can be made. Run with `pytest -s` to see HAProxy's view at each step.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2

from memory.levels import PressureLevel
from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from tools.harness.cgroup import CgroupUnavailable, ChildCgroup
from tools.harness.haproxy import (
    HAPROXY,
    WORKER_HEADER,
    Backend,
    Haproxy,
    Worker,
    haproxy_version,
    start_haproxy,
)
from tools.harness.server import ServerProcess, free_port, start_server, wait_all_serving
from tools.harness.steering import (
    ROOMY_LIMIT,
    Squeeze,
    agent_line,
    health,
    memory_status,
    pin_default,
    wait_for,
    worker_args,
)

pytestmark = [
    pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed "
                       "(Debian: apt-get install haproxy; .ci/run installs it)"),
    pytest.mark.timeout(180),
]

HOLD_S = 1.5
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SESSION_HEADER = "x-session-id"
AGENT_INTER = "250ms"  # each state change below waits for the agent's next check
LONG = 1500  # tokens (~5 s): a stream that outlives the agent's next checks (~1 s)


@dataclass
class Pair:
    haproxy: Haproxy
    workers: dict[str, ServerProcess]  # HAProxy server name -> worker
    agent_ports: dict[str, int]
    squeeze: Squeeze  # of w1


@pytest.fixture(scope="module")
def pair(tmp_path_factory, demo_path) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("haproxy")
    try:
        cg = ChildCgroup.create(ROOMY_LIMIT)
    except CgroupUnavailable as exc:
        pytest.skip(f"needs a child memory cgroup: {exc.reason}")
    workers: dict[str, ServerProcess] = {}
    agents = {"w1": free_port(), "w2": free_port()}
    hap = None
    try:
        workers["w1"] = start_server(tmp, *worker_args(HOLD_S, agents["w1"]),
                                     prefix=cg.prefix(), wait=False)
        workers["w2"] = start_server(tmp, *worker_args(HOLD_S, agents["w2"]), wait=False)
        wait_all_serving(list(workers.values()))
        for w in workers.values():
            pin_default(w)
        servers = [Worker(name, w.port, agents[name]) for name, w in workers.items()]
        hap = start_haproxy(tmp, [
            Backend("rr", servers, agent_inter=AGENT_INTER),
            Backend("session", servers, balance=f"hdr({SESSION_HEADER})",
                    agent_inter=AGENT_INTER),
        ])
        print(f"HAProxy {haproxy_version()}")
        for backend in ("rr", "session"):
            for name in workers:
                hap.wait_server(backend, name, lambda s: s.status == "UP" and s.weight == 100)
        yield Pair(hap, workers, agents, Squeeze(workers["w1"], cg))
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


def served_by(address: str, n: int, session: str = "") -> list[str]:
    """The worker that answered each of `n` Generates sent to `address`, in order."""
    out = []
    with grpc.insecure_channel(address) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        for i in range(n):
            call = stub.Generate(inference_pb2.GenerateRequest(
                text=f"hello {i}", max_tokens=2, ignore_eos=True), timeout=30,
                metadata=((SESSION_HEADER, session),) if session else None)
            for _ in call:
                pass
            out.append(dict(call.initial_metadata()).get(WORKER_HEADER, ""))
    return out


def view(pair: Pair, backend: str) -> str:
    return "; ".join(f"{s.name} {s.status} weight {s.weight} agent '{s.agent_description}'"
                     for (b, _), s in sorted(pair.haproxy.servers().items())
                     if b == f"be_{backend}")


def squeeze_to_hard(pair: Pair, backend: str) -> None:
    limit = pair.squeeze.press()
    wait_for("level hard on w1", lambda: pair.squeeze.level() >= PressureLevel.HARD)
    pair.haproxy.wait_server(backend, "w1", lambda s: s.status.startswith("DRAIN"))
    print(f"squeezed w1 to {limit >> 20} MiB: {view(pair, backend)}")


def release(pair: Pair, backend: str) -> None:
    pair.squeeze.release()
    pair.haproxy.wait_server(backend, "w1", lambda s: s.status == "UP" and s.weight == 100,
                             timeout=HOLD_S + 30)
    print(f"released w1: {view(pair, backend)}")


def test_agent_check_drains_a_squeezed_worker_and_takes_it_back(pair: Pair):
    address = pair.haproxy.address("rr")
    w1 = pair.workers["w1"]
    assert agent_line(pair.agent_ports["w1"]) == "up ready 100%"
    before = Counter(served_by(address, 6))
    assert before == {"w1": 3, "w2": 3}, before

    squeeze_to_hard(pair, "rr")
    assert health(w1) == NOT_SERVING and health(w1, "") == NOT_SERVING
    assert agent_line(pair.agent_ports["w1"]) == "drain"
    assert pair.haproxy.server("rr", "w2").status == "UP"
    during = Counter(served_by(address, 8))
    assert memory_status(w1).level == PressureLevel.HARD  # not emergency: nothing aborted
    assert during == {"w2": 8}, during

    # Back below hard: health and the agent wait out the hold, then serve again.
    pair.squeeze.release()
    calm_at = wait_for("w1 below hard",
                       lambda: pair.squeeze.level() < PressureLevel.HARD and time.monotonic())
    assert agent_line(pair.agent_ports["w1"]) == "drain"  # held
    serving_at = wait_for("w1 SERVING", lambda: health(w1) == SERVING and time.monotonic(),
                          timeout=HOLD_S + 10)
    print(f"below hard -> SERVING after {serving_at - calm_at:.2f}s (hold {HOLD_S}s)")
    # The level is seen up to a poll late, SERVING at once: the gap is at least the hold
    # less one poll of this loop and one enforcer tick.
    assert serving_at - calm_at >= HOLD_S - 0.35
    assert agent_line(pair.agent_ports["w1"]) == "up ready 100%"
    pair.haproxy.wait_server("rr", "w1", lambda s: s.status == "UP" and s.weight == 100)
    after = Counter(served_by(address, 6))
    assert after == {"w1": 3, "w2": 3}, after


# -- sessions ----------------------------------------------------------------------------


def turn(address: str, session: str, tokens: list[int]) -> tuple[str, int, list[int]]:
    """One session turn through HAProxy: (worker, cached_tokens, generated ids)."""
    with grpc.insecure_channel(address) as ch:
        call = inference_pb2_grpc.InferenceServiceStub(ch).Generate(
            inference_pb2.GenerateRequest(token_ids=inference_pb2.TokenIds(ids=tokens),
                                          max_tokens=4, ignore_eos=True, session_id=session),
            timeout=60, metadata=((SESSION_HEADER, session),))
        cached, out = -1, []
        for msg in call:
            kind = msg.WhichOneof("event")
            if kind == "start":
                cached = msg.start.cached_tokens
            elif kind == "chunk":
                out.extend(msg.chunk.token_ids)
        return dict(call.initial_metadata()).get(WORKER_HEADER, ""), cached, out


def test_session_turns_follow_the_header_hash_and_move_when_drained(pair: Pair):
    address = pair.haproxy.address("session")
    rng = random.Random(13)
    # Sessions until each worker has one: the hash decides, not us.
    homes: dict[str, tuple[str, list[int]]] = {}  # worker -> (session, conversation)
    for i in range(40):
        sid = f"chat-{i}"
        prompt = [rng.randrange(5, 1000) for _ in range(200)]
        worker, cached, out = turn(address, sid, prompt)
        assert cached == 0
        homes.setdefault(worker, (sid, prompt + out))
        if len(homes) == 2:
            break
    assert set(homes) == {"w1", "w2"}, homes

    def next_turn(worker: str) -> tuple[str, int]:
        sid, convo = homes[worker]
        convo += [rng.randrange(5, 1000) for _ in range(16)]
        got, cached, out = turn(address, sid, convo)
        convo += out
        return got, cached

    # Warm: every turn lands where the session's KV is and restores it.
    for worker in ("w1", "w2"):
        got, cached = next_turn(worker)
        assert got == worker and cached > 0, (worker, got, cached)

    squeeze_to_hard(pair, "session")
    moved, cached = next_turn("w1")
    print(f"w1's session while w1 is drained: served by {moved}, cached_tokens {cached}")
    assert moved == "w2" and cached == 0  # elsewhere, and a cold prefill
    stayed, cached = next_turn("w2")
    assert stayed == "w2" and cached > 0  # the other worker's sessions do not move

    release(pair, "session")
    back, cached = next_turn("w1")
    print(f"w1's session after w1 is back: served by {back}, cached_tokens {cached}")
    # Consistent hashing gives the key back to its server. Its bank may still hold
    # the session's older prefix (a shorter restore) unless hard pressure shed it.
    assert back == "w1"


def test_soft_pressure_halves_the_weight(pair: Pair):
    w1 = pair.workers["w1"]
    pair.squeeze.press(0.4)  # between the soft (0.3) and hard (0.5) marks
    wait_for("level soft on w1", lambda: pair.squeeze.level() == PressureLevel.SOFT)
    assert agent_line(pair.agent_ports["w1"]) == "up ready 50%"
    assert health(w1) == SERVING  # soft pauses admission but still takes work
    pair.haproxy.wait_server("rr", "w1", lambda s: s.status == "UP" and s.weight == 50)
    print(f"w1 at soft: {view(pair, 'rr')}")
    release(pair, "rr")


def test_sigterm_says_down_and_lets_the_stream_in_flight_finish(pair: Pair):
    """Decided: a draining worker answers `down #draining`, not `drain`: it is leaving,
    so not even persistent traffic should reach it; HAProxy does not cut the streams
    it already forwarded to a server marked down. Runs last: it stops w2."""
    w2 = pair.workers["w2"]
    address = pair.haproxy.address("rr")
    with grpc.insecure_channel(address) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        # Round robin: of two long streams, one is on w2.
        calls = [stub.Generate(inference_pb2.GenerateRequest(
            text=f"long {i}", max_tokens=LONG, ignore_eos=True), timeout=120) for i in range(2)]
        on = {dict(c.initial_metadata()).get(WORKER_HEADER): c for c in calls}
        assert set(on) == {"w1", "w2"}, on
        w2.proc.send_signal(15)
        assert wait_for("w2's agent to say down #draining",
                        lambda: agent_line(pair.agent_ports["w2"]) == "down #draining")
        t0 = time.monotonic()
        pair.haproxy.wait_server("rr", "w2", lambda s: s.status.startswith("DOWN"))
        print(f"w2 draining: {view(pair, 'rr')} after {time.monotonic() - t0:.2f}s")
        assert w2.proc.poll() is None  # down by its agent, not by its exit
        assert Counter(served_by(address, 4)) == {"w1": 4}
        tokens = {name: sum(len(m.chunk.token_ids) for m in c
                            if m.WhichOneof("event") == "chunk") for name, c in on.items()}
    assert tokens == {"w1": LONG, "w2": LONG}, tokens
    assert w2.proc.wait(30) == 0
