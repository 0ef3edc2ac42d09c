"""WatchPressure fan-out: snapshot first, gapless sequences, coalesced samples, overflow."""

import asyncio

from plimsoll.v1 import control_pb2
from service.pressure_broker import PressureBroker


def snapshot(level: int = 1) -> control_pb2.PressureSnapshot:
    return control_pb2.PressureSnapshot(level=level)


def transition(a: int, b: int) -> control_pb2.PressureTransition:
    return control_pb2.PressureTransition(from_level=a, to_level=b)


def sample(level: int) -> control_pb2.PressureSample:
    return control_pb2.PressureSample(level=level)


async def drain(sub) -> list:
    out = []
    while sub.queue:
        out.append(await sub.next())
    return out


async def test_snapshot_first_then_transitions_in_order():
    broker = PressureBroker()
    sub = broker.subscribe(snapshot(), include_samples=False, include_actions=False)
    broker.publish("transition", transition(1, 2))
    broker.publish("sample", sample(2))  # not asked for
    broker.publish("transition", transition(2, 3))
    msgs = await drain(sub)
    assert [m.WhichOneof("event") for m in msgs] == ["snapshot", "transition", "transition"]
    assert [m.sequence for m in msgs] == [1, 2, 3]
    assert msgs[2].transition.to_level == 3


async def test_samples_coalesce_but_transitions_do_not():
    broker = PressureBroker()
    sub = broker.subscribe(snapshot(), include_samples=True, include_actions=False)
    for level in (1, 1, 2):
        broker.publish("sample", sample(level))
    broker.publish("transition", transition(1, 2))
    broker.publish("sample", sample(3))
    broker.publish("sample", sample(3))
    msgs = await drain(sub)
    kinds = [m.WhichOneof("event") for m in msgs]
    assert kinds == ["snapshot", "sample", "transition", "sample"]
    assert msgs[1].sample.level == 2  # the newest of the first three
    assert [m.sequence for m in msgs] == [1, 2, 3, 4]


async def test_overflow_ends_the_stream_instead_of_dropping():
    broker = PressureBroker(capacity=4)
    slow = broker.subscribe(snapshot(), include_samples=False, include_actions=False)
    fast = broker.subscribe(snapshot(), include_samples=False, include_actions=False)
    for i in range(10):
        broker.publish("transition", transition(1 + i % 2, 2 - i % 2))
        await drain(fast)
    assert slow.overflowed
    got = [await slow.next() for _ in range(len(slow.queue))]
    assert await slow.next() is None  # the servicer then ends it with RESOURCE_EXHAUSTED
    assert [m.sequence for m in got] == [1, 2, 3, 4]
    assert not fast.overflowed


async def test_a_waiting_subscriber_wakes_on_publish():
    broker = PressureBroker()
    sub = broker.subscribe(snapshot(), include_samples=False, include_actions=True)
    await sub.next()
    waiter = asyncio.ensure_future(sub.next())
    await asyncio.sleep(0)
    broker.publish("action", control_pb2.EnforcerAction(kind="evict_model", model="m"))
    msg = await asyncio.wait_for(waiter, 1)
    assert msg.action.model == "m" and msg.sequence == 2
