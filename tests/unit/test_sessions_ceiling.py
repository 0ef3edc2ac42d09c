"""The bank's dynamic ceiling (mtplx.md section 4) and its plan, plan_hold_to_ceiling."""

from __future__ import annotations

import asyncio

from memory.actions import REASON_DYNAMIC_CEILING, ShrinkMode, ShrinkSessionCache
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.plans.bank_ceiling import (
    BASE_RESERVE_BYTES,
    DYNAMIC_CEILING_SLACK_BYTES,
    MAX_BANK_IDLE_BYTES,
    MAX_RESERVE_BYTES,
    MIN_BANK_CEILING_BYTES,
    bank_dynamic_ceiling,
    bank_idle_max_bytes,
    dynamic_reserve_bytes,
    plan_hold_to_ceiling,
    working_set_bytes,
)
from memory.plans.steps import Snapshot
from memory.plans.tick import PolicyState, tick_plan
from memory.readings import MemoryReadings
from memory.views import EngineView
from sessions.bank import SessionBank
from tests.support.clock import FakeClock
from tests.support.plans import NoEngines, drive
from tests.support.sessions import SpanRecorder, make_entry

GiB = 1 << 30
MiB = 1 << 20


def test_constants():
    got = {"min": MIN_BANK_CEILING_BYTES, "idle_max": MAX_BANK_IDLE_BYTES,
           "reserve": BASE_RESERVE_BYTES, "max_reserve": MAX_RESERVE_BYTES,
           "slack": DYNAMIC_CEILING_SLACK_BYTES}
    assert got == {"min": 1 * GiB, "idle_max": 48 * GiB, "reserve": 3 * GiB,
                   "max_reserve": 16 * GiB, "slack": 256 * MiB}


def test_bank_idle_max_clamped_1_to_48_gib():
    assert bank_idle_max_bytes(64 * GiB, 20 * GiB) == 41 * GiB
    assert bank_idle_max_bytes(16 * GiB, 14 * GiB) == 1 * GiB
    assert bank_idle_max_bytes(192 * GiB, 10 * GiB) == 48 * GiB


def test_reserve_is_max_of_3gib_and_spike_capped_at_min_16gib_and_half_free():
    assert dynamic_reserve_bytes(64 * GiB, 20 * GiB) == 3 * GiB
    assert dynamic_reserve_bytes(64 * GiB, 20 * GiB, spike_bytes=10 * GiB) == 10 * GiB
    assert dynamic_reserve_bytes(64 * GiB, 20 * GiB, spike_bytes=40 * GiB) == 16 * GiB
    assert dynamic_reserve_bytes(16 * GiB, 14 * GiB, spike_bytes=5 * GiB) == 1 * GiB


def test_working_set_is_active_minus_weights_minus_bank():
    assert working_set_bytes(30 * GiB, 20 * GiB, 6 * GiB) == 4 * GiB
    assert working_set_bytes(10 * GiB, 20 * GiB, 0) == 0


def test_dynamic_ceiling_examples():
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 4 * GiB) == 37 * GiB
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 4 * GiB, spike_bytes=10 * GiB) == 30 * GiB
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 40 * GiB) == 1 * GiB  # floor 1 GiB
    assert bank_dynamic_ceiling(192 * GiB, 10 * GiB, 0) == 48 * GiB  # capped at idle max
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 0, bank_idle_max=8 * GiB) == 8 * GiB
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 0, reserve_bytes=0) == 41 * GiB


def hold(target: int) -> ShrinkSessionCache:
    return ShrinkSessionCache(target_bytes=target, protect_active=True,
                              reason=REASON_DYNAMIC_CEILING, mode=ShrinkMode.TO_BYTES)


def test_plan_hold_to_ceiling_shrinks_to_the_ceiling_protecting_active():
    assert plan_hold_to_ceiling(1200, 0, slack_bytes=0) == hold(0)
    assert plan_hold_to_ceiling(1200, 1199, slack_bytes=0) == hold(1199)
    assert plan_hold_to_ceiling(1200, 1200, slack_bytes=0) is None


def test_plan_hold_to_ceiling_slack_256mib():
    assert plan_hold_to_ceiling(1200, 1000, slack_bytes=200) is None  # 1200 <= 1000 + 200
    assert plan_hold_to_ceiling(1200, 999, slack_bytes=200) == hold(999)
    assert plan_hold_to_ceiling(800, 0) is None  # well within the default slack
    assert plan_hold_to_ceiling(GiB + 256 * MiB, GiB) is None
    assert plan_hold_to_ceiling(GiB + 256 * MiB + 1, GiB) == hold(GiB)



def test_hold_performed_on_a_real_bank_keeps_active_entries_above_target():
    rec = SpanRecorder()
    bank = SessionBank(clock=FakeClock(), active_sessions=lambda: {"live"}, tracer=rec.tracer)
    bank.put(make_entry([1], 400, "live"))
    bank.put(make_entry([2], 400, "live"))
    bank.put(make_entry([3], 400, "idle"))
    action = plan_hold_to_ceiling(bank.total_bytes(), 0, slack_bytes=0)
    out = asyncio.run(Executor(reader=None, pool=NoEngines(), bank=bank).perform(action))
    assert (out.entries, out.bytes_freed) == (1, 400) and out.done
    assert bank.total_bytes() == 800 and sorted(e.tokens for e in bank.entries()) == [(1,), (2,)]
    assert bank.stats().evictions == {REASON_DYNAMIC_CEILING: 1}
    assert rec.spans() == []  # the governor records the shrink, not the bank


def tick_snap(*, bank_max: int, session: int, usage: int, weights: int = 20 * GiB) -> Snapshot:
    """64 GiB balanced: the ceiling is the static 58 GiB; one ready engine holds `weights`."""
    return Snapshot(
        readings=MemoryReadings(process_bytes=usage, system_total_bytes=64 * GiB),
        engines=(EngineView("m", measured_bytes=weights),),
        session_bytes=session, bank_max_bytes=bank_max,
    )


def holds(driven):
    return [a for a in driven.actions if isinstance(a, ShrinkSessionCache)]


def test_tick_budget_is_the_min_of_the_static_cap_and_the_dynamic_ceiling():
    # usage 30, weights 20, bank 6: working set 4, dynamic 58 - 20 - 3 - 4 = 31 > cap 10.
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0),
              [tick_snap(bank_max=10 * GiB, session=6 * GiB, usage=30 * GiB)])
    assert d.result.state.bank_ceiling_bytes == 10 * GiB and holds(d) == []
    # usage 50: working set 24, dynamic 58 - 20 - 3 - 24 = 11 < cap 64.
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0),
              [tick_snap(bank_max=64 * GiB, session=6 * GiB, usage=50 * GiB)])
    assert d.result.state.bank_ceiling_bytes == 11 * GiB and holds(d) == []


def test_tick_holds_a_bank_over_its_budget_by_more_than_the_slack():
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0),
              [tick_snap(bank_max=10 * GiB, session=11 * GiB, usage=30 * GiB)])
    assert holds(d) == [hold(10 * GiB)]
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0),
              [tick_snap(bank_max=10 * GiB, session=10 * GiB + 256 * MiB, usage=30 * GiB)])
    assert holds(d) == []
