"""The one eviction ladder's order: which idle models go first. Pure.

The enforcer tick, making room for a load and admission all take idle models
in this order, so an operator sees one rule: pending unloads first, then the
least recently used; never a pinned, busy, loading or unloading model.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from memory.views import EngineView


def idle_victims(engines: Iterable[EngineView], exclude: Collection[str] = ()) -> list[EngineView]:
    """Idle, ready, non-pinned models: pending unloads first, then least recently used."""
    candidates = [
        e for e in engines
        if e.ready and not e.pinned and not e.busy and e.model_id not in exclude
    ]
    return sorted(candidates, key=lambda e: (not e.pending_unload, e.last_used, e.model_id))


def freeable_bytes(victims: Iterable[EngineView]) -> int:
    """What unloading these models frees by their measured sizes (unknown counts 0)."""
    return sum(v.measured_bytes or 0 for v in victims)
