"""The one eviction ladder's order: which idle models go first. Pure.

The enforcer tick, making room for a load and admission all take idle models
in this order, so an operator sees one rule: pending unloads first, then the
least recently used; never a pinned, busy, loading or unloading model.

A model in its warm-up (loaded less than `MemoryConfig.load_warmup_s` ago) is
not an idle victim: a load the governor admitted under the soft mark is not
undone by the next tick, by another load or by admission. The tick at hard
pressure and in an emergency is the exception (`warming_last`): there the
warm-up only orders such models after every other idle one. Hard is the mark
where the ladder unloads even the last idle model rather than abort live
requests, and an idle model holds no KV worth keeping, however young; reaching
hard after a load admitted under soft means something else grew, so the older
idle models go first. A pending unload was already decided and is never spared.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from memory.views import EngineView


def warming(engine: EngineView, warmup_s: float) -> bool:
    """Loaded less than `warmup_s` ago and not marked for unloading."""
    age = engine.loaded_age_s
    return age is not None and age < warmup_s and not engine.pending_unload


def idle_victims(engines: Iterable[EngineView], exclude: Collection[str] = (), *,
                 warmup_s: float = 0.0, warming_last: bool = False) -> list[EngineView]:
    """Idle, ready, non-pinned models: pending unloads first, then least recently used.

    Models in their warm-up are left out, or with `warming_last` put after all others.
    """
    candidates = [
        e for e in engines
        if e.ready and not e.pinned and not e.busy and e.model_id not in exclude
        and (warming_last or not warming(e, warmup_s))
    ]
    return sorted(candidates, key=lambda e: (warming(e, warmup_s), not e.pending_unload,
                                             e.last_used, e.model_id))


def freeable_bytes(victims: Iterable[EngineView]) -> int:
    """What unloading these models frees by their measured sizes (unknown counts 0)."""
    return sum(v.measured_bytes or 0 for v in victims)
