"""Scripted stand-ins for the governor's collaborators, for unit tests of the memory plans.

`ScriptedReader` replays readings; `FakeEnginePool`, `FakeEngine` and
`FakeSessionTier` implement the protocols in `memory.protocols` and log every
call in order; `RecordingSink` keeps what the governor reports; `make_world`
wires a real `Executor` and `Governor` over them with a `FakeClock`; `drive`
runs any pure plan generator (`tick_plan`, `load_plan`, `admission_plan`)
against scripted snapshots without an event loop.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace

from memory.actions import (
    AbortRequests,
    Action,
    EvictModel,
    ExpireSessions,
    Outcome,
    PressureReclaim,
    ShrinkSessionCache,
    Transition,
)
from memory.ceiling import Limits
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.governor import Governor
from memory.levels import GIB, PressureLevel, Tier
from memory.plans.admission import AdmissionSettings
from memory.plans.steps import Execute, Measure, Snapshot
from memory.protocols import TickSample
from memory.readings import MemoryReadings, MlxFigures
from memory.recording import Recorder
from memory.store_cache import StoreCacheGate
from memory.views import BankFigures, EngineState, EngineView, QueueView, RequestView
from tests.support.clock import FakeClock


def readings(
    process_gib: float,
    *,
    total_gib: float = 64,
    available_gib: float | None = None,
    pool_gib: float = 0,
    container_limit_gib: float | None = None,
    device_gib: float | None = None,
    footprint_gib: float | None = None,
    active_gib: float | None = None,
    os_pressure: str | None = None,
) -> MemoryReadings:
    """Readings in GiB (converted to bytes). By default the dynamic term does not bind."""
    process = int(process_gib * GIB)
    return MemoryReadings(
        process_bytes=process,
        system_total_bytes=int(total_gib * GIB),
        mlx_active_bytes=int(active_gib * GIB) if active_gib is not None else process,
        mlx_pool_bytes=int(pool_gib * GIB),
        footprint_bytes=int(footprint_gib * GIB) if footprint_gib is not None else process,
        system_available_bytes=(
            int(available_gib * GIB) if available_gib is not None else int(total_gib * GIB)
        ),
        container_limit_bytes=(
            int(container_limit_gib * GIB) if container_limit_gib is not None else None
        ),
        device_limit_bytes=int(device_gib * GIB) if device_gib is not None else None,
        os_pressure=os_pressure,
        sources={"scripted": "test"},
    )


class ScriptedReader:
    """Returns `current`; queued readings (if any) are taken first, in order.

    Tests set `current` between ticks, and hooks (an aux-cache callback, a
    pool's `on_unload`, a tier's `on_shrink`) change it to show an action's effect.
    `mlx_seen` keeps the MLX figures the executor handed to each read. `fail(n)`
    may return an exception for the n-th attempt (from 1) to raise instead of reading;
    `attempts` counts every call, `reads` the ones that returned.
    """

    def __init__(self, current: MemoryReadings, *queued: MemoryReadings) -> None:
        self.current = current
        self.queue = list(queued)
        self.reads = 0
        self.attempts = 0
        self.mlx_seen: list[MlxFigures | None] = []
        self.fail: Callable[[int], BaseException | None] | None = None

    def push(self, *more: MemoryReadings) -> None:
        self.queue.extend(more)

    def read(self, mlx: MlxFigures | None = None) -> MemoryReadings:
        self.attempts += 1
        error = self.fail(self.attempts) if self.fail is not None else None
        if error is not None:
            raise error
        self.mlx_seen.append(mlx)
        if self.queue:
            self.current = self.queue.pop(0)
        self.reads += 1
        return self.current


def figures(active: int, pool: int, at: float = math.inf) -> MlxFigures:
    """An engine-thread MLX sample; `at` = inf: fresh whatever the clock says."""
    return MlxFigures(active_bytes=active, pool_bytes=pool, at=at)


@dataclass
class FakeEngine:
    """An `EngineHandle` whose view is plain fields; every call lands in `calls`.

    `sample` is what `mlx_sample()` returns: an `MlxFigures`, or an
    (active, pool) pair taken at `sample_at` (inf by default: always fresh).
    `fresh` is what `fresh_sample()` returns (None: the same as `sample`).
    `queued` are request ids waiting for a slot: `abort_requests(None)` ends them too.
    """

    model_id: str
    state: EngineState = EngineState.READY
    pinned: bool = False
    active_requests: int | None = 0
    requests: tuple[RequestView, ...] = ()
    queued: tuple[str, ...] = ()
    last_used: float = 0.0
    measured_bytes: int | None = None
    pending_unload: bool = False
    max_num_seqs: int = 8
    accept_reclaim: bool = True
    sample: MlxFigures | tuple[int, int] | None = None
    sample_at: float = math.inf
    fresh: MlxFigures | None = None
    fail_view: bool = False
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    journal: list[tuple[Any, ...]] | None = None  # shared with the pool: global call order
    limits: tuple[int, int, int, Tier] | None = None  # the last set_limits
    gate: StoreCacheGate = field(init=False)
    batch: StoreCacheGate = field(init=False)  # the decode batch cap walks the same way

    def __post_init__(self) -> None:
        self.gate = StoreCacheGate(self.max_num_seqs)
        self.batch = StoreCacheGate(self.max_num_seqs)

    def _note(self, *entry: Any, journal: bool = True) -> None:
        self.calls.append(entry)
        if journal and self.journal is not None:
            self.journal.append((entry[0], self.model_id, *entry[1:]))

    def view(self) -> EngineView:
        if self.fail_view:
            raise RuntimeError("view failed")
        return EngineView(
            model_id=self.model_id,
            state=self.state,
            pinned=self.pinned,
            active_requests=self.active_requests,
            requests=self.requests,
            last_used=self.last_used,
            measured_bytes=self.measured_bytes,
            pending_unload=self.pending_unload,
            store_cache_cap=self.gate.cap,
            max_num_seqs=self.max_num_seqs,
        )

    @property
    def busy(self) -> bool:
        return self.active_requests is None or self.active_requests > 0

    def _figures(self) -> MlxFigures | None:
        s = self.sample
        if s is None or isinstance(s, MlxFigures):
            return s
        return MlxFigures(int(s[0]), int(s[1]), self.sample_at)

    def request_pressure_reclaim(self) -> bool:
        self._note("pressure_reclaim")
        return self.accept_reclaim

    async def fresh_sample(self, timeout_s: float) -> MlxFigures | None:
        self._note("fresh_sample", timeout_s, journal=False)  # measuring is not an action
        return self.fresh if self.fresh is not None else self._figures()

    def request_idle_reclaim(self) -> None:
        self._note("idle_reclaim")

    async def abort_requests(self, reason: str,
                             request_ids: Sequence[str] | None = None) -> list[str]:
        if request_ids is None:
            ids = [r.request_id for r in self.requests] + list(self.queued)
        else:
            ids = list(request_ids)
        self._note("abort", reason, None if request_ids is None else tuple(request_ids))
        return ids

    def flag_load_abort(self) -> None:
        self._note("flag_load_abort")

    def adjust_store_cache_cap(self, level: PressureLevel) -> int:
        cap = self.gate.adjust(level)
        self._note("cap", level, cap)
        return cap

    def adjust_batch_cap(self, level: PressureLevel) -> int:
        cap = self.batch.adjust(level)
        self._note("batch_cap", level, cap)
        return cap

    def set_limits(self, ceiling_bytes: int, abort_cap_bytes: int, non_mlx_bytes: int,
                   tier: Tier) -> None:
        self.limits = (ceiling_bytes, abort_cap_bytes, non_mlx_bytes, tier)
        self._note("set_limits", ceiling_bytes, abort_cap_bytes, non_mlx_bytes, tier)

    def mlx_sample(self) -> MlxFigures | None:
        self._note("mlx_sample", journal=False)
        return self._figures()


class FakeEnginePool:
    """An `EnginePool` over `FakeEngine`s; `log` records (call, model, ...) in order.

    `eviction_blocker` reads the fake's pinned / busy / state fields (or a reason
    a test put in `blockers`). `unload` returns (measured_bytes or 0, the engine's
    `queued` ids, none by default) and opens a span named `UNLOAD_SPAN` on `tracer`
    when one is set, so tests can check it nests in the action's span.
    """

    UNLOAD_SPAN = "fake.pool.unload"

    def __init__(self, *engines: FakeEngine, tracer: trace.Tracer | None = None) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.engines: dict[str, FakeEngine] = {}
        self.on_unload: Callable[[str], None] | None = None
        self.blockers: dict[str, str] = {}
        self.tracer = tracer
        for engine in engines:
            self.add(engine)

    def add(self, engine: FakeEngine) -> FakeEngine:
        engine.journal = self.log
        self.engines[engine.model_id] = engine
        return engine

    def handles(self) -> list[FakeEngine]:
        return list(self.engines.values())

    def eviction_blocker(self, model_id: str) -> str | None:
        if model_id in self.blockers:
            return self.blockers[model_id]
        engine = self.engines.get(model_id)
        if engine is None:
            return "not loaded"
        if engine.pinned:
            return "pinned"
        if engine.busy:
            return "busy"
        if engine.state is not EngineState.READY:
            return engine.state.value
        return None

    async def unload(self, model_id: str, reason: str) -> tuple[int, list[str]]:
        span = (self.tracer.start_as_current_span(self.UNLOAD_SPAN)
                if self.tracer is not None else contextlib.nullcontext())
        with span:
            engine = self.engines.pop(model_id)
            self.log.append(("unload", model_id, reason))
            if self.on_unload is not None:
                self.on_unload(model_id)
            # A forced unload ends what the model still holds (its queue, when a test
            # put one there; nothing otherwise).
            return engine.measured_bytes or 0, list(engine.queued)

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        self.log.append(("mark_pending_unload", model_id, reason))
        self.engines[model_id].pending_unload = True


class FakeSessionTier:
    """A `SessionTier` holding `bytes_held`, of which `active_bytes` are protected.

    Entries are `entry_bytes` each (the last one partial). `expired` entries of
    `expired_bytes` in all are idle past the TTL. `calls` records every shrink
    as (target, protect_active, reason); `on_shrink(freed)` shows its effect.
    """

    def __init__(self, bytes_held: int, active_bytes: int = 0, entry_bytes: int = GIB,
                 *, max_bytes: int = 48 * GIB, expired: int = 0,
                 expired_bytes: int = 0) -> None:
        self.bytes_held = bytes_held
        self.active_bytes = active_bytes
        self.entry_bytes = entry_bytes
        self.max_bytes = max_bytes
        self.expired = expired
        self.expired_bytes = expired_bytes
        self.calls: list[tuple[int, bool, str]] = []
        self.admission_calls: list[dict[str, Any]] = []
        self.expire_calls = 0
        self.on_shrink: Callable[[int], None] | None = None

    def total_bytes(self) -> int:
        return self.bytes_held

    def _plan(self, target: int, protect_active: bool, gone_bytes: int = 0) -> tuple[int, int]:
        held = max(0, self.bytes_held - gone_bytes)
        floor = max(target, self.active_bytes if protect_active else 0)
        freed = max(0, held - floor)
        return (-(-freed // self.entry_bytes) if freed else 0), freed

    def _take(self, target: int, protect_active: bool) -> int:
        entries, freed = self._plan(target, protect_active)
        self.bytes_held -= freed
        if self.on_shrink is not None:
            self.on_shrink(freed)
        return entries

    def shrink_to_bytes(self, target_bytes: int, *, protect_active: bool, reason: str,
                        protect_session_ids: Sequence[str] = ()) -> int:
        self.calls.append((target_bytes, protect_active, reason))
        return self._take(target_bytes, protect_active)

    def shrink_for_admission(self, target_bytes: int, *, protect_tokens: Sequence[int] | None,
                             model: str | None, reason: str, protect_active: bool,
                             protect_session_ids: Sequence[str] = ()) -> tuple[int, int]:
        self.calls.append((target_bytes, protect_active, reason))
        self.admission_calls.append({"target": target_bytes, "model": model, "reason": reason,
                                     "protect_tokens": protect_tokens,
                                     "protect_session_ids": tuple(protect_session_ids)})
        return self._take(target_bytes, protect_active), 0  # every fake entry is non-terminal

    def expire_idle(self) -> int:
        self.expire_calls += 1
        n, self.expired = self.expired, 0
        self.bytes_held = max(0, self.bytes_held - self.expired_bytes)
        self.expired_bytes = 0
        return n

    def expired_count(self) -> int:
        return self.expired

    def figures(self, model: str, prompt_tokens: Sequence[int],
                protect_session_ids: Sequence[str] = ()) -> BankFigures:
        lru_entries, lru_bytes = self._plan(0, True)
        chain_entries, chain_bytes = self._plan(0, False, lru_bytes)
        return BankFigures(
            total_bytes=self.bytes_held, max_bytes=self.max_bytes,
            lru_freeable_bytes=lru_bytes, lru_freeable_entries=lru_entries,
            chain_freeable_bytes=chain_bytes, chain_freeable_entries=chain_entries,
        )

    def preview_freed(self, target_bytes: int, *, mode: str, protect_active: bool,
                      protect_tokens: Sequence[int] | None, model: str | None,
                      protect_session_ids: Sequence[str], assume_evicted: Sequence[object]
                      ) -> tuple[int, int, tuple[object, ...]]:
        gone = sum(int(k[1]) for k in assume_evicted if isinstance(k, tuple))
        entries, freed = self._plan(target_bytes, protect_active, gone)
        return entries, freed, (("freed", freed),) if freed else ()


@dataclass
class RecordingSink:
    """A `PressureSink` that keeps everything it is told."""

    transitions: list[Transition] = field(default_factory=list)
    samples: list[TickSample] = field(default_factory=list)
    actions: list[tuple[Action, Outcome]] = field(default_factory=list)

    def on_transition(self, transition: Transition, readings: MemoryReadings,
                      limits: Limits) -> None:
        self.transitions.append(transition)

    def on_sample(self, sample: TickSample) -> None:
        self.samples.append(sample)

    def on_action(self, action: Action, outcome: Outcome) -> None:
        self.actions.append((action, outcome))


class FakeDesk:
    """An `AdmissionDesk`: the pause the governor sets, and scripted queue figures."""

    def __init__(self) -> None:
        self.paused: list[PressureLevel | None] = []
        self.queue = QueueView()
        self.reserved = 0
        self.pinned: tuple[str, ...] = ()

    def set_paused(self, level: PressureLevel | None) -> None:
        self.paused.append(level)

    def queue_view(self) -> QueueView:
        return self.queue

    def reserved_bytes(self) -> int:
        return self.reserved

    def pinned_sessions(self) -> tuple[str, ...]:
        return self.pinned


def default_outcome(action: Action) -> Outcome:
    """What a cooperative world answers: reclaims accepted, unloads free the measured size."""
    if isinstance(action, PressureReclaim):
        return Outcome(action, accepted=True)
    if isinstance(action, ShrinkSessionCache | ExpireSessions):
        return Outcome(action, entries=0, bytes_freed=0)
    if isinstance(action, EvictModel):
        return Outcome(action, bytes_freed=action.predicted_bytes or 0)
    if isinstance(action, AbortRequests):
        return Outcome(action, request_ids=action.request_ids or ())
    return Outcome(action)


@dataclass
class Driven:
    result: Any  # the plan's return value (TickResult, LoadResult, AdmissionResult)
    steps: list[Measure | Execute]

    @property
    def executed(self) -> list[Action]:
        return [a for s in self.steps if isinstance(s, Execute) for a in s.actions]

    def executed_of(self, kind: type) -> list[Any]:
        return [a for a in self.executed if isinstance(a, kind)]


def drive(
    plan: Any,
    *snapshots: Snapshot | Sequence[Snapshot],
    respond: Callable[[Action], Outcome] = default_outcome,
) -> Driven:
    """Run a plan generator with no loop: the i-th Measure gets the i-th snapshot (the
    last repeats); each Execute gets `respond(action)` per action. Snapshots may be given
    one by one or as one list."""
    flat: list[Snapshot] = []
    for s in snapshots:
        flat.extend([s] if isinstance(s, Snapshot) else s)
    if not flat:
        raise ValueError("drive needs at least one snapshot")
    steps: list[Measure | Execute] = []
    reply: Any = None
    measures = 0
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            return Driven(stop.value, steps)
        steps.append(step)
        if isinstance(step, Measure):
            reply = flat[min(measures, len(flat) - 1)]
            measures += 1
        else:
            reply = [respond(a) for a in step.actions]


@dataclass
class World:
    """A governor and its executor wired to fakes, with the handles a test needs."""

    governor: Governor
    executor: Executor
    pool: FakeEnginePool
    reader: ScriptedReader
    sink: RecordingSink
    clock: FakeClock
    tier: FakeSessionTier | None
    desk: FakeDesk | None
    aux_calls: list[int]

    def engine(self, model_id: str) -> FakeEngine:
        return self.pool.engines[model_id]

    def set_usage(self, process_gib: float, **kwargs: Any) -> None:
        self.reader.current = readings(process_gib, **kwargs)

    async def tick(self) -> Any:
        result = await self.governor.tick()
        assert result is not None
        return result


def make_world(
    config: MemoryConfig,
    current: MemoryReadings,
    engines: Iterable[FakeEngine] = (),
    *,
    tier: FakeSessionTier | None = None,
    desk: FakeDesk | None = None,
    aux_frees: Callable[[], int] | None = None,
    recorder: Recorder | None = None,
    admission: AdmissionSettings | None = None,
    tracer: trace.Tracer | None = None,
    clock: FakeClock | None = None,
) -> World:
    """A real `Executor` and `Governor` over fakes, on a `FakeClock` (1000.0 at start).

    `tracer` goes to the fake pool (its unload span) and, unless `recorder` is
    given, to the recorder's action spans."""
    clock = clock or FakeClock()
    pool = FakeEnginePool(*engines, tracer=tracer)
    reader = ScriptedReader(current)
    sink = RecordingSink()
    aux_calls: list[int] = []

    def aux() -> int:
        freed = aux_frees() if aux_frees is not None else 0
        aux_calls.append(freed)
        pool.log.append(("aux_clear", "-", freed))
        return freed

    executor = Executor(reader, pool, bank=tier, desk=desk, aux_caches={"decode": aux},
                        clock=clock)
    if recorder is None and tracer is not None:
        recorder = Recorder(tracer=tracer)
    governor = Governor(config, executor, sink, admission=admission, recorder=recorder,
                        clock=clock)
    return World(governor, executor, pool, reader, sink, clock, tier, desk, aux_calls)
