"""The thin asyncio loop around the pure policy: read, decide, execute, record.

`MemoryEnforcer.tick()` drives `memory.policy.tick_plan`: each `Measure` step
gets a fresh snapshot (readings, engine views, session-tier bytes), each
`Execute` step runs its actions against the engine pool, the session tier and
the auxiliary caches, and every action leaves a span, metrics and a sink
callback. Exceptions from engines are logged and become failed outcomes; the
loop keeps going.

The enforcer never calls MLX while an engine is busy or loading: it takes the
engines' latest samples instead. With every engine idle (or none loaded) the
reader may ask MLX directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

import telemetry
from memory.actions import (
    AbortLoad,
    AbortRequests,
    Action,
    AdjustStoreCacheCap,
    ClearAuxCaches,
    EvictModel,
    IdleReclaim,
    MarkPendingUnload,
    Outcome,
    PauseAdmission,
    PressureReclaim,
    ResumeAdmission,
    ShrinkSessionCache,
    Transition,
)
from memory.cadence import extend_activity_hint, poll_interval
from memory.ceiling import Limits, compute_limits
from memory.config import MemoryConfig
from memory.levels import PressureLevel
from memory.policy import Execute, Measure, PolicyState, Snapshot, TickResult, tick_plan
from memory.protocols import (
    AuxCache,
    EngineHandle,
    EnginePool,
    ReadingsSource,
    SessionTier,
)
from memory.readings import MemoryReadings
from memory.views import EngineState, EngineView
from telemetry import names

log = logging.getLogger(__name__)

# Attribute names not (yet) in telemetry.names; kept here in one place so a
# move into the catalogue is a one-line change each.
ATTR_RECLAIM_KIND = "plimsoll.reclaim_kind"  # pressure | idle | aux_caches
ATTR_ACCEPTED = "plimsoll.accepted"  # an engine accepted a pressure reclaim
ATTR_PENDING_UNLOAD = "plimsoll.pending_unload"
ATTR_KEEP_LOADED = "plimsoll.keep_loaded"
ATTR_ABORT_KIND = "plimsoll.abort_kind"  # request | load
ATTR_ERROR = "plimsoll.error"


@dataclass(frozen=True)
class TickSample:
    """What one tick saw and decided; sent to the sink's `on_sample` and kept as status."""

    at: float
    level: PressureLevel
    emergency: bool
    readings: MemoryReadings
    limits: Limits
    session_bytes: int | None
    deferred: bool
    grace_polls: int
    admission_paused: bool
    poll_interval_s: float
    engines: tuple[EngineView, ...]


