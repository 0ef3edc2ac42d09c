"""Scripted stand-ins for the enforcer's collaborators, for unit tests of the policy.

Not used by the service. `ScriptedReader` replays readings; `FakeEnginePool`,
`FakeEngine` and `FakeSessionTier` implement the protocols in
`memory.protocols` and log every call in order; `drive` runs the pure
`tick_plan` generator against a list of snapshots without any event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memory.actions import (
    AbortRequests,
    Action,
    EvictModel,
    Outcome,
    PressureReclaim,
    ShrinkSessionCache,
)
from memory.levels import GIB, PressureLevel
from memory.policy import Execute, Measure, Snapshot, TickResult
from memory.readings import MemoryReadings, MlxSample
from memory.store_cache import StoreCacheGate
from memory.views import EngineState, EngineView, RequestView


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
    """

    def __init__(self, current: MemoryReadings, *queued: MemoryReadings) -> None:
        self.current = current
        self.queue = list(queued)
        self.reads = 0
        self.samplers: list[MlxSample | None] = []
        self.samples: list[tuple[int, int] | None] = []

    def push(self, *more: MemoryReadings) -> None:
        self.queue.extend(more)

    def read(self, mlx_sample: MlxSample | None = None) -> MemoryReadings:
        self.samplers.append(mlx_sample)
        if mlx_sample is not None:
            self.samples.append(mlx_sample())
        if self.queue:
            self.current = self.queue.pop(0)
        self.reads += 1
        return self.current


@dataclass
class FakeEngine:
    """An `EngineHandle` whose view is plain fields; every call lands in `calls`."""

    model_id: str
    state: EngineState = EngineState.READY
    pinned: bool = False
    active_requests: int | None = 0
    requests: tuple[RequestView, ...] = ()
    last_used: float = 0.0
    measured_bytes: int | None = None
    pending_unload: bool = False
    max_num_seqs: int = 8
    accept_reclaim: bool = True
    sample: tuple[int, int] | None = None
    fail_view: bool = False
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    journal: list[tuple[Any, ...]] | None = None  # shared with the pool: global call order
    gate: StoreCacheGate = field(init=False)

    def __post_init__(self) -> None:
        self.gate = StoreCacheGate(self.max_num_seqs)

    def _note(self, *entry: Any) -> None:
        self.calls.append(entry)
        if self.journal is not None:
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

    def request_pressure_reclaim(self) -> bool:
        self._note("pressure_reclaim")
        return self.accept_reclaim

    def request_idle_reclaim(self) -> None:
        self._note("idle_reclaim")

    def abort_requests(self, reason: str, request_ids: Sequence[str] | None = None) -> list[str]:
        ids = [r.request_id for r in self.requests] if request_ids is None else list(request_ids)
        self._note("abort", reason, None if request_ids is None else tuple(request_ids))
        return ids

    def flag_load_abort(self) -> None:
        self._note("flag_load_abort")

    def adjust_store_cache_cap(self, level: PressureLevel) -> int:
        cap = self.gate.adjust(level)
        self._note("cap", level, cap)
        return cap

    def mlx_sample(self) -> tuple[int, int] | None:
        self._note("mlx_sample")
        return self.sample


class FakeEnginePool:
    """An `EnginePool` over `FakeEngine`s; `log` records (call, model, reason) in order."""

    def __init__(self, *engines: FakeEngine) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.engines: dict[str, FakeEngine] = {}
        self.on_unload: Callable[[str], None] | None = None
        for engine in engines:
            self.add(engine)

    def add(self, engine: FakeEngine) -> FakeEngine:
        engine.journal = self.log
        self.engines[engine.model_id] = engine
        return engine

    def handles(self) -> list[FakeEngine]:
        return list(self.engines.values())

    async def unload(self, model_id: str, reason: str) -> int:
        engine = self.engines.pop(model_id)
        self.log.append(("unload", model_id, reason))
        if self.on_unload is not None:
            self.on_unload(model_id)
        return engine.measured_bytes or 0

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        self.log.append(("mark_pending_unload", model_id, reason))
        self.engines[model_id].pending_unload = True


