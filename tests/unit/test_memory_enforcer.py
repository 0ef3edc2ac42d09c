"""The governor's loop over the real executor: telemetry, resilience, sink, admission, cost."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections import Counter

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import telemetry
from memory.actions import (
    REASON_HARD_BUSY,
    REASON_HARD_LRU,
    REASON_SESSION_SHRINK,
    REASON_SHRINK_RECLAIM,
    AbortRequests,
    ClearAuxCaches,
    EvictModel,
    IdleReclaim,
    PressureReclaim,
    PropagateLimits,
    ShrinkSessionCache,
)
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.governor import Governor
from memory.levels import GIB, PressureLevel, Tier
from memory.protocols import (
    AdmissionDesk,
    EngineHandle,
    EnginePool,
    PressureSink,
    SessionTier,
    TickSample,
)
from memory.recording import Recorder, entry_for
from memory.views import RequestView
from telemetry import names
from telemetry.instruments import Instruments
from tests.support.memory_fakes import (
    FakeDesk,
    FakeEngine,
    FakeEnginePool,
    FakeSessionTier,
    RecordingSink,
    ScriptedReader,
    make_world,
    readings,
)

OK, SOFT, HARD, EMERGENCY = list(PressureLevel)
CFG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20)


@pytest.fixture
def tracing(monkeypatch):
    """An SDK tracer kept in memory; the tick span (telemetry.tracer) goes there too."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    monkeypatch.setattr(telemetry, "tracer", lambda: tracer)
    return exporter, tracer


@pytest.fixture
def metrics():
    reader = InMemoryMetricReader()
    inst = Instruments(MeterProvider(metric_readers=[reader]).get_meter("t"))
    return reader, inst


def points(reader: InMemoryMetricReader) -> dict[str, list]:
    out: dict[str, list] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


# -- telemetry ------------------------------------------------------------------------------


def _ladder_world(tracer, recorder=None):
    """Hard: aux clear, bank shrink, reclaims (refused), an eviction, then the busy victim."""
    a = FakeEngine("a", last_used=1, measured_bytes=GIB, accept_reclaim=False)
    x = FakeEngine(
        "x",
        active_requests=2,
        requests=(RequestView("r1", 0), RequestView("r2", 1)),
        accept_reclaim=False,
    )
    tier = FakeSessionTier(GIB)
    w = make_world(CFG, readings(19.9), [a, x], tier=tier, tracer=tracer, recorder=recorder)
    w.pool.on_unload = lambda m: w.set_usage(19.8)
    return w


