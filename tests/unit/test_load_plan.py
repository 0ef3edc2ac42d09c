"""Loads that cannot stay: a load is admitted only if it fits under the soft mark after
the evictions it makes, a hopeless one evicts nothing, and a just-loaded model is spared
idle eviction for its warm-up (below hard) by the tick, admission and other loads.

Pure plans driven by scripted snapshots. Ceiling 20 GiB (custom tier on 64 GiB): soft
17, hard 19, emergency at 22 (ceiling + 2 GiB). Warm-up: the default 10 s.
"""

from __future__ import annotations

import asyncio
import math
import os
from dataclasses import replace

import pytest

from engine.pool import ModelEntry, ModelPool, ModelState
from memory.actions import (
    MEASURE_LOAD,
    REASON_ADMISSION_EVICT,
    REASON_HARD_LRU,
    REASON_SOFT_LRU,
    EvictModel,
    RefuseLoad,
)
from memory.ceiling import compute_limits
from memory.config import LOAD_WARMUP_S, MemoryConfig
from memory.levels import GIB, MIB, PressureLevel, Tier
from memory.plans.admission import AdmissionRequest, AdmissionSettings, Verdict, admission_plan
from memory.plans.eviction import idle_victims, warming
from memory.plans.load import BINDING_LOAD_SOFT, ERROR_LOAD_EXCEEDS_SOFT, LoadResult, load_plan
from memory.plans.steps import Measure, Snapshot
from memory.plans.tick import PolicyState, ReliefMemo, assess, plan_relief, tick_plan
from memory.readings import MemoryReadings
from memory.views import EngineView
from service.engines import EngineHandleAdapter
from tests.support.memory_fakes import drive, readings

CFG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20)
SOFT, CEILING = 17 * GIB, 20 * GIB
YOUNG, OLD = 1.0, 60.0  # seconds since load: inside and past the 10 s warm-up


def g(x: float) -> int:
    return int(x * GIB)


def snap(usage: float, *engines: EngineView) -> Snapshot:
    return Snapshot(readings(usage), tuple(engines))


def idle(model_id: str, size: float, last_used: float, age: float | None = OLD,
         **kw) -> EngineView:
    return EngineView(model_id, last_used=last_used, measured_bytes=g(size), loaded_age_s=age,
                      **kw)


def evicted(driven) -> list[str]:
    return [a.model_id for a in driven.executed_of(EvictModel)]


def refusal_of(driven) -> RefuseLoad:
    (refusal,) = driven.executed_of(RefuseLoad)
    return refusal


# -- a. admitted only under soft -------------------------------------------------------


def test_a_load_under_the_ceiling_but_over_soft_is_refused_with_the_numbers():
    # 16 + 2 = 18: under the 20 GiB ceiling (the old rule admitted it), over soft (17).
    engines = (EngineView("p", pinned=True, measured_bytes=g(4)),)
    driven = drive(load_plan("new", g(2), CFG), snap(16, *engines))
    refusal = refusal_of(driven)
    assert driven.steps[0] == Measure(MEASURE_LOAD) and evicted(driven) == []
    assert driven.result == LoadResult(refusal=refusal)
    assert (refusal.binding, refusal.error_reason, refusal.tried) == (
        BINDING_LOAD_SOFT, ERROR_LOAD_EXCEEDS_SOFT, ())
    assert refusal.numbers == {"estimated_bytes": g(2), "usage_bytes": g(16),
                               "soft_bytes": SOFT, "ceiling_bytes": CEILING,
                               "freeable_bytes": 0}
    assert "soft mark 17408 MiB" in refusal.message
    assert "no idle model may be evicted" in refusal.message


def test_a_load_evicts_only_until_it_fits_under_soft():
    # 16 + 2 = 18 > 17: a (1 GiB, least recently used) brings it to 15 + 2 = 17.
    engines = (idle("a", 1, last_used=1), idle("b", 2, last_used=2))
    driven = drive(load_plan("new", g(2), CFG), snap(16, *engines), snap(15, *engines))
    assert evicted(driven) == ["a"]
    assert driven.result == LoadResult(evicted=("a",))


def test_after_its_evictions_a_load_still_over_soft_is_refused_naming_them():
    # The prediction fits (15 + 2 = 17); the fresh reading says 16: refused, b kept.
    engines = (idle("a", 1, last_used=1), idle("b", 2, last_used=2))
    driven = drive(load_plan("new", g(2), CFG), snap(16, *engines), snap(16, *engines))
    refusal = refusal_of(driven)
    assert evicted(driven) == ["a"] and refusal.tried == ("evict:a",)
    assert refusal.numbers["usage_bytes"] == g(16)
    assert driven.result == LoadResult(evicted=("a",), refusal=refusal)


# -- b. hopeless: nothing evicted --------------------------------------------------------


