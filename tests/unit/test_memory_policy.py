"""The pure tick: grading, the resume band, emergency, grace, the relief ladder, properties.

Ceiling 20 GiB (custom tier on 64 GiB): soft 17, hard 19. The level is raw (seed
fact 1: ok below soft, always); the opt-in resume band (`resume_band_fraction`)
only delays ResumeAdmission.
"""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from memory.actions import (
    REASON_DYNAMIC_CEILING,
    REASON_EMERGENCY_ALL,
    REASON_HARD_BUSY,
    REASON_PENDING_UNLOAD,
    REASON_POOL_RECLAIM,
    REASON_SESSION_SHRINK,
    REASON_SHRINK_RECLAIM,
    REASON_SOFT_LRU,
    AbortRequests,
    AdjustBatchCap,
    AdjustStoreCacheCap,
    ClearAuxCaches,
    EvictModel,
    ExpireSessions,
    IdleReclaim,
    MarkPendingUnload,
    PauseAdmission,
    PressureReclaim,
    PropagateLimits,
    ResumeAdmission,
    ShrinkSessionCache,
)
from memory.ceiling import compute_limits
from memory.config import AbortOrder, MemoryConfig
from memory.levels import GIB, PressureLevel, Tier
from memory.plans.admission import AdmissionRequest, Verdict
from memory.plans.steps import Execute, Measure, Snapshot
from memory.plans.tick import (
    Assessment,
    PolicyState,
    ReliefMemo,
    admission_action,
    assess,
    is_emergency,
    plan_relief,
    plan_session_shrink,
    pool_reclaim_wanted,
    raw_level,
    select_requests,
    tick_plan,
)
from memory.views import EngineState, EngineView, QueueView, RequestView
from tests.support.memory_fakes import (
    FakeDesk,
    FakeEngine,
    FakeSessionTier,
    drive,
    make_world,
    readings,
)

OK, SOFT, HARD, EMERGENCY = (
    PressureLevel.OK,
    PressureLevel.SOFT,
    PressureLevel.HARD,
    PressureLevel.EMERGENCY,
)
CFG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20)
LIMITS = compute_limits(readings(0), CFG)


def g(x: float) -> int:
    return int(x * GIB)


def hard(usage: float, emergency: bool = False) -> Assessment:
    return Assessment(EMERGENCY if emergency else HARD, HARD, emergency, 0, g(usage))


def soft(usage: float) -> Assessment:
    return Assessment(SOFT, SOFT, False, 0, g(usage))


# -- the level is raw; the opt-in resume band delays only ResumeAdmission --------------


def test_the_level_is_raw_a_reading_hovering_at_the_soft_mark_flaps():
    # Seed fact 1: ok below the soft mark, always. A hovering reading flaps each poll.
    seen = [
        assess(g(u), LIMITS, SOFT, 0, CFG, new_poll=True).level
        for u in [16.9, 17.0, 16.9, 17.05, 16.7, 16.61, 16.9, 17.0]
    ]
    assert seen == [OK, SOFT, OK, SOFT, OK, OK, OK, SOFT]
    assert raw_level(17 * GIB - 1, LIMITS) is OK and raw_level(17 * GIB, LIMITS) is SOFT


def test_the_level_ignores_the_previous_level_at_both_marks():
    for previous in PressureLevel:
        assert assess(g(19.0), LIMITS, previous, 0, CFG, new_poll=True).level is HARD
        assert assess(g(18.7), LIMITS, previous, 0, CFG, new_poll=True).level is SOFT
        assert assess(g(16.99), LIMITS, previous, 0, CFG, new_poll=True).level is OK
    # Emergency sits on hard; under the ceiling it is gone and the marks decide alone.
    assert assess(g(16.8), LIMITS, EMERGENCY, 2, CFG, new_poll=True).level is OK


async def test_end_to_end_a_hovering_reading_flaps_and_pauses_and_resumes_each_time():
    w = make_world(CFG, readings(17.0), [FakeEngine("p", pinned=True)], desk=FakeDesk())
    for usage in [17.0, 16.8, 17.1, 16.7, 17.0, 16.65]:
        w.set_usage(usage)
        await w.tick()
    assert [(t.from_level, t.to_level) for t in w.sink.transitions] == [(OK, SOFT), (SOFT, OK)] * 3
    assert w.desk is not None and w.desk.paused == [SOFT, None] * 3  # default band 0