async def test_every_reclaim_shrink_abort_and_eviction_has_exactly_one_span(tracing, metrics):
    exporter, tracer = tracing
    reader, inst = metrics
    w = _ladder_world(tracer, Recorder(inst=inst, tracer=tracer))
    r = await w.tick()

    executed = [o.action for o in r.outcomes]
    kinds = {type(a) for a in executed}
    assert {ClearAuxCaches, ShrinkSessionCache, PressureReclaim, EvictModel,
            AbortRequests} <= kinds
    expected = Counter(entry_for(a).span for a in executed if entry_for(a).span is not None)
    spans = exporter.get_finished_spans()
    got = Counter(s.name for s in spans
                  if s.name not in (names.SPAN_ENFORCER_TICK, FakeEnginePool.UNLOAD_SPAN))
    assert got == expected  # one span per action, no more, no less
    assert got[names.SPAN_RECLAIM] == 3  # the aux clear and one pressure reclaim per engine
    assert (got[names.SPAN_BANK_SHRINK], got[names.SPAN_EVICT], got[names.SPAN_ABORT]) == (1, 1, 1)

    by_name: dict[str, list] = {}
    for span in spans:
        by_name.setdefault(span.name, []).append(span)
    (tick,) = by_name[names.SPAN_ENFORCER_TICK]
    for span in spans:
        if span.name not in (names.SPAN_ENFORCER_TICK, FakeEnginePool.UNLOAD_SPAN):
            assert span.parent is not None and span.parent.span_id == tick.context.span_id

    transition = by_name[names.SPAN_LEVEL_TRANSITION][0].attributes
    assert transition[names.ATTR_FROM_LEVEL] == "ok" and transition[names.ATTR_LEVEL] == "hard"
    assert transition[names.ATTR_CEILING] == 20 * GIB

    aux, *reclaims = by_name[names.SPAN_RECLAIM]
    assert aux.attributes[names.ATTR_RECLAIM_KIND] == "aux_caches"
    assert aux.attributes[names.ATTR_BYTES_FREED] == 0
    assert [(s.attributes[names.ATTR_MODEL], s.attributes[names.ATTR_RECLAIM_KIND],
             s.attributes[names.ATTR_REASON], s.attributes[names.ATTR_ACCEPTED])
            for s in reclaims] == [("a", "pressure", REASON_SHRINK_RECLAIM, False),
                                   ("x", "pressure", REASON_SHRINK_RECLAIM, False)]

    shrink = by_name[names.SPAN_BANK_SHRINK][0].attributes
    assert shrink[names.ATTR_TARGET] == 0 and shrink[names.ATTR_BYTES_FREED] == GIB
    assert shrink[names.ATTR_ENTRIES_EVICTED] == 1 and shrink[names.ATTR_PROTECT_ACTIVE] is True
    assert shrink[names.ATTR_REASON] == REASON_SESSION_SHRINK
    assert shrink[names.ATTR_SHRINK_MODE] == "shrink_to_bytes"
    assert shrink[names.ATTR_LEVEL] == "hard" and shrink[names.ATTR_USAGE] == int(19.9 * GIB)

    (evict,) = by_name[names.SPAN_EVICT]
    ev = evict.attributes
    assert ev[names.ATTR_MODEL] == "a" and ev[names.ATTR_BYTES_FREED] == GIB
    assert ev[names.ATTR_REASON] == REASON_HARD_LRU and ev[names.ATTR_TARGET] == GIB
    abort = by_name[names.SPAN_ABORT][0].attributes
    assert abort[names.ATTR_MODEL] == "x" and tuple(abort[names.ATTR_REQUEST_IDS]) == ("r1", "r2")
    assert abort[names.ATTR_REASON] == REASON_HARD_BUSY and abort[names.ATTR_KEEP_LOADED] is True

    # The eviction's span is open before the executor runs: the unload's span is its child.
    (unload,) = by_name[FakeEnginePool.UNLOAD_SPAN]
    assert unload.parent is not None and unload.parent.span_id == evict.context.span_id
    assert evict.start_time <= unload.start_time and unload.end_time <= evict.end_time

    # And the counters count what was carried out.
    p = points(reader)
    assert sorted((q.attributes[names.ATTR_EVICTION_KIND], q.value) for q in
                  p[names.METRIC_EVICTIONS]) == [("model", 1), ("session_entry", 1)]
    assert sum(q.value for q in p[names.METRIC_ABORTS]) == 2  # r1 and r2
    assert sum(q.value for q in p[names.METRIC_SHRINKS]) == 1
    assert sum(q.value for q in p[names.METRIC_RECLAIMS]) == 3


async def test_metrics_gauges_and_counters(metrics):
    reader, inst = metrics
    a = FakeEngine("a", last_used=1, measured_bytes=3 * GIB)
    w = make_world(CFG, readings(19.5, pool_gib=1), [a], recorder=Recorder(inst=inst))
    await w.tick()
    p = points(reader)
    assert p[names.METRIC_MEMORY_CEILING][0].value == 20 * GIB
    assert p[names.METRIC_MEMORY_USAGE][0].value == int(19.5 * GIB)
    assert p[names.METRIC_POOL_BYTES][0].value == GIB
    assert p[names.METRIC_PRESSURE_LEVEL][0].value == int(w.governor.level)
    (evictions,) = p[names.METRIC_EVICTIONS]
    assert evictions.value == 1
    assert evictions.attributes[names.ATTR_REASON] == "hard_pressure_idle_lru"
    assert sum(q.value for q in p[names.METRIC_TRANSITIONS]) >= 1


# -- resilience ----------------------------------------------------------------------------


class Exploding(FakeEngine):
    def request_pressure_reclaim(self) -> bool:
        raise RuntimeError("reclaim exploded")

    async def abort_requests(self, reason, request_ids=None):
        raise RuntimeError("abort exploded")

    def adjust_store_cache_cap(self, level):
        raise RuntimeError("cap exploded")


async def test_the_loop_survives_engine_pool_tier_aux_and_sink_exceptions():
    bad = Exploding("bad", active_requests=1, requests=(RequestView("r", 0),))
    good = FakeEngine("good", last_used=1, measured_bytes=GIB)

    def aux_boom() -> int:
        raise RuntimeError("aux exploded")

    w = make_world(CFG, readings(19.5, pool_gib=5), [bad, good], aux_frees=aux_boom)

    async def unload_boom(model_id: str, reason: str) -> tuple[int, list[str]]:
        raise RuntimeError("unload exploded")

    w.pool.unload = unload_boom  # type: ignore[method-assign]
    w.sink.on_transition = lambda *a: (_ for _ in ()).throw(RuntimeError("sink exploded"))
    r = await w.tick()
    assert r is not None
    failed = [o for o in r.outcomes if not o.ok]
    assert {type(o.action).__name__ for o in failed} >= {"PressureReclaim", "AdjustStoreCacheCap"}
    assert any("reclaim exploded" in (o.error or "") for o in failed)
    assert r.actions_of(PressureReclaim) == [PressureReclaim("bad"), PressureReclaim("good")]
    assert r.deferred  # "good" accepted
    (aux,) = [o for o in r.outcomes if isinstance(o.action, ClearAuxCaches)]
    assert aux.ok and aux.bytes_freed == 0  # one failing cache does not fail the clear
    r2 = await w.tick()
    assert r2 is not None  # and the next tick runs