def test_a_hopeless_load_unloads_no_idle_model_for_nothing():
    # The observed case: a 1 GiB load, two idle 300 MiB models. 16.8 - 0.59 + 1 > 17
    # even after both; under the ceiling, so the old rule unloaded both first.
    engines = (idle("m1", 300 / 1024, last_used=1), idle("m2", 300 / 1024, last_used=2))
    driven = drive(load_plan("big", g(1), CFG), snap(16.8, *engines))
    refusal = refusal_of(driven)
    assert evicted(driven) == [] and len(driven.steps) == 2  # one measure, the refusal
    assert refusal.numbers["freeable_bytes"] == 2 * g(300 / 1024)
    assert refusal.tried == ()
    assert "even after evicting every idle model it may" in refusal.message
    assert "nothing was evicted" in refusal.message


# -- c. the warm-up ------------------------------------------------------------------------


def test_warming_means_younger_than_the_warm_up_and_not_marked_for_unloading():
    assert warming(idle("w", 1, 0, age=9.99), 10.0)
    assert not warming(idle("w", 1, 0, age=10.0), 10.0)
    assert not warming(idle("w", 1, 0, age=None), 10.0)  # unknown: never protected
    assert not warming(idle("w", 1, 0, age=0.0), 0.0)  # warm-up 0: off
    assert not warming(idle("w", 1, 0, age=1.0, pending_unload=True), 10.0)


def test_idle_victims_leave_warming_models_out_or_put_them_last():
    engines = [idle("w", 1, last_used=0, age=YOUNG), idle("b", 1, last_used=2),
               idle("a", 1, last_used=1), idle("pending", 1, last_used=3, age=YOUNG,
                                               pending_unload=True)]
    ids = [e.model_id for e in idle_victims(engines, warmup_s=10.0)]
    assert ids == ["pending", "a", "b"]
    last = [e.model_id for e in idle_victims(engines, warmup_s=10.0, warming_last=True)]
    assert last == ["pending", "a", "b", "w"]
    # No warm-up given: the ladder's order as before.
    assert [e.model_id for e in idle_victims(engines)] == ["pending", "w", "a", "b"]


def test_a_load_never_evicts_a_model_in_its_warm_up():
    w, a = idle("w", 2, last_used=0, age=YOUNG), idle("a", 1, last_used=1)
    fits = drive(load_plan("new", g(2), CFG), snap(16, w, a), snap(15, w, a))
    assert evicted(fits) == ["a"]  # w is the least recently used, but warming
    # 3 GiB could fit only by evicting w: refused, and a is kept too; the refusal says
    # when w's warm-up ends (10 - 1 s), and asks the client to retry then.
    hopeless = drive(load_plan("new", g(3), CFG), snap(16, w, a))
    refusal = refusal_of(hopeless)
    assert evicted(hopeless) == []
    assert (refusal.numbers["freeable_bytes"], refusal.numbers["warming_bytes"]) == (g(1), g(2))
    assert refusal.retry_after_s == 9.0
    assert "once 'w' (2048 MiB) pass their load warm-up, in 9.0 s" in refusal.message
    # Even w could not make room for 6 GiB: no hint, the usual retry.
    never = refusal_of(drive(load_plan("new", g(6), CFG), snap(16, w, a)))
    assert "warming_bytes" not in never.numbers and never.retry_after_s == 10.0
    # Past its warm-up w is an ordinary idle victim.
    w_old = idle("w", 2, last_used=0, age=LOAD_WARMUP_S)
    later = drive(load_plan("new", g(3), CFG), snap(16, w_old, a), snap(14, w_old, a))
    assert evicted(later) == ["w"] and later.result.refusal is None  # 14 + 3 = 17


def tick_evictions(usage: float, *engines: EngineView, config: MemoryConfig = CFG
                   ) -> list[tuple[str, str]]:
    driven = drive(tick_plan(PolicyState(), config, now=100.0), snap(usage, *engines))
    return [(a.model_id, a.reason) for a in driven.executed_of(EvictModel)]


def test_the_tick_at_soft_spares_a_warming_model_then_follows_the_seed():
    # Another model is busy, so the just-loaded one is the only idle victim and more
    # than one is loaded: the seed's soft rule would unload it at once.
    busy = EngineView("busy", active_requests=1, last_used=5, measured_bytes=g(4),
                      loaded_age_s=OLD)
    assert tick_evictions(17.5, busy, idle("new", 1, last_used=4, age=YOUNG)) == []
    assert tick_evictions(17.5, busy, idle("new", 1, last_used=4, age=LOAD_WARMUP_S)) == [
        ("new", REASON_SOFT_LRU)]
    no_warmup = CFG.replace(load_warmup_s=0)
    assert tick_evictions(17.5, busy, idle("new", 1, last_used=4, age=YOUNG),
                          config=no_warmup) == [("new", REASON_SOFT_LRU)]


def test_at_soft_an_older_idle_model_goes_instead_of_the_warming_one():
    young, old = idle("new", 1, last_used=1, age=YOUNG), idle("old", 1, last_used=5)
    assert tick_evictions(17.5, young, old) == [("old", REASON_SOFT_LRU)]