def test_admission_action_resumes_at_ok_unless_inside_the_opt_in_band():
    assert admission_action(SOFT, False) == PauseAdmission(SOFT)
    assert admission_action(SOFT, True) is None
    assert admission_action(OK, True, g(16.9), LIMITS) == ResumeAdmission(OK)  # band 0
    band = 0.02  # 0.4 GiB of the 20 GiB ceiling: resume below 16.6 GiB
    assert admission_action(OK, True, g(16.61), LIMITS, band) is None
    assert admission_action(OK, True, g(16.59), LIMITS, band) == ResumeAdmission(OK)
    assert admission_action(OK, False, g(16.61), LIMITS, band) is None


async def test_resume_band_the_level_goes_ok_at_once_but_admission_waits():
    cfg = CFG.replace(resume_band_fraction=0.02)
    w = make_world(cfg, readings(17.0), [FakeEngine("p", pinned=True)], desk=FakeDesk())
    r = await w.tick()
    assert (r.level, w.governor.admission_paused) == (SOFT, True)
    for usage in (16.9, 16.7, 16.61):  # ok at once, still inside soft - 0.4 GiB
        w.set_usage(usage)
        r = await w.tick()
        assert r.level is OK and r.actions_of(ResumeAdmission) == []
        assert w.governor.admission_paused and r.state.admission_paused
    assert [(t.from_level, t.to_level) for t in w.sink.transitions] == [(OK, SOFT), (SOFT, OK)]
    w.set_usage(16.59)
    r = await w.tick()
    assert r.actions_of(ResumeAdmission) == [ResumeAdmission(OK)]
    assert not w.governor.admission_paused
    assert w.desk is not None and w.desk.paused == [SOFT, None]
    assert len(w.sink.transitions) == 2  # the resume is not a transition


async def test_resume_band_default_zero_resumes_on_the_first_ok_tick():
    w = make_world(CFG, readings(17.0), [FakeEngine("p", pinned=True)])
    await w.tick()
    w.set_usage(16.99)
    r = await w.tick()
    assert (r.level, r.actions_of(ResumeAdmission)) == (OK, [ResumeAdmission(OK)])
    assert not w.governor.admission_paused


async def test_in_the_resume_band_admit_predicts_what_the_paused_queue_does():
    """Admit (a preview) must say what Generate would do: inside the resume band the
    queue is still paused, so a second request waits."""
    cfg = CFG.replace(resume_band_fraction=0.02)
    desk = FakeDesk()
    w = make_world(cfg, readings(17.0), [FakeEngine("p", pinned=True)], desk=desk)
    await w.tick()
    w.set_usage(16.7)
    await w.tick()
    assert (w.governor.level, w.governor.admission_paused, desk.paused) == (OK, True, [SOFT])
    desk.queue = QueueView(in_flight=1, waiting=0)
    request = AdmissionRequest(model="p", prompt_tokens=(1, 2, 3), max_tokens=1,
                               kv_bytes_per_token=1)
    result = await w.governor.admit(request, preview=True)
    assert result is not None
    assert (result.verdict, result.binding) == (Verdict.WAIT, "paused_at_soft")


# -- emergency --------------------------------------------------------------------


def test_emergency_by_margin_by_polls_and_never_under_the_ceiling():
    c, m = g(20), 2 * GIB
    assert not is_emergency(c - 1, c, 99, m, 2)  # under the ceiling: never
    assert not is_emergency(c, c, 1, m, 2)  # at the ceiling, first poll
    assert is_emergency(c, c, 2, m, 2)  # second consecutive poll
    assert not is_emergency(c + m - 1, c, 1, m, 2)
    assert is_emergency(c + m, c, 1, m, 2)  # 2 GiB over at once