class MemoryEnforcer:
    """Keeps the process under its ceiling. One per process."""

    def __init__(
        self,
        config: MemoryConfig,
        reader: ReadingsSource,
        pool: EnginePool,
        *,
        session_tier: SessionTier | None = None,
        aux_caches: Iterable[AuxCache] = (),
        sink: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config.validate()
        self._reader = reader
        self._pool = pool
        self._session_tier = session_tier
        self._aux_caches = list(aux_caches)
        self._sink = sink
        self._clock = clock

        # Updated as a tick's transitions and pauses execute (admission pauses
        # before an eviction awaits an unload; a tick abandoned half way keeps
        # what it already published), then replaced by the tick's final state.
        self._state = PolicyState()
        self._last: TickResult | None = None
        self._last_sample: TickSample | None = None
        self._handles: dict[str, EngineHandle] = {}
        self._poll_interval = config.active_poll_s
        self._hint_until = float("-inf")
        self._hint_lock = threading.Lock()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._tick_lock: asyncio.Lock | None = None
        self._pending_wake = False
        self._stopped = False
        _metrics().register(self)

    # -- public state -----------------------------------------------------------
    @property
    def config(self) -> MemoryConfig:
        return self._config

    def set_config(self, config: MemoryConfig) -> None:
        """Swap settings (tier, fractions…); the next tick uses them."""
        self._config = config.validate()
        self.wake()

    @property
    def level(self) -> PressureLevel:
        return self._state.level

    @property
    def emergency(self) -> bool:
        return self._last.emergency if self._last else False

    @property
    def state(self) -> PolicyState:
        return self._state

    @property
    def readings(self) -> MemoryReadings | None:
        return self._last.readings if self._last else None

    @property
    def limits(self) -> Limits | None:
        return self._last.limits if self._last else None

    @property
    def last_result(self) -> TickResult | None:
        return self._last

    @property
    def last_sample(self) -> TickSample | None:
        return self._last_sample

    @property
    def admission_paused(self) -> bool:
        return self._state.admission_paused

    @property
    def poll_interval(self) -> float:
        return self._poll_interval

    @property
    def activity_hint_until(self) -> float:
        return self._hint_until

    # -- loop ---------------------------------------------------------------------
    async def run(self) -> None:
        """Tick, then sleep the adaptive interval or until `wake()`; until `stop()`."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        if self._pending_wake:
            self._event.set()
        while not self._stopped:
            self._event.clear()  # a wake() during the tick re-checks right after it
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("memory enforcer tick failed; continuing")
            if self._stopped:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout=self._poll_interval)

    def stop(self) -> None:
        self._stopped = True
        self.wake()

    def note_activity(self) -> None:
        """A request arrived: poll fast for at least 2 s. Re-checks at once only when the
        loop sleeps the long idle interval — a burst of requests must not run a tick
        (and a sample to every subscriber) per request."""
        sleeping_long = self._poll_interval > self._config.active_poll_s
        self.wake(active=True) if sleeping_long else self._extend_hint()

    def _extend_hint(self) -> None:
        now = self._clock()
        with self._hint_lock:
            self._hint_until = extend_activity_hint(
                now, self._hint_until, self._config.active_poll_s
            )

    def wake(self, active: bool = False) -> None:
        """Re-check early; with `active`, poll fast for at least 2 s. Safe from any thread."""
        if active:
            now = self._clock()
            with self._hint_lock:
                self._hint_until = extend_activity_hint(
                    now, self._hint_until, self._config.active_poll_s
                )
            self._poll_interval = self._config.active_poll_s
        loop, event = self._loop, self._event
        if loop is None or event is None:
            self._pending_wake = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)

    # -- one tick -------------------------------------------------------------------
    async def tick(self) -> TickResult | None:
        """Run one tick now. Returns None when a measurement failed (state unchanged)."""
        if self._tick_lock is None:
            self._tick_lock = asyncio.Lock()
        async with self._tick_lock:
            now = self._clock()
            with telemetry.tracer().start_as_current_span(names.SPAN_ENFORCER_TICK) as span:
                result = await self._drive(tick_plan(self._state, self._config, now))
                if result is not None:
                    span.set_attribute(names.ATTR_LEVEL, result.level.label)
                    span.set_attribute(names.ATTR_USAGE, result.readings.process_bytes)
                    span.set_attribute(names.ATTR_CEILING, result.limits.ceiling_bytes)
            if result is None:
                return None
            self._state = result.state
            self._last = result
            self._poll_interval = self._select_interval(result)
            self._last_sample = TickSample(
                at=now,
                level=result.level,
                emergency=result.emergency,
                readings=result.readings,
                limits=result.limits,
                session_bytes=result.session_bytes,
                deferred=result.deferred,
                grace_polls=result.state.grace_polls,
                admission_paused=result.state.admission_paused,
                poll_interval_s=self._poll_interval,
                engines=result.engines,
            )
            self._notify("on_sample", self._last_sample)
            return result

    async def _drive(self, gen: Any) -> TickResult | None:
        reply: Any = None
        latest: Snapshot | None = None
        while True:
            try:
                step = gen.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(step, Measure):
                try:
                    latest = self._snapshot()
                except Exception:
                    log.exception("memory reading failed (%s); tick abandoned", step.reason)
                    gen.close()
                    return None
                reply = latest
            elif isinstance(step, Execute):
                assert latest is not None
                reply = [await self._execute(action, latest) for action in step.actions]
            else:  # pragma: no cover - the policy yields only the two kinds
                raise TypeError(f"unknown policy step {step!r}")

    def _select_interval(self, result: TickResult) -> float:
        views = result.engines
        return poll_interval(
            result.level,
            self._clock(),
            self._hint_until,
            any(v.loading for v in views),
            views,
            active_s=self._config.active_poll_s,
            idle_s=self._config.idle_poll_s,
            empty_s=self._config.empty_poll_s,
            os_pressure=result.readings.os_pressure,
        )

    # -- measuring --------------------------------------------------------------------
    def _snapshot(self) -> Snapshot:
        try:
            handles = list(self._pool.handles())
        except Exception:
            # Engines may be decoding: no direct MLX call, no sample either.
            log.exception("engine pool handles() failed; measuring without engines")
            handles, sampler = [], _no_sample
        else:
            sampler = None
        views = [self._view(handle) for handle in handles]
        self._handles = {h.model_id: h for h in handles}
        readings = self._reader.read(sampler or self._sampler(views, handles))
        session_bytes = None
        if self._session_tier is not None:
            try:
                session_bytes = int(self._session_tier.total_bytes())
            except Exception:
                log.exception("session tier total_bytes() failed")
        return Snapshot(readings, tuple(views), session_bytes)

    @staticmethod
    def _view(handle: EngineHandle) -> EngineView:
        try:
            return handle.view()
        except Exception:
            # Unknown state: never evict it blind (pinned), keep polling fast (busy).
            log.exception("engine %s view() failed", getattr(handle, "model_id", "?"))
            return EngineView(
                model_id=handle.model_id, state=EngineState.READY, pinned=True, active_requests=None
            )

    @staticmethod
    def _sampler(
        views: Sequence[EngineView], handles: Sequence[EngineHandle]
    ) -> Callable[[], tuple[int, int] | None] | None:
        """None (the reader may ask MLX) only when no engine is busy or loading."""
        if not any(v.busy or v.loading for v in views):
            return None

        def sample() -> tuple[int, int] | None:
            # MLX's allocator is process-wide: each engine reports the same
            # figures at different moments; the largest is the safe one.
            samples: list[tuple[int, int]] = []
            for handle in handles:
                try:
                    s = handle.mlx_sample()
                except Exception:
                    log.exception("engine %s mlx_sample() failed", handle.model_id)
                    continue
                if s is not None:
                    samples.append(s)
            if not samples:
                return None
            return max(s[0] for s in samples), max(s[1] for s in samples)

        return sample

    # -- executing --------------------------------------------------------------------
    async def _execute(self, action: Action, snap: Snapshot) -> Outcome:
        try:
            outcome = await self._perform(action, snap)
        except Exception as exc:
            log.exception("memory action %r failed", action)
            outcome = Outcome.failed(action, f"{type(exc).__name__}: {exc}")
        self._record(action, outcome, snap)
        self._notify("on_action", action, outcome)
        return outcome

    def _handle(self, model_id: str) -> EngineHandle:
        handle = self._handles.get(model_id)
        if handle is None:
            raise LookupError(f"no engine handle for model {model_id!r}")
        return handle

    async def _perform(self, action: Action, snap: Snapshot) -> Outcome:
        match action:
            case AdjustStoreCacheCap(model_id=m, level=level):
                return Outcome(action, value=int(self._handle(m).adjust_store_cache_cap(level)))
            case ClearAuxCaches():
                return Outcome(action, bytes_freed=self._clear_aux())
            case PressureReclaim(model_id=m):
                return Outcome(action, accepted=bool(self._handle(m).request_pressure_reclaim()))
            case IdleReclaim(model_id=m):
                self._handle(m).request_idle_reclaim()
                return Outcome(action, accepted=True)
            case ShrinkSessionCache(target_bytes=target, protect_active=protect):
                if self._session_tier is None:
                    return Outcome(action, entries=0, bytes_freed=0)
                entries, freed = self._shrink_sessions(target, protect)
                return Outcome(action, entries=entries, bytes_freed=freed)
            case EvictModel(model_id=m, reason=reason, abort_first=abort_first):
                ids: list[str] = []
                if abort_first and m in self._handles:
                    ids = list(self._handles[m].abort_requests(reason) or [])
                freed = await self._pool.unload(m, reason)
                return Outcome(action, bytes_freed=int(freed or 0), request_ids=tuple(ids))
            case AbortRequests(model_id=m, request_ids=req, reason=reason):
                ids = self._handle(m).abort_requests(reason, list(req) if req is not None else None)
                return Outcome(action, request_ids=tuple(ids or ()))
            case MarkPendingUnload(model_id=m, reason=reason):
                self._pool.mark_pending_unload(m, reason)
                return Outcome(action)
            case AbortLoad(model_id=m):
                self._handle(m).flag_load_abort()
                return Outcome(action)
            case PauseAdmission():
                self._state = dataclasses.replace(self._state, admission_paused=True)
                return Outcome(action)
            case ResumeAdmission():
                self._state = dataclasses.replace(self._state, admission_paused=False)
                return Outcome(action)
            case Transition():
                self._state = dataclasses.replace(self._state, level=action.to_level)
                self._publish_transition(action, snap)
                return Outcome(action)
        raise TypeError(f"unknown memory action {action!r}")

    def _shrink_sessions(self, target: int, protect: bool) -> tuple[int, int]:
        """Accepts a tier returning (entries, bytes freed) or just the entry count
        (then bytes freed is the drop in `total_bytes()`)."""
        tier = self._session_tier
        assert tier is not None
        before = int(tier.total_bytes())
        result: Any = tier.shrink_to_bytes(target, protect_active=protect)
        if isinstance(result, tuple):
            return int(result[0]), int(result[1])
        return int(result), max(0, before - int(tier.total_bytes()))

    def _clear_aux(self) -> int:
        freed = 0
        for clear in self._aux_caches:
            try:
                freed += int(clear() or 0)
            except Exception:
                log.exception("auxiliary cache clear failed")
        return freed

    def _publish_transition(self, transition: Transition, snap: Snapshot) -> None:
        log.log(
            logging.WARNING if transition.to_level > transition.from_level else logging.INFO,
            "memory pressure %s -> %s (%s): usage %d, ceiling %d, soft %d, hard %d",
            transition.from_level.label,
            transition.to_level.label,
            transition.reason,
            transition.usage_bytes,
            transition.ceiling_bytes,
            transition.soft_bytes,
            transition.hard_bytes,
        )
        self._notify(
            "on_transition", transition, snap.readings, compute_limits(snap.readings, self._config)
        )

    def _notify(self, method: str, *args: Any) -> None:
        callback = getattr(self._sink, method, None) if self._sink is not None else None
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            log.exception("memory sink %s failed", method)

    # -- telemetry ----------------------------------------------------------------------
    def _record(self, action: Action, outcome: Outcome, snap: Snapshot) -> None:
        span_name, attrs = _span_for(action, outcome, snap, self._state.level)
        if span_name is not None:
            with telemetry.tracer().start_as_current_span(span_name, attributes=attrs) as span:
                if not outcome.ok:
                    span.set_attribute("error", True)
                    if outcome.error:
                        span.set_attribute(ATTR_ERROR, outcome.error)
        _metrics().count(action, outcome)
        if isinstance(action, EvictModel | AbortRequests | AbortLoad | MarkPendingUnload):
            log.warning("memory enforcer %s -> %s", action, "ok" if outcome.ok else outcome.error)


def _no_sample() -> tuple[int, int] | None:
    return None


def _span_for(
    action: Action, outcome: Outcome, snap: Snapshot, level: PressureLevel
) -> tuple[str | None, dict[str, Any]]:
    """The catalogue span and its attributes for an action (None: no span)."""
    r = snap.readings
    attrs: dict[str, Any] = {names.ATTR_LEVEL: level.label, names.ATTR_USAGE: r.process_bytes}
    model = getattr(action, "model_id", None)
    if model is not None:
        attrs[names.ATTR_MODEL] = model
    reason = getattr(action, "reason", None)
    if reason is not None:
        attrs[names.ATTR_REASON] = reason
    if outcome.bytes_freed is not None:
        attrs[names.ATTR_BYTES_FREED] = outcome.bytes_freed
    if outcome.request_ids:
        attrs[names.ATTR_REQUEST_IDS] = list(outcome.request_ids)
    match action:
        case PressureReclaim() | IdleReclaim():
            attrs[ATTR_RECLAIM_KIND] = "pressure" if isinstance(action, PressureReclaim) else "idle"
            if outcome.accepted is not None:
                attrs[ATTR_ACCEPTED] = outcome.accepted
            return names.SPAN_RECLAIM, attrs
        case ClearAuxCaches():
            attrs[names.ATTR_REASON] = "aux_caches"
            attrs[ATTR_RECLAIM_KIND] = "aux_caches"
            return names.SPAN_RECLAIM, attrs
        case ShrinkSessionCache(target_bytes=target):
            attrs[names.ATTR_TARGET] = target
            attrs[names.ATTR_ENTRIES_EVICTED] = outcome.entries or 0
            return names.SPAN_BANK_SHRINK, attrs
        case EvictModel(predicted_bytes=predicted):
            if predicted is not None:
                attrs[names.ATTR_TARGET] = predicted
            return names.SPAN_EVICT, attrs
        case MarkPendingUnload():
            attrs[ATTR_PENDING_UNLOAD] = True
            return names.SPAN_EVICT, attrs
        case AbortRequests(keep_loaded=keep):
            attrs[ATTR_KEEP_LOADED] = keep
            return names.SPAN_ABORT, attrs
        case AbortLoad():
            return names.SPAN_LOAD_ABORT, attrs
        case Transition():
            attrs.update(
                {
                    names.ATTR_FROM_LEVEL: action.from_level.label,
                    names.ATTR_LEVEL: action.to_level.label,
                    names.ATTR_USAGE: action.usage_bytes,
                    names.ATTR_CEILING: action.ceiling_bytes,
                    names.ATTR_TARGET: action.soft_bytes,
                    names.ATTR_REASON: action.reason,
                }
            )
            return names.SPAN_LEVEL_TRANSITION, attrs
    return None, attrs


# ---------------------------------------------------------------------------
# metrics (one set of instruments per process, observing live enforcers)


class _Metrics:
    def __init__(self) -> None:
        m = telemetry.meter()
        self._enforcers: weakref.WeakSet[MemoryEnforcer] = weakref.WeakSet()
        self.evictions = m.create_counter(
            names.METRIC_EVICTIONS, unit="1", description="Models evicted by the memory enforcer"
        )
        self.aborts = m.create_counter(
            names.METRIC_ABORTS, unit="1", description="Requests and loads aborted for memory"
        )
        self.transitions = m.create_counter(
            names.METRIC_TRANSITIONS, unit="1", description="Pressure level transitions"
        )
        m.create_observable_gauge(
            names.METRIC_MEMORY_USAGE, [self._usage], unit="By", description="Process memory usage"
        )
        m.create_observable_gauge(
            names.METRIC_MEMORY_CEILING, [self._ceiling], unit="By", description="Memory ceiling"
        )
        m.create_observable_gauge(
            names.METRIC_PRESSURE_LEVEL, [self._level], unit="1", description="Pressure level (1-4)"
        )
        m.create_observable_gauge(
            names.METRIC_POOL_BYTES, [self._pool], unit="By", description="MLX buffer pool bytes"
        )

    def register(self, enforcer: MemoryEnforcer) -> None:
        self._enforcers.add(enforcer)

    def _observe(self, pick: Callable[[MemoryEnforcer], int | None]) -> list[Observation]:
        out = []
        for enforcer in list(self._enforcers):
            value = pick(enforcer)
            if value is not None:
                out.append(Observation(value))
        return out

    def _usage(self, _options: CallbackOptions) -> list[Observation]:
        return self._observe(lambda e: e.readings.process_bytes if e.readings else None)

    def _ceiling(self, _options: CallbackOptions) -> list[Observation]:
        return self._observe(lambda e: e.limits.ceiling_bytes if e.limits else None)

    def _level(self, _options: CallbackOptions) -> list[Observation]:
        return self._observe(lambda e: int(e.level))

    def _pool(self, _options: CallbackOptions) -> list[Observation]:
        return self._observe(lambda e: e.readings.mlx_pool_bytes if e.readings else None)

    def count(self, action: Action, outcome: Outcome) -> None:
        if not outcome.ok:
            return
        match action:
            case EvictModel(model_id=m, reason=reason):
                self.evictions.add(1, {names.ATTR_REASON: reason, names.ATTR_MODEL: m})
            case AbortRequests(model_id=m, reason=reason) if outcome.request_ids:
                self.aborts.add(
                    len(outcome.request_ids),
                    {names.ATTR_REASON: reason, names.ATTR_MODEL: m, ATTR_ABORT_KIND: "request"},
                )
            case AbortLoad(model_id=m, reason=reason):
                self.aborts.add(
                    1, {names.ATTR_REASON: reason, names.ATTR_MODEL: m, ATTR_ABORT_KIND: "load"}
                )
            case Transition(from_level=a, to_level=b):
                self.transitions.add(1, {names.ATTR_FROM_LEVEL: a.label, names.ATTR_LEVEL: b.label})


_metrics_instance: _Metrics | None = None
_metrics_lock = threading.Lock()


def _metrics() -> _Metrics:
    global _metrics_instance
    with _metrics_lock:
        if _metrics_instance is None:
            _metrics_instance = _Metrics()
        return _metrics_instance
