"""The OS pressure guard's hysteresis (120 s re-arm, 30 s flap, 60 s busy defer) and its plan.

`guard_step` is pure (state in, state and actions out); `PressureGuard`
(tests.support.os_guard) keeps the state for tests that feed it readings one by one. The tick's upkeep turns each guard action
into a `ShrinkSessionCache` (and a pool reclaim when it evicted or the report is
critical), which the executor performs on the bank.
"""

from __future__ import annotations

import asyncio
import dataclasses

from memory.actions import (
    REASON_OS_CRITICAL,
    REASON_OS_RECLAIM,
    REASON_OS_WARNING,
    Outcome,
    PressureReclaim,
    ShrinkMode,
    ShrinkSessionCache,
)
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.levels import GIB
from memory.plans.os_guard import (
    FLAP_S,
    REARM_S,
    WARNING_MAX_DEFER_S,
    GuardState,
    GuardTiming,
    OsPressure,
    PressureAction,
    guard_step,
    parse_os_pressure,
)
from memory.plans.steps import Snapshot
from memory.plans.tick import PolicyState, tick_plan
from memory.readings import MemoryReadings
from memory.views import EngineView
from sessions.bank import SessionBank
from tests.support.clock import FakeClock
from tests.support.os_guard import PressureGuard
from tests.support.plans import NoEngines, default_outcome, drive
from tests.support.sessions import make_entry

BUDGET = 1000


def run(guard, script, busy=False):
    """script: [(t, level)] -> {t: [(reason, target, trigger)]} for ticks that acted."""
    out = {}
    for t, level in script:
        acts = guard.observe(level, t, budget_bytes=BUDGET, busy=busy)
        if acts:
            out[t] = [(a.reason, a.target_bytes, a.trigger) for a in acts]
    return out


def test_constants():
    assert (REARM_S, FLAP_S, WARNING_MAX_DEFER_S) == (120.0, 30.0, 60.0)


def test_rising_edge_into_warning_shrinks_to_half_budget_protecting_active():
    g = PressureGuard()
    (a,) = g.observe("warning", 0.0, budget_bytes=BUDGET)
    assert (a.level, a.target_bytes, a.protect_active, a.reason, a.trigger) == (
        OsPressure.WARNING, 500, True, "memory_pressure_warning", "edge")
    assert a.reason == REASON_OS_WARNING


def test_guard_step_is_pure_state_in_state_out():
    start = GuardState()
    state, (a,) = guard_step(start, "critical", 5.0, budget_bytes=BUDGET)
    assert start == GuardState()  # the input is untouched (frozen)
    assert state == GuardState(level=OsPressure.CRITICAL, last_action_at=5.0, pending_since=None)
    assert a == PressureAction(OsPressure.CRITICAL, 0, REASON_OS_CRITICAL, "edge")
    # Same input, same output: no hidden state.
    assert guard_step(start, "critical", 5.0, budget_bytes=BUDGET) == (state, [a])
    again, acts = guard_step(state, "critical", 6.0, budget_bytes=BUDGET)
    assert acts == [] and again == state


def test_guard_step_busy_warning_remembers_the_pending_edge():
    state, acts = guard_step(GuardState(), "warning", 0.0, budget_bytes=BUDGET, busy=True)
    assert acts == [] and state.pending_since == 0.0 and state.pending_trigger == "edge"
    state, (a,) = guard_step(state, "warning", 60.0, budget_bytes=BUDGET, busy=True)
    assert (a.trigger, a.target_bytes, state.last_action_at) == ("deferred", 500, 60.0)
    state, acts = guard_step(state, "normal", 61.0, budget_bytes=BUDGET)
    assert acts == [] and state == GuardState(OsPressure.NORMAL, 60.0, None, "edge")