def test_emergency_counter_counts_polls_not_remeasurements_and_resets_below():
    a = assess(g(20.5), LIMITS, HARD, 0, CFG, new_poll=True)
    assert (a.over_ceiling_polls, a.level) == (1, HARD)
    again = assess(g(20.5), LIMITS, HARD, a.over_ceiling_polls, CFG, new_poll=False)
    assert (again.over_ceiling_polls, again.level) == (1, HARD)  # same poll
    second = assess(g(20.5), LIMITS, HARD, 1, CFG, new_poll=True)
    assert (second.over_ceiling_polls, second.level) == (2, EMERGENCY)
    assert second.base_level is HARD and second.emergency
    below = assess(g(19.9), LIMITS, EMERGENCY, 2, CFG, new_poll=False)
    assert (below.over_ceiling_polls, below.emergency) == (0, False)


# -- grace and the pool floor -------------------------------------------------------


def test_pool_floor_is_strictly_above_two_gib_or_freed_references():
    state = PolicyState(level=SOFT)
    assert not pool_reclaim_wanted(readings(18, pool_gib=2), state, CFG)
    assert pool_reclaim_wanted(
        dataclasses.replace(readings(18), mlx_pool_bytes=2 * GIB + 1), state, CFG
    )
    assert pool_reclaim_wanted(
        readings(18), dataclasses.replace(state, shrink_freed_refs=True), CFG
    )
    assert not pool_reclaim_wanted(
        readings(18, pool_gib=9), state, CFG.replace(pressure_reclaim=False)
    )
    unreadable = dataclasses.replace(readings(18), mlx_pool_bytes=None)
    assert not pool_reclaim_wanted(unreadable, state, CFG)


async def test_grace_needs_an_engine_to_accept_the_reclaim():
    b = FakeEngine("b", last_used=1.0, measured_bytes=GIB, accept_reclaim=False)
    c = FakeEngine("c", last_used=2.0, measured_bytes=GIB, accept_reclaim=False)
    w = make_world(CFG, readings(18, pool_gib=5), [b, c])
    r = await w.tick()
    assert r.actions_of(PressureReclaim) == [PressureReclaim("b"), PressureReclaim("c")]
    assert not r.deferred and r.state.grace_polls == 0
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["b"]


async def test_grace_is_off_when_pressure_reclaim_is_disabled():
    cfg = CFG.replace(pressure_reclaim=False)
    w = make_world(
        cfg,
        readings(18, pool_gib=5),
        [FakeEngine("b", measured_bytes=GIB), FakeEngine("c", last_used=9)],
    )
    r = await w.tick()
    assert r.actions_of(PressureReclaim) == [] and not r.deferred
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["b"]


async def test_grace_counter_stops_at_the_configured_maximum():
    cfg = CFG.replace(reclaim_grace_polls=2)
    w = make_world(cfg, readings(18, pool_gib=5), [FakeEngine("p", pinned=True)])
    deferred = [(await w.tick()).deferred for _ in range(4)]
    assert deferred == [True, True, False, False]
    assert w.governor.state.grace_polls == 2


async def test_shrink_freed_references_are_remembered_until_an_engine_accepts():
    a = FakeEngine("a", active_requests=1, accept_reclaim=False)
    tier = FakeSessionTier(4 * GIB)
    w = make_world(CFG, readings(19.5), [a], tier=tier)
    r = await w.tick()
    assert r.actions_of(PressureReclaim) == [PressureReclaim("a", REASON_SHRINK_RECLAIM)]
    assert r.state.shrink_freed_refs and not r.deferred

    a.accept_reclaim = True
    tier.bytes_held = 0
    r = await w.tick()  # pool 0, but the freed references still want a drain
    assert r.actions_of(PressureReclaim) == [PressureReclaim("a", REASON_POOL_RECLAIM)]
    assert r.deferred and not r.state.shrink_freed_refs


def test_session_shrink_target_is_the_excess_over_soft():
    assert plan_session_shrink(g(19.5), LIMITS, g(4)) == ShrinkSessionCache(g(1.5), True)
    assert plan_session_shrink(g(25), LIMITS, g(4)) == ShrinkSessionCache(0, True)
    assert plan_session_shrink(g(16), LIMITS, g(4)) is None
    assert plan_session_shrink(g(19.5), LIMITS, 0) is None
    assert plan_session_shrink(g(19.5), LIMITS, None) is None


