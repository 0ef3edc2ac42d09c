"""The governor on the real path: real gRPC over loopback, real engine threads on the
tiny demo model, the real governor → executor → pool, publisher → broker → gRPC.

Readings are scripted (a `ScriptedReader` stands in for /proc and the cgroup), so
pressure levels are exact; everything they drive is real.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
import mlx.core as mx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.demo_models import ensure_demo_model
from memory.actions import REASON_ADMISSION_RECLAIM, EvictModel, Outcome, PressureReclaim
from memory.config import MemoryConfig
from memory.levels import PressureLevel, Tier
from memory.plans.steps import Execute, Measure
from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from service.convert import label
from service.server import PlimsollServer, ServerConfig
from telemetry import names
from tests.support.memory_fakes import ScriptedReader, readings

# Custom tier, 10 GiB: soft 8.5, hard 9.5, emergency at 12 (ceiling + 2 GiB).
CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=10, idle_poll_s=3600,
                      empty_poll_s=3600, active_poll_s=3600)
OK_GIB, SOFT_GIB, HARD_GIB, EMERGENCY_GIB = 4.0, 9.0, 9.7, 12.5


@pytest.fixture()
def exporter(captured) -> InMemorySpanExporter:
    captured.spans.clear()
    return captured.spans


async def start(demo_path, reader: ScriptedReader, models: int = 2,
                memory: MemoryConfig = CONFIG, extra_source=None) -> PlimsollServer:
    """A server on the tiny model plus `models - 1` more (`extra_source`, default tiny).
    The governor's own loop is stopped: the test runs every tick itself."""
    config = ServerConfig(port=0, models=[str(demo_path)], memory=memory)
    server = PlimsollServer(config, reader=reader)
    await server.start()
    await server.load_initial_models()
    for i in range(1, models):
        await server.service.pool.load(str(extra_source or demo_path), f"extra-{i}")
    server.service.governor.stop()
    await server.service.governor.tick()  # after any tick of its loop still in flight
    return server


async def watch(port: int, into: list, ready: asyncio.Event | None = None) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = control_pb2_grpc.ControlServiceStub(ch)
        call = stub.WatchPressure(control_pb2.WatchPressureRequest(include_actions=True))
        try:
            async for msg in call:
                into.append(msg)
                if ready is not None:
                    ready.set()
        except grpc.aio.AioRpcError:
            pass


def levels(msgs: list) -> list[tuple[str, int, int]]:
    out = []
    for m in msgs:
        kind = m.WhichOneof("event")
        if kind == "snapshot":
            out.append(("snapshot", m.snapshot.level, m.snapshot.level))
        elif kind == "transition":
            out.append(("transition", m.transition.from_level, m.transition.to_level))
    return out


async def test_a_snapshot_agrees_with_the_transitions_after_it(demo_path):
    """Ticks through ok → emergency → hard → soft (two transitions in one tick, around
    a real eviction that awaits an engine thread) → emergency; subscribers join at
    every moment, mid-tick included. Each one's snapshot level is the `from` of the
    first transition it receives, and its transitions chain without a gap."""
    reader = ScriptedReader(readings(OK_GIB))
    server = await start(demo_path, reader, models=3)
    gov = server.service.governor
    streams: list[list] = []
    tasks: list[asyncio.Task] = []

    def subscribe() -> asyncio.Event:
        msgs: list = []
        streams.append(msgs)
        got_snapshot = asyncio.Event()
        tasks.append(asyncio.ensure_future(watch(server.port, msgs, got_snapshot)))
        return got_snapshot

    leases = {}
    try:
        for e in server.service.pool.entries():  # nothing evictable in tick 1
            leases[e.model_id] = await server.service.control.pin_model(e.model_id, "t", None)
        await asyncio.wait_for(subscribe().wait(), 10)  # one subscriber from the start
        # tick 1: emergency (at once: 2 GiB over the ceiling)
        reader.current = readings(EMERGENCY_GIB)
        await gov.tick()
        assert gov.level is PressureLevel.EMERGENCY
        # tick 2: hard at the poll (emergency → hard), then an eviction of an idle
        # model (a real unload) and a re-measure at soft (hard → soft).
        server.service.control.unpin(leases["extra-1"].lease_id)
        reader.current = readings(HARD_GIB)
        after_eviction = readings(SOFT_GIB)
        server.service.pool.listeners.append(
            lambda: setattr(reader, "current", after_eviction))
        tick = asyncio.ensure_future(gov.tick())
        while not tick.done():
            subscribe()  # join at every turn of the loop while the tick runs
            await asyncio.sleep(0.002)
        await tick
        assert gov.level is PressureLevel.SOFT
        server.service.pool.listeners.pop()
        # tick 3: back to emergency
        reader.current = readings(EMERGENCY_GIB)
        await gov.tick()
        await asyncio.sleep(0.3)
    finally:
        await server.drain()
        await asyncio.gather(*tasks, return_exceptions=True)

    joined_mid_tick = 0
    for msgs in streams:
        seq = levels(msgs)
        if not seq:
            continue  # connected after the drain began
        assert seq[0][0] == "snapshot", seq
        current = seq[0][2]
        for kind, frm, to in seq[1:]:
            assert kind == "transition"
            assert frm == current, f"snapshot/transition disagree: {seq}"
            current = to
        if seq[0][2] == PressureLevel.HARD and len(seq) > 1:
            joined_mid_tick += 1
    assert joined_mid_tick >= 1, "no subscriber joined between the tick's two transitions"
    first = levels(streams[0])
    assert [(f, t) for _, f, t in first[1:]] == [
        (PressureLevel.OK, PressureLevel.EMERGENCY),
        (PressureLevel.EMERGENCY, PressureLevel.HARD),
        (PressureLevel.HARD, PressureLevel.SOFT),
        (PressureLevel.SOFT, PressureLevel.EMERGENCY),
    ]


