"""What the enforcer needs from the rest of the service, as typing protocols.

`engine` implements `EnginePool` / `EngineHandle`; `sessions` implements
`SessionTier`; `service` implements `EnforcerSink`. The enforcer imports none
of those packages.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from memory.levels import PressureLevel
from memory.readings import MemoryReadings, MlxSample
from memory.views import EngineView

if TYPE_CHECKING:
    from memory.actions import Action, Outcome, Transition
    from memory.ceiling import Limits
    from memory.enforcer import TickSample


@runtime_checkable
class EngineHandle(Protocol):
    """One model's engine (loading ones included, so a load can be flagged to abort)."""

    model_id: str

    def view(self) -> EngineView: ...

    def request_pressure_reclaim(self) -> bool:
        """Set a flag the engine thread consumes at its next step boundary, even under
        load (synchronize, then clear the MLX pool). True if accepted."""
        ...

    def request_idle_reclaim(self) -> None:
        """Set a flag consumed only once the engine is idle."""
        ...

    def abort_requests(self, reason: str, request_ids: Sequence[str] | None = None) -> list[str]:
        """Abort the given requests (None: all); returns the ids aborted."""
        ...

    def flag_load_abort(self) -> None: ...

    def adjust_store_cache_cap(self, level: PressureLevel) -> int:
        """Move the store-cache cap one step for this level; returns the new cap."""
        ...

    def mlx_sample(self) -> tuple[int, int] | None:
        """The latest (active, pool) bytes sampled on the engine thread, if any."""
        ...


@runtime_checkable
class EnginePool(Protocol):
    def handles(self) -> list[EngineHandle]: ...

    async def unload(self, model_id: str, reason: str) -> int:
        """Unload a model (stop, release, settle); returns bytes freed."""
        ...

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        """Unload as soon as the model is idle; refuse new requests for it meanwhile."""
        ...


@runtime_checkable
class SessionTier(Protocol):
    """The session KV cache tier (the SessionBank)."""

    def shrink_to_bytes(self, target_bytes: int, *, protect_active: bool) -> tuple[int, int] | int:
        """Evict toward target; returns (entries evicted, bytes freed), or just the
        entry count (the enforcer then takes bytes freed from `total_bytes()`)."""
        ...

    def total_bytes(self) -> int:
        """Bytes held now; must be O(1) (called several times per tick)."""
        ...


class ReadingsSource(Protocol):
    """`memory.readings.MemoryReader` or a scripted stand-in."""

    def read(self, mlx_sample: MlxSample | None = None) -> MemoryReadings: ...


class EnforcerSink(Protocol):
    """Where the enforcer reports (WatchPressure broker, status). Every method optional."""

    def on_transition(
        self, transition: Transition, readings: MemoryReadings, limits: Limits
    ) -> None: ...

    def on_sample(self, sample: TickSample) -> None: ...

    def on_action(self, action: Action, outcome: Outcome) -> None: ...


AuxCache = Callable[[], int]
"""Clears a cheap auxiliary cache; returns bytes freed."""