def test_guard_timing_is_configurable():
    timing = GuardTiming(rearm_s=10.0, flap_s=1.0, warning_max_defer_s=2.0)
    g = PressureGuard(rearm_s=10.0, flap_s=1.0, warning_max_defer_s=2.0)
    assert g.timing == timing
    acted = run(g, [(t, "warning") for t in (0, 5, 10, 15, 20)])
    assert list(acted) == [0, 10, 20]


def test_negative_budget_targets_zero():
    (a,) = PressureGuard().observe("warning", 0.0, budget_bytes=-5)
    assert a.target_bytes == 0


def test_sustained_warning_rearms_every_120s():
    acted = run(PressureGuard(), [(t, "warning") for t in (0, 10, 60, 119, 120, 200, 239, 240)])
    assert list(acted) == [0, 120, 240]
    assert acted[120] == [("memory_pressure_warning", 500, "rearm")]


def test_normal_warning_flapping_cannot_retrigger_faster_than_30s():
    script = [(0, "warning"), (10, "normal"), (20, "warning"), (29, "warning"), (30, "warning"),
              (31, "normal"), (45, "warning"), (61, "normal"), (70, "warning")]
    acted = run(PressureGuard(), script)
    assert list(acted) == [0, 30, 70]
    assert acted[30][0][2] == "deferred"  # the edge at 20 acted once the window ended


def test_flap_that_settles_to_normal_inside_the_window_does_nothing():
    acted = run(PressureGuard(), [(0, "warning"), (5, "normal"), (10, "warning"), (15, "normal"),
                                  (40, "normal")])
    assert list(acted) == [0]


def test_critical_never_deferred_and_acts_on_every_rising_edge():
    g = PressureGuard()
    acted = run(g, [(0, "warning"), (5, "critical"), (6, "normal"), (7, "critical"),
                    (60, "critical"), (126, "critical"), (127, "critical")], busy=True)
    assert list(acted) == [5, 7, 127]  # 0: warning deferred (busy); 127 = 7 + 120 re-arm
    assert acted[5] == [("memory_pressure_critical", 0, "edge")]
    assert acted[127] == [("memory_pressure_critical", 0, "rearm")]


def test_warning_defers_up_to_60s_while_busy():
    g = PressureGuard()
    acted = run(g, [(0, "warning"), (30, "warning"), (59, "warning"), (60, "warning")], busy=True)
    assert list(acted) == [60] and acted[60][0][2] == "deferred"
    g = PressureGuard()
    assert g.observe("warning", 0, budget_bytes=BUDGET, busy=True) == []
    assert len(g.observe("warning", 10, budget_bytes=BUDGET, busy=False)) == 1  # idle: act now


def test_warning_after_critical_waits_for_rearm():
    acted = run(PressureGuard(), [(0, "critical"), (10, "warning"), (100, "warning"),
                                  (120, "warning")])
    assert list(acted) == [0, 120]


def test_unknown_readings_change_nothing():
    g = PressureGuard()
    assert run(g, [(0, "warning"), (1, "unknown"), (2, None), (3, 0), (4, "warning")]) == {
        0: [("memory_pressure_warning", 500, "edge")]}
    assert g.level is OsPressure.WARNING


def test_parse_os_pressure_strings_and_macos_ints():
    assert [parse_os_pressure(v) for v in ("Normal", " WARNING ", "critical", 1, 2, 4, 3, "x")] == [
        OsPressure.NORMAL, OsPressure.WARNING, OsPressure.CRITICAL, OsPressure.NORMAL,
        OsPressure.WARNING, OsPressure.CRITICAL, OsPressure.UNKNOWN, OsPressure.UNKNOWN]


# -- the plan: the tick's upkeep turns guard actions into bank shrinks -----------------------


