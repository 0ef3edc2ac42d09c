"""Readiness under pressure (service.readiness) and the agent check's listener
(service.agent_check), with a scripted clock and an in-process pressure broker."""

from __future__ import annotations

import asyncio

import pytest

from memory.levels import PressureLevel
from plimsoll.v1 import control_pb2
from service.agent_check import bound_port, start_agent_check
from service.pressure_broker import PressureBroker
from service.readiness import PressureGate, ReadinessWatch, decide, step_gate
from tests.support.clock import FakeClock

OK, SOFT, HARD, EMERGENCY = (PressureLevel.OK, PressureLevel.SOFT, PressureLevel.HARD,
                             PressureLevel.EMERGENCY)
HOLD = 5.0


def run(levels_at: list[tuple[float, PressureLevel]], *, draining: bool = False,
        models_ready: bool = True):
    gate = PressureGate()
    out = []
    for now, level in levels_at:
        d = decide(gate, level, now, HOLD, draining=draining, models_ready=models_ready)
        gate = d.gate
        out.append((d.serving, d.agent_line))
    return out


def test_ok_and_soft_serve_with_their_weights():
    assert run([(0, OK), (1, SOFT), (2, OK)]) == [
        (True, "up ready 100%"), (True, "up ready 50%"), (True, "up ready 100%")]


def test_hard_shuts_and_the_gate_opens_only_after_the_hold():
    seen = run([(0, OK), (1, HARD), (2, SOFT), (6.9, OK), (7.0, OK), (8, SOFT)])
    assert seen == [
        (True, "up ready 100%"),
        (False, "drain"),
        (False, "drain"),  # calm since 2.0
        (False, "drain"),  # 4.9 s of calm
        (True, "up ready 100%"),  # 5.0 s: open
        (True, "up ready 50%"),
    ]


def test_hard_again_during_the_hold_restarts_it():
    seen = run([(0, HARD), (1, SOFT), (5, HARD), (6, OK), (10.9, OK), (11, OK)])
    assert [s for s, _ in seen] == [False, False, False, False, False, True]


def test_emergency_is_down_and_needs_the_hold_too():
    seen = run([(0, EMERGENCY), (1, HARD), (2, OK), (7, OK)])
    assert seen == [(False, "down #emergency"), (False, "drain"), (False, "drain"),
                    (True, "up ready 100%")]


def test_drain_wins_over_everything():
    for level in PressureLevel:
        d = decide(PressureGate(), level, 0.0, HOLD, draining=True, models_ready=True)
        assert (d.serving, d.agent_line) == (False, "down #draining")


def test_loading_is_down_and_not_serving():
    assert run([(0, OK)], models_ready=False) == [(False, "down #loading")]


def test_recheck_at_is_the_end_of_the_hold():
    d = decide(PressureGate(), HARD, 0.0, HOLD, draining=False, models_ready=True)
    assert d.recheck_at is None  # still at hard: no end in sight
    d = decide(d.gate, SOFT, 3.0, HOLD, draining=False, models_ready=True)
    assert d.recheck_at == 8.0
    # Time alone opens the gate: the same level, seen at the recheck time.
    assert step_gate(d.gate, SOFT, 8.0, HOLD) == PressureGate()


def test_no_hold_opens_at_once():
    gate = step_gate(PressureGate(), HARD, 0.0, 0.0)
    assert step_gate(gate, SOFT, 0.0, 0.0) == PressureGate()


# -- the loop, fed by a real broker ----------------------------------------------------


class Publisher:
    """The part of PressurePublisher that ReadinessWatch reads, over a real broker."""

    def __init__(self) -> None:
        self.broker = PressureBroker()
        self.level = OK

    def subscribe(self, include_samples: bool, include_actions: bool, *,
                  internal: bool = False):
        return self.broker.subscribe(control_pb2.PressureSnapshot(level=int(self.level)),
                                     include_samples, include_actions, internal=internal)

    def transition(self, to: PressureLevel) -> None:
        self.broker.publish("transition", control_pb2.PressureTransition(
            from_level=int(self.level), to_level=int(to)))
        self.level = to


async def until(predicate, timeout: float = 5.0) -> bool:
    """Polls `predicate` while the loop runs: a loaded machine may be slow to get there."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.005)
    return True


async def test_watch_applies_each_transition_and_opens_after_the_hold():
    clock = FakeClock(100.0)
    pub = Publisher()
    applied: list[bool] = []
    draining = False

    async def apply(serving: bool) -> None:
        applied.append(serving)

    watch = ReadinessWatch(pub, models_ready=lambda: True, draining=lambda: draining,
                           apply=apply, hold_s=0.25, clock=clock)
    watch.start()
    assert await until(lambda: applied == [True] and pub.broker.subscriber_count == 1)
    assert watch.agent_line() == "up ready 100%"
    # A hard blip that is over before the loop looks still shuts the gate: every
    # transition is seen, not only the latest level.
    pub.transition(HARD)
    pub.transition(SOFT)
    assert await until(lambda: applied == [True, False] and watch.level == SOFT), applied
    assert watch.agent_line() == "drain"
    clock.advance(0.125)
    await asyncio.sleep(0.05)
    assert watch.agent_line() == "drain" and applied == [True, False]
    clock.advance(0.125)  # the hold is over: the loop's own timer re-decides
    assert await until(lambda: applied == [True, False, True]), applied
    assert watch.agent_line() == "up ready 50%"
    draining = True
    assert watch.agent_line() == "down #draining"
    assert await until(lambda: applied[-1] is False), applied
    pub.broker.close_all()
    await watch.stop()


async def test_watch_resubscribes_after_an_overflow():
    pub = Publisher()
    pub.broker.capacity = 1

    async def apply(serving: bool) -> None:
        pass

    watch = ReadinessWatch(pub, models_ready=lambda: True, draining=lambda: False,
                           apply=apply, hold_s=0.0)
    watch.start()
    assert await until(lambda: pub.broker.subscriber_count == 1)
    for _ in range(3):  # more transitions than the queue holds, before the loop reads
        pub.transition(SOFT)
    pub.transition(HARD)
    # The overflowed stream ends; the fresh subscription's snapshot says hard.
    assert await until(lambda: watch.level == HARD)
    assert watch.agent_line() == "drain"
    await watch.stop()


# -- the agent check listener -----------------------------------------------------------


@pytest.mark.parametrize("send", [b"", b"backend/w1\n"])
async def test_agent_check_answers_one_line_and_closes(send: bytes):
    answers = iter(["up ready 100%", "drain"])
    server = await start_agent_check("127.0.0.1", 0, lambda: next(answers))
    port = bound_port(server)
    try:
        for expected in (b"up ready 100%\n", b"drain\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if send:  # HAProxy's agent-send
                writer.write(send)
                await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 2)
            assert line == expected
            writer.close()
            await writer.wait_closed()
    finally:
        server.close()
        await server.wait_closed()