async def test_one_engine_failing_set_limits_does_not_starve_the_others():
    class BadLimits(FakeEngine):
        def set_limits(self, *args) -> None:
            raise RuntimeError("limits exploded")

    good = FakeEngine("good")
    w = make_world(CFG, readings(5), [BadLimits("bad"), good])
    await w.tick()
    assert good.limits is not None


async def test_a_failed_reading_abandons_the_tick_and_keeps_the_state():
    w = make_world(CFG, readings(18), [FakeEngine("p", pinned=True)])
    await w.tick()
    assert w.governor.level is SOFT
    w.reader.fail = lambda n: OSError("proc vanished")
    assert await w.governor.tick() is None
    assert w.governor.level is SOFT and w.governor.admission_paused


async def test_run_keeps_going_after_a_failing_tick():
    w = make_world(
        CFG.replace(active_poll_s=0.01, idle_poll_s=0.01, empty_poll_s=0.01), readings(5)
    )
    w.reader.fail = lambda n: RuntimeError("first read fails") if n == 1 else None
    task = asyncio.create_task(w.governor.run())
    await asyncio.sleep(0.1)
    w.governor.stop()
    await asyncio.wait_for(task, 1.0)
    assert w.reader.attempts >= 3 and w.reader.reads == w.reader.attempts - 1


async def test_a_view_that_raises_is_treated_as_pinned_and_busy():
    broken = FakeEngine("broken", measured_bytes=GIB, fail_view=True)
    w = make_world(CFG, readings(19.5), [broken])
    r = await w.tick()
    assert r.actions_of(EvictModel) == [] and r.actions_of(AbortRequests) == []
    assert r.actions_of(IdleReclaim) == [IdleReclaim("broken")]
    assert w.governor.poll_interval == 1.0


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
    assert w.governor.readings is sample.readings and w.governor.limits == sample.limits
    assert w.governor.last_sample is sample


async def test_the_sink_hears_every_action_with_its_outcome():
    a = FakeEngine("a", last_used=1, measured_bytes=GIB)
    w = make_world(CFG, readings(18), [a, FakeEngine("b", last_used=2)])
    r = await w.tick()
    assert [(act, out) for act, out in w.sink.actions] == [(o.action, o) for o in r.outcomes]


async def test_admission_is_paused_before_an_unload_is_awaited():
    seen = []
    a = FakeEngine("a", last_used=1, measured_bytes=GIB)
    b = FakeEngine("b", last_used=2, measured_bytes=GIB)
    desk = FakeDesk()
    w = make_world(CFG, readings(18), [a, b], desk=desk)
    w.pool.on_unload = lambda m: seen.append(
        (w.governor.admission_paused, w.governor.level, list(desk.paused)))
    await w.tick()
    assert seen == [(True, SOFT, [SOFT])]
    w.set_usage(5)
    await w.tick()
    assert not w.governor.admission_paused and desk.paused == [SOFT, None]


async def test_the_executor_measures_a_shrink_by_the_tier_totals():
    class Careless(FakeSessionTier):
        """Takes everything down to the target, active or not, and reports 3 entries."""

        def shrink_to_bytes(self, target_bytes, *, protect_active, reason,
                            protect_session_ids=()):
            self.calls.append((target_bytes, protect_active, reason))
            self.bytes_held = min(self.bytes_held, target_bytes)
            return 3

    w = make_world(CFG, readings(19.5), [FakeEngine("p", pinned=True)],
                   tier=Careless(4 * GIB))
    r = await w.tick()
    shrink = [o for o in r.outcomes if isinstance(o.action, ShrinkSessionCache)]
    assert shrink[0].action.reason == REASON_SESSION_SHRINK
    assert (shrink[0].entries, shrink[0].bytes_freed) == (3, int(2.5 * GIB))


