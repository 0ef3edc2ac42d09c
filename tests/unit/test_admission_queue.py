"""AdmissionQueue (bounded FIFO waiting), hyper mode, start-up validation, reservations."""

from __future__ import annotations

import asyncio

import pytest

from sessions.admission import (
    BINDING_HYPER_CAP,
    BINDING_PAUSED_AT_SOFT,
    BINDING_QUEUE_FULL,
    HYPER_ADMISSION_CAP,
    LEVEL_OK,
    LEVEL_SOFT,
    AdmissionQueue,
    QueueOutcome,
    ReservationBook,
    SchedulerMode,
    queue_from_settings,
    validate_scheduler_settings,
)
from sessions.testing import FakeClock

# -- queue ------------------------------------------------------------------------------


async def test_hyper_admits_one_and_hands_over_fifo():
    q = AdmissionQueue(mode=SchedulerMode.HYPER, queue_limit=4)
    first = await q.acquire(1.0)
    assert first.admitted and q.in_flight == 1
    order: list[str] = []

    async def waiter(name):
        r = await q.acquire(5.0)
        order.append(name)
        return r

    tasks = [asyncio.create_task(waiter(n)) for n in ("b", "c")]
    await asyncio.sleep(0.01)
    assert q.waiting == 2 and q.in_flight == 1
    first.slot.release()
    first.slot.release()  # idempotent
    await asyncio.sleep(0.01)
    assert order == ["b"] and q.in_flight == 1
    (await tasks[0]).slot.release()
    r = await tasks[1]
    assert order == ["b", "c"] and r.admitted and r.waited_s > 0
    r.slot.release()
    assert q.in_flight == 0


async def test_queue_full_is_immediate_and_typed():
    q = AdmissionQueue(mode=SchedulerMode.HYPER, queue_limit=1)
    a = await q.acquire()
    b = asyncio.create_task(q.acquire(5.0))
    await asyncio.sleep(0.01)
    c = await q.acquire(5.0)
    assert c.outcome is QueueOutcome.QUEUE_FULL and c.binding == BINDING_QUEUE_FULL
    assert c.retry_after_s == 1.0 and not c.admitted
    a.slot.release()
    assert (await b).admitted


async def test_waiting_times_out_with_a_typed_outcome():
    q = AdmissionQueue(mode=SchedulerMode.HYPER)
    a = await q.acquire()
    r = await q.acquire(0.05)
    assert r.outcome is QueueOutcome.TIMEOUT and r.binding == BINDING_HYPER_CAP
    assert r.waited_s >= 0.04 and q.waiting == 0 and q.in_flight == 1
    a.slot.release()
    assert q.in_flight == 0


async def test_paused_at_soft_first_request_passes_then_resume_on_ok():
    q = AdmissionQueue(level=LEVEL_SOFT)
    first = await q.acquire(1.0)
    assert first.admitted  # nothing admitted: the first always passes
    assert q.blocked_by() == BINDING_PAUSED_AT_SOFT
    second = asyncio.create_task(q.acquire(5.0))
    await asyncio.sleep(0.01)
    assert not second.done()
    q.set_level(LEVEL_OK)
    assert (await second).admitted and q.in_flight == 2


async def test_paused_waiter_admitted_when_in_flight_drains_to_zero():
    q = AdmissionQueue(level=LEVEL_SOFT)
    first = await q.acquire()
    second = asyncio.create_task(q.acquire(5.0))
    await asyncio.sleep(0.01)
    first.slot.release()
    assert (await second).admitted


async def test_cancelled_waiter_leaves_the_queue():
    q = AdmissionQueue(mode=SchedulerMode.HYPER)
    a = await q.acquire()
    t = asyncio.create_task(q.acquire(5.0))
    await asyncio.sleep(0.01)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert q.waiting == 0
    a.slot.release()
    assert q.in_flight == 0


async def test_admission_cap_in_default_mode():
    q = queue_from_settings(validate_scheduler_settings("default", 8, admission_cap=2))
    a, b = await q.acquire(), await q.acquire()
    assert a.admitted and b.admitted
    r = await q.acquire(0.02)
    assert r.outcome is QueueOutcome.TIMEOUT and r.binding == "admission_cap"


# -- scheduler settings ---------------------------------------------------------------------


def test_hyper_cap_is_exactly_one():
    s = validate_scheduler_settings(SchedulerMode.HYPER, 1)
    assert HYPER_ADMISSION_CAP == 1 and s.admission_cap == 1 and s.mode is SchedulerMode.HYPER


@pytest.mark.parametrize("kw,flag", [
    ({"max_num_seqs": 4}, "--max-num-seqs=4"),
    ({"max_num_seqs": 1, "admission_cap": 2}, "--admission-cap=2"),
    ({"max_num_seqs": 1, "prefill_batch_size": 8}, "--prefill-batch-size=8"),
    ({"max_num_seqs": 1, "completion_batch_size": 32}, "--completion-batch-size=32"),
])
def test_hyper_refuses_settings_that_allow_more_than_one(kw, flag):
    with pytest.raises(ValueError, match="hyper admits exactly one") as exc:
        validate_scheduler_settings("hyper", **kw)
    assert flag in str(exc.value)


def test_default_mode_settings_and_bad_values():
    s = validate_scheduler_settings("default", 16)
    assert s.admission_cap is None and s.max_num_seqs == 16
    with pytest.raises(ValueError, match="--scheduler-mode"):
        validate_scheduler_settings("turbo", 1)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        validate_scheduler_settings("default", 0)
    with pytest.raises(ValueError, match="--queue-limit"):
        validate_scheduler_settings("default", 1, queue_limit=-1)


# -- reservations --------------------------------------------------------------------------


def test_reservations_count_against_others_and_expire():
    clock = FakeClock(0.0)
    ids = iter(["t1", "t2", "t3"])
    book = ReservationBook(clock, id_factory=lambda: next(ids))
    r1 = book.reserve(1000, "m")  # default TTL 30 s
    r2 = book.reserve(300, "m2", ttl_s=10)
    assert (r1.ticket, r1.expires_at, r2.expires_at) == ("t1", 30.0, 10.0)
    assert book.reserved_bytes() == 1300
    assert book.reserved_bytes(excluding="t1") == 300
    assert book.reserved_bytes(model="m") == 1000
    clock.set(10.0)
    assert book.reserved_bytes() == 1000  # t2 expired: no longer counted
    assert [r.ticket for r in book.expire()] == ["t2"] and len(book) == 1
    assert book.redeem("t1") == r1 and book.redeem("t1") is None  # single use
    r3 = book.reserve(5, "m", ttl_s=1)
    clock.set(11.0)
    assert book.get("t3") is None and book.redeem(r3.ticket) is None  # expired at redeem
    with pytest.raises(ValueError):
        book.reserve(-1, "m")
