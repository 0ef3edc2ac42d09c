"""The thin loop: resilience, telemetry, sink, live admission flag, cost of a tick."""

from __future__ import annotations

import asyncio
import time

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import memory.enforcer as enforcer_module
import telemetry
from memory.actions import (
    REASON_HARD_BUSY,
    AbortRequests,
    EvictModel,
    IdleReclaim,
    PressureReclaim,
    ShrinkSessionCache,
)
from memory.config import MemoryConfig
from memory.enforcer import MemoryEnforcer, TickSample
from memory.fakes import FakeEngine, FakeSessionTier, make_world, readings
from memory.levels import GIB, PressureLevel, Tier
from memory.views import RequestView
from telemetry import names

OK, SOFT, HARD, EMERGENCY = list(PressureLevel)
CFG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20)


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(telemetry, "tracer", lambda: provider.get_tracer("test"))
    return exporter


@pytest.fixture
def metric_reader(monkeypatch):
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    monkeypatch.setattr(telemetry, "meter", lambda: provider.get_meter("test"))
    monkeypatch.setattr(enforcer_module, "_metrics_instance", None)
    return reader


# -- telemetry ------------------------------------------------------------------------------


async def test_spans_for_transition_eviction_abort_reclaim_and_shrink(spans):
    # Engines refuse the reclaim, so the freed session references do not defer the ladder.
    a = FakeEngine("a", last_used=1, measured_bytes=GIB, accept_reclaim=False)
    x = FakeEngine(
        "x",
        active_requests=2,
        requests=(RequestView("r1", 0), RequestView("r2", 1)),
        accept_reclaim=False,
    )
    tier = FakeSessionTier(GIB)
    w = make_world(CFG, readings(19.9), [a, x], tier=tier)
    w.pool.on_unload = lambda m: w.set_usage(19.8)
    await w.tick()

    by_name: dict[str, list] = {}
    for span in spans.get_finished_spans():
        by_name.setdefault(span.name, []).append(span)
    assert set(by_name) >= {
        names.SPAN_ENFORCER_TICK,
        names.SPAN_LEVEL_TRANSITION,
        names.SPAN_BANK_SHRINK,
        names.SPAN_RECLAIM,
        names.SPAN_EVICT,
        names.SPAN_ABORT,
    }
    transition = by_name[names.SPAN_LEVEL_TRANSITION][0].attributes
    assert transition[names.ATTR_FROM_LEVEL] == "ok" and transition[names.ATTR_LEVEL] == "hard"
    assert transition[names.ATTR_CEILING] == 20 * GIB
    evict = by_name[names.SPAN_EVICT][0].attributes
    assert evict[names.ATTR_MODEL] == "a" and evict[names.ATTR_BYTES_FREED] == GIB
    assert evict[names.ATTR_REASON] == "hard_pressure_idle_lru"
    abort = by_name[names.SPAN_ABORT][0].attributes
    assert abort[names.ATTR_MODEL] == "x" and tuple(abort[names.ATTR_REQUEST_IDS]) == ("r1", "r2")
    assert abort[names.ATTR_REASON] == REASON_HARD_BUSY
    shrink = by_name[names.SPAN_BANK_SHRINK][0].attributes
    assert shrink[names.ATTR_TARGET] == 0 and shrink[names.ATTR_BYTES_FREED] == GIB
    tick = by_name[names.SPAN_ENFORCER_TICK][0]
    assert all(s.parent.span_id == tick.context.span_id for s in by_name[names.SPAN_EVICT])


async def test_metrics_gauges_and_counters(metric_reader):
    a = FakeEngine("a", last_used=1, measured_bytes=3 * GIB)
    w = make_world(CFG, readings(19.5, pool_gib=1), [a])
    await w.tick()
    data = metric_reader.get_metrics_data()
    points = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = list(metric.data.data_points)
    assert points[names.METRIC_MEMORY_CEILING][0].value == 20 * GIB
    assert points[names.METRIC_MEMORY_USAGE][0].value == int(19.5 * GIB)
    assert points[names.METRIC_POOL_BYTES][0].value == GIB
    assert points[names.METRIC_PRESSURE_LEVEL][0].value == int(w.enforcer.level)
    evictions = points[names.METRIC_EVICTIONS]
    assert evictions[0].value == 1
    assert evictions[0].attributes[names.ATTR_REASON] == "hard_pressure_idle_lru"
    assert sum(p.value for p in points[names.METRIC_TRANSITIONS]) >= 1


# -- resilience ----------------------------------------------------------------------------