async def stream_tokens(port: int, model: str, max_tokens: int) -> AsyncIterator:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        call = stub.Generate(inference_pb2.GenerateRequest(
            model_id=model, text="a request that arrives after the decision",
            max_tokens=max_tokens, ignore_eos=True))
        async for msg in call:
            yield msg


async def test_an_eviction_rechecks_before_it_aborts_and_records_only_what_happened(
        demo_path, exporter):
    """A plan decided to evict extra-1 while it was idle; a request for it arrives
    before the eviction runs. The eviction is skipped: the request is not aborted,
    the model stays loaded, and no eviction span, counter or event says it happened."""
    reader = ScriptedReader(readings(OK_GIB))
    server = await start(demo_path, reader)
    gov = server.service.governor
    exporter.clear()
    events: list = []
    watcher = asyncio.ensure_future(watch(server.port, events))
    try:
        got: list = []
        started = asyncio.Event()

        async def client() -> None:
            async for msg in stream_tokens(server.port, "extra-1", 300):
                got.append(msg)
                started.set()

        request = asyncio.ensure_future(client())
        await asyncio.wait_for(started.wait(), 30)

        def decided_while_idle():
            yield Measure("test")
            outcomes = yield Execute((EvictModel("extra-1", "test_decided_while_idle"),))
            return outcomes

        (outcome,) = await gov.run_plan(decided_while_idle())
        assert isinstance(outcome, Outcome)
        assert outcome.skipped is not None and "busy" in outcome.skipped
        assert not outcome.done and outcome.bytes_freed is None
        await asyncio.wait_for(request, 60)  # the stream ends normally, no ABORTED
        assert got[-1].WhichOneof("event") == "end"
        assert server.service.pool.get("extra-1").engine is not None  # still loaded
        await asyncio.sleep(0.2)
    finally:
        await server.drain()
        watcher.cancel()
    evictions = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_EVICT]
    assert len(evictions) == 1
    assert evictions[0].attributes[names.ATTR_SKIPPED].startswith("busy")
    assert names.ATTR_BYTES_FREED not in evictions[0].attributes
    unloads = [s for s in exporter.get_finished_spans() if s.name == names.SPAN_MODEL_UNLOAD
               and s.attributes.get(names.ATTR_MODEL) == "extra-1"]
    assert not unloads
    kinds = [label(control_pb2.EnforcerActionKind, m.action.kind) for m in events
             if m.WhichOneof("event") == "action"]
    assert "evict_model" not in kinds