def test_at_hard_a_warming_model_goes_last_but_does_go():
    # Hard unloads even the last idle model; the warm-up only orders it after the rest.
    young, old = idle("new", 2, last_used=5, age=YOUNG), idle("old", 1, last_used=9)
    assert tick_evictions(19.5, young, old) == [("old", REASON_HARD_LRU),
                                                ("new", REASON_HARD_LRU)]
    assert tick_evictions(19.5, young) == [("new", REASON_HARD_LRU)]


def test_in_an_emergency_a_warming_model_is_no_shield():
    young, old = idle("new", 3, last_used=5, age=YOUNG), idle("old", 1, last_used=9)
    assert tick_evictions(22.5, young, old) == [("old", REASON_HARD_LRU),
                                                ("new", REASON_HARD_LRU)]


@pytest.mark.parametrize("usage", [17.5, 19.5, 22.5])
def test_past_the_warm_up_the_relief_is_exactly_the_seeds(usage: float):
    # Soft, hard and emergency: models past their warm-up are handled as models with no
    # load age at all (what the seed tests script).
    engines = [EngineView("p", pinned=True, last_used=0, measured_bytes=g(4)),
               EngineView("x", active_requests=1, last_used=0, measured_bytes=g(3)),
               idle("a", 1, last_used=1, age=None), idle("b", 2, last_used=2, age=None),
               idle("c", 0.5, last_used=3, age=None)]
    aged = [replace(e, loaded_age_s=LOAD_WARMUP_S) for e in engines]
    limits = compute_limits(readings(usage), CFG)
    a = assess(g(usage), limits, PressureLevel.OK, 0, CFG, new_poll=True)
    seed = plan_relief(g(usage), limits, a, engines, CFG, ReliefMemo())
    assert seed.actions  # something to compare
    assert plan_relief(g(usage), limits, a, aged, CFG, ReliefMemo()) == seed


def test_admission_does_not_evict_a_model_in_its_warm_up():
    # Threshold 16 GiB (hard 0.8 of 20), ceiling 19 (the pre-chunk margin). The request
    # needs 4 GiB; 14 + 4 = 18 is over the threshold: idle models go, LRU first.
    config = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20, soft_fraction=0.7,
                          hard_fraction=0.8)
    request = AdmissionRequest(model="m", prompt_tokens=(7,) * 2048, max_tokens=0,
                               kv_bytes_per_token=MIB, attention_heads=0)
    m = EngineView("m", active_requests=1, last_used=5, measured_bytes=g(4))

    def run(age: float) -> list[str]:
        engines = (m, idle("young", 2, last_used=1, age=age), idle("old", 1, last_used=2))
        shots = [Snapshot(MemoryReadings(process_bytes=g(u), system_total_bytes=64 * GIB),
                          engines) for u in (14, 13)]
        driven = drive(admission_plan(request, config, AdmissionSettings(),
                                      PressureLevel.OK), shots)
        assert driven.result.verdict is Verdict.ADMIT_AFTER_SHEDDING
        assert all(a.reason == REASON_ADMISSION_EVICT for a in driven.executed_of(EvictModel))
        return evicted(driven)

    assert run(YOUNG) == ["old"]
    assert run(OLD) == ["young"]  # the seed's LRU order once the warm-up is over


# -- the setting ------------------------------------------------------------------------


def test_the_warm_up_setting_defaults_to_ten_seconds_and_is_validated():
    assert MemoryConfig().load_warmup_s == LOAD_WARMUP_S == 10.0
    assert MemoryConfig.from_mapping({"load-warmup-s": 2}).load_warmup_s == 2.0
    assert MemoryConfig.from_mapping({"load_warmup_s": 0}).load_warmup_s == 0.0
    for bad in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="load_warmup_s must be finite and >= 0"):
            MemoryConfig(load_warmup_s=bad).validate()
    with pytest.raises(ValueError, match="load_warmup_s must be a number"):
        MemoryConfig.from_mapping({"load_warmup_s": "soon"})


# -- the facts the plans see ----------------------------------------------------------------


def test_the_engine_view_reports_seconds_since_the_load_finished():
    now = [103.5]
    entry = ModelEntry("m", "/x", state=ModelState.READY, loaded_at=100.0, measured_bytes=5)
    handle = EngineHandleAdapter(entry, lambda: (0, 0), lambda e: None, lambda r: None,
                                 clock=lambda: now[0])
    assert handle.view().loaded_age_s == 3.5
    entry.state = ModelState.LOADING  # a reload under way: no warm-up yet
    assert handle.view().loaded_age_s is None


async def test_the_load_estimate_is_the_weight_files_mlx_lm_reads(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name, size in (("model-00001-of-00002.safetensors", 300 * MIB),
                       ("model-00002-of-00002.safetensors", 100 * MIB),
                       ("adapters.safetensors", 900 * MIB)):  # not read by mlx_lm.load
        with open(folder / name, "wb") as fh:
            os.truncate(fh.fileno(), size)  # sparse: no disk used
    pool = ModelPool(asyncio.get_running_loop())
    assert pool.estimate_bytes(str(folder)) == int(400 * MIB * 1.05)
    assert pool.estimate_bytes("someone/not-downloaded") is None
    assert pool.estimate_bytes(str(tmp_path / "empty")) is None
