"""WatchPressure fan-out: snapshot first, per-process sequences, coalesced samples,
overflow, and the replay a re-subscriber asks for."""

import asyncio

from plimsoll.v1 import control_pb2
from service.convert import ACTION_KINDS
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
    broker.publish("sample", sample(2))  # not asked for: a gap in this subscriber's numbers
    broker.publish("transition", transition(2, 3))
    msgs = await drain(sub)
    assert [m.WhichOneof("event") for m in msgs] == ["snapshot", "transition", "transition"]
    assert [m.sequence for m in msgs] == [0, 1, 3]  # the snapshot reflects event 0
    assert msgs[2].transition.to_level == 3


async def test_sequences_are_per_process_not_per_subscriber():
    broker = PressureBroker()
    early = broker.subscribe(snapshot(), include_samples=False, include_actions=False)
    broker.publish("transition", transition(1, 2))
    late = broker.subscribe(snapshot(2), include_samples=False, include_actions=False)
    broker.publish("transition", transition(2, 1))
    assert [m.sequence for m in await drain(early)] == [0, 1, 2]
    assert [m.sequence for m in await drain(late)] == [1, 2]  # snapshot at 1, then 2


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
    assert [m.sequence for m in msgs] == [0, 3, 4, 6]


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
    assert [m.sequence for m in got] == [0, 1, 2, 3]
    assert not fast.overflowed


async def test_a_waiting_subscriber_wakes_on_publish():
    broker = PressureBroker()
    sub = broker.subscribe(snapshot(), include_samples=False, include_actions=True)
    await sub.next()
    waiter = asyncio.ensure_future(sub.next())
    await asyncio.sleep(0)
    broker.publish("action", control_pb2.EnforcerAction(kind=ACTION_KINDS["evict_model"],
                                                        model_id="m"))
    msg = await asyncio.wait_for(waiter, 1)
    assert msg.action.model_id == "m" and msg.sequence == 1


async def test_a_re_subscriber_gets_what_it_missed_replayed_before_its_snapshot():
    broker = PressureBroker()
    first = broker.subscribe(snapshot(), include_samples=False, include_actions=True)
    broker.publish("transition", transition(1, 2))
    seen = (await drain(first))[-1].sequence
    broker.unsubscribe(first)
    broker.publish("action", control_pb2.EnforcerAction(kind=ACTION_KINDS["evict_model"]))
    broker.publish("sample", sample(2))  # samples are not retained
    broker.publish("transition", transition(2, 1))
    again = broker.subscribe(snapshot(1), include_samples=False, include_actions=True,
                             resume_after=seen)
    msgs = await drain(again)
    assert [(m.WhichOneof("event"), m.sequence, m.replayed) for m in msgs] == [
        ("action", 2, True), ("transition", 4, True), ("snapshot", 4, False)]
    assert not msgs[-1].snapshot.replay_incomplete
    # Without actions asked for, only the transition is replayed.
    quiet = broker.subscribe(snapshot(1), include_samples=False, include_actions=False,
                             resume_after=seen)
    assert [m.sequence for m in await drain(quiet)] == [4, 4]


async def test_a_resume_from_another_process_replays_nothing_and_says_so():
    """Every message names its process; sequence numbers of another instance (the server
    restarted) mean nothing here, so no replay, and the snapshot says events were missed."""
    old, broker = PressureBroker(), PressureBroker()
    assert old.instance != broker.instance
    for _ in range(3):
        broker.publish("transition", transition(1, 2))
    sub = broker.subscribe(snapshot(), include_samples=False, include_actions=False,
                           resume_after=1, resume_instance=old.instance)
    msgs = await drain(sub)
    assert [m.sequence for m in msgs] == [3] and msgs[0].snapshot.replay_incomplete
    assert {m.instance for m in msgs} == {broker.instance}
    same = broker.subscribe(snapshot(), include_samples=False, include_actions=False,
                            resume_after=1, resume_instance=broker.instance)
    msgs = await drain(same)
    assert [(m.sequence, m.replayed) for m in msgs] == [(2, True), (3, True), (3, False)]
    assert {m.instance for m in msgs} == {broker.instance}


async def test_a_replay_says_when_the_ring_forgot_events():
    broker = PressureBroker(retained=2)
    for _ in range(5):
        broker.publish("transition", transition(1, 2))
    sub = broker.subscribe(snapshot(), include_samples=False, include_actions=False,
                           resume_after=1)
    msgs = await drain(sub)
    assert [m.sequence for m in msgs] == [4, 5, 5]
    assert msgs[-1].snapshot.replay_incomplete
    fresh = broker.subscribe(snapshot(), include_samples=False, include_actions=False,
                             resume_after=3)
    assert not (await drain(fresh))[-1].snapshot.replay_incomplete


def test_every_recorded_event_kind_has_a_wire_kind():
    from memory.recording import TABLE

    kinds = {e.event for e in TABLE.values() if e.event is not None}
    assert kinds == set(ACTION_KINDS)