class Exploding(FakeEngine):
    def request_pressure_reclaim(self) -> bool:
        raise RuntimeError("reclaim exploded")

    def abort_requests(self, reason, request_ids=None):
        raise RuntimeError("abort exploded")

    def adjust_store_cache_cap(self, level):
        raise RuntimeError("cap exploded")


async def test_the_loop_survives_engine_pool_tier_aux_and_sink_exceptions():
    bad = Exploding("bad", active_requests=1, requests=(RequestView("r", 0),))
    good = FakeEngine("good", last_used=1, measured_bytes=GIB)

    def aux_boom() -> int:
        raise RuntimeError("aux exploded")

    w = make_world(CFG, readings(19.5, pool_gib=5), [bad, good], aux_frees=aux_boom)

    async def unload_boom(model_id: str, reason: str) -> int:
        raise RuntimeError("unload exploded")

    w.pool.unload = unload_boom
    w.sink.on_transition = lambda *a: (_ for _ in ()).throw(RuntimeError("sink exploded"))
    r = await w.tick()
    assert r is not None
    failed = [o for o in r.outcomes if not o.ok]
    assert {type(o.action).__name__ for o in failed} >= {"PressureReclaim", "AdjustStoreCacheCap"}
    assert any("reclaim exploded" in (o.error or "") for o in failed)
    assert r.actions_of(PressureReclaim) == [PressureReclaim("bad"), PressureReclaim("good")]
    assert r.deferred  # "good" accepted
    r2 = await w.tick()
    assert r2 is not None  # and the next tick runs


async def test_a_failed_reading_abandons_the_tick_and_keeps_the_state():
    w = make_world(CFG, readings(18), [FakeEngine("p", pinned=True)])
    await w.tick()
    assert w.enforcer.level is SOFT

    def broken(mlx_sample=None):
        raise OSError("proc vanished")

    w.enforcer._reader = type("R", (), {"read": staticmethod(broken)})()
    assert await w.enforcer.tick() is None
    assert w.enforcer.level is SOFT and w.enforcer.admission_paused


async def test_run_keeps_going_after_a_failing_tick():
    w = make_world(
        CFG.replace(active_poll_s=0.01, idle_poll_s=0.01, empty_poll_s=0.01), readings(5)
    )
    calls = {"n": 0}
    real = w.reader.read

    def flaky(mlx_sample=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("first read fails")
        return real(mlx_sample)

    w.enforcer._reader = type("R", (), {"read": staticmethod(flaky)})()
    task = asyncio.create_task(w.enforcer.run())
    await asyncio.sleep(0.1)
    w.enforcer.stop()
    await asyncio.wait_for(task, 1.0)
    assert calls["n"] >= 3


async def test_a_view_that_raises_is_treated_as_pinned_and_busy():
    broken = FakeEngine("broken", measured_bytes=GIB, fail_view=True)
    w = make_world(CFG, readings(19.5), [broken])
    r = await w.tick()
    assert r.actions_of(EvictModel) == [] and r.actions_of(AbortRequests) == []
    assert r.actions_of(IdleReclaim) == [IdleReclaim("broken")]
    assert w.enforcer.poll_interval == 1.0


# -- sink, admission, session tier ---------------------------------------------------------


async def test_sink_gets_a_sample_every_tick_and_transitions_with_figures():
    w = make_world(CFG, readings(5), [FakeEngine("a")])
    await w.tick()
    w.set_usage(18)
    await w.tick()
    assert len(w.sink.samples) == 2
    sample = w.sink.samples[-1]
    assert isinstance(sample, TickSample)
    assert (sample.level, sample.admission_paused, sample.poll_interval_s) == (SOFT, True, 1.0)
    assert sample.limits.soft_bytes == 17 * GIB and sample.at == 1000.0
    (t,) = w.sink.transitions
    assert (t.from_level, t.to_level, t.usage_bytes, t.ceiling_bytes) == (
        OK,
        SOFT,
        18 * GIB,
        20 * GIB,
    )
    assert w.enforcer.readings is sample.readings and w.enforcer.limits is sample.limits


async def test_admission_is_paused_before_an_unload_is_awaited():
    seen = []
    a = FakeEngine("a", last_used=1, measured_bytes=GIB)
    b = FakeEngine("b", last_used=2, measured_bytes=GIB)
    w = make_world(CFG, readings(18), [a, b])
    w.pool.on_unload = lambda m: seen.append((w.enforcer.admission_paused, w.enforcer.level))
    await w.tick()
    assert seen == [(True, SOFT)]
    w.set_usage(5)
    await w.tick()
    assert not w.enforcer.admission_paused


async def test_a_session_tier_returning_only_an_entry_count_is_accepted():
    class CountOnly:
        def __init__(self) -> None:
            self.held = 4 * GIB

        def total_bytes(self) -> int:
            return self.held

        def shrink_to_bytes(self, target_bytes: int, *, protect_active: bool) -> int:
            self.held = target_bytes
            return 3

    w = make_world(CFG, readings(19.5), [FakeEngine("p", pinned=True)])
    w.enforcer._session_tier = CountOnly()
    r = await w.tick()
    (shrink,) = [o for o in r.outcomes if isinstance(o.action, ShrinkSessionCache)]
    assert (shrink.entries, shrink.bytes_freed) == (3, int(2.5 * GIB))


async def test_disabled_enforcer_reports_but_never_acts():
    a = FakeEngine("a", measured_bytes=GIB)
    w = make_world(CFG.replace(enabled=False), readings(25, pool_gib=5), [a])
    r = await w.tick()
    assert r.level is OK and not w.enforcer.admission_paused
    assert w.pool.log == [("cap", "a", OK, 8)]
    assert w.enforcer.limits.ceiling_bytes == 20 * GIB


async def test_set_config_takes_effect_next_tick():
    w = make_world(CFG, readings(18), [FakeEngine("p", pinned=True)])
    assert (await w.tick()).level is SOFT
    w.enforcer.set_config(MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=40))
    assert (await w.tick()).level is OK
    with pytest.raises(ValueError):
        w.enforcer.set_config(MemoryConfig(tier=Tier.CUSTOM))