async def test_shrink_protects_active_entries():
    tier = FakeSessionTier(4 * GIB, active_bytes=3 * GIB)
    w = make_world(CFG, readings(19.5), [FakeEngine("p", pinned=True)], tier=tier)
    r = await w.tick()
    # The hard shrink toward soft, then the bank's dynamic ceiling in the upkeep:
    # 20 - 3 (reserve) - 16.5 (working set: 19.5 - the 3 GiB bank) -> its 1 GiB floor.
    assert tier.calls == [(g(1.5), True, REASON_SESSION_SHRINK),
                          (GIB, True, REASON_DYNAMIC_CEILING)]
    assert tier.bytes_held == 3 * GIB  # the active 3 GiB stay
    shrink = [o for o in r.outcomes if isinstance(o.action, ShrinkSessionCache)]
    assert [(o.entries, o.bytes_freed) for o in shrink] == [(1, GIB), (0, 0)]


# -- the relief ladder ---------------------------------------------------------------


def view(model_id: str, **kw) -> EngineView:
    return EngineView(model_id, **kw)


def test_relief_predicts_freed_bytes_and_evicts_only_enough():
    engines = [
        view("a", last_used=1, measured_bytes=g(1)),
        view("b", last_used=2, measured_bytes=g(2)),
        view("c", last_used=3, measured_bytes=g(3)),
    ]
    plan = plan_relief(g(19.5), LIMITS, hard(19.5), engines, CFG)
    assert [a.model_id for a in plan.actions] == ["a", "b"]  # 19.5 - 1 - 2 = 16.5 <= 17
    assert plan.predicted_usage == g(16.5) and plan.complete


def test_relief_with_an_unknown_size_remeasures_before_going_on():
    engines = [view("a", last_used=1), view("b", last_used=2, measured_bytes=g(3))]
    plan = plan_relief(g(19.5), LIMITS, hard(19.5), engines, CFG)
    assert [a.model_id for a in plan.actions] == ["a"] and not plan.complete
    again = plan_relief(g(18), LIMITS, hard(18), engines, CFG, ReliefMemo().after(plan.actions))
    assert [a.model_id for a in again.actions] == ["b"]


def test_relief_remeasures_before_escalating_past_evictions():
    engines = [view("a", measured_bytes=g(1)), view("busy", active_requests=2)]
    plan = plan_relief(g(19.5), LIMITS, hard(19.5), engines, CFG)
    assert [type(a) for a in plan.actions] == [EvictModel] and not plan.complete
    memo = ReliefMemo().after(plan.actions)
    later = plan_relief(g(18.5), LIMITS, hard(18.5), engines, CFG, memo)
    assert later.actions == (AbortRequests("busy", None, REASON_HARD_BUSY, True),)


async def test_a_lagging_reading_does_not_escalate_to_aborts_the_prediction_rules_out():
    a = FakeEngine("a", last_used=1, measured_bytes=2 * GIB)
    b = FakeEngine("b", last_used=2)  # unknown size: the plan re-measures after it
    c = FakeEngine("c", last_used=3, measured_bytes=GIB)
    x = FakeEngine("x", last_used=0, active_requests=1, requests=(RequestView("r", 0.0),))
    w = make_world(CFG, readings(19.5), [a, b, c, x])  # the reading never drops (lag)
    r = await w.tick()
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["a", "b", "c"]
    assert r.actions_of(AbortRequests) == []  # predicted 16.5 <= soft: x keeps its request


async def test_a_lower_fresh_reading_after_evictions_is_believed():
    a = FakeEngine("a", last_used=1, measured_bytes=GIB)
    x = FakeEngine("x", last_used=0, active_requests=1, requests=(RequestView("r", 0.0),))
    w = make_world(CFG, readings(19.5), [a, x])
    w.pool.on_unload = lambda model: w.set_usage(16.8)  # a held more than measured
    r = await w.tick()
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["a"]
    assert r.actions_of(AbortRequests) == []
    assert r.level is OK  # 16.8 < soft 17: ok at once (seed fact 1, no hysteresis)
    assert r.actions_of(ResumeAdmission) == [ResumeAdmission(OK)]