class FakeSessionTier:
    """A `SessionTier` holding `bytes_held`, of which `active_bytes` are protected."""

    def __init__(self, bytes_held: int, active_bytes: int = 0, entry_bytes: int = GIB) -> None:
        self.bytes_held = bytes_held
        self.active_bytes = active_bytes
        self.entry_bytes = entry_bytes
        self.calls: list[tuple[int, bool]] = []
        self.on_shrink: Callable[[int], None] | None = None

    def total_bytes(self) -> int:
        return self.bytes_held

    def shrink_to_bytes(self, target_bytes: int, *, protect_active: bool) -> tuple[int, int]:
        self.calls.append((target_bytes, protect_active))
        floor = max(target_bytes, self.active_bytes if protect_active else 0)
        freed = max(0, self.bytes_held - floor)
        self.bytes_held -= freed
        entries = -(-freed // self.entry_bytes) if freed else 0
        if self.on_shrink is not None:
            self.on_shrink(freed)
        return entries, freed


@dataclass
class RecordingSink:
    transitions: list[Any] = field(default_factory=list)
    samples: list[Any] = field(default_factory=list)
    actions: list[tuple[Action, Outcome]] = field(default_factory=list)

    def on_transition(self, transition: Any, readings: Any, limits: Any) -> None:
        self.transitions.append(transition)

    def on_sample(self, sample: Any) -> None:
        self.samples.append(sample)

    def on_action(self, action: Action, outcome: Outcome) -> None:
        self.actions.append((action, outcome))


def default_outcome(action: Action) -> Outcome:
    """What a cooperative world answers: reclaims accepted, unloads free the measured size."""
    if isinstance(action, PressureReclaim):
        return Outcome(action, accepted=True)
    if isinstance(action, ShrinkSessionCache):
        return Outcome(action, entries=0, bytes_freed=0)
    if isinstance(action, EvictModel):
        return Outcome(action, bytes_freed=action.predicted_bytes or 0)
    if isinstance(action, AbortRequests):
        return Outcome(action, request_ids=action.request_ids or ())
    return Outcome(action)


@dataclass
class Driven:
    result: TickResult
    steps: list[Measure | Execute]


def drive(
    gen: Any,
    snapshots: Sequence[Snapshot],
    respond: Callable[[Action], Outcome] = default_outcome,
) -> Driven:
    """Run a `tick_plan` generator: the i-th Measure gets snapshots[i] (the last repeats)."""
    steps: list[Measure | Execute] = []
    reply: Any = None
    measures = 0
    while True:
        try:
            step = gen.send(reply)
        except StopIteration as stop:
            return Driven(stop.value, steps)
        steps.append(step)
        if isinstance(step, Measure):
            reply = snapshots[min(measures, len(snapshots) - 1)]
            measures += 1
        else:
            reply = [respond(a) for a in step.actions]


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


@dataclass
class World:
    """An enforcer wired to fakes, with the handles a test needs."""

    enforcer: Any
    pool: FakeEnginePool
    reader: ScriptedReader
    sink: RecordingSink
    clock: FakeClock
    tier: FakeSessionTier | None
    aux_calls: list[int]

    def engine(self, model_id: str) -> FakeEngine:
        return self.pool.engines[model_id]

    def set_usage(self, process_gib: float, **kwargs: Any) -> None:
        self.reader.current = readings(process_gib, **kwargs)

    async def tick(self) -> TickResult:
        result = await self.enforcer.tick()
        assert result is not None
        return result


def make_world(
    config: Any,
    current: MemoryReadings,
    engines: Iterable[FakeEngine] = (),
    *,
    tier: FakeSessionTier | None = None,
    aux_frees: Callable[[], int] | None = None,
) -> World:
    """Build a `MemoryEnforcer` over fakes (import here: fakes must not import the loop eagerly)."""
    from memory.enforcer import MemoryEnforcer

    pool = FakeEnginePool(*engines)
    reader = ScriptedReader(current)
    sink = RecordingSink()
    clock = FakeClock()
    aux_calls: list[int] = []

    def aux() -> int:
        freed = aux_frees() if aux_frees is not None else 0
        aux_calls.append(freed)
        pool.log.append(("aux_clear", "-", freed))
        return freed

    enforcer = MemoryEnforcer(
        config, reader, pool, session_tier=tier, aux_caches=[aux], sink=sink, clock=clock
    )
    return World(enforcer, pool, reader, sink, clock, tier, aux_calls)