def test_constructor_validates_the_config():
    with pytest.raises(ValueError):
        MemoryEnforcer(MemoryConfig(soft_fraction=0.99), object(), object())  # type: ignore[arg-type]


# -- cost -----------------------------------------------------------------------------------


async def test_a_tick_with_eight_engines_and_a_session_tier_is_cheap():
    engines = [
        FakeEngine(
            f"m{i}",
            pinned=i % 3 == 0,
            active_requests=i % 2,
            requests=tuple(RequestView(f"m{i}-r{j}", j, GIB // 8) for j in range(i % 2 * 4)),
            last_used=float(i),
            measured_bytes=GIB,
        )
        for i in range(8)
    ]
    tier = FakeSessionTier(64 * GIB, active_bytes=64 * GIB)  # fully protected: nothing frees
    w = make_world(CFG, readings(18.5, pool_gib=1), engines, tier=tier)
    w.pool.unload = _no_unload  # keep all eight loaded tick after tick
    await w.tick()
    start = time.perf_counter()
    for _ in range(100):
        await w.tick()
    per_tick = (time.perf_counter() - start) / 100
    assert per_tick < 0.005, f"{per_tick * 1e3:.2f} ms per tick"


async def _no_unload(model_id: str, reason: str) -> int:
    return 0


async def test_when_the_pool_cannot_list_engines_mlx_is_not_called_directly():
    w = make_world(CFG, readings(5), [FakeEngine("a")])

    def broken_handles():
        raise RuntimeError("pool lock poisoned")

    w.pool.handles = broken_handles
    r = await w.tick()
    assert r is not None and r.engines == ()
    sampler = w.reader.samplers[-1]
    assert sampler is not None and sampler() is None  # "unavailable", never a direct MLX read


async def test_an_abandoned_tick_keeps_what_it_already_published():
    tier = FakeSessionTier(4 * GIB)
    w = make_world(CFG, readings(18), [FakeEngine("p", pinned=True)], tier=tier)
    reads = {"n": 0}
    real = w.reader.read

    def fifth_read_fails(mlx_sample=None):
        reads["n"] += 1
        if reads["n"] == 5:  # tick 2: poll, after-aux (hard committed), after-shrink fails
            raise OSError("gone")
        return real(mlx_sample)

    w.enforcer._reader = type("R", (), {"read": staticmethod(fifth_read_fails)})()
    await w.tick()  # reads 1-2: ok -> soft, published
    w.set_usage(19.5)
    assert await w.enforcer.tick() is None  # abandoned after publishing soft -> hard
    assert (w.enforcer.level, w.enforcer.admission_paused) == (HARD, True)
    await w.tick()
    assert [(t.from_level, t.to_level) for t in w.sink.transitions] == [(OK, SOFT), (SOFT, HARD)]


def test_fakes_satisfy_the_protocols():
    from memory.protocols import EngineHandle, EnginePool, SessionTier

    assert isinstance(FakeEngine("a"), EngineHandle)
    assert isinstance(make_world(CFG, readings(1)).pool, EnginePool)
    assert isinstance(FakeSessionTier(0), SessionTier)