async def test_evictions_that_fall_short_escalate_to_the_busy_victim_after_remeasuring():
    a = FakeEngine("a", last_used=1, measured_bytes=GIB)
    x = FakeEngine("x", last_used=0, active_requests=1, requests=(RequestView("r", 0.0),))
    w = make_world(CFG, readings(19.5), [a, x])
    w.pool.on_unload = lambda model: w.set_usage(19.2)  # still at or above the hard mark
    r = await w.tick()
    assert [type(o).__name__ for o in r.actions if isinstance(o, EvictModel | AbortRequests)] == [
        "EvictModel",
        "AbortRequests",
    ]
    assert r.actions_of(AbortRequests) == [AbortRequests("x", None, REASON_HARD_BUSY, True)]


def test_pending_unload_goes_first_even_at_soft():
    engines = [
        view("a", last_used=1, measured_bytes=g(0.5)),
        view("old", last_used=5, measured_bytes=g(0.5), pending_unload=True),
    ]
    plan = plan_relief(g(18), LIMITS, soft(18), engines, CFG)
    assert plan.actions == (EvictModel("old", REASON_PENDING_UNLOAD, g(0.5)),)


def test_soft_never_evicts_the_last_non_pinned_model_but_hard_does():
    engines = [view("a", measured_bytes=g(1)), view("p", pinned=True, measured_bytes=g(5))]
    assert plan_relief(g(18), LIMITS, soft(18), engines, CFG).actions == ()
    assert [a.model_id for a in plan_relief(g(19.5), LIMITS, hard(19.5), engines, CFG).actions] == [
        "a"
    ]


def test_soft_counts_busy_non_pinned_models_as_loaded():
    engines = [view("a", measured_bytes=g(1)), view("busy", active_requests=1)]
    plan = plan_relief(g(18), LIMITS, soft(18), engines, CFG)
    assert plan.actions == (EvictModel("a", REASON_SOFT_LRU, g(1)),)


def test_busy_victim_is_the_least_recently_used_busy_non_pinned_model():
    engines = [
        view("new", active_requests=1, last_used=9),
        view("old", active_requests=1, last_used=1),
        view("pinned", active_requests=1, last_used=0, pinned=True),
    ]
    plan = plan_relief(g(19.5), LIMITS, hard(19.5), engines, CFG)
    assert plan.actions == (AbortRequests("old", None, REASON_HARD_BUSY, True),)


def test_unknown_active_requests_count_as_busy():
    plan = plan_relief(g(19.5), LIMITS, hard(19.5), [view("x", active_requests=None)], CFG)
    assert plan.actions == (AbortRequests("x", None, REASON_HARD_BUSY, True),)


def test_soft_does_not_abort_loads_or_requests():
    engines = [view("l", state=EngineState.LOADING), view("b", active_requests=3)]
    assert plan_relief(g(18.9), LIMITS, soft(18.9), engines, CFG).actions == ()


def test_emergency_all_pinned_aborts_only_busy_engines_and_keeps_them_loaded():
    engines = [
        view("p", pinned=True, active_requests=2),
        view("q", pinned=True, active_requests=0),
        view("u", pinned=True, active_requests=None),
    ]
    plan = plan_relief(g(22.5), LIMITS, hard(22.5, emergency=True), engines, CFG)
    assert plan.actions == (
        AbortRequests("p", None, REASON_EMERGENCY_ALL, True),
        AbortRequests("u", None, REASON_EMERGENCY_ALL, True),
    )


# -- graded relief ---------------------------------------------------------------------


REQS = (
    RequestView("r1", started_at=1.0, bytes_estimate=g(1)),
    RequestView("r2", started_at=3.0, bytes_estimate=g(1)),
    RequestView("r3", started_at=2.0, bytes_estimate=g(3)),
)


def test_select_requests_youngest_first_until_the_deficit_is_covered():
    assert select_requests(REQS, AbortOrder.YOUNGEST, g(1.5), stop_on_unknown=True) == (
        "r2",
        "r3",
    )
    assert select_requests(REQS, AbortOrder.YOUNGEST, g(0.5), stop_on_unknown=True) == ("r2",)


def test_select_requests_largest_first_and_all():
    assert select_requests(REQS, AbortOrder.LARGEST, g(2), stop_on_unknown=True) == ("r3",)
    assert select_requests(REQS, AbortOrder.ALL, g(2), stop_on_unknown=True) is None