async def test_disabled_enforcer_reports_but_never_acts():
    a = FakeEngine("a", measured_bytes=GIB)
    w = make_world(CFG.replace(enabled=False), readings(25, pool_gib=5), [a])
    r = await w.tick()
    assert r.level is OK and not w.governor.admission_paused
    assert w.pool.log == [("cap", "a", OK, 8), ("batch_cap", "a", OK, 8)]
    assert w.governor.limits is not None and w.governor.limits.ceiling_bytes == 20 * GIB


async def test_every_tick_hands_its_limits_to_every_engine():
    a, b = FakeEngine("a"), FakeEngine("b")
    w = make_world(CFG, readings(5, active_gib=3), [a, b])
    r = await w.tick()
    assert r.actions_of(PropagateLimits) == [PropagateLimits(20 * GIB, 20 * GIB, 2 * GIB,
                                                             Tier.CUSTOM)]
    assert a.limits == b.limits == (20 * GIB, 20 * GIB, 2 * GIB, Tier.CUSTOM)


async def test_set_config_takes_effect_next_tick():
    w = make_world(CFG, readings(18), [FakeEngine("p", pinned=True)])
    assert (await w.tick()).level is SOFT
    w.governor.set_config(MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=40))
    assert (await w.tick()).level is OK
    with pytest.raises(ValueError):
        w.governor.set_config(MemoryConfig(tier=Tier.CUSTOM))


def test_constructor_validates_the_config():
    executor = Executor(ScriptedReader(readings(1)), FakeEnginePool())
    with pytest.raises(ValueError):
        Governor(MemoryConfig(soft_fraction=0.99), executor)


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
    w.pool.unload = _no_unload  # type: ignore[method-assign]  # keep all eight loaded
    await w.tick()
    start = time.perf_counter()
    for _ in range(100):
        await w.tick()
    per_tick = (time.perf_counter() - start) / 100
    assert per_tick < 0.005, f"{per_tick * 1e3:.2f} ms per tick"


async def _no_unload(model_id: str, reason: str) -> tuple[int, list[str]]:
    return 0, []


async def test_when_the_pool_cannot_list_engines_mlx_is_unavailable_not_guessed():
    w = make_world(CFG, readings(5), [FakeEngine("a", sample=(GIB, GIB))])

    def broken_handles():
        raise RuntimeError("pool lock poisoned")

    w.pool.handles = broken_handles  # type: ignore[method-assign]
    r = await w.tick()
    assert r is not None and r.engines == ()
    assert w.reader.mlx_seen[-1] is None  # "unavailable", never a direct MLX read


async def test_an_abandoned_tick_keeps_what_it_already_published():
    tier = FakeSessionTier(4 * GIB)
    w = make_world(CFG, readings(18), [FakeEngine("p", pinned=True)], tier=tier)
    # tick 2: poll (3), after-aux (4, hard committed), after-shrink (5) fails
    w.reader.fail = lambda n: OSError("gone") if n == 5 else None
    await w.tick()  # reads 1-2: ok -> soft, published
    w.set_usage(19.5)
    assert await w.governor.tick() is None  # abandoned after publishing soft -> hard
    assert (w.governor.level, w.governor.admission_paused) == (HARD, True)
    await w.tick()
    assert [(t.from_level, t.to_level) for t in w.sink.transitions] == [(OK, SOFT), (SOFT, HARD)]


# -- the fakes keep to the protocols ----------------------------------------------------------


def _members(proto: type) -> dict[str, object]:
    skip = {"__init__", "__subclasshook__", "__class_getitem__", "__init_subclass__"}
    out = {n: v for n, v in vars(proto).items() if not n.startswith("_")}
    out.update({n: None for n in getattr(proto, "__annotations__", {}) if n not in skip})
    return {n: v for n, v in out.items() if n not in skip}


@pytest.mark.parametrize(("proto", "fake"), [
    (EngineHandle, FakeEngine("a")),
    (EnginePool, FakeEnginePool()),
    (SessionTier, FakeSessionTier(0)),
    (AdmissionDesk, FakeDesk()),
    (PressureSink, RecordingSink()),
])
def test_fakes_satisfy_the_protocols(proto, fake):
    for name, member in _members(proto).items():
        assert hasattr(fake, name), f"{type(fake).__name__} lacks {name}"
        if not inspect.isfunction(member):
            continue
        got = getattr(fake, name)
        assert inspect.iscoroutinefunction(got) == inspect.iscoroutinefunction(member), name
        want = [p for p in inspect.signature(member).parameters.values() if p.name != "self"]
        have = inspect.signature(got).parameters
        for p in want:
            assert p.name in have, f"{type(fake).__name__}.{name} lacks parameter {p.name}"
            assert have[p.name].kind == p.kind, f"{type(fake).__name__}.{name}({p.name})"
