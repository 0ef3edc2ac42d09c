"""Making room for a model load. Pure (a plan the governor drives).

Before a load of `estimate` bytes: when usage (the reclaimable MLX pool aside)
plus the estimate would cross the soft mark, evict idle non-pinned models in
the eviction ladder's order until it would not. A load that could not fit under
the ceiling even after every eviction it may make evicts nothing and is
refused with the numbers; after the evictions, a fresh measurement decides.
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
from memory.plans.eviction import freeable_bytes, idle_victims
from memory.plans.steps import Execute, Measure, Snapshot, Step

ERROR_LOAD_EXCEEDS_CEILING = "MEMORY_PRESSURE"
RETRY_AFTER_LOAD_S = 10.0


@dataclass(frozen=True)
class LoadResult:
    evicted: tuple[str, ...] = ()
    refusal: RefuseLoad | None = None


def _usage(snap: Snapshot) -> int:
    return snap.readings.process_bytes - snap.readings.pool_bytes


def _refusal(model_id: str, estimate: int, usage: int, limits: Limits, freeable: int,
             tried: tuple[str, ...]) -> RefuseLoad:
    return RefuseLoad(
        binding="ceiling",
        error_reason=ERROR_LOAD_EXCEEDS_CEILING,
        message=(f"model '{model_id}' needs about {estimate} bytes; usage {usage} + that "
                 f"exceeds the ceiling {limits.ceiling_bytes} ({limits.binding_term})"
                 + (f" even after evicting idle models worth {freeable} bytes"
                    if freeable else "")),
        retry_after_s=RETRY_AFTER_LOAD_S,
        numbers={"estimated_bytes": estimate, "usage_bytes": usage,
                 "ceiling_bytes": limits.ceiling_bytes, "soft_bytes": limits.soft_bytes,
                 "freeable_bytes": freeable},
        tried=tried,
    )


def plan_evictions(usage: int, estimate: int, limits: Limits, snap: Snapshot,
                   model_id: str) -> tuple[list[EvictModel], int]:
    """Idle LRU models to evict so usage + estimate fits under soft -> (evictions, freeable)."""
    victims = idle_victims(snap.engines, exclude=(model_id,))
    evictions: list[EvictModel] = []
    predicted = usage
    for v in victims:
        if predicted + estimate <= limits.soft_bytes:
            break
        evictions.append(EvictModel(v.model_id, f"{REASON_MAKE_ROOM_FOR_LOAD}:{model_id}",
                                    predicted_bytes=v.measured_bytes))
        predicted -= v.measured_bytes or 0
    return evictions, freeable_bytes(victims)


def load_plan(model_id: str, estimate: int, config: MemoryConfig
              ) -> Generator[Step, Any, LoadResult]:
    snap: Snapshot = yield Measure(MEASURE_LOAD)
    limits = compute_limits(snap.readings, config)
    usage = _usage(snap)
    evictions, freeable = plan_evictions(usage, estimate, limits, snap, model_id)
    if usage - freeable + estimate > limits.ceiling_bytes:
        refusal = _refusal(model_id, estimate, usage, limits, freeable, ())
        yield Execute((refusal,))
        return LoadResult(refusal=refusal)  # hopeless: keep every model
    if not evictions:
        return LoadResult()
    outcomes: list[Outcome] = yield Execute(tuple(evictions))
    evicted = tuple(o.action.model_id for o in outcomes
                    if isinstance(o.action, EvictModel) and o.done)
    snap = yield Measure(MEASURE_AFTER_EVICTION)
    limits = compute_limits(snap.readings, config)
    usage = _usage(snap)
    if usage + estimate > limits.ceiling_bytes:
        refusal = _refusal(model_id, estimate, usage, limits, freeable,
                           tuple(f"evict:{m}" for m in evicted))
        yield Execute((refusal,))
        return LoadResult(evicted, refusal)
    return LoadResult(evicted)
