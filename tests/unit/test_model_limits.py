"""Model keep-alive and the loaded-model limits (memory.plans.model_limits), as pure plans
over scripted engine views and clock; then through the tick and the load plan.

Pins override every rule; busy models and models in their load warm-up are spared; the
least recently used idle model goes first.
"""

from __future__ import annotations

from memory.actions import (
    REASON_KEEP_ALIVE,
    REASON_MAX_LOADED_MODELS,
    REASON_MAX_MODEL_MEMORY,
    EvictModel,
    RefuseLoad,
)
from memory.config import MemoryConfig, ModelLimits
from memory.levels import GIB, Tier
from memory.plans.load import load_plan
from memory.plans.model_limits import (
    ERROR_MAX_LOADED_MODELS,
    ERROR_MAX_MODEL_MEMORY,
    expires_in,
    next_expiry_s,
    plan_model_limits,
    plan_room,
)
from memory.plans.steps import Snapshot
from memory.plans.tick import PolicyState, tick_plan
from memory.views import EngineState, EngineView
from tests.support.memory_fakes import readings
from tests.support.plans import drive

OLD = 60.0  # seconds since load: past the 10 s warm-up
NONE = ModelLimits()


def model(model_id: str, last_used: float, *, gib: float = 1.0, keep: float | None = None,
          age: float | None = OLD, **kw) -> EngineView:
    return EngineView(model_id, last_used=last_used, measured_bytes=int(gib * GIB),
                      keep_alive_s=keep, loaded_age_s=age, **kw)


def victims(actions: list[EvictModel]) -> list[tuple[str, str]]:
    return [(a.model_id, a.reason) for a in actions]


# -- keep-alive -------------------------------------------------------------------------------
def test_a_model_unused_for_its_keep_alive_goes_and_not_a_moment_before():
    m = model("a", last_used=100.0, keep=30.0)
    assert expires_in(m, 120.0) == 10.0
    assert plan_model_limits([m], 129.9, NONE) == []
    assert victims(plan_model_limits([m], 130.0, NONE)) == [("a", REASON_KEEP_ALIVE)]


def test_pins_busy_models_and_models_without_keep_alive_never_expire():
    engines = [model("pinned", 0.0, keep=1.0, pinned=True),
               model("busy", 0.0, keep=1.0, active_requests=1),
               model("forever", 0.0),
               model("loading", 0.0, keep=1.0, state=EngineState.LOADING)]
    assert plan_model_limits(engines, 1e6, NONE) == []
    assert next_expiry_s(engines, 1e6) is None


def test_zero_keep_alive_unloads_once_idle_and_the_soonest_expiry_is_reported():
    engines = [model("now", 50.0, keep=0.0), model("later", 50.0, keep=20.0)]
    assert next_expiry_s(engines, 55.0) == 0.0
    assert victims(plan_model_limits(engines, 55.0, NONE)) == [("now", REASON_KEEP_ALIVE)]
    assert next_expiry_s(engines[1:], 55.0) == 15.0


# -- the limits, every tick ------------------------------------------------------------------
def test_over_the_count_the_least_recently_used_idle_models_go():
    engines = [model("a", 30.0), model("b", 10.0), model("c", 20.0), model("d", 40.0)]
    assert victims(plan_model_limits(engines, 100.0, ModelLimits(max_loaded_models=2))) == [
        ("b", REASON_MAX_LOADED_MODELS), ("c", REASON_MAX_LOADED_MODELS)]


def test_the_count_spares_pinned_busy_and_warming_models():
    engines = [model("pinned", 1.0, pinned=True), model("busy", 2.0, active_requests=3),
               model("young", 3.0, age=1.0), model("idle", 4.0)]
    assert victims(plan_model_limits(engines, 100.0, ModelLimits(max_loaded_models=1),
                                     warmup_s=10.0)) == [
        ("idle", REASON_MAX_LOADED_MODELS)]


def test_over_the_bytes_lru_idle_models_go_until_under():
    engines = [model("a", 10.0, gib=2), model("b", 20.0, gib=3), model("c", 30.0, gib=4)]
    plan = plan_model_limits(engines, 100.0, ModelLimits(max_model_bytes=5 * GIB))
    assert victims(plan) == [("a", REASON_MAX_MODEL_MEMORY), ("b", REASON_MAX_MODEL_MEMORY)]


def test_an_expired_model_counts_toward_the_limits_no_more():
    engines = [model("old", 10.0, keep=5.0), model("b", 20.0), model("c", 30.0)]
    plan = plan_model_limits(engines, 100.0, ModelLimits(max_loaded_models=2))
    assert victims(plan) == [("old", REASON_KEEP_ALIVE)]


# -- before a load ---------------------------------------------------------------------------
def test_a_load_at_the_count_unloads_the_lru_idle_model_first():
    engines = [model("a", 10.0), model("b", 20.0)]
    room = plan_room(engines, "new", GIB, ModelLimits(max_loaded_models=2))
    assert room.refusal is None
    assert [(e.model_id, e.reason) for e in room.evictions] == [
        ("a", f"{REASON_MAX_LOADED_MODELS}:new")]


def test_a_load_that_cannot_get_room_evicts_nothing_and_says_why():
    engines = [model("pinned", 10.0, pinned=True), model("busy", 20.0, active_requests=1)]
    room = plan_room(engines, "new", GIB, ModelLimits(max_loaded_models=2))
    assert room.evictions == () and isinstance(room.refusal, RefuseLoad)
    assert room.refusal.error_reason == ERROR_MAX_LOADED_MODELS
    assert "pinned, busy" in room.refusal.message and "pinned" in room.refusal.message
    assert room.refusal.numbers == {"max_loaded_models": 2, "loaded_models": 2,
                                    "evictable_models": 0}
    # Reloading one already counted needs no room.
    assert plan_room(engines, "pinned", GIB, ModelLimits(max_loaded_models=2)).refusal is None


def test_a_load_over_the_bytes_unloads_lru_idle_models_or_is_refused():
    engines = [model("a", 10.0, gib=2), model("b", 20.0, gib=2)]
    limits = ModelLimits(max_model_bytes=5 * GIB)
    room = plan_room(engines, "new", 2 * GIB, limits)
    assert [e.model_id for e in room.evictions] == ["a"]
    hopeless = plan_room(engines, "new", 6 * GIB, limits)
    assert hopeless.evictions == () and hopeless.refusal.error_reason == ERROR_MAX_MODEL_MEMORY
    assert plan_room(engines, "new", None, limits).refusal is None  # size unknown yet


def test_the_load_plan_applies_the_limits_before_the_soft_mark():
    cfg = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20, max_loaded_models=1)
    first = Snapshot(readings(4), (model("a", 10.0),))
    after = Snapshot(readings(3), ())
    driven = drive(load_plan("new", GIB, cfg), [first, after])
    assert [a.model_id for a in driven.actions if isinstance(a, EvictModel)] == ["a"]
    assert driven.result.evicted == ("a",) and driven.result.refusal is None


def test_the_tick_unloads_an_expired_model_with_the_enforcer_off_too():
    for enabled in (True, False):
        cfg = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20, enabled=enabled)
        snap = Snapshot(readings(2), (model("a", 10.0, keep=5.0), model("b", 10.0)))
        driven = drive(tick_plan(PolicyState(), cfg, 100.0), [snap], repeat_last=True)
        evicted = [(a.model_id, a.reason) for a in driven.actions if isinstance(a, EvictModel)]
        assert evicted == [("a", REASON_KEEP_ALIVE)], enabled