async def test_admission_evicts_idle_models_before_it_refuses(demo_path, exporter):
    """A pinned model serves; two idle non-pinned models (the 67 MB small demo model)
    hold the memory at level ok. A prefill whose projection crosses the hard mark is
    admitted after the governor evicts one idle model, the least recently used; a
    request that could not fit even after every relief is refused with the numbers
    and sheds nothing.

    Scale: a 512 MiB custom ceiling (soft 435, hard and abort line 486 MiB), so the
    tiny model's 4,000-token prefill (~70 MiB projected) matters. Scripted usage is
    a base plus what the loaded idle models measured at load."""
    # load_warmup_s=0: the idle models were loaded just now, and are meant to be evictable.
    memory = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=0.5, idle_poll_s=3600,
                          empty_poll_s=3600, active_poll_s=3600, load_warmup_s=0)
    mib = 1 << 20
    reader = ScriptedReader(readings(0.3))
    server = await start(demo_path, reader, models=3, memory=memory,
                         extra_source=ensure_demo_model("small"))
    svc = server.service
    pool = svc.pool

    pinned = pool.get("").model_id  # the default: the tiny model

    def on_change() -> None:
        idle = sum(e.measured_bytes for e in pool.entries()
                   if e.model_id != pinned and e.engine is not None)
        reader.current = readings((290 * mib + idle) / (1 << 30))

    pool.listeners.append(on_change)
    on_change()
    exporter.clear()
    try:
        await svc.control.pin_model(pinned, "test", None)
        pool.touch(pool.get("extra-2"))  # extra-1 is now the least recently used
        await svc.governor.tick()
        assert svc.governor.level is PressureLevel.OK
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            request = inference_pb2.GenerateRequest(
                model_id=pinned, token_ids=inference_pb2.TokenIds(ids=[5] * 4000),
                max_tokens=1, ignore_eos=True)
            msgs = [m async for m in stub.Generate(request)]
            assert msgs[-1].WhichOneof("event") == "end"
            spans = exporter.get_finished_spans()
            evicted = [s.attributes[names.ATTR_MODEL] for s in spans
                       if s.name == names.SPAN_EVICT and names.ATTR_SKIPPED not in s.attributes]
            assert evicted == ["extra-1"]  # one was enough
            (evict,) = [s for s in spans if s.name == names.SPAN_EVICT]
            (unload,) = [s for s in spans if s.name == names.SPAN_MODEL_UNLOAD]
            assert unload.parent.span_id == evict.context.span_id  # the unload is its child
            assert evict.attributes[names.ATTR_REASON] == "admission_idle_lru"
            assert pool.get("extra-2").engine is not None
            # Hopeless now, even with extra-2 gone: refused, and extra-2 stays.
            pool.listeners.remove(on_change)
            reader.current = readings(560 / 1024)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [m async for m in stub.Generate(request)]
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "admission limit" in err.value.details()
            assert pool.get("extra-2").engine is not None
    finally:
        if on_change in pool.listeners:
            pool.listeners.remove(on_change)
        await server.drain()


