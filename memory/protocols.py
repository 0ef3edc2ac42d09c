"""What the executor touches, as typing protocols.

`service` implements `EnginePool` / `EngineHandle` over the model pool and
`AdmissionDesk` over the admission queue, reservations and session pins;
`sessions.SessionBank` implements `SessionTier`; the WatchPressure publisher
implements `PressureSink`. `memory` imports none of those packages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from memory.levels import PressureLevel, Tier
from memory.readings import MemoryReadings, MlxFigures, MlxSample
from memory.views import BankFigures, EngineView, QueueView

if TYPE_CHECKING:
    from memory.actions import Action, Outcome, Transition
    from memory.ceiling import Limits


class EngineHandle(Protocol):
    """One model's engine (loading ones included, so a load can be flagged to abort)."""

    model_id: str

    def view(self) -> EngineView: ...

    def request_pressure_reclaim(self) -> bool:
        """Set a flag the engine thread consumes at its next step boundary, even under
        load (synchronize, then clear the MLX pool). True if accepted."""
        ...

    async def fresh_sample(self, timeout_s: float) -> MlxFigures | None:
        """A sample the engine thread takes at its next step boundary (after any
        pending reclaim); None when it does not come within the timeout."""
        ...

    def request_idle_reclaim(self) -> None:
        """Set a flag consumed only once the engine is idle."""
        ...

    async def abort_requests(self, reason: str,
                             request_ids: Sequence[str] | None = None) -> list[str]:
        """End the given requests (None: all, queued ones included); the ids ended."""
        ...

    def flag_load_abort(self) -> None: ...

    def adjust_store_cache_cap(self, level: PressureLevel) -> int:
        """Move the store-cache cap one step for this level; returns the new cap."""
        ...

    def adjust_batch_cap(self, level: PressureLevel) -> int:
        """Move the decode batch cap one step for this level; returns the new cap."""
        ...

    def set_limits(self, ceiling_bytes: int, abort_cap_bytes: int, non_mlx_bytes: int,
                   tier: Tier) -> None:
        """This tick's limits, for the engine's prefill chunk sizing."""
        ...

    def mlx_sample(self) -> MlxFigures | None:
        """The latest MLX figures sampled on the engine thread, if any."""
        ...


class EnginePool(Protocol):
    def handles(self) -> list[EngineHandle]: ...

    def eviction_blocker(self, model_id: str) -> str | None:
        """Why the model may not be evicted now (pinned, busy, not ready), or None."""
        ...

    async def unload(self, model_id: str, reason: str) -> tuple[int, list[str]]:
        """Unload a model (stop, release, settle) -> (bytes freed, request ids it ended)."""
        ...

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        """Unload as soon as the model is idle; refuse new requests for it meanwhile."""
        ...


class SessionTier(Protocol):
    """The session KV cache tier (the SessionBank)."""

    max_bytes: int

    def total_bytes(self) -> int:
        """Bytes held now; must be O(1) (called several times per tick)."""
        ...

    def shrink_to_bytes(self, target_bytes: int, *, protect_active: bool, reason: str,
                        protect_session_ids: Sequence[str] = ()) -> int:
        """Evict toward target (LRU, idle sessions first) -> entries evicted."""
        ...

    def shrink_for_admission(self, target_bytes: int, *, protect_tokens: Sequence[int] | None,
                             model: str | None, reason: str, protect_active: bool,
                             protect_session_ids: Sequence[str] = ()) -> tuple[int, int]:
        """Two-phase shed -> (non-terminal, terminal) entries evicted."""
        ...

    def expire_idle(self) -> int:
        """Evict entries idle past the TTL -> entries evicted."""
        ...

    def expired_count(self) -> int:
        """Entries idle past the TTL now (read-only)."""
        ...

    def figures(self, model: str, prompt_tokens: Sequence[int],
                protect_session_ids: Sequence[str] = ()) -> BankFigures:
        """What admission's bank steps could free for this prompt (a dry run)."""
        ...

    def preview_freed(self, target_bytes: int, *, mode: str, protect_active: bool,
                      protect_tokens: Sequence[int] | None, model: str | None,
                      protect_session_ids: Sequence[str], assume_evicted: Sequence[object]
                      ) -> tuple[int, int, tuple[object, ...]]:
        """A shrink's dry run -> (entries, bytes, the keys it would take)."""
        ...


class AdmissionDesk(Protocol):
    """The admission side the governor steers: the queue's pause, reservations, pins."""

    def set_paused(self, level: PressureLevel | None) -> None:
        """Pause new admissions at `level` (the first request still passes); None resumes."""
        ...

    def queue_view(self) -> QueueView: ...

    def reserved_bytes(self) -> int: ...

    def pinned_sessions(self) -> tuple[str, ...]: ...


class ReadingsSource(Protocol):
    """`memory.readings.MemoryReader` or a scripted stand-in."""

    def read(self, mlx_sample: MlxSample | None = None) -> MemoryReadings: ...


@dataclass(frozen=True)
class TickSample:
    """What one governor tick saw and decided; sent to the sink and kept as status."""

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


class PressureSink(Protocol):
    """Where the governor reports (the WatchPressure publisher)."""

    def on_transition(
        self, transition: Transition, readings: MemoryReadings, limits: Limits
    ) -> None: ...

    def on_sample(self, sample: TickSample) -> None: ...

    def on_action(self, action: Action, outcome: Outcome) -> None: ...
