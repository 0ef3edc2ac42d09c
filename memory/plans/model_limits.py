"""Model keep-alive and the loaded-model limits. Pure.

Three rules, each an eviction of idle, ready, non-pinned models (pins override all):

- keep-alive: a model unused for its own keep-alive (`EngineView.keep_alive_s`; None
  keeps it loaded) is unloaded at the next tick;
- `max_loaded_models`: more models loaded (or loading) than that, and the least
  recently used idle ones go;
- `max_model_bytes`: the loaded models' measured bytes over that, and the least
  recently used idle ones go.

Before a load the same limits make room for the new model (`plan_room`): idle LRU
models go first; when even every idle model would not make room, nothing is evicted
and the load is refused with the numbers. A model in its load warm-up is spared, as
everywhere else (memory.plans.eviction).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from memory.actions import (
    REASON_KEEP_ALIVE,
    REASON_MAX_LOADED_MODELS,
    REASON_MAX_MODEL_MEMORY,
    EvictModel,
    RefuseLoad,
)
from memory.config import ModelLimits
from memory.levels import MIB
from memory.plans.eviction import idle_victims
from memory.views import EngineView

ERROR_MAX_LOADED_MODELS = "MAX_LOADED_MODELS"
ERROR_MAX_MODEL_MEMORY = "MAX_MODEL_MEMORY"
RETRY_AFTER_LIMIT_S = 10.0


def expires_in(engine: EngineView, now: float) -> float | None:
    """Seconds until the model's keep-alive runs out (0 when it has); None when it
    never expires (no keep-alive, pinned) or cannot now (busy, not ready)."""
    if engine.keep_alive_s is None or engine.pinned or not engine.ready or engine.busy:
        return None
    return max(0.0, engine.last_used + engine.keep_alive_s - now)


def next_expiry_s(engines: Sequence[EngineView], now: float) -> float | None:
    """How long until the soonest keep-alive runs out: the governor wakes by then."""
    times = [t for t in (expires_in(e, now) for e in engines) if t is not None]
    return min(times, default=None)


def _loaded(engines: Sequence[EngineView]) -> list[EngineView]:
    return [e for e in engines if e.ready or e.loading]


def plan_model_limits(engines: Sequence[EngineView], now: float, limits: ModelLimits,
                      warmup_s: float = 0.0) -> list[EvictModel]:
    """Every tick: the keep-alive expiries, then whatever brings the loaded models back
    under the count and byte limits, least recently used first."""
    evictions = [EvictModel(e.model_id, REASON_KEEP_ALIVE, predicted_bytes=e.measured_bytes)
                 for e in sorted(engines, key=lambda e: (e.last_used, e.model_id))
                 if expires_in(e, now) == 0.0]
    gone = {a.model_id for a in evictions}
    remaining = [e for e in _loaded(engines) if e.model_id not in gone]
    victims = idle_victims(remaining, warmup_s=warmup_s)
    if limits.max_loaded_models is not None:
        over = len(remaining) - limits.max_loaded_models
        for v in victims[:max(0, over)]:
            evictions.append(EvictModel(v.model_id, REASON_MAX_LOADED_MODELS,
                                        predicted_bytes=v.measured_bytes))
            gone.add(v.model_id)
    if limits.max_model_bytes is not None:
        total = sum(e.measured_bytes or 0 for e in remaining if e.model_id not in gone)
        for v in victims:
            if total <= limits.max_model_bytes:
                break
            if v.model_id in gone:
                continue
            evictions.append(EvictModel(v.model_id, REASON_MAX_MODEL_MEMORY,
                                        predicted_bytes=v.measured_bytes))
            gone.add(v.model_id)
            total -= v.measured_bytes or 0
    return evictions


@dataclass(frozen=True)
class Room:
    evictions: tuple[EvictModel, ...] = ()
    refusal: RefuseLoad | None = None


def plan_room(engines: Sequence[EngineView], model_id: str, estimate: int | None,
              limits: ModelLimits, warmup_s: float = 0.0) -> Room:
    """Before loading `model_id` (about `estimate` bytes; None: unknown): the idle LRU
    models to evict so that the count and byte limits hold with it loaded, or a
    refusal when they cannot."""
    others = [e for e in _loaded(engines) if e.model_id != model_id]
    victims = idle_victims(others, warmup_s=warmup_s)
    chosen: list[EngineView] = []
    if limits.max_loaded_models is not None:
        over = len(others) + 1 - limits.max_loaded_models
        if over > len(victims):
            return Room(refusal=_count_refusal(model_id, others, victims, limits))
        chosen = victims[:max(0, over)]
    reasons = {v.model_id: REASON_MAX_LOADED_MODELS for v in chosen}
    if limits.max_model_bytes is not None and estimate is not None:
        total = sum(e.measured_bytes or 0 for e in others) + estimate
        total -= sum(v.measured_bytes or 0 for v in chosen)
        for v in victims:
            if total <= limits.max_model_bytes:
                break
            if v.model_id in reasons:
                continue
            chosen.append(v)
            reasons[v.model_id] = REASON_MAX_MODEL_MEMORY
            total -= v.measured_bytes or 0
        if total > limits.max_model_bytes:
            return Room(refusal=_bytes_refusal(model_id, estimate, others, victims, limits))
    return Room(tuple(EvictModel(v.model_id, f"{reasons[v.model_id]}:{model_id}",
                                 predicted_bytes=v.measured_bytes) for v in chosen))


def _count_refusal(model_id: str, others: Sequence[EngineView],
                   victims: Sequence[EngineView], limits: ModelLimits) -> RefuseLoad:
    held = [e.model_id for e in others if e.model_id not in {v.model_id for v in victims}]
    return RefuseLoad(
        binding="max_loaded_models",
        error_reason=ERROR_MAX_LOADED_MODELS,
        message=(f"model '{model_id}' would be model {len(others) + 1} of at most "
                 f"{limits.max_loaded_models} loaded (--max-loaded-models), and only "
                 f"{len(victims)} loaded model(s) may be unloaded for it; pinned, busy "
                 f"or warming up: {', '.join(held) or 'none'}; nothing was evicted"),
        retry_after_s=RETRY_AFTER_LIMIT_S,
        numbers={"max_loaded_models": limits.max_loaded_models or 0,
                 "loaded_models": len(others), "evictable_models": len(victims)},
    )


def _bytes_refusal(model_id: str, estimate: int, others: Sequence[EngineView],
                   victims: Sequence[EngineView], limits: ModelLimits) -> RefuseLoad:
    loaded = sum(e.measured_bytes or 0 for e in others)
    freeable = sum(v.measured_bytes or 0 for v in victims)
    cap = limits.max_model_bytes or 0
    return RefuseLoad(
        binding="max_model_memory",
        error_reason=ERROR_MAX_MODEL_MEMORY,
        message=(f"model '{model_id}' needs about {estimate / MIB:.0f} MiB: with the "
                 f"{loaded / MIB:.0f} MiB of models loaded that is over the "
                 f"{cap / MIB:.0f} MiB allowed (--max-model-memory-gb) even after "
                 f"unloading every idle model ({freeable / MIB:.0f} MiB); nothing was "
                 "evicted"),
        retry_after_s=RETRY_AFTER_LIMIT_S,
        numbers={"estimated_bytes": estimate, "loaded_model_bytes": loaded,
                 "max_model_bytes": cap, "freeable_bytes": freeable},
    )
