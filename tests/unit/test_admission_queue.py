"""AdmissionQueue (bounded FIFO waiting for the shared gate), hyper mode, start-up validation.

Reservations moved with the TTL map to tests/unit/test_sessions_ttl.py.
"""

from __future__ import annotations

import asyncio

import pytest

from memory.levels import PressureLevel
from memory.plans.admission import (
    BINDING_ADMISSION_CAP,
    BINDING_HYPER_CAP,
    BINDING_PAUSED_AT_HARD,
    BINDING_PAUSED_AT_SOFT,
    BINDING_QUEUE_FULL,
    DEFAULT_QUEUE_LIMIT,
    HYPER_ADMISSION_CAP,
    RETRY_AFTER_WAIT_S,
    AdmissionSettings,
    SchedulerMode,
    validate_scheduler_settings,
)
from memory.views import QueueView
from sessions.admission import AdmissionQueue, QueueOutcome, queue_from_settings

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
    assert c.retry_after_s == RETRY_AFTER_WAIT_S == 1.0 and not c.admitted
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


async def test_paused_at_soft_nothing_passes_until_resume_on_ok():
    # Seed 000: at soft new admissions pause, even with nothing admitted.
    q = AdmissionQueue(level=PressureLevel.SOFT)
    assert q.blocked_by() == BINDING_PAUSED_AT_SOFT
    first = asyncio.create_task(q.acquire(5.0))
    second = asyncio.create_task(q.acquire(5.0))
    await asyncio.sleep(0.01)
    assert not first.done() and not second.done() and q.waiting == 2
    q.set_paused(None)  # the governor resumes admission: FIFO order
    assert (await first).admitted and (await second).admitted and q.in_flight == 2


async def test_a_paused_waiter_is_admitted_on_resume_not_on_release():
    q = AdmissionQueue()
    first = await q.acquire()
    q.set_paused(PressureLevel.SOFT)
    second = asyncio.create_task(q.acquire(5.0))
    await asyncio.sleep(0.01)
    first.slot.release()
    await asyncio.sleep(0.01)
    assert not second.done()
    q.set_paused(None)
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
    assert r.outcome is QueueOutcome.TIMEOUT and r.binding == BINDING_ADMISSION_CAP


async def test_set_paused_pauses_at_a_level_and_view_reports_the_gate():
    q = AdmissionQueue(queue_limit=3)
    assert q.view() == QueueView(in_flight=0, waiting=0, limit=3)
    first = await q.acquire()
    q.set_paused(PressureLevel.HARD)
    assert q.level is PressureLevel.HARD and q.blocked_by() == BINDING_PAUSED_AT_HARD
    second = asyncio.create_task(q.acquire(5.0))
    await asyncio.sleep(0.01)
    assert q.view() == QueueView(in_flight=1, waiting=1, limit=3)
    q.set_paused(None)
    assert q.level is PressureLevel.OK and q.blocked_by() is None
    assert (await second).admitted and q.view() == QueueView(in_flight=2, waiting=0, limit=3)
    first.slot.release()


async def test_pause_while_a_waiter_times_out_reports_the_pause():
    q = AdmissionQueue(level=PressureLevel.SOFT)
    r = await q.acquire(0.02)
    assert r.outcome is QueueOutcome.TIMEOUT and r.binding == BINDING_PAUSED_AT_SOFT
    assert r.retry_after_s == RETRY_AFTER_WAIT_S


# -- scheduler settings ---------------------------------------------------------------------


def test_hyper_cap_is_exactly_one():
    s = validate_scheduler_settings(SchedulerMode.HYPER, 1)
    assert HYPER_ADMISSION_CAP == 1 and s.admission_cap == 1
    assert s.scheduler_mode is SchedulerMode.HYPER
    q = queue_from_settings(s)
    assert (q.mode, q.admission_cap, q.queue_limit) == (SchedulerMode.HYPER, 1, DEFAULT_QUEUE_LIMIT)


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
    assert s == AdmissionSettings(scheduler_mode=SchedulerMode.DEFAULT, admission_cap=None,
                                  queue_limit=DEFAULT_QUEUE_LIMIT)
    assert validate_scheduler_settings("default", 16, queue_limit=0).queue_limit == 0
    with pytest.raises(ValueError, match="--scheduler-mode"):
        validate_scheduler_settings("turbo", 1)
    with pytest.raises(ValueError, match="--max-num-seqs"):
        validate_scheduler_settings("default", 0)
    with pytest.raises(ValueError, match="--queue-limit"):
        validate_scheduler_settings("default", 1, queue_limit=-1)


async def test_close_sends_every_waiter_away_and_admits_nothing_more():
    q = AdmissionQueue(level=PressureLevel.SOFT)
    waiting = [asyncio.create_task(q.acquire(5.0)) for _ in range(2)]
    await asyncio.sleep(0.01)
    q.close()
    assert [(await w).outcome for w in waiting] == [QueueOutcome.CLOSED] * 2
    assert q.waiting == 0
    assert (await q.acquire(5.0)).outcome is QueueOutcome.CLOSED