def snap(os_pressure: str | None, *, session_bytes: int = 900, busy: bool = False) -> Snapshot:
    """1 GiB of 64 (level ok), one ready engine, a bank of `session_bytes` with budget 1000."""
    return Snapshot(
        readings=MemoryReadings(process_bytes=GIB, system_total_bytes=64 * GIB,
                                os_pressure=os_pressure),
        engines=(EngineView("m", measured_bytes=GIB // 2, active_requests=1 if busy else 0),),
        session_bytes=session_bytes, bank_max_bytes=BUDGET,
    )


def evicting(entries: int, freed: int):
    def outcome(action):
        if isinstance(action, ShrinkSessionCache):
            return Outcome(action, entries=entries, bytes_freed=freed)
        return default_outcome(action)
    return outcome


def guard_steps(driven):
    return [a for a in driven.actions if isinstance(a, ShrinkSessionCache | PressureReclaim)]


def test_tick_warning_shrinks_to_half_the_budget_then_reclaims_the_pool():
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0), [snap("warning")],
              evicting(2, 600))
    assert guard_steps(d) == [
        ShrinkSessionCache(target_bytes=500, protect_active=True, reason=REASON_OS_WARNING,
                           mode=ShrinkMode.TO_BYTES),
        PressureReclaim("m", REASON_OS_RECLAIM),
    ]
    assert d.result.state.guard.level is OsPressure.WARNING
    assert d.result.state.guard.last_action_at == 0.0
    assert d.result.state.bank_ceiling_bytes == BUDGET
    # The guard state is carried to the next tick: 10 s later nothing re-arms.
    d2 = drive(tick_plan(d.result.state, MemoryConfig(), 10.0), [snap("warning")])
    assert guard_steps(d2) == []


def test_tick_warning_that_evicted_nothing_does_not_reclaim():
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0), [snap("warning")], evicting(0, 0))
    assert guard_steps(d) == [ShrinkSessionCache(500, True, REASON_OS_WARNING)]


def test_tick_critical_shrinks_to_zero_and_reclaims_even_with_nothing_evicted():
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0), [snap("critical")], evicting(0, 0))
    assert guard_steps(d) == [
        ShrinkSessionCache(0, protect_active=True, reason=REASON_OS_CRITICAL),
        PressureReclaim("m", REASON_OS_RECLAIM),
    ]


def test_tick_warning_waits_while_the_engine_is_busy():
    state = PolicyState()
    for now in (0.0, 30.0, 59.0):
        d = drive(tick_plan(state, MemoryConfig(), now), [snap("warning", busy=True)])
        assert guard_steps(d) == []
        state = d.result.state
    d = drive(tick_plan(state, MemoryConfig(), 60.0), [snap("warning", busy=True)],
              evicting(1, 300))
    assert guard_steps(d)[0] == ShrinkSessionCache(500, True, REASON_OS_WARNING)


def test_tick_without_a_session_tier_has_no_guard():
    s = dataclasses.replace(snap("critical"), session_bytes=None)
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0), [s])
    assert guard_steps(d) == [] and d.result.state.guard == GuardState()



def test_guard_shrinks_performed_on_a_real_bank_spare_active_sessions():
    bank = SessionBank(clock=FakeClock(), active_sessions=lambda: {"live"}, max_bytes=BUDGET)
    bank.put(make_entry([1], 300, "live"))
    bank.put(make_entry([2], 300, "idle1"))
    bank.put(make_entry([3], 300, "idle2"))
    executor = Executor(reader=None, pool=NoEngines(), bank=bank)
    g = PressureGuard()

    def perform(a: PressureAction) -> Outcome:
        action = ShrinkSessionCache(a.target_bytes, a.protect_active, a.reason)
        return asyncio.run(executor.perform(action))

    (warn,) = g.observe("warning", 0, budget_bytes=bank.max_bytes)
    out = perform(warn)
    assert (out.entries, out.bytes_freed, bank.total_bytes()) == (2, 600, 300)
    (crit,) = g.observe("critical", 1, budget_bytes=BUDGET)
    out = perform(crit)
    assert (out.entries, out.bytes_freed) == (0, 0)
    assert bank.total_bytes() == 300  # the active session stays, above the target 0
    assert bank.stats().evictions == {REASON_OS_WARNING: 2}
