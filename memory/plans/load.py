"""Making room for a model load. Pure (a plan the governor drives).

A load of `estimate` bytes is admitted only if it fits under the soft mark
after the evictions it makes: a load that crossed soft would be undone by the
next tick's relief, or would push other models out after the fact.

Before the load, when usage (the reclaimable MLX pool aside) plus the estimate
would cross soft, idle non-pinned models are evicted in the eviction ladder's
order (models in their warm-up spared) until it would not. A load that could
not fit under soft even after every eviction it may make evicts nothing and is
refused with the numbers. After the evictions, a fresh measurement decides.

Before all that, the loaded-model limits (`--max-loaded-models`,
`--max-model-memory-gb`: memory.plans.model_limits) make room the same way, or refuse.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from memory.actions import (
    MEASURE_AFTER_EVICTION,
    MEASURE_LOAD,
    REASON_MAKE_ROOM_FOR_LOAD,
    EvictModel,
    Outcome,
    RefuseLoad,
)
from memory.ceiling import Limits, compute_limits
from memory.config import MemoryConfig
from memory.levels import MIB
from memory.plans.eviction import freeable_bytes, idle_victims, warming
from memory.plans.model_limits import ERROR_MAX_LOADED_MODELS, plan_room
from memory.plans.steps import Execute, Measure, Snapshot, Step
from memory.views import EngineView

ERROR_LOAD_EXCEEDS_SOFT = "LOAD_EXCEEDS_SOFT"  # the ErrorInfo reason LoadModel answers with
BINDING_LOAD_SOFT = "soft"  # the mark a load must fit under
RETRY_AFTER_LOAD_S = 10.0
RETRY_AFTER_WARMUP_MIN_S = 0.5


@dataclass(frozen=True)
class LoadResult:
    evicted: tuple[str, ...] = ()
    refusal: RefuseLoad | None = None


def _usage(snap: Snapshot) -> int:
    return snap.readings.process_bytes - snap.readings.pool_bytes


def _mib(n: int) -> str:
    return f"{n / MIB:.0f} MiB"


@dataclass(frozen=True)
class WarmupWait:
    """Models in their warm-up whose eviction would make the load fit, and how long
    until the last of them may go."""

    model_ids: tuple[str, ...]
    bytes: int
    seconds: float


def warmup_wait(usage: int, estimate: int, limits: Limits, freeable: int,
                snap: Snapshot, model_id: str, config: MemoryConfig) -> WarmupWait | None:
    """None unless the load would fit once some idle models in their warm-up are past it."""
    warm = [v for v in idle_victims(snap.engines, exclude=(model_id,),
                                    warmup_s=config.load_warmup_s, warming_last=True)
            if warming(v, config.load_warmup_s)]
    chosen: list[EngineView] = []
    predicted = usage - freeable
    for v in sorted(warm, key=lambda v: -(v.loaded_age_s or 0.0)):  # soonest out first
        chosen.append(v)
        predicted -= v.measured_bytes or 0
        if fits(predicted, estimate, limits):
            left = config.load_warmup_s - (chosen[-1].loaded_age_s or 0.0)
            return WarmupWait(tuple(c.model_id for c in chosen),
                              freeable_bytes(chosen), max(0.0, left))
    return None


def _refusal(model_id: str, estimate: int, usage: int, limits: Limits, freeable: int,
             tried: tuple[str, ...], wait: WarmupWait | None = None) -> RefuseLoad:
    if tried:
        after = f"after evicting {', '.join(t.removeprefix('evict:') for t in tried)}"
    elif freeable:
        after = f"even after evicting every idle model it may ({_mib(freeable)}); nothing was evicted"
    else:
        after = "and no idle model may be evicted"
    numbers = {"estimated_bytes": estimate, "usage_bytes": usage,
               "ceiling_bytes": limits.ceiling_bytes, "soft_bytes": limits.soft_bytes,
               "freeable_bytes": freeable}
    retry_after = RETRY_AFTER_LOAD_S
    if wait is not None:
        # Just-loaded models are spared for their warm-up: say when they may make room.
        after += (f"; it may fit once {', '.join(repr(m) for m in wait.model_ids)} "
                  f"({_mib(wait.bytes)}) pass their load warm-up, in {wait.seconds:.1f} s")
        numbers["warming_bytes"] = wait.bytes
        retry_after = max(RETRY_AFTER_WARMUP_MIN_S, wait.seconds)
    return RefuseLoad(
        binding=BINDING_LOAD_SOFT,
        error_reason=ERROR_LOAD_EXCEEDS_SOFT,
        message=(f"model '{model_id}' needs about {_mib(estimate)}: usage {_mib(usage)} plus "
                 f"that crosses the soft mark {_mib(limits.soft_bytes)} (ceiling "
                 f"{_mib(limits.ceiling_bytes)}, {limits.binding_term}) {after}"),
        retry_after_s=retry_after,
        numbers=numbers,
        tried=tried,
    )


def load_victims(snap: Snapshot, model_id: str, config: MemoryConfig) -> list[EngineView]:
    """The idle models a load may evict: never the one being loaded, none in its warm-up."""
    return idle_victims(snap.engines, exclude=(model_id,), warmup_s=config.load_warmup_s)


def fits(usage: int, estimate: int, limits: Limits) -> bool:
    return usage + estimate <= limits.soft_bytes


def plan_evictions(usage: int, estimate: int, limits: Limits,
                   victims: list[EngineView]) -> list[EngineView]:
    """The first victims whose measured sizes bring usage + estimate under soft."""
    chosen: list[EngineView] = []
    predicted = usage
    for v in victims:
        if fits(predicted, estimate, limits):
            break
        chosen.append(v)
        predicted -= v.measured_bytes or 0
    return chosen


def load_plan(model_id: str, estimate: int | None, config: MemoryConfig
              ) -> Generator[Step, Any, LoadResult]:
    """The loaded-model limits first (memory.plans.model_limits: they need no
    estimate), then, with an estimate and the enforcer on, the soft mark."""
    snap: Snapshot = yield Measure(MEASURE_LOAD)
    room = plan_room(snap.engines, model_id, estimate, config.model_limits,
                     config.load_warmup_s)
    if room.refusal is not None:
        yield Execute((room.refusal,))
        return LoadResult(refusal=room.refusal)
    evicted: tuple[str, ...] = ()
    if room.evictions:
        outcomes: list[Outcome] = yield Execute(room.evictions)
        evicted = tuple(o.action.model_id for o in outcomes
                        if isinstance(o.action, EvictModel) and o.done)
        if len(evicted) < len(room.evictions):  # busy or pinned since the snapshot
            refusal = _limit_declined(model_id)
            yield Execute((refusal,))
            return LoadResult(evicted, refusal)
        snap = yield Measure(MEASURE_AFTER_EVICTION)
    if estimate is None or not config.enabled:
        return LoadResult(evicted)  # a repository not downloaded yet: the tick follows
    result = yield from _fit_under_soft(model_id, estimate, config, snap)
    return LoadResult(evicted + result.evicted, result.refusal)


def _limit_declined(model_id: str) -> RefuseLoad:
    return RefuseLoad(
        binding="max_loaded_models", error_reason=ERROR_MAX_LOADED_MODELS,
        message=(f"model '{model_id}': a model chosen to make room under the loaded-model "
                 "limits was used or pinned meanwhile; retry"),
        retry_after_s=1.0)


def _fit_under_soft(model_id: str, estimate: int, config: MemoryConfig, snap: Snapshot
                    ) -> Generator[Step, Any, LoadResult]:
    limits = compute_limits(snap.readings, config)
    usage = _usage(snap)
    if fits(usage, estimate, limits):
        return LoadResult()
    victims = load_victims(snap, model_id, config)
    freeable = freeable_bytes(victims)
    if not fits(usage - freeable, estimate, limits):
        wait = warmup_wait(usage, estimate, limits, freeable, snap, model_id, config)
        refusal = _refusal(model_id, estimate, usage, limits, freeable, (), wait)
        yield Execute((refusal,))
        return LoadResult(refusal=refusal)  # hopeless: keep every model
    evictions = tuple(
        EvictModel(v.model_id, f"{REASON_MAKE_ROOM_FOR_LOAD}:{model_id}",
                   predicted_bytes=v.measured_bytes)
        for v in plan_evictions(usage, estimate, limits, victims))
    outcomes: list[Outcome] = yield Execute(evictions)
    evicted = tuple(o.action.model_id for o in outcomes
                    if isinstance(o.action, EvictModel) and o.done)
    snap = yield Measure(MEASURE_AFTER_EVICTION)
    limits = compute_limits(snap.readings, config)
    usage = _usage(snap)
    if not fits(usage, estimate, limits):
        refusal = _refusal(model_id, estimate, usage, limits, freeable,
                           tuple(f"evict:{m}" for m in evicted))
        yield Execute((refusal,))
        return LoadResult(evicted, refusal)
    return LoadResult(evicted)