def spans_named(exporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def test_os_pressure_sheds_idle_sessions_with_one_span_per_shrink_and_reclaim(
        demo_path, exporter):
    """A real session snapshot in the bank; the OS reports critical pressure (level ok
    by our own marks). The guard's shrink runs once, with one span carrying its
    reason and figures, followed by a pool reclaim span per engine."""
    reader = ScriptedReader(readings(OK_GIB))
    server = await start(demo_path, reader, models=1)
    svc = server.service
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            request = inference_pb2.GenerateRequest(text="remember this turn", max_tokens=4,
                                                    ignore_eos=True, session_id="s1")
            _ = [m async for m in stub.Generate(request)]
        assert svc.bank.entry_count() == 1
        held = svc.bank.total_bytes()
        exporter.clear()
        reader.current = readings(OK_GIB, os_pressure="critical")
        await svc.governor.tick()
        assert svc.bank.entry_count() == 0
    finally:
        await server.drain()
    (shrink,) = spans_named(exporter, names.SPAN_BANK_SHRINK)
    assert shrink.attributes[names.ATTR_REASON] == "memory_pressure_critical"
    assert shrink.attributes[names.ATTR_TARGET] == 0
    assert shrink.attributes[names.ATTR_ENTRIES_EVICTED] == 1
    assert shrink.attributes[names.ATTR_BYTES_FREED] == held
    assert shrink.attributes[names.ATTR_PROTECT_ACTIVE] is True
    reclaims = [s for s in spans_named(exporter, names.SPAN_RECLAIM)
                if s.attributes.get(names.ATTR_REASON) == "os_pressure_reclaim"]
    assert len(reclaims) == 1  # one engine
    assert not spans_named(exporter, names.SPAN_BANK_EVICT)  # no second span for it


async def test_a_pre_chunk_prefill_abort_is_typed_and_recorded(demo_path, exporter):
    """The real prefill guard with a ceiling below what the engine already holds: the
    engine thread ends the request before its first chunk, the client gets
    ABORTED / PREFILL_ABORT, and the abort has its span and
    WatchPressure event."""
    reader = ScriptedReader(readings(OK_GIB))
    server = await start(demo_path, reader, models=1)
    svc = server.service
    events: list = []
    ready = asyncio.Event()
    watcher = asyncio.ensure_future(watch(server.port, events, ready))
    try:
        await asyncio.wait_for(ready.wait(), 10)
        (handle,) = svc.engines.handles()
        handle.set_limits(1 << 20, 1 << 20, 0, Tier.CUSTOM)  # 1 MiB: below the weights
        exporter.clear()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            request = inference_pb2.GenerateRequest(text="too big for the line",
                                                    max_tokens=4)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                _ = [m async for m in stub.Generate(request)]
        assert err.value.code() is grpc.StatusCode.ABORTED  # PREFILL_ABORT
        assert "pre-chunk abort" in err.value.details()
        await asyncio.sleep(0.2)
    finally:
        await server.drain()
        watcher.cancel()
    (span,) = spans_named(exporter, names.SPAN_PREFILL_ABORT)
    assert span.attributes[names.ATTR_ABORT_KIND] == "prefill"
    assert span.attributes[names.ATTR_REASON] == "prefill_exceeds_ceiling"
    assert len(span.attributes[names.ATTR_REQUEST_IDS]) == 1
    kinds = [label(control_pb2.EnforcerActionKind, m.action.kind) for m in events
             if m.WhichOneof("event") == "action"]
    assert kinds.count("prefill_abort") == 1


async def test_engines_reclaiming_the_one_pool_report_it_freed_once(demo_path):
    """MLX's buffer pool is process-wide. An admission reclaims it on every engine in
    turn; each reports what its own reclaim took, so the pool is counted once: the
    first takes it all, the second finds it empty."""
    reader = ScriptedReader(readings(OK_GIB))
    server = await start(demo_path, reader, models=2)
    svc = server.service
    try:
        # The pool is the process's: buffers this thread frees land in it as an
        # engine's would (the engines clear it after each prefill and when idle).
        buffers = [mx.arange(1 << 18, dtype=mx.float32) + i for i in range(32)]  # 1 MiB each
        mx.eval(buffers)
        del buffers
        handles = svc.engines.handles()
        assert len(handles) == 2
        # Both engines' latest samples show the whole pool.
        pool = min([(await h.fresh_sample(10)).pool_bytes for h in handles])
        assert pool >= 30 << 20
        plan = (PressureReclaim(h.model_id, REASON_ADMISSION_RECLAIM, wait=True) for h in handles)

        def reclaim_both():
            yield Measure("test")
            return (yield Execute(tuple(plan)))

        outcomes = await svc.governor.run_plan(reclaim_both())
        left = (await handles[0].fresh_sample(10)).pool_bytes
    finally:
        await server.drain()
    freed = [o.bytes_freed for o in outcomes]
    assert left < pool // 10
    assert freed[0] >= 0.9 * pool, (freed, pool)
    assert sum(freed) <= pool, f"the pool ({pool} bytes) was reported freed as {freed}"


async def test_a_measurement_after_an_eviction_is_fresh(demo_path):
    """Real readings (this process): with the 67 MB small model and the tiny one
    loaded, evict the small one. The tiny engine's last MLX sample still counts the
    small model's weights (MLX's allocator is process-wide), so a reading built on it
    would be stale; the measurement the plan takes after the eviction is not."""
    config = ServerConfig(port=0, models=[str(demo_path)])
    server = PlimsollServer(config)
    await server.start()
    await server.load_initial_models()
    svc = server.service
    await svc.pool.load(str(ensure_demo_model("small")), "small")
    svc.governor.stop()
    small_bytes = svc.pool.get("small").measured_bytes
    tiny = svc.pool.get("")
    try:
        def evict_and_measure():
            before = yield Measure("test")
            yield Execute((EvictModel("small", "test"),))
            evicted_at = time.monotonic()
            stale = tiny.engine.mlx_sample()  # the latest sample when the unload ended
            after = yield Measure("test")
            return before, stale, evicted_at, after

        before, stale, evicted_at, after = await svc.governor.run_plan(evict_and_measure())
        freed = before.readings.mlx_active_bytes - after.readings.mlx_active_bytes
        assert freed >= 0.9 * small_bytes
        assert after.readings.sources["mlx"] == "engine thread sample"
        # The figure used was sampled after the eviction ended, whatever the tiny
        # engine's latest sample was then.
        assert after.mlx_sampled_at is not None and after.mlx_sampled_at >= evicted_at - 0.001
        assert stale is not None
    finally:
        await server.drain()


async def test_a_soft_tick_clears_the_servers_aux_caches_and_walks_the_store_cap(
        demo_path, exporter):
    """At soft the tick first clears the auxiliary caches the server keeps (glibc's
    free heap pages, each tokenizer's BPE word cache), then re-measures; every tick
    walks each engine's store-cache cap (the gate on session snapshot stores) one
    step: down at soft, back up at ok."""
    reader = ScriptedReader(readings(OK_GIB))
    server = await start(demo_path, reader, models=1)
    svc = server.service
    engine = svc.pool.get("").engine
    assert svc.executor.aux_cache_names == ("c_heap", "tokenizer_bpe")
    try:
        start_cap = engine.store_gate.cap
        exporter.clear()
        reader.current = readings(SOFT_GIB)
        await svc.governor.tick()
        aux = [s for s in spans_named(exporter, names.SPAN_RECLAIM)
               if s.attributes.get(names.ATTR_RECLAIM_KIND) == "aux_caches"]
        assert len(aux) == 1
        assert aux[0].attributes[names.ATTR_BYTES_FREED] >= 0
        assert engine.store_gate.cap == start_cap - 1
        assert engine.batch_cap == start_cap - 1  # the decode batch cap walks beside it
        reader.current = readings(OK_GIB)
        await svc.governor.tick()
        assert engine.store_gate.cap == start_cap
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = control_pb2_grpc.ControlServiceStub(ch)
            models = await stub.ListModels(control_pb2.ListModelsRequest())
        assert models.models[0].store_cache_cap == start_cap
    finally:
        await server.drain()


async def test_a_client_cancelled_during_its_admission_eviction_leaves_no_half_unloaded_model(
        demo_path, exporter):
    """The admission of a request evicts an idle model; the client cancels while the
    unload is under way. The eviction still finishes: the model ends unloaded (not
    stuck UNLOADING with a stopped engine), and its eviction is recorded once."""
    # load_warmup_s=0: the idle models were loaded just now, and are meant to be evictable.
    memory = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=0.5, idle_poll_s=3600,
                          empty_poll_s=3600, active_poll_s=3600, load_warmup_s=0)
    mib = 1 << 20
    reader = ScriptedReader(readings(0.3))
    server = await start(demo_path, reader, models=2, memory=memory,
                         extra_source=ensure_demo_model("small"))
    svc = server.service
    pool = svc.pool
    pinned = pool.get("").model_id
    base = 290 * mib

    def usage() -> None:
        idle = sum(e.measured_bytes for e in pool.entries()
                   if e.model_id != pinned and e.engine is not None)
        reader.current = readings((base + 67 * mib + idle) / (1 << 30))

    usage()
    await svc.control.pin_model(pinned, "test", None)
    await svc.governor.tick()
    exporter.clear()
    cancelled = asyncio.Event()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            stub = inference_pb2_grpc.InferenceServiceStub(ch)
            call = stub.Generate(inference_pb2.GenerateRequest(
                model_id=pinned, token_ids=inference_pb2.TokenIds(ids=[5] * 4000),
                max_tokens=1, ignore_eos=True))

            def on_change() -> None:
                if pool.get("extra-1").state.name == "UNLOADING" and not cancelled.is_set():
                    call.cancel()  # the client goes away in the middle of the unload
                    cancelled.set()

            pool.listeners.append(on_change)
            with pytest.raises(asyncio.CancelledError):
                _ = [m async for m in call]
            await asyncio.wait_for(cancelled.wait(), 10)
            for _ in range(100):  # the eviction goes on without the caller
                if pool.get("extra-1").state.name == "UNLOADED":
                    break
                await asyncio.sleep(0.05)
        entry = pool.get("extra-1")
        assert entry.state.name == "UNLOADED" and entry.engine is None
        evictions = [s for s in spans_named(exporter, names.SPAN_EVICT)
                     if names.ATTR_SKIPPED not in s.attributes]
        assert [s.attributes[names.ATTR_MODEL] for s in evictions] == ["extra-1"]
    finally:
        pool.listeners.remove(on_change)
        await server.drain()