def test_select_requests_unknown_estimates_end_a_gentle_batch():
    reqs = (
        RequestView("a", 1.0, None),
        RequestView("b", 2.0, None),
        RequestView("c", 0.5, g(1)),
    )
    assert select_requests(reqs, AbortOrder.YOUNGEST, g(5), stop_on_unknown=True) == ("b",)
    assert select_requests(reqs, AbortOrder.YOUNGEST, g(5), stop_on_unknown=False) == (
        "b",
        "a",
        "c",
    )
    assert select_requests(reqs, AbortOrder.LARGEST, g(5), stop_on_unknown=True) == ("c", "a")


def test_graded_busy_victim_aborts_the_youngest_request_only():
    cfg = CFG.replace(abort_order=AbortOrder.YOUNGEST)
    engines = [view("b", active_requests=3, requests=REQS)]
    plan = plan_relief(g(18.5), LIMITS, hard(18.5), engines, cfg)  # deficit 1.5 GiB
    assert plan.actions == (AbortRequests("b", ("r2", "r3"), REASON_HARD_BUSY, True),)
    # In emergency the victim is going away: all of its requests end.
    emergency = plan_relief(g(22.5), LIMITS, hard(22.5, True), engines, cfg)
    assert emergency.actions[0] == AbortRequests("b", None, "emergency_busy_victim", False)


def test_graded_emergency_across_pinned_engines():
    cfg = CFG.replace(abort_order=AbortOrder.LARGEST)
    engines = [
        view("p", pinned=True, active_requests=1, requests=(RequestView("p1", 1, g(4)),)),
        view(
            "q",
            pinned=True,
            active_requests=2,
            requests=(
                RequestView("q1", 1, g(2)),
                RequestView("q2", 2, g(5)),
            ),
        ),
    ]
    plan = plan_relief(g(24), LIMITS, hard(24, True), engines, cfg)  # deficit 7 GiB
    assert plan.actions == (
        AbortRequests("p", ("p1",), REASON_EMERGENCY_ALL, True),
        AbortRequests("q", ("q2",), REASON_EMERGENCY_ALL, True),
    )


# -- the generator itself ----------------------------------------------------------------


def test_tick_plan_steps_for_an_ok_tick_measure_once_then_walk_caps_and_propagate():
    snap = Snapshot(readings(5), (view("a", max_num_seqs=4),))
    driven = drive(tick_plan(PolicyState(), CFG, now=7.0), [snap])
    assert driven.steps == [
        Measure("poll"),
        Execute((AdjustStoreCacheCap("a", OK), AdjustBatchCap("a", OK))),
        Execute((PropagateLimits(20 * GIB, 20 * GIB, 0, Tier.CUSTOM),)),
    ]
    assert driven.result.level is OK and driven.result.measurements == 1


def test_tick_plan_steps_for_a_soft_tick_with_scripted_snapshots():
    engines = (view("a", last_used=1, measured_bytes=g(1)), view("b", last_used=2))
    snaps = [Snapshot(readings(18), engines), Snapshot(readings(18), engines)]
    driven = drive(tick_plan(PolicyState(), CFG, now=1.0), snaps)
    kinds = [
        s.reason if isinstance(s, Measure) else [type(a).__name__ for a in s.actions]
        for s in driven.steps
    ]
    assert kinds == [
        "poll",
        ["ClearAuxCaches"],
        "after_aux_clear",
        ["Transition", "PauseAdmission"],
        ["EvictModel"],
        "after_relief",
        ["AdjustStoreCacheCap", "AdjustBatchCap"],  # a is gone: only b's caps walk
        ["PropagateLimits"],
    ]
    assert driven.result.transitions[0].at == 1.0


def test_disabled_enforcer_measures_but_never_acts():
    cfg = CFG.replace(enabled=False)
    snap = Snapshot(readings(30), (view("a", measured_bytes=g(5)),))
    driven = drive(tick_plan(PolicyState(), cfg, now=0.0), [snap])
    assert driven.result.level is OK
    # Caps recover toward max_num_seqs; no limits are handed out (no pre-prefill checks).
    assert [type(a) for a in driven.result.actions] == [AdjustStoreCacheCap, AdjustBatchCap]
    assert driven.result.limits.ceiling_bytes == g(20)


