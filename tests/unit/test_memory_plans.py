"""The pure plans with scripted snapshots: making room for a load, the tick's upkeep (idle
TTL, the OS pressure guard, the bank's dynamic ceiling), the one eviction ladder; and the
governor's handling of a skipped eviction and of stale engine samples.

Ceiling 20 GiB (custom tier on 64 GiB): soft 17, hard 19.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from memory.actions import (
    MEASURE_AFTER_EVICTION,
    MEASURE_LOAD,
    REASON_DYNAMIC_CEILING,
    REASON_OS_CRITICAL,
    REASON_OS_RECLAIM,
    REASON_OS_WARNING,
    Action,
    EvictModel,
    ExpireSessions,
    Outcome,
    PressureReclaim,
    PropagateLimits,
    Refuse,
    RefuseLoad,
    ShrinkMode,
    ShrinkSessionCache,
)
from memory.ceiling import compute_limits
from memory.config import MemoryConfig
from memory.levels import GIB, MIB, PressureLevel, Tier
from memory.plans.eviction import freeable_bytes, idle_victims
from memory.plans.load import ERROR_LOAD_EXCEEDS_SOFT, LoadResult, load_plan
from memory.plans.os_guard import GuardState, OsPressure
from memory.plans.steps import Execute, Measure, Snapshot
from memory.plans.tick import PolicyState, ReliefMemo, assess, plan_relief, tick_plan
from memory.recording import Recorder
from memory.views import EngineState, EngineView
from telemetry import names
from telemetry.instruments import Instruments
from tests.support.memory_fakes import (
    FakeEngine,
    default_outcome,
    drive,
    figures,
    make_world,
    readings,
)

OK, SOFT, HARD = PressureLevel.OK, PressureLevel.SOFT, PressureLevel.HARD
CFG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20)
CFG_LIMITS = compute_limits(readings(0), CFG)


def g(x: float) -> int:
    return int(x * GIB)


def view(model_id: str, **kw) -> EngineView:
    return EngineView(model_id, **kw)


def snap(usage: float, *engines: EngineView, pool: float = 0, **kw) -> Snapshot:
    return Snapshot(readings(usage, pool_gib=pool, **kw.pop("r", {})), tuple(engines), **kw)


ENGINES = (
    view("p", pinned=True, last_used=0, measured_bytes=g(4)),
    view("x", active_requests=1, last_used=0, measured_bytes=g(3)),
    view("l", state=EngineState.LOADING, last_used=0),
    view("a", last_used=1, measured_bytes=g(1)),
    view("b", last_used=2, measured_bytes=g(2)),
    view("c", last_used=3, measured_bytes=g(4)),
)


def evictions(driven) -> list[str]:
    return [a.model_id for a in driven.executed_of(EvictModel)]


# -- making room for a load -------------------------------------------------------------


def test_load_evicts_idle_lru_non_pinned_models_until_usage_plus_estimate_fits_soft():
    # usage 14 (16 - a 2 GiB reclaimable pool) + 5 = 19 > 17: a (1) then b (2) -> 16.
    driven = drive(load_plan("new", g(5), CFG), snap(16, *ENGINES, pool=2), snap(11, *ENGINES))
    assert [s.reason for s in driven.steps if isinstance(s, Measure)] == [
        MEASURE_LOAD, MEASURE_AFTER_EVICTION]
    assert driven.executed == [
        EvictModel("a", "make_room_for_load:new", g(1)),
        EvictModel("b", "make_room_for_load:new", g(2)),
    ]
    assert driven.result == LoadResult(evicted=("a", "b"))


def test_load_that_fits_under_soft_evicts_nothing_and_measures_once():
    driven = drive(load_plan("new", g(5), CFG), snap(12, *ENGINES))
    assert driven.steps == [Measure(MEASURE_LOAD)]
    assert driven.result == LoadResult()


def test_load_never_evicts_the_model_being_loaded_and_takes_pending_unloads_first():
    engines = (view("new", last_used=0, measured_bytes=g(8)),
               view("a", last_used=1, measured_bytes=g(1)),
               view("old", last_used=9, measured_bytes=g(3), pending_unload=True))
    driven = drive(load_plan("new", g(5), CFG), snap(14, *engines), snap(11, *engines))
    assert evictions(driven) == ["old"]  # 14 - 3 + 5 = 16 <= 17


def test_a_hopeless_load_evicts_nothing_and_is_refused_with_the_numbers():
    # Every idle model (a 1 + b 2 + c 4 = 7 GiB) would leave 14 - 7 + 14 = 21 > 17 (soft).
    driven = drive(load_plan("big", g(14), CFG), snap(14, *ENGINES))
    assert driven.executed_of(EvictModel) == []
    (refusal,) = driven.executed
    assert isinstance(refusal, Refuse) and driven.result == LoadResult(refusal=refusal)
    assert (refusal.binding, refusal.error_reason, refusal.tried) == (
        "soft", ERROR_LOAD_EXCEEDS_SOFT, ())
    assert refusal.numbers == {"estimated_bytes": g(14), "usage_bytes": g(14),
                               "ceiling_bytes": g(20), "soft_bytes": g(17),
                               "freeable_bytes": g(7)}
    assert "even after evicting every idle model" in refusal.message
    # At 10 GiB it just fits under soft (14 - 7 + 10 = 17): then it evicts everything it may.
    fits = drive(load_plan("big", g(10), CFG), snap(14, *ENGINES), snap(7, *ENGINES))
    assert evictions(fits) == ["a", "b", "c"] and fits.result.refusal is None


def test_a_load_remeasures_after_evicting_and_refuses_with_numbers_if_still_over():
    # The reading lags the unloads: 16 + 5 = 21 > 20 after evicting a and b.
    driven = drive(load_plan("new", g(5), CFG), snap(14, *ENGINES), snap(16, *ENGINES))
    assert evictions(driven) == ["a", "b"]
    refusal = driven.executed[-1]
    assert isinstance(refusal, Refuse)
    assert refusal.tried == ("evict:a", "evict:b")
    assert (refusal.numbers["usage_bytes"], refusal.numbers["estimated_bytes"]) == (g(16), g(5))
    assert driven.result == LoadResult(evicted=("a", "b"), refusal=refusal)


def test_a_skipped_eviction_does_not_count_as_evicted():
    def respond(action: Action) -> Outcome:
        if isinstance(action, EvictModel) and action.model_id == "a":
            return Outcome(action, skipped="busy")
        return default_outcome(action)

    driven = drive(load_plan("new", g(5), CFG), snap(14, *ENGINES), snap(12, *ENGINES),
                   respond=respond)
    assert evictions(driven) == ["a", "b"] and driven.result.evicted == ("b",)


# -- the eviction ladder's one order -------------------------------------------------------


def test_idle_victims_pending_unloads_first_then_lru_never_pinned_busy_or_not_ready():
    engines = [
        view("z", last_used=5), view("y", last_used=1), view("m", last_used=1),
        view("pend2", last_used=9, pending_unload=True), view("pend1", last_used=8,
                                                               pending_unload=True),
        view("pin", pinned=True), view("busy", active_requests=2), view("blind",
                                                                         active_requests=None),
        view("load", state=EngineState.LOADING), view("gone", state=EngineState.UNLOADING),
        view("pin-pend", pinned=True, pending_unload=True),
    ]
    order = [v.model_id for v in idle_victims(engines)]
    assert order == ["pend1", "pend2", "m", "y", "z"]  # ties by model id
    assert [v.model_id for v in idle_victims(engines, exclude=("pend1", "m"))] == [
        "pend2", "y", "z"]
    assert freeable_bytes([view("a", measured_bytes=5), view("b")]) == 5


def test_the_tick_and_the_load_take_idle_models_in_the_same_order():
    engines = (view("c", last_used=3, measured_bytes=g(1)),
               view("a", last_used=1, measured_bytes=g(1)),
               view("pend", last_used=7, measured_bytes=g(1), pending_unload=True),
               view("b", last_used=2, measured_bytes=g(1)))
    a = assess(g(20.5), CFG_LIMITS, OK, 0, CFG, new_poll=True)
    assert (a.level, a.emergency) == (HARD, False)
    tick_order = [x.model_id for x in plan_relief(g(20.5), CFG_LIMITS, a, engines, CFG,
                                                  ReliefMemo()).actions]
    load = drive(load_plan("new", g(5), CFG), snap(16, *engines), snap(10, *engines))
    assert tick_order == evictions(load) == ["pend", "a", "b", "c"]


# -- the tick's upkeep -----------------------------------------------------------------


def upkeep_actions(driven) -> list[Action]:
    """What the tick did from PropagateLimits on (the upkeep)."""
    acts = driven.result.actions
    start = next(i for i, x in enumerate(acts) if isinstance(x, PropagateLimits))
    return list(acts[start:])


A = view("a", last_used=1, measured_bytes=g(2))


def test_upkeep_without_a_session_tier_only_propagates_the_limits():
    driven = drive(tick_plan(PolicyState(), CFG, now=0.0),
                   snap(5, A, r={"os_pressure": "critical"}))
    assert [type(x) for x in upkeep_actions(driven)] == [PropagateLimits]


def test_upkeep_expires_sessions_only_when_some_are_past_the_ttl():
    quiet = drive(tick_plan(PolicyState(), CFG, now=0.0),
                  snap(5, A, session_bytes=g(1), bank_max_bytes=g(8)))
    assert quiet.executed_of(ExpireSessions) == []
    due = drive(tick_plan(PolicyState(), CFG, now=0.0),
                snap(5, A, session_bytes=g(1), bank_max_bytes=g(8), sessions_expired=3))
    assert upkeep_actions(due)[1] == ExpireSessions()  # right after PropagateLimits
    assert len(due.executed_of(ExpireSessions)) == 1


def respond_entries(entries: int) -> Callable[[Action], Outcome]:
    def respond(action: Action) -> Outcome:
        if isinstance(action, ShrinkSessionCache):
            return Outcome(action, entries=entries, bytes_freed=entries * GIB)
        return default_outcome(action)
    return respond


def guard_tick(os_pressure: str, entries: int, *engines: EngineView,
               state: PolicyState | None = None):
    # weights 2, working set 0: the bank's ceiling is min(20 - 2 - 3, its 8 GiB budget) = 8.
    s = snap(5, *(engines or (A,)), session_bytes=g(6), bank_max_bytes=g(8),
             r={"os_pressure": os_pressure})
    return drive(tick_plan(state or PolicyState(), CFG, now=50.0), s,
                 respond=respond_entries(entries))


def test_os_warning_halves_the_budget_sparing_active_sessions_then_reclaims_if_it_evicted():
    driven = guard_tick("warning", 2)
    assert upkeep_actions(driven)[1:] == [
        ShrinkSessionCache(g(4), protect_active=True, reason=REASON_OS_WARNING),
        PressureReclaim("a", REASON_OS_RECLAIM),
    ]
    guard = driven.result.state.guard
    assert (guard.level, guard.last_action_at, driven.result.state.bank_ceiling_bytes) == (
        OsPressure.WARNING, 50.0, g(8))
    nothing = guard_tick("warning", 0)  # the shrink took nothing: no reclaim
    assert upkeep_actions(nothing)[1:] == [
        ShrinkSessionCache(g(4), protect_active=True, reason=REASON_OS_WARNING)]


def test_os_warning_waits_for_a_busy_engine_but_critical_never_does():
    busy = view("a", last_used=1, measured_bytes=g(2), active_requests=1)
    assert guard_tick("warning", 2, busy).executed_of(ShrinkSessionCache) == []
    critical = guard_tick("critical", 0, busy)
    assert critical.executed_of(ShrinkSessionCache) == [
        ShrinkSessionCache(0, protect_active=True, reason=REASON_OS_CRITICAL)]


def test_os_critical_takes_the_whole_budget_and_reclaims_even_if_nothing_was_evicted():
    driven = guard_tick("critical", 0, A, view("b", last_used=2))
    assert upkeep_actions(driven)[1:] == [
        ShrinkSessionCache(0, protect_active=True, reason=REASON_OS_CRITICAL),
        PressureReclaim("a", REASON_OS_RECLAIM),
        PressureReclaim("b", REASON_OS_RECLAIM),
    ]


def test_os_guard_acts_on_the_rising_edge_only():
    state = PolicyState(guard=GuardState(level=OsPressure.WARNING, last_action_at=40.0))
    assert guard_tick("warning", 2, state=state).executed_of(ShrinkSessionCache) == []
    assert guard_tick("normal", 2, state=state).result.state.guard.level is OsPressure.NORMAL


@pytest.mark.parametrize(("over", "shrinks"), [(0, False), (256 * MIB, False),
                                               (256 * MIB + 1, True), (GIB, True)])
def test_the_dynamic_ceiling_shrinks_the_bank_only_when_over_by_more_than_256_mib(over, shrinks):
    # bank budget 2 GiB: min(20 - 2 - 3, 2) = 2 GiB.
    s = snap(5, A, session_bytes=g(2) + over, bank_max_bytes=g(2))
    driven = drive(tick_plan(PolicyState(), CFG, now=0.0), s)
    assert driven.result.state.bank_ceiling_bytes == g(2)
    expected = [ShrinkSessionCache(g(2), protect_active=True, reason=REASON_DYNAMIC_CEILING,
                                   mode=ShrinkMode.TO_BYTES)]
    assert driven.executed_of(ShrinkSessionCache) == (expected if shrinks else [])


def test_the_dynamic_ceiling_follows_the_working_set_each_tick():
    # usage 15 = weights 2 + bank 4 + running 9: 20 - 2 - 3 - 9 = 6 GiB, under the 8 GiB budget.
    s = snap(15, A, session_bytes=g(4), bank_max_bytes=g(8))
    assert drive(tick_plan(PolicyState(), CFG, now=0.0), s).result.state.bank_ceiling_bytes == g(6)
    # usage 16.5: 20 - 2 - 3 - 10.5 = 4.5 GiB; the 4 GiB bank is within the slack.
    s = snap(16.5, A, session_bytes=g(4), bank_max_bytes=g(8))
    d = drive(tick_plan(PolicyState(), CFG, now=0.0), s)
    assert d.result.state.bank_ceiling_bytes == g(4.5) and d.executed_of(ShrinkSessionCache) == []


# -- the governor: a skipped eviction, and fresh samples after freeing --------------------


async def test_a_blocked_eviction_is_skipped_uncounted_and_stale_samples_are_not_believed():
    reader = InMemoryMetricReader()
    inst = Instruments(MeterProvider(metric_readers=[reader]).get_meter("t"))
    old = figures(10 * GIB, GIB, at=999.5)  # 0.5 s old at the first poll: fresh enough
    fresh = figures(9 * GIB, GIB, at=1000.3)
    c = FakeEngine("c", pinned=True, sample=old, fresh=fresh)
    a = FakeEngine("a", last_used=1, measured_bytes=GIB)
    b = FakeEngine("b", last_used=2, measured_bytes=GIB)

    def aux() -> int:
        w.clock.advance(0.2)  # the clear ends at 1000.2: older samples are stale after it
        return 0

    w = make_world(CFG, readings(18), [a, b, c], aux_frees=aux, recorder=Recorder(inst=inst))

    def blocker(model_id: str) -> str | None:
        w.clock.advance(1.0)  # a request came for "a" since the decision
        return "busy" if model_id == "a" else None

    w.pool.eviction_blocker = blocker  # type: ignore[method-assign]
    r = await w.tick()

    # "a" is declined; the tick does not count its bytes as freed and takes the next
    # idle model instead.
    skipped, evicted = [o for o in r.outcomes if isinstance(o.action, EvictModel)]
    assert skipped.action.model_id == "a" and evicted.action.model_id == "b"
    assert (skipped.skipped, skipped.done, skipped.ok, skipped.bytes_freed) == (
        "busy", False, True, None)
    assert evicted.done
    assert [e[1] for e in w.pool.log if e[0] == "unload"] == ["b"]
    assert (w.sink.actions[-len(r.outcomes):] == [(o.action, o) for o in r.outcomes])
    data = reader.get_metrics_data()
    points = [(dict(p.attributes), p.value) for rm in data.resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics
              if m.name == names.METRIC_EVICTIONS for p in m.data.data_points]
    assert [(a[names.ATTR_MODEL], v) for a, v in points] == [("b", 1)]  # not "a"

    # poll: the 0.5 s old sample; after the aux clear (done, at 1000.2) that sample is
    # stale and the engine is asked for a fresh one; nothing older is believed again.
    assert w.reader.mlx_seen[:2] == [old, fresh]
    assert old not in w.reader.mlx_seen[1:]


async def test_after_a_done_eviction_samples_taken_before_it_are_ignored():
    early = figures(9 * GIB, GIB, at=1000.3)
    c = FakeEngine("c", pinned=True, sample=early)  # its fresh_sample answers the same
    b = FakeEngine("b", last_used=2, measured_bytes=GIB)
    w = make_world(CFG, readings(14), [b, c])
    def unload(model: str) -> None:
        w.clock.advance(1.0)  # the unload ends at 1001.0
        w.reader.current = readings(13)  # and frees b's 1 GiB

    w.pool.on_unload = unload
    result = await w.governor.make_room_for_load("new", g(4))  # 14 + 4 > 17; 13 + 4 fits
    assert result == LoadResult(evicted=("b",))
    # Before the load: the 0.3 s-ahead sample; after the eviction, only samples taken
    # after it count, and the engine has none: MLX figures are unavailable.
    assert w.reader.mlx_seen == [early, None]


async def test_a_refused_load_keeps_every_model_and_reports_the_refusal():
    engines = [FakeEngine("a", last_used=1, measured_bytes=GIB)]
    w = make_world(CFG, readings(14), engines)
    result = await w.governor.make_room_for_load("big", g(14))
    assert result.refusal is not None and result.evicted == ()
    assert [type(a) for a, _ in w.sink.actions] == [RefuseLoad]
    assert "a" in w.pool.engines and w.pool.log == []


def test_executed_steps_are_plain_data():
    driven = drive(load_plan("new", g(5), CFG), snap(14, *ENGINES), snap(10, *ENGINES))
    assert all(isinstance(s, Measure | Execute) for s in driven.steps)
