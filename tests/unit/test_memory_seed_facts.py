"""One scenario per fact of seeds/000_b8f669d67cca3e12.txt (oMLX ProcessMemoryEnforcer).

Scripted readings and a scripted clock drive the real `Governor.tick()` (the
`tick_plan` carried out by the real `Executor`) over fake engines; each test
asserts the exact actions, transitions and cadence.

Unless a test says otherwise the machine has 64 GiB and the tier is custom
with a 20 GiB ceiling: soft = 17 GiB, hard = 19 GiB, emergency at >= 20 GiB
(+2 GiB, or two polls). The level is raw: ok below soft, always.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading

import pytest

from memory.actions import (
    REASON_DYNAMIC_CEILING,
    REASON_EMERGENCY_ALL,
    REASON_EMERGENCY_BUSY,
    REASON_HARD_BUSY,
    REASON_HARD_LRU,
    REASON_POOL_RECLAIM,
    REASON_SESSION_SHRINK,
    REASON_SHRINK_RECLAIM,
    REASON_SOFT_LRU,
    AbortLoad,
    AbortRequests,
    AdjustBatchCap,
    AdjustStoreCacheCap,
    ClearAuxCaches,
    EvictModel,
    IdleReclaim,
    MarkPendingUnload,
    PauseAdmission,
    PressureReclaim,
    ShrinkSessionCache,
    Transition,
)
from memory.cadence import poll_interval
from memory.ceiling import compute_limits
from memory.chunking import (
    plan_chunk,
    prefill_abort_bytes,
    prefill_target_bytes,
    should_abort_before_chunk,
)
from memory.config import MemoryConfig
from memory.levels import GIB, PressureLevel, Tier
from memory.plans.tick import raw_level
from memory.readings import MemoryReader
from memory.views import EngineState, EngineView, RequestView
from tests.support.memory_fakes import (
    FakeEngine,
    FakeSessionTier,
    figures,
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


def reqs(*ids: str) -> tuple[RequestView, ...]:
    return tuple(RequestView(rid, started_at=float(i)) for i, rid in enumerate(ids))


def busy(model_id: str, *ids: str, **kw) -> FakeEngine:
    ids = ids or ("r1", "r2")
    return FakeEngine(model_id, active_requests=len(ids), requests=reqs(*ids), **kw)


def unloads(world) -> list[str]:
    return [entry[1] for entry in world.pool.log if entry[0] == "unload"]


# -- fact 1 ---------------------------------------------------------------------


async def test_fact01_levels_are_fractions_of_a_ceiling_recomputed_every_tick():
    # Balanced tier, 64 GiB: static = 64 - 6 = 58 GiB; dynamic = footprint + available.
    cfg = MemoryConfig(tier=Tier.BALANCED)
    w = make_world(cfg, readings(46, available_gib=4))

    r = await w.tick()  # dynamic 50 binds: soft 45, hard 47.5
    assert (r.limits.ceiling_bytes, r.limits.binding_term) == (50 * GIB, "dynamic")
    assert r.limits.soft_bytes == int(50 * GIB * 0.90)
    assert r.limits.hard_bytes == int(50 * GIB * 0.95)
    assert r.level is SOFT

    w.set_usage(46, available_gib=2)  # the system gave 2 GiB away: ceiling 48, hard 45.6
    r = await w.tick()
    assert r.limits.ceiling_bytes == 48 * GIB
    assert r.level is HARD

    w.set_usage(46, available_gib=30)  # dynamic 76: the static 58 binds, soft 52.2
    r = await w.tick()
    assert (r.limits.ceiling_bytes, r.limits.binding_term) == (58 * GIB, "static")
    assert r.level is OK
    assert [(t.from_level, t.to_level) for t in w.sink.transitions] == [
        (OK, SOFT),
        (SOFT, HARD),
        (HARD, OK),
    ]

    # Exact boundaries: ok below soft, soft in [soft, hard), hard at or above hard.
    limits = compute_limits(readings(0), CFG)
    assert (limits.soft_bytes, limits.hard_bytes) == (17 * GIB, 19 * GIB)
    assert raw_level(17 * GIB - 1, limits) is OK
    assert raw_level(17 * GIB, limits) is SOFT
    assert raw_level(19 * GIB - 1, limits) is SOFT
    assert raw_level(19 * GIB, limits) is HARD


# -- fact 2 ---------------------------------------------------------------------


async def test_fact02_soft_evicts_idle_lru_only_while_more_than_one_loaded_pauses_admission():
    a = FakeEngine("a", last_used=1.0, measured_bytes=GIB // 2)
    b = FakeEngine("b", last_used=2.0, measured_bytes=GIB // 2)
    p = FakeEngine("p", pinned=True, last_used=0.0, measured_bytes=4 * GIB)
    w = make_world(CFG, readings(18), [a, b, p])
    w.pool.on_unload = lambda model: w.set_usage(17.5)

    r = await w.tick()
    assert r.actions_of(EvictModel) == [EvictModel("a", REASON_SOFT_LRU, GIB // 2)]
    assert r.level is SOFT
    assert w.governor.admission_paused is True
    assert PauseAdmission(SOFT) in r.actions

    for _ in range(3):  # still soft: b is the last non-pinned model and stays
        r = await w.tick()
        assert r.actions_of(EvictModel) == []
    assert unloads(w) == ["a"]
    assert set(w.pool.engines) == {"b", "p"}


async def test_fact02_soft_leaves_in_flight_requests_alone():
    c = busy("c", "r1", "r2", last_used=0.0)
    a = FakeEngine("a", last_used=5.0, measured_bytes=GIB // 2)
    w = make_world(CFG, readings(18.5), [c, a])

    r = await w.tick()
    assert r.level is SOFT
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["a"]  # two non-pinned loaded
    assert r.actions_of(AbortRequests) == []
    assert r.actions_of(MarkPendingUnload) == []
    assert [call for call in c.calls if call[0] == "abort"] == []
    assert "c" in w.pool.engines


# -- fact 3 ---------------------------------------------------------------------


async def test_fact03_hard_unloads_even_the_last_idle_model_aborting_its_requests_first():
    a = FakeEngine("a", last_used=1.0, measured_bytes=2 * GIB, queued=("q1",))
    p = FakeEngine("p", pinned=True, measured_bytes=4 * GIB)
    w = make_world(CFG, readings(19.5), [a, p])
    w.pool.on_unload = lambda model: w.set_usage(17.5)

    r = await w.tick()
    # The forced unload ends whatever the model still holds before it
    # releases the weights; the ids it ended come back in the outcome.
    assert r.actions_of(EvictModel) == [EvictModel("a", REASON_HARD_LRU, 2 * GIB)]
    assert [e for e in w.pool.log if e[0] == "unload"] == [("unload", "a", REASON_HARD_LRU)]
    (evict,) = [o for o in r.outcomes if isinstance(o.action, EvictModel)]
    assert evict.done and evict.bytes_freed == 2 * GIB and evict.request_ids == ("q1",)
    assert "p" in w.pool.engines
    assert r.level is SOFT  # re-measured after the unload


# -- fact 4 ---------------------------------------------------------------------


async def test_fact04_hard_sole_busy_victim_is_aborted_and_kept_loaded():
    b = busy("b", "r1", "r2")
    p = FakeEngine("p", pinned=True)
    w = make_world(CFG, readings(19.5), [b, p])

    r = await w.tick()
    assert r.level is HARD and not r.emergency
    assert r.actions_of(AbortRequests) == [AbortRequests("b", None, REASON_HARD_BUSY, True)]
    assert r.actions_of(MarkPendingUnload) == []
    assert ("abort", REASON_HARD_BUSY, None) in b.calls
    assert unloads(w) == [] and not b.pending_unload


async def test_fact04_hard_sole_busy_victim_in_emergency_is_marked_pending_unload():
    b = busy("b", "r1", "r2")
    p = FakeEngine("p", pinned=True)
    w = make_world(CFG, readings(22.5), [b, p])  # 2.5 GiB over the 20 GiB ceiling

    r = await w.tick()
    assert r.level is EMERGENCY
    assert r.actions_of(AbortRequests) == [AbortRequests("b", None, REASON_EMERGENCY_BUSY, False)]
    assert r.actions_of(MarkPendingUnload) == [MarkPendingUnload("b", REASON_EMERGENCY_BUSY)]
    assert ("mark_pending_unload", "b", REASON_EMERGENCY_BUSY) in w.pool.log
    assert unloads(w) == []  # busy: the pool unloads it once idle
    assert b.pending_unload


# -- fact 5 ---------------------------------------------------------------------


async def test_fact05_hard_nothing_evictable_flags_loads_before_anything_else():
    p = busy("p", "r1", pinned=True)
    loading = FakeEngine("l", state=EngineState.LOADING)
    w = make_world(CFG, readings(19.5), [p, loading])

    r = await w.tick()
    assert r.actions_of(AbortLoad) == [AbortLoad("l")]
    assert ("flag_load_abort",) in loading.calls
    assert r.actions_of(AbortRequests) == []
    assert r.actions_of(IdleReclaim) == []


async def test_fact05_hard_no_loads_requests_idle_reclaim_when_not_emergency():
    p = busy("p", "r1", pinned=True)
    q = FakeEngine("q", pinned=True)
    w = make_world(CFG, readings(19.5), [p, q])

    r = await w.tick()
    assert r.actions_of(IdleReclaim) == [IdleReclaim("p"), IdleReclaim("q")]
    assert r.actions_of(AbortRequests) == []
    assert ("idle_reclaim",) in p.calls and ("idle_reclaim",) in q.calls


async def test_fact05_hard_no_loads_aborts_active_requests_only_in_emergency():
    p = busy("p", "r1", pinned=True)
    q = FakeEngine("q", pinned=True)
    w = make_world(CFG, readings(22.0), [p, q])

    r = await w.tick()
    assert r.level is EMERGENCY
    assert r.actions_of(AbortRequests) == [AbortRequests("p", None, REASON_EMERGENCY_ALL, True)]
    assert r.actions_of(IdleReclaim) == []
    assert unloads(w) == []  # pinned models stay loaded


# -- fact 6 ---------------------------------------------------------------------


async def test_fact06_emergency_needs_the_real_ceiling_and_two_gib_or_two_polls():
    w = make_world(CFG, readings(19.5), [FakeEngine("p", pinned=True)])

    for _ in range(3):  # at the hard mark, under the ceiling: never emergency
        r = await w.tick()
        assert (r.level, r.emergency) == (HARD, False)

    w.set_usage(22.0)  # exactly ceiling + 2 GiB: emergency on the first poll
    r = await w.tick()
    assert (r.level, r.emergency) == (EMERGENCY, True)

    w.set_usage(19.0)  # under the ceiling: the counter resets
    r = await w.tick()
    assert (r.level, r.state.over_ceiling_polls) == (HARD, 0)

    w.set_usage(20.5)
    r = await w.tick()
    assert (r.level, r.state.over_ceiling_polls) == (HARD, 1)  # one poll over
    r = await w.tick()
    assert (r.level, r.state.over_ceiling_polls) == (EMERGENCY, 2)  # second consecutive poll


# -- fact 7 ---------------------------------------------------------------------


async def test_fact07_a_soft_tick_clears_aux_caches_and_remeasures_before_pausing():
    a = FakeEngine("a", last_used=1.0, measured_bytes=GIB)
    b = FakeEngine("b", last_used=2.0, measured_bytes=GIB)

    def aux_frees() -> int:
        w.set_usage(16.5)  # the decode cache held 1.5 GiB
        return 3 * GIB // 2

    w = make_world(CFG, readings(18), [a, b], aux_frees=aux_frees)
    r = await w.tick()
    assert w.aux_calls == [3 * GIB // 2]
    assert w.reader.reads == 2  # measured, cleared, re-measured
    assert r.level is OK
    assert r.actions_of(PauseAdmission) == [] and r.actions_of(EvictModel) == []
    assert w.sink.transitions == []


async def test_fact07_aux_clear_comes_before_the_pause_and_the_eviction():
    a = FakeEngine("a", last_used=1.0, measured_bytes=GIB)
    b = FakeEngine("b", last_used=2.0, measured_bytes=GIB)
    w = make_world(CFG, readings(18), [a, b])
    r = await w.tick()
    kinds = [type(x).__name__ for x in r.actions]
    assert kinds.index("ClearAuxCaches") < kinds.index("PauseAdmission")
    assert kinds.index("PauseAdmission") < kinds.index("EvictModel")
    assert w.pool.log[0][0] == "aux_clear"


# -- fact 8 ---------------------------------------------------------------------


async def test_fact08_pressure_reclaim_defers_enforcement_at_most_five_polls_per_episode():
    a = busy("a", "r1", last_used=5.0)
    b = FakeEngine("b", last_used=1.0, measured_bytes=GIB)
    w = make_world(CFG, readings(18, pool_gib=3), [a, b])

    for poll in range(1, 6):
        r = await w.tick()
        assert r.deferred and r.state.grace_polls == poll
        assert r.actions_of(PressureReclaim) == [PressureReclaim("a"), PressureReclaim("b")]
        assert r.actions_of(EvictModel) == []
    assert a.calls.count(("pressure_reclaim",)) == 5  # sent to the busy engine too

    r = await w.tick()  # grace spent: enforcement goes ahead
    assert not r.deferred and r.state.grace_polls == 5
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["b"]

    w.set_usage(10, pool_gib=3)  # back to ok: the episode ends, the counter resets
    r = await w.tick()
    assert (r.level, r.state.grace_polls) == (OK, 0)
    assert r.actions_of(PressureReclaim) == []  # ok: no reclaim

    w.set_usage(18, pool_gib=3)  # a new episode gets its own grace
    r = await w.tick()
    assert r.deferred and r.state.grace_polls == 1


async def test_fact08_emergency_is_never_deferred():
    b = FakeEngine("b", measured_bytes=4 * GIB)
    w = make_world(CFG, readings(22.5, pool_gib=3), [b])
    r = await w.tick()
    assert r.level is EMERGENCY and not r.deferred
    # "not ok and not emergency": no pressure reclaim at all in an emergency tick,
    # even with the pool over its floor; nothing may wait.
    assert r.actions_of(PressureReclaim) == []
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["b"]


async def test_fact08_no_pressure_reclaim_anywhere_in_an_emergency_tick():
    # A session shrink in emergency frees references, but nothing may wait for a drain.
    b = busy("b", "r1")
    tier = FakeSessionTier(4 * GIB)
    w = make_world(CFG, readings(22.5, pool_gib=9), [b], tier=tier)
    r = await w.tick()
    assert r.level is EMERGENCY and not r.deferred
    assert r.actions_of(ShrinkSessionCache)[0] == ShrinkSessionCache(0, True)
    assert r.actions_of(PressureReclaim) == []
    assert ("pressure_reclaim",) not in b.calls
    assert r.actions_of(AbortRequests) == [AbortRequests("b", None, REASON_EMERGENCY_BUSY, False)]


# -- fact 9 ---------------------------------------------------------------------


async def test_fact09_reclaim_is_skipped_unless_the_pool_exceeds_two_gib():
    a = busy("a", last_used=5.0)
    b = FakeEngine("b", last_used=1.0, measured_bytes=GIB)
    w = make_world(CFG, readings(18, pool_gib=2), [a, b])  # exactly 2 GiB: not over
    r = await w.tick()
    assert r.actions_of(PressureReclaim) == []
    assert not r.deferred
    assert [e.model_id for e in r.actions_of(EvictModel)] == ["b"]

    just_over = dataclasses.replace(readings(18), mlx_pool_bytes=2 * GIB + 1)
    w2 = make_world(CFG, just_over, [busy("a"), FakeEngine("b")])
    r = await w2.tick()
    assert r.actions_of(PressureReclaim) and r.deferred


async def test_fact09_a_session_shrink_that_freed_references_triggers_reclaim_with_small_pool():
    a = busy("a", last_used=5.0)
    tier = FakeSessionTier(4 * GIB)
    w = make_world(CFG, readings(19.5, pool_gib=0), [a], tier=tier)
    r = await w.tick()
    # target = bank - (usage - soft) = 4 - 2.5 = 1.5 GiB; then the upkeep holds the bank
    # to its dynamic ceiling (20 - 3 reserve - 18 working set: the 1 GiB floor).
    assert r.actions_of(ShrinkSessionCache) == [
        ShrinkSessionCache(3 * GIB // 2, True),
        ShrinkSessionCache(GIB, True, REASON_DYNAMIC_CEILING),
    ]
    assert tier.calls == [(3 * GIB // 2, True, REASON_SESSION_SHRINK),
                          (GIB, True, REASON_DYNAMIC_CEILING)]
    assert r.actions_of(PressureReclaim) == [PressureReclaim("a", REASON_SHRINK_RECLAIM)]
    assert r.deferred  # the freed references get a poll to drain
    assert r.actions_of(AbortRequests) == []


# -- fact 10 --------------------------------------------------------------------


def _forbid_mlx(monkeypatch) -> None:
    import mlx.core as mx

    def forbidden(*_a, **_k) -> int:
        raise AssertionError("the governor called MLX itself")

    for name in ("get_active_memory", "get_cache_memory", "get_peak_memory", "clear_cache"):
        monkeypatch.setattr(mx, name, forbidden)


async def test_fact10_the_governor_never_touches_mlx_it_sets_flags_and_reads_samples(monkeypatch):
    _forbid_mlx(monkeypatch)
    a = busy("a", "r1", sample=(5 * GIB, 3 * GIB))
    b = busy("b", "r2", sample=(6 * GIB, 2 * GIB))
    cfg = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=6.5)  # soft 5.525, hard 6.175
    w = make_world(cfg, readings(0), [a, b])
    w.executor._reader = MemoryReader(probe_device=False)  # the real reader, real RSS

    r = await w.tick()
    assert r.readings.sources["mlx"] == "engine thread sample"
    # MLX's allocator is process-wide: the largest of the engines' figures is the safe one.
    assert (r.readings.mlx_active_bytes, r.readings.mlx_pool_bytes) == (6 * GIB, 3 * GIB)
    assert r.level is SOFT
    # The governor only sets flags; the engine thread drains the pool at its next
    # step boundary even though both engines are busy. No idle reclaim is sent.
    assert r.actions_of(PressureReclaim) == [PressureReclaim("a"), PressureReclaim("b")]
    assert ("pressure_reclaim",) in a.calls and ("pressure_reclaim",) in b.calls
    assert r.actions_of(IdleReclaim) == []
    assert r.deferred  # accepted: the drain gets its poll


async def test_fact10_without_engine_samples_mlx_is_unavailable_never_asked(monkeypatch):
    _forbid_mlx(monkeypatch)
    w = make_world(CFG, readings(0), [FakeEngine("a")])  # idle, no sample
    w.executor._reader = MemoryReader(probe_device=False)
    r = await w.tick()
    assert (r.readings.mlx_active_bytes, r.readings.mlx_pool_bytes) == (None, None)
    assert r.readings.sources["mlx"].startswith("unavailable")
    assert r.readings.process_bytes == r.readings.footprint_bytes
    # The executor asked the engine thread for a sample (it had none); it did not call MLX.
    assert [c[0] for c in w.engine("a").calls if "sample" in c[0]] == [
        "mlx_sample", "fresh_sample"]


async def test_fact10_a_stale_engine_sample_is_not_a_reading_of_now():
    a = FakeEngine("a", sample=figures(7 * GIB, GIB, at=1000.0 - 2.5))  # 2.5 s old
    a.fresh = figures(5 * GIB, GIB, at=1000.0)
    w = make_world(CFG, readings(5), [a])
    await w.tick()
    assert w.reader.mlx_seen == [figures(5 * GIB, GIB, at=1000.0)]


# -- fact 11 --------------------------------------------------------------------


async def test_fact11_after_a_hard_shrink_the_level_is_recomputed_and_may_drop_to_ok():
    a = FakeEngine("a", measured_bytes=4 * GIB)
    tier = FakeSessionTier(6 * GIB)
    w = make_world(CFG, readings(19.5), [a], tier=tier)
    tier.on_shrink = lambda freed: w.set_usage(15.0)

    r = await w.tick()
    assert r.level is OK
    assert unloads(w) == [] and r.actions_of(EvictModel) == []
    assert [(t.from_level, t.to_level, t.reason) for t in r.transitions] == [
        (OK, HARD, "poll"),
        (HARD, OK, "after_session_shrink"),
    ]
    assert not w.governor.admission_paused


async def test_fact11_after_a_hard_shrink_the_level_may_drop_to_soft_without_eviction():
    a = FakeEngine("a", measured_bytes=4 * GIB)
    tier = FakeSessionTier(6 * GIB)
    w = make_world(CFG, readings(19.5), [a], tier=tier)
    tier.on_shrink = lambda freed: w.set_usage(18.0)

    r = await w.tick()
    assert r.level is SOFT
    assert unloads(w) == []  # soft, and a is the last non-pinned model


# -- fact 12 --------------------------------------------------------------------


async def test_fact12_store_cache_cap_walks_one_step_every_tick_including_deferred_and_ok():
    a = FakeEngine("a", max_num_seqs=4, pinned=True)
    w = make_world(CFG, readings(18, pool_gib=3), [a])

    caps = []
    for _ in range(5):  # soft: the first ticks are deferred (grace), the walk goes on
        r = await w.tick()
        assert r.actions_of(AdjustStoreCacheCap) == [AdjustStoreCacheCap("a", SOFT)]
        assert r.actions_of(AdjustBatchCap) == [AdjustBatchCap("a", SOFT)]  # and the batch cap
        caps.append((r.deferred, a.gate.cap, a.batch.cap))
    assert caps == [(True, 3, 3), (True, 2, 2), (True, 1, 1), (True, 1, 1), (True, 1, 1)]

    w.set_usage(10)
    ok_caps = []
    for _ in range(5):  # ok: back toward max_num_seqs, one step a tick
        r = await w.tick()
        assert r.actions_of(AdjustStoreCacheCap) == [AdjustStoreCacheCap("a", OK)]
        assert r.actions_of(AdjustBatchCap) == [AdjustBatchCap("a", OK)]
        ok_caps.append((a.gate.cap, a.batch.cap))
    assert ok_caps == [(2, 2), (3, 3), (4, 4), (4, 4), (4, 4)]


async def test_fact12_every_tick_walks_both_caps_of_every_ready_engine():
    engines = [FakeEngine("a", pinned=True), FakeEngine("b", last_used=5.0, measured_bytes=GIB),
               FakeEngine("l", state=EngineState.LOADING)]
    w = make_world(CFG, readings(5), engines)
    for usage in (5, 18, 19.5, 22.5, 5):  # ok, soft, hard, emergency, ok
        w.set_usage(usage)
        r = await w.tick()
        ready = [m for m in ("a", "b") if m in w.pool.engines]
        assert r.actions_of(AdjustStoreCacheCap) == [
            AdjustStoreCacheCap(m, r.state.level) for m in ready]
        assert r.actions_of(AdjustBatchCap) == [AdjustBatchCap(m, r.state.level) for m in ready]


# -- fact 13 --------------------------------------------------------------------


async def test_fact13_poll_interval_is_1s_active_10s_idle_30s_empty():
    w = make_world(CFG, readings(5), [])
    await w.tick()
    assert w.governor.poll_interval == 30.0  # nothing loaded

    idle = w.pool.add(FakeEngine("a"))
    await w.tick()
    assert w.governor.poll_interval == 10.0  # loaded and idle

    idle.active_requests = 2
    await w.tick()
    assert w.governor.poll_interval == 1.0  # active requests

    idle.active_requests = None
    await w.tick()
    assert w.governor.poll_interval == 1.0  # cannot report

    idle.active_requests = 0
    w.pool.add(FakeEngine("l", state=EngineState.LOADING))
    await w.tick()
    assert w.governor.poll_interval == 1.0  # a model is loading

    del w.pool.engines["l"]
    w.set_usage(18)
    await w.tick()
    assert w.governor.poll_interval == 1.0  # not ok

    w.set_usage(5)
    await w.tick()
    assert w.governor.poll_interval == 10.0
    w.governor.wake()  # every wake opens a live activity hint
    await w.tick()
    assert w.governor.poll_interval == 1.0
    w.clock.advance(2.5)  # the hint lapsed: idle again
    await w.tick()
    assert w.governor.poll_interval == 10.0

    views = [EngineView("a")]
    assert poll_interval(OK, 0.0, -1.0, False, views) == 10.0
    assert poll_interval(OK, 0.0, -1.0, False, []) == 30.0
    assert poll_interval(SOFT, 0.0, -1.0, False, []) == 1.0
    assert poll_interval(OK, 0.0, 0.5, False, []) == 1.0
    assert poll_interval(OK, 0.0, -1.0, True, []) == 1.0


# -- fact 14 --------------------------------------------------------------------


async def test_fact14_wake_rechecks_early_and_extends_an_activity_hint_of_at_least_2s():
    w = make_world(CFG, readings(5), [FakeEngine("a")])  # idle: 10 s interval
    task = asyncio.create_task(w.governor.run())
    try:
        await asyncio.sleep(0.05)
        assert w.reader.reads == 1 and w.governor.poll_interval == 10.0
        assert w.governor.activity_hint_until == -math.inf

        w.governor.wake()  # from the loop's thread: re-checks AND opens a hint
        assert w.governor.activity_hint_until == 1002.0  # max(2 s, 2 x 1 s)
        await asyncio.sleep(0.05)
        assert w.reader.reads == 2 and w.governor.poll_interval == 1.0

        w.clock.now = 1001.0  # a later wake never shortens the window, it extends it
        thread = threading.Thread(target=w.governor.wake)  # from another thread
        thread.start()
        thread.join()
        assert w.governor.activity_hint_until == 1003.0
        await asyncio.sleep(0.05)
        assert w.reader.reads == 3 and w.governor.poll_interval == 1.0

        w.clock.now = 1003.5  # the hint has lapsed, but a plain wake opens a new one
        w.governor.wake()
        assert w.governor.activity_hint_until == 1005.5
        await asyncio.sleep(0.05)
        assert w.reader.reads == 4 and w.governor.poll_interval == 1.0
    finally:
        w.governor.stop()
        await asyncio.wait_for(task, 1.0)

    w.clock.now = 1006.0  # no wake since: once the hint lapses the idle cadence is back
    await w.tick()
    assert w.governor.poll_interval == 10.0

    slow = make_world(MemoryConfig(active_poll_s=1.5), readings(1))
    slow.clock.now = 50.0
    slow.governor.wake()
    assert slow.governor.activity_hint_until == 53.0  # 2 x 1.5 s beats 2 s


async def test_fact14_note_activity_rechecks_only_from_the_long_idle_sleep():
    w = make_world(CFG, readings(5), [FakeEngine("a")])
    task = asyncio.create_task(w.governor.run())
    try:
        await asyncio.sleep(0.05)
        assert (w.reader.reads, w.governor.poll_interval) == (1, 10.0)
        w.governor.note_activity()  # asleep for 10 s: re-check now, poll fast
        await asyncio.sleep(0.05)
        assert (w.reader.reads, w.governor.poll_interval) == (2, 1.0)
        assert w.governor.activity_hint_until == 1002.0
        w.clock.now = 1001.0
        w.governor.note_activity()  # already polling fast: the hint grows, no extra tick
        await asyncio.sleep(0.05)
        assert w.reader.reads == 2 and w.governor.activity_hint_until == 1003.0
    finally:
        w.governor.stop()
        await asyncio.wait_for(task, 1.0)


# -- fact 15 --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tier", "chunk_fraction", "abort_margin"),
    [
        (Tier.SAFE, 0.90, 0.90),
        (Tier.BALANCED, 0.92, 0.93),
        (Tier.AGGRESSIVE, 0.97, 0.97),
        (Tier.CUSTOM, 0.95, 0.95),
    ],
)
def test_fact15_prefill_chunk_fractions_and_pre_chunk_abort_margins(
    tier, chunk_fraction, abort_margin
):
    cap = 100 * GIB  # the hard ceiling (and here the stable abort cap too)
    assert prefill_target_bytes(tier, cap) == int(cap * chunk_fraction)
    assert prefill_abort_bytes(tier, cap) == int(cap * abort_margin)
    bpt = 1 << 20  # 1 MiB a token

    def chunk(usage: int) -> int:
        return plan_chunk(tier=tier, ceiling_bytes=cap, usage_bytes=usage,
                          bytes_per_token=bpt, remaining_tokens=10**6)

    # Far from the line: the full chunk; nearer: fewer tokens; at the line: the minimum.
    assert chunk(0) == 2048
    assert chunk(int(cap * chunk_fraction) - 100 * bpt) == 100
    assert chunk(int(cap * chunk_fraction)) == 32

    def aborts(usage: int, ceiling: int = cap) -> bool:
        return should_abort_before_chunk(tier=tier, abort_cap_bytes=cap, ceiling_bytes=ceiling,
                                         usage_bytes=usage, chunk_tokens=32,
                                         bytes_per_token=bpt)

    line = int(cap * abort_margin)
    assert not aborts(line - 32 * bpt)
    assert aborts(line - 32 * bpt + 1)
    # The abort line is the margin of the stable cap, and never past the moving ceiling.
    low = line - GIB
    assert not aborts(low - 32 * bpt, ceiling=low) and aborts(low - 32 * bpt + 1, ceiling=low)


# -- fact 16 (correction) ---------------------------------------------------------


async def test_fact16_cap_walk_runs_per_tick_not_per_transition():
    a = FakeEngine("a", max_num_seqs=8)
    w = make_world(CFG, readings(18), [a, FakeEngine("p", pinned=True)])
    for _ in range(4):  # one soft episode, a single transition, four steps down
        await w.tick()
        assert w.governor.poll_interval == 1.0
    assert len(w.sink.transitions) == 1
    assert a.gate.cap == 4

    w.set_usage(5)
    await w.tick()  # ok: the transition tick steps once
    assert a.gate.cap == 5
    assert w.governor.poll_interval == 10.0  # idle and ok: a 10 s cadence
    for _ in range(2):  # no transitions, and the walk still steps each (10 s) tick
        w.clock.advance(10.0)
        await w.tick()
    assert a.gate.cap == 7
    assert len(w.sink.transitions) == 2
    assert [t.to_level for t in w.sink.transitions] == [SOFT, OK]
    assert all(isinstance(t, Transition) for t in w.sink.transitions)


def test_seed_constants_match_the_reference():
    from memory import levels

    assert levels.EMERGENCY_MARGIN_BYTES == 2 * GIB
    assert levels.EMERGENCY_POLLS == 2
    assert levels.POOL_RECLAIM_FLOOR_BYTES == 2 * GIB
    assert levels.PRESSURE_RECLAIM_GRACE_POLLS_MAX == 5
    assert (levels.ACTIVE_POLL_S, levels.IDLE_POLL_S, levels.EMPTY_POLL_S) == (1.0, 10.0, 30.0)
    assert levels.ACTIVITY_HINT_MIN_S == 2.0
    assert ClearAuxCaches() == ClearAuxCaches()
    assert REASON_POOL_RECLAIM == "pool_reclaim"