def test_disabled_enforcer_never_shrinks_the_session_bank_but_keeps_the_idle_ttl():
    cfg = CFG.replace(enabled=False)
    engines = (view("a", measured_bytes=g(5)),)
    for os_pressure in (None, "critical"):
        snap = Snapshot(readings(30, os_pressure=os_pressure), engines, session_bytes=g(4),
                        bank_max_bytes=g(48))
        driven = drive(tick_plan(PolicyState(), cfg, now=0.0), [snap])
        assert driven.result.actions_of(ShrinkSessionCache) == []
        assert driven.result.actions_of(PressureReclaim) == []
    expired = Snapshot(readings(30), engines, session_bytes=g(4), bank_max_bytes=g(48),
                       sessions_expired=2)
    driven = drive(tick_plan(PolicyState(), cfg, now=0.0), [expired])
    assert driven.result.actions_of(ExpireSessions) == [ExpireSessions()]  # housekeeping


def test_ok_tick_clears_nothing_and_resumes_admission():
    state = PolicyState(level=SOFT, admission_paused=True, grace_polls=3)
    driven = drive(tick_plan(state, CFG, now=0.0), [Snapshot(readings(5))])
    r = driven.result
    assert ClearAuxCaches() not in r.actions
    assert r.state == PolicyState(level=OK)
    assert [type(a).__name__ for a in r.actions] == [
        "Transition", "ResumeAdmission", "PropagateLimits"]


# -- properties ----------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    u1=st.integers(0, 40 * GIB),
    u2=st.integers(0, 40 * GIB),
    previous=st.sampled_from(list(PressureLevel)),
    polls=st.integers(0, 3),
)
def test_property_level_is_monotonic_in_usage(u1, u2, previous, polls):
    lo, hi = sorted((u1, u2))
    a_lo = assess(lo, LIMITS, previous, polls, CFG, new_poll=True)
    a_hi = assess(hi, LIMITS, previous, polls, CFG, new_poll=True)
    assert a_lo.level <= a_hi.level


@settings(max_examples=300, deadline=None)
@given(
    usage=st.integers(0, 40 * GIB),
    p1=st.sampled_from(list(PressureLevel)),
    p2=st.sampled_from(list(PressureLevel)),
)
def test_property_the_base_level_depends_on_usage_alone(usage, p1, p2):
    a1 = assess(usage, LIMITS, p1, 0, CFG, new_poll=False)
    a2 = assess(usage, LIMITS, p2, 0, CFG, new_poll=False)
    assert a1.base_level == a2.base_level
    assert (a1.level is OK) == (usage < LIMITS.soft_bytes)


engine_views = st.builds(
    EngineView,
    model_id=st.sampled_from(["a", "b", "c", "d", "e", "f"]),
    state=st.sampled_from(list(EngineState)),
    pinned=st.booleans(),
    active_requests=st.one_of(st.none(), st.integers(0, 3)),
    last_used=st.floats(0, 100),
    measured_bytes=st.one_of(st.none(), st.integers(0, 8 * GIB)),
    pending_unload=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(
    engines=st.lists(engine_views, max_size=6, unique_by=lambda e: e.model_id),
    usage=st.integers(15 * GIB, 30 * GIB),
    polls=st.integers(0, 3),
    order=st.sampled_from(list(AbortOrder)),
)
def test_property_pinned_models_are_never_evicted_and_only_emergency_aborts_them(
    engines, usage, polls, order
):
    cfg = CFG.replace(abort_order=order)
    a = assess(usage, LIMITS, OK, polls, cfg, new_poll=True)
    if a.level is OK:
        return
    plan = plan_relief(usage, LIMITS, a, engines, cfg)
    pinned = {e.model_id for e in engines if e.pinned}
    for action in plan.actions:
        if isinstance(action, EvictModel | MarkPendingUnload):
            assert action.model_id not in pinned
        if isinstance(action, AbortRequests) and action.model_id in pinned:
            assert a.emergency and action.reason == REASON_EMERGENCY_ALL and action.keep_loaded
        if isinstance(action, EvictModel):  # never a busy or loading model
            victim = next(e for e in engines if e.model_id == action.model_id)
            assert victim.ready and not victim.busy
    if a.level is SOFT:
        assert not any(isinstance(x, AbortRequests | IdleReclaim) for x in plan.actions)
