"""The enforcer tick: pure functions and one pure state machine.

Nothing here reads memory, a clock or MLX. `tick_plan` is a generator that the
governor (`memory.governor`) drives:

- it yields `Measure(reason)` and receives a fresh `Snapshot` (readings, engine
  views, session-tier bytes);
- it yields `Execute(actions)` and receives one `Outcome` per action;
- it returns a `TickResult` (new `PolicyState`, level, limits, what was done).

The tick re-measures after clearing auxiliary caches, after a session shrink
and after evictions of models whose size is unknown, so a scripted list of
snapshots drives it exactly the same way the real reader does.

The ladder, in order:

1. At or above soft: clear auxiliary caches, re-measure.
   Commit the level (ok below soft, always; the emergency counter), pause
   admission, or resume it at ok (below an opt-in band under soft).
2. Not ok and not emergency: when the MLX pool exceeds the floor (2 GiB) or a
   session shrink just freed references, ask every ready engine for a pressure
   reclaim. When an engine accepted, defer enforcement (at most 5 consecutive
   polls per pressure episode; the counter resets at ok).
3. Hard: shrink the session tier toward soft, protecting active entries; when
   it freed anything ask for a pool reclaim (the freed references sit in the
   pool), re-measure and re-grade (hard may drop to soft or ok), and defer if
   grace remains.
4. Relief toward the soft mark, with sizes predicted from measured model bytes:
   pending unloads first, then idle non-pinned LRU models (at soft only while
   more than one non-pinned model is loaded; at hard even the last one; a model
   in its load warm-up is spared below hard and taken last at hard); at
   hard, then the LRU busy non-pinned model (abort its requests, keep it loaded;
   in emergency abort all and mark a pending unload); with nothing evictable,
   flag in-progress loads to abort; with none, abort active requests on every
   engine (emergency only) or ask every engine for an idle reclaim.
5. Every tick, deferred and ok ones too: one store-cache cap step per engine
   (and one step of its decode batch cap), and this tick's limits to every engine.
6. Every tick, the upkeep (`upkeep` below): model keep-alive and the
   loaded-model limits (memory.plans.model_limits), then the bank's idle TTL,
   the OS pressure guard, the bank's dynamic ceiling.
7. Transitions are actions, executed (published) where they are committed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from memory.actions import (
    MEASURE_AFTER_AUX,
    MEASURE_AFTER_EVICTION,
    MEASURE_AFTER_RELIEF,
    MEASURE_AFTER_SHRINK,
    MEASURE_DISABLED,
    MEASURE_POLL,
    REASON_EMERGENCY_ALL,
    REASON_EMERGENCY_BUSY,
    REASON_HARD_BUSY,
    REASON_HARD_LRU,
    REASON_NO_EVICTABLE,
    REASON_OS_RECLAIM,
    REASON_PENDING_UNLOAD,
    REASON_POOL_RECLAIM,
    REASON_SHRINK_RECLAIM,
    REASON_SOFT_LRU,
    AbortLoad,
    AbortRequests,
    Action,
    AdjustBatchCap,
    AdjustStoreCacheCap,
    ClearAuxCaches,
    EvictModel,
    ExpireSessions,
    IdleReclaim,
    MarkPendingUnload,
    Outcome,
    PauseAdmission,
    PressureReclaim,
    PropagateLimits,
    ResumeAdmission,
    ShrinkSessionCache,
    Transition,
)
from memory.ceiling import Limits, compute_limits
from memory.config import AbortOrder, MemoryConfig
from memory.levels import PressureLevel
from memory.plans.bank_ceiling import bank_dynamic_ceiling, plan_hold_to_ceiling, working_set_bytes
from memory.plans.eviction import idle_victims
from memory.plans.model_limits import plan_model_limits
from memory.plans.os_guard import GuardState, OsPressure, guard_step
from memory.plans.steps import Execute, Measure, Snapshot, Step
from memory.readings import MemoryReadings
from memory.views import EngineView, RequestView

OK, SOFT, HARD, EMERGENCY = (
    PressureLevel.OK,
    PressureLevel.SOFT,
    PressureLevel.HARD,
    PressureLevel.EMERGENCY,
)


# ---------------------------------------------------------------------------
# state and steps


@dataclass(frozen=True)
class PolicyState:
    """What the policy remembers between ticks."""

    level: PressureLevel = OK  # last committed level (EMERGENCY included)
    over_ceiling_polls: int = 0  # consecutive polls at or above the real ceiling
    grace_polls: int = 0  # deferred polls in this pressure episode
    shrink_freed_refs: bool = False  # a session shrink freed references not yet reclaimed
    admission_paused: bool = False
    guard: GuardState = GuardState()  # the OS pressure guard's hysteresis
    bank_ceiling_bytes: int | None = None  # the bank's dynamic ceiling, last tick


@dataclass(frozen=True)
class Assessment:
    level: PressureLevel  # EMERGENCY when the emergency rule holds
    base_level: PressureLevel  # OK / SOFT / HARD from the marks
    emergency: bool
    over_ceiling_polls: int
    usage_bytes: int


@dataclass(frozen=True)
class TickResult:
    state: PolicyState
    level: PressureLevel
    emergency: bool
    readings: MemoryReadings
    limits: Limits
    engines: tuple[EngineView, ...]
    session_bytes: int | None
    deferred: bool
    outcomes: tuple[Outcome, ...]
    transitions: tuple[Transition, ...]
    measurements: int

    @property
    def actions(self) -> tuple[Action, ...]:
        return tuple(o.action for o in self.outcomes)

    def actions_of(self, kind: type) -> list[Any]:
        return [a for a in self.actions if isinstance(a, kind)]


# ---------------------------------------------------------------------------
# grading


def raw_level(usage: int, limits: Limits) -> PressureLevel:
    """ok below soft, soft in [soft, hard), hard at or above hard."""
    if usage >= limits.hard_bytes:
        return HARD
    if usage >= limits.soft_bytes:
        return SOFT
    return OK


def is_emergency(
    usage: int, ceiling: int, over_polls: int, margin_bytes: int, polls_needed: int
) -> bool:
    """At or above the real ceiling and either margin bytes over it or over for N polls."""
    if usage < ceiling:
        return False
    return usage >= ceiling + margin_bytes or over_polls >= polls_needed


def assess(
    usage: int,
    limits: Limits,
    previous: PressureLevel,
    over_ceiling_polls: int,
    config: MemoryConfig,
    *,
    new_poll: bool,
) -> Assessment:
    """Grade usage. `new_poll` counts this measurement as a poll for the emergency counter;
    a re-measurement inside the same tick does not count again (but still resets it)."""
    if usage < limits.ceiling_bytes:
        polls = 0
    elif new_poll:
        polls = over_ceiling_polls + 1
    else:
        polls = max(over_ceiling_polls, 1)
    base = raw_level(usage, limits)
    emergency = is_emergency(
        usage, limits.ceiling_bytes, polls, config.emergency_margin_bytes, config.emergency_polls
    )
    return Assessment(
        level=EMERGENCY if emergency else base,
        base_level=HARD if emergency else base,
        emergency=emergency,
        over_ceiling_polls=polls,
        usage_bytes=usage,
    )


def commit(
    state: PolicyState, assessment: Assessment, limits: Limits, reason: str, now: float,
    resume_band: float = 0.0,
) -> tuple[PolicyState, list[Action]]:
    """Adopt an assessment: transition, admission pause/resume, episode counters."""
    actions: list[Action] = []
    admission = admission_action(assessment.level, state.admission_paused,
                                 assessment.usage_bytes, limits, resume_band)
    if (admission is None and state.admission_paused and assessment.level != OK
            and assessment.level != state.level):
        admission = PauseAdmission(assessment.level)  # still paused, at the new level
    paused = state.admission_paused if admission is None else isinstance(admission,
                                                                          PauseAdmission)
    if assessment.level != state.level:
        actions.append(
            Transition(
                from_level=state.level,
                to_level=assessment.level,
                reason=reason,
                usage_bytes=assessment.usage_bytes,
                ceiling_bytes=limits.ceiling_bytes,
                soft_bytes=limits.soft_bytes,
                hard_bytes=limits.hard_bytes,
                emergency=assessment.emergency,
                at=now,
            )
        )
    if admission is not None:
        actions.append(admission)  # after the transition it follows from
    at_ok = assessment.level == OK
    new_state = dataclasses.replace(
        state,
        level=assessment.level,
        over_ceiling_polls=assessment.over_ceiling_polls,
        grace_polls=0 if at_ok else state.grace_polls,  # a pressure episode ends at ok
        shrink_freed_refs=False if at_ok else state.shrink_freed_refs,
        admission_paused=paused,
    )
    return new_state, actions


# ---------------------------------------------------------------------------
# single decisions


def pool_reclaim_wanted(readings: MemoryReadings, state: PolicyState, config: MemoryConfig) -> bool:
    """The pool is worth draining: above the floor, or a shrink just freed references."""
    if not config.pressure_reclaim:
        return False
    return readings.pool_bytes > config.pool_reclaim_floor_bytes or state.shrink_freed_refs


def plan_pressure_reclaim(
    engines: Iterable[EngineView], reason: str = REASON_POOL_RECLAIM
) -> tuple[PressureReclaim, ...]:
    """One pressure reclaim per ready engine (busy ones included: it runs under load)."""
    return tuple(PressureReclaim(e.model_id, reason) for e in engines if e.ready)


def may_defer(assessment: Assessment, state: PolicyState, config: MemoryConfig) -> bool:
    """Deferral is for pressure that is not ok and not emergency, within the grace budget."""
    return assessment.level in (SOFT, HARD) and state.grace_polls < config.reclaim_grace_polls


def plan_session_shrink(
    usage: int, limits: Limits, session_bytes: int | None
) -> ShrinkSessionCache | None:
    """Shrink the session tier by the excess over soft (never below zero)."""
    if not session_bytes or session_bytes <= 0:
        return None
    excess = usage - limits.soft_bytes
    if excess <= 0:
        return None
    return ShrinkSessionCache(target_bytes=max(0, session_bytes - excess), protect_active=True)


def plan_cap_walk(
    level: PressureLevel, engines: Iterable[EngineView]
) -> tuple[AdjustStoreCacheCap | AdjustBatchCap, ...]:
    """One step per engine of its store-cache cap and of its decode batch cap."""
    ready = [e for e in engines if e.ready]
    return tuple(AdjustStoreCacheCap(e.model_id, level) for e in ready) + tuple(
        AdjustBatchCap(e.model_id, level) for e in ready
    )


def plan_propagate(readings: MemoryReadings, limits: Limits) -> PropagateLimits:
    """This tick's ceiling for the engines' prefill chunk sizing. The non-MLX term
    leaves out MLX's buffer pool as well as its active memory: the guard adds both as
    they are when it plans (a pool an admission reclaimed since this tick, or one a
    chunk has since reused, is not counted twice)."""
    non_mlx = max(0, readings.process_bytes - (readings.mlx_active_bytes or 0)
                  - (readings.mlx_pool_bytes or 0))
    return PropagateLimits(limits.ceiling_bytes, limits.abort_cap_bytes, non_mlx, limits.tier)


def select_requests(
    requests: Sequence[RequestView],
    order: AbortOrder,
    deficit_bytes: int,
    *,
    stop_on_unknown: bool,
) -> tuple[str, ...] | None:
    """Which requests to abort; None means all of the engine's requests.

    Graded orders take requests youngest-first or largest-first until their
    byte estimates cover the deficit. An unknown estimate ends the batch when
    `stop_on_unknown` (non-emergency: re-measure before ending more).
    """
    if order is AbortOrder.ALL or not requests:
        return None
    if order is AbortOrder.YOUNGEST:
        ordered = sorted(requests, key=lambda r: (-r.started_at, r.request_id))
    else:
        ordered = sorted(
            requests,
            key=lambda r: (r.bytes_estimate is None, -(r.bytes_estimate or 0), r.request_id),
        )
    chosen: list[str] = []
    covered = 0
    for request in ordered:
        chosen.append(request.request_id)
        if request.bytes_estimate is None:
            if stop_on_unknown:
                break
            continue
        covered += request.bytes_estimate
        if covered >= deficit_bytes:
            break
    return tuple(chosen)


# ---------------------------------------------------------------------------
# relief toward the soft mark


@dataclass(frozen=True)
class ReliefMemo:
    """What this tick has already done, so a re-plan never repeats it."""

    evicted: frozenset[str] = frozenset()
    aborted: frozenset[str] = frozenset()
    loads_flagged: frozenset[str] = frozenset()
    skipped: frozenset[str] = frozenset()  # evictions the executor declined: not again

    def after(self, actions: Iterable[Action],
              skipped: Iterable[str] = ()) -> ReliefMemo:
        evicted, aborted, flagged = set(self.evicted), set(self.aborted), set(self.loads_flagged)
        declined = set(self.skipped) | set(skipped)
        for action in actions:
            if isinstance(action, EvictModel) and action.model_id not in declined:
                evicted.add(action.model_id)
            elif isinstance(action, AbortRequests):
                aborted.add(action.model_id)
            elif isinstance(action, AbortLoad):
                flagged.add(action.model_id)
        return ReliefMemo(frozenset(evicted), frozenset(aborted), frozenset(flagged),
                          frozenset(declined))


@dataclass(frozen=True)
class ReliefPlan:
    actions: tuple[Action, ...]
    predicted_usage: int
    # False: re-measure and plan again, with usage = min(fresh, predicted) — after
    # an eviction of unknown size, or before escalating past evictions at hard.
    complete: bool


def _idle_victims(engines: Sequence[EngineView], memo: ReliefMemo, warmup_s: float = 0.0,
                  warming_last: bool = False) -> list[EngineView]:
    return idle_victims(engines, exclude=memo.evicted | memo.skipped, warmup_s=warmup_s,
                        warming_last=warming_last)


def _busy_victim(engines: Sequence[EngineView], memo: ReliefMemo) -> EngineView | None:
    """The least recently used busy non-pinned model not already handled."""
    candidates = [
        e
        for e in engines
        if e.ready
        and not e.pinned
        and e.busy
        and not e.pending_unload
        and e.model_id not in memo.evicted
        and e.model_id not in memo.aborted
    ]
    return min(candidates, key=lambda e: (e.last_used, e.model_id), default=None)


def plan_relief(
    usage: int,
    limits: Limits,
    assessment: Assessment,
    engines: Sequence[EngineView],
    config: MemoryConfig,
    memo: ReliefMemo = ReliefMemo(),
) -> ReliefPlan:
    """The eviction/abort ladder for one measurement, predicting freed bytes.

    Evicts while predicted usage is above the soft mark (the target is always
    soft, so the level does not oscillate at a boundary).
    """
    level = assessment.base_level
    emergency = assessment.emergency
    soft = limits.soft_bytes
    predicted = usage
    actions: list[Action] = []
    live = [e for e in engines if e.model_id not in memo.evicted]
    non_pinned_loaded = sum(1 for e in live if e.ready and not e.pinned)

    def plan(complete: bool = True) -> ReliefPlan:
        return ReliefPlan(tuple(actions), predicted, complete)

    # Pending unloads and idle LRU models; a model in its load warm-up is spared below
    # hard and taken last at hard (memory.plans.eviction).
    for victim in _idle_victims(live, memo, config.load_warmup_s, level >= HARD):
        if predicted <= soft:
            return plan()
        if not victim.pending_unload and level < HARD and non_pinned_loaded <= 1:
            break  # soft: the last non-pinned model stays loaded
        if victim.pending_unload:
            reason = REASON_PENDING_UNLOAD
        else:
            reason = REASON_HARD_LRU if level >= HARD else REASON_SOFT_LRU
        actions.append(EvictModel(victim.model_id, reason, victim.measured_bytes))
        non_pinned_loaded -= 1
        if victim.measured_bytes is None:
            return plan(complete=False)  # unknown size: re-measure before going on
        predicted -= victim.measured_bytes

    if predicted <= soft or level < HARD:
        return plan()  # soft with nothing evictable: the admission pause is all
    if actions:
        # Evictions did not cover the deficit by prediction: re-measure before
        # anything more destructive (aborts), rather than trust the prediction.
        return plan(complete=False)

    # Hard: the busy LRU non-pinned model. (No eviction is planned past this point.)
    busy = _busy_victim(live, memo)
    if busy is not None:
        if emergency:
            actions.append(AbortRequests(busy.model_id, None, REASON_EMERGENCY_BUSY, False))
            actions.append(MarkPendingUnload(busy.model_id, REASON_EMERGENCY_BUSY))
        else:
            ids = select_requests(
                busy.requests, config.abort_order, predicted - soft, stop_on_unknown=True
            )
            actions.append(AbortRequests(busy.model_id, ids, REASON_HARD_BUSY, True))
        return plan()

    # Nothing evictable: in-progress loads first.
    loading = [e for e in live if e.loading and e.model_id not in memo.loads_flagged]
    if loading:
        actions.extend(AbortLoad(e.model_id) for e in loading)
        return plan()

    # All pinned (or nothing loaded).
    if emergency and predicted >= limits.ceiling_bytes:
        actions.extend(_emergency_aborts(live, predicted - soft, config, memo))
    else:
        actions.extend(IdleReclaim(e.model_id, REASON_NO_EVICTABLE) for e in live if e.ready)
    return plan()


def _emergency_aborts(
    engines: Sequence[EngineView], deficit: int, config: MemoryConfig, memo: ReliefMemo
) -> list[Action]:
    """Emergency with everything pinned: abort active requests on every engine (models stay).

    Graded orders pick youngest/largest requests across all engines; unknown
    estimates do not stop the batch here (emergency errs on the side of safety).
    """
    busy = [e for e in engines if e.ready and e.busy and e.model_id not in memo.aborted]
    if config.abort_order is AbortOrder.ALL or any(not e.requests for e in busy):
        return [AbortRequests(e.model_id, None, REASON_EMERGENCY_ALL, True) for e in busy]
    owner = {r.request_id: e.model_id for e in busy for r in e.requests}
    pooled = [r for e in busy for r in e.requests]
    chosen = select_requests(pooled, config.abort_order, deficit, stop_on_unknown=False) or ()
    actions: list[Action] = []
    for engine in busy:
        ids = tuple(i for i in chosen if owner[i] == engine.model_id)
        if ids:
            actions.append(AbortRequests(engine.model_id, ids, REASON_EMERGENCY_ALL, True))
    return actions


def admission_action(
    level: PressureLevel, paused: bool, usage: int = 0, limits: Limits | None = None,
    resume_band: float = 0.0,
) -> Action | None:
    """New admissions pause whenever the level is not ok, and resume at ok — once usage
    is `resume_band` of the ceiling below the soft mark, when that opt-in band is set."""
    if level != OK and not paused:
        return PauseAdmission(level)
    if level == OK and paused:
        band = int(limits.ceiling_bytes * resume_band) if limits is not None else 0
        if limits is not None and band > 0 and usage >= limits.soft_bytes - band:
            return None  # still inside the opt-in resume band
        return ResumeAdmission(level)
    return None


# ---------------------------------------------------------------------------
# the tick


@dataclass
class _Tick:
    """Mutable bookkeeping for one run of `tick_plan` (local to the generator)."""

    state: PolicyState
    config: MemoryConfig
    now: float
    snap: Snapshot
    limits: Limits
    outcomes: list[Outcome] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    measurements: int = 1
    evicted: frozenset[str] = frozenset()
    bank_freed: int = 0  # session bytes freed since the last measurement

    @property
    def usage(self) -> int:
        return self.snap.readings.process_bytes

    def observe(self, snap: Snapshot) -> None:
        self.snap = snap
        self.limits = compute_limits(snap.readings, self.config)
        self.measurements += 1
        self.bank_freed = 0

    @property
    def bank_bytes(self) -> int | None:
        if self.snap.session_bytes is None:
            return None
        return max(0, self.snap.session_bytes - self.bank_freed)

    def assess(self, *, new_poll: bool = False) -> Assessment:
        return assess(
            self.usage,
            self.limits,
            self.state.level,
            self.state.over_ceiling_polls,
            self.config,
            new_poll=new_poll,
        )


def _execute(tick: _Tick, actions: Sequence[Action]) -> Generator[Step, Any, list[Outcome]]:
    if not actions:
        return []
    outcomes: list[Outcome] = list((yield Execute(tuple(actions))))
    tick.outcomes.extend(outcomes)
    tick.transitions.extend(a for a in actions if isinstance(a, Transition))
    tick.bank_freed += sum(o.bytes_freed or 0 for o in outcomes
                           if isinstance(o.action, ShrinkSessionCache | ExpireSessions))
    return outcomes


def _commit(tick: _Tick, assessment: Assessment, reason: str) -> Generator[Step, Any, None]:
    tick.state, actions = commit(tick.state, assessment, tick.limits, reason, tick.now,
                                 tick.config.resume_band_fraction)
    yield from _execute(tick, actions)


def _measure(tick: _Tick, reason: str) -> Generator[Step, Any, None]:
    tick.observe((yield Measure(reason)))


def tick_plan(
    state: PolicyState, config: MemoryConfig, now: float
) -> Generator[Step, Any, TickResult]:
    """One enforcer tick as a state machine (see the module docstring)."""
    first: Snapshot = yield Measure(MEASURE_POLL)
    tick = _Tick(state, config, now, first, compute_limits(first.readings, config))
    deferred = False

    if not config.enabled:
        # Measured and reported, never enforced; caps recover toward max_num_seqs.
        ok = Assessment(OK, OK, False, 0, tick.usage)
        yield from _commit(tick, ok, MEASURE_DISABLED)
        yield from _execute(tick, plan_cap_walk(OK, tick.snap.engines))
        yield from upkeep(tick)
        return _result(tick, ok, deferred)

    a = tick.assess(new_poll=True)
    if a.level >= SOFT:
        # Cheap auxiliary caches go before any pause or eviction; then re-measure.
        yield from _execute(tick, [ClearAuxCaches()])
        polls = a.over_ceiling_polls
        yield from _measure(tick, MEASURE_AFTER_AUX)
        a = assess(tick.usage, tick.limits, tick.state.level, polls, config, new_poll=False)
    yield from _commit(tick, a, MEASURE_POLL)  # the aux clear is part of the poll

    # Drain the reclaimable pool before anything destructive; not in an emergency,
    # when nothing may wait.
    if a.level in (SOFT, HARD) and pool_reclaim_wanted(tick.snap.readings, tick.state, config):
        outcomes = yield from _execute(tick, plan_pressure_reclaim(tick.snap.engines))
        accepted = any(o.accepted for o in outcomes)
        if accepted:
            tick.state = dataclasses.replace(tick.state, shrink_freed_refs=False)
        if accepted and may_defer(a, tick.state, config):
            tick.state = dataclasses.replace(tick.state, grace_polls=tick.state.grace_polls + 1)
            deferred = True

    if not deferred and a.base_level >= HARD:
        shrink = plan_session_shrink(tick.usage, tick.limits, tick.snap.session_bytes)
        if shrink is not None:
            (result,) = yield from _execute(tick, [shrink])
            if result.ok and ((result.entries or 0) > 0 or (result.bytes_freed or 0) > 0):
                a, deferred = yield from _after_shrink(tick)

    if not deferred and a.level >= SOFT:
        a = yield from _relieve(tick, a)

    yield from _execute(tick, plan_cap_walk(tick.state.level, _remaining(tick)))
    yield from upkeep(tick)
    return _result(tick, a, deferred)


def _after_shrink(tick: _Tick) -> Generator[Step, Any, tuple[Assessment, bool]]:
    """Freed session references land in the MLX pool: reclaim, re-measure, maybe defer."""
    accepted = False
    if tick.config.pressure_reclaim and tick.state.level != EMERGENCY:
        reclaims = plan_pressure_reclaim(tick.snap.engines, REASON_SHRINK_RECLAIM)
        outcomes = yield from _execute(tick, reclaims)
        accepted = any(o.accepted for o in outcomes)
    yield from _measure(tick, MEASURE_AFTER_SHRINK)
    a = tick.assess()
    yield from _commit(tick, a, MEASURE_AFTER_SHRINK)
    # Not accepted yet: remember, so the next tick asks again even with a small pool.
    tick.state = dataclasses.replace(
        tick.state,
        shrink_freed_refs=tick.config.pressure_reclaim and not accepted and a.level != OK,
    )
    if accepted and not a.emergency and may_defer(a, tick.state, tick.config):
        tick.state = dataclasses.replace(tick.state, grace_polls=tick.state.grace_polls + 1)
        return a, True
    return a, False


def _relieve(tick: _Tick, a: Assessment) -> Generator[Step, Any, Assessment]:
    memo = ReliefMemo()
    evicted_any = False
    usage = tick.usage
    for _round in range(len(tick.snap.engines) + 2):
        plan = plan_relief(usage, tick.limits, a, tick.snap.engines, tick.config, memo)
        outcomes = yield from _execute(tick, plan.actions)
        # An eviction the executor declined (pinned or busy since the snapshot) freed
        # nothing: its bytes stay in the prediction and the plan is not complete.
        declined = [o.action for o in outcomes
                    if isinstance(o.action, EvictModel) and not o.done]
        memo = memo.after(plan.actions, skipped=(d.model_id for d in declined))
        predicted = plan.predicted_usage + sum(d.predicted_bytes or 0 for d in declined)
        evicted_any = evicted_any or any(isinstance(o.action, EvictModel) and o.done
                                         for o in outcomes)
        if plan.complete and not declined:
            break
        yield from _measure(tick, MEASURE_AFTER_EVICTION)
        a = tick.assess()
        yield from _commit(tick, a, MEASURE_AFTER_EVICTION)
        evicted_any = False  # this measurement already saw the evictions so far
        if a.level == OK:
            break
        # A reading that lags an unload must not evict a second model for the
        # same bytes; a reading lower than predicted is believed.
        usage = min(tick.usage, predicted)
    tick.evicted = memo.evicted
    if evicted_any:
        yield from _measure(tick, MEASURE_AFTER_RELIEF)
        a = tick.assess()
        yield from _commit(tick, a, MEASURE_AFTER_RELIEF)
    return a


def upkeep(tick: _Tick) -> Generator[Step, Any, None]:
    """Every tick: limits to the engines, then the bank's idle TTL, the OS pressure
    guard (warning: half the budget, critical: all of it, active sessions spared; a
    pool reclaim when it freed anything or the report is critical) and the bank's
    dynamic ceiling."""
    engines = _remaining(tick)
    enforce = tick.config.enabled  # disabled: measured and reported, never enforced
    if enforce:
        yield from _execute(tick, [plan_propagate(tick.snap.readings, tick.limits)])
    # Keep-alive and the loaded-model limits are the operator's, not pressure's:
    # they hold with the enforcer disabled too.
    lifecycle = plan_model_limits(engines, tick.now, tick.config.model_limits,
                                  tick.config.load_warmup_s)
    if lifecycle:
        outcomes = yield from _execute(tick, lifecycle)
        tick.evicted = tick.evicted | {o.action.model_id for o in outcomes
                                       if isinstance(o.action, EvictModel) and o.done}
        engines = _remaining(tick)
    if tick.bank_bytes is None:
        return
    if tick.snap.sessions_expired:
        yield from _execute(tick, [ExpireSessions()])
    if not enforce:
        return
    weights = sum(e.measured_bytes or 0 for e in engines if e.ready)
    usage = tick.usage
    ceiling = bank_dynamic_ceiling(
        tick.limits.ceiling_bytes, weights, working_set_bytes(usage, weights, tick.bank_bytes or 0),
        bank_idle_max=tick.snap.bank_max_bytes,
    )
    budget = min(tick.snap.bank_max_bytes or ceiling, ceiling)
    guard, guard_actions = guard_step(
        tick.state.guard, tick.snap.readings.os_pressure, tick.now, budget_bytes=budget,
        busy=any(e.busy for e in engines),
    )
    tick.state = dataclasses.replace(tick.state, guard=guard, bank_ceiling_bytes=budget)
    for g in guard_actions:
        (out,) = yield from _execute(tick, [ShrinkSessionCache(
            target_bytes=g.target_bytes, protect_active=True, reason=g.reason)])
        reclaim_allowed = tick.config.pressure_reclaim and tick.state.level != EMERGENCY
        if reclaim_allowed and ((out.entries or 0) > 0 or g.level is OsPressure.CRITICAL):
            yield from _execute(tick, plan_pressure_reclaim(engines, REASON_OS_RECLAIM))
    hold = plan_hold_to_ceiling(tick.bank_bytes or 0, budget)
    if hold is not None:
        yield from _execute(tick, [hold])


def _remaining(tick: _Tick) -> list[EngineView]:
    return [e for e in tick.snap.engines if e.model_id not in tick.evicted]


def _result(tick: _Tick, a: Assessment, deferred: bool) -> TickResult:
    return TickResult(
        state=tick.state,
        level=tick.state.level,
        emergency=a.emergency,
        readings=tick.snap.readings,
        limits=tick.limits,
        engines=tick.snap.engines,
        session_bytes=tick.snap.session_bytes,
        deferred=deferred,
        outcomes=tuple(tick.outcomes),
        transitions=tuple(tick.transitions),
        measurements=tick.measurements,
    )
