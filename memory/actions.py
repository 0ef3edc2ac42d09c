"""The enforcer's actions and their outcomes: plain data the policy returns and the loop executes."""

from __future__ import annotations

from dataclasses import dataclass

from memory.levels import PressureLevel

# -- reasons (stable strings: they reach spans, metrics and client statuses) ---
REASON_SOFT_LRU = "soft_pressure_idle_lru"
REASON_HARD_LRU = "hard_pressure_idle_lru"
REASON_PENDING_UNLOAD = "pending_unload"
REASON_HARD_BUSY = "hard_pressure_busy_victim"
REASON_EMERGENCY_BUSY = "emergency_busy_victim"
REASON_EMERGENCY_ALL = "emergency_all_engines"
REASON_LOAD_ABORT = "hard_pressure_abort_load"
REASON_NO_EVICTABLE = "hard_pressure_no_evictable"
REASON_POOL_RECLAIM = "pool_reclaim"
REASON_SHRINK_RECLAIM = "session_shrink_freed_references"
REASON_SESSION_SHRINK = "hard_pressure_session_shrink"

# -- measurement / transition reasons ------------------------------------------
MEASURE_POLL = "poll"
MEASURE_AFTER_AUX = "after_aux_clear"
MEASURE_AFTER_SHRINK = "after_session_shrink"
MEASURE_AFTER_EVICTION = "after_eviction"
MEASURE_AFTER_RELIEF = "after_relief"
MEASURE_DISABLED = "enforcer_disabled"


@dataclass(frozen=True)
class ClearAuxCaches:
    """Drop cheap auxiliary caches (decode caches and the like) before anything else."""


@dataclass(frozen=True)
class PressureReclaim:
    """Ask an engine to drain the MLX pool at its next step boundary, even under load."""

    model_id: str
    reason: str = REASON_POOL_RECLAIM


@dataclass(frozen=True)
class IdleReclaim:
    """Ask an engine to drain the MLX pool once it is idle."""

    model_id: str
    reason: str = REASON_NO_EVICTABLE


@dataclass(frozen=True)
class ShrinkSessionCache:
    target_bytes: int
    protect_active: bool = True
    reason: str = REASON_SESSION_SHRINK


@dataclass(frozen=True)
class EvictModel:
    """Unload a model; its requests are aborted first (normally a no-op for an idle model)."""

    model_id: str
    reason: str
    abort_first: bool = True
    predicted_bytes: int | None = None


@dataclass(frozen=True)
class AbortRequests:
    """End requests on a model. request_ids None means all of them."""

    model_id: str
    request_ids: tuple[str, ...] | None
    reason: str
    keep_loaded: bool = True


@dataclass(frozen=True)
class MarkPendingUnload:
    model_id: str
    reason: str


@dataclass(frozen=True)
class AbortLoad:
    model_id: str
    reason: str = REASON_LOAD_ABORT


@dataclass(frozen=True)
class PauseAdmission:
    level: PressureLevel


@dataclass(frozen=True)
class ResumeAdmission:
    level: PressureLevel


@dataclass(frozen=True)
class AdjustStoreCacheCap:
    model_id: str
    level: PressureLevel


@dataclass(frozen=True)
class Transition:
    """A committed level change, with the figures that caused it."""

    from_level: PressureLevel
    to_level: PressureLevel
    reason: str
    usage_bytes: int
    ceiling_bytes: int
    soft_bytes: int
    hard_bytes: int
    emergency: bool
    at: float  # the tick's clock value


Action = (
    ClearAuxCaches
    | PressureReclaim
    | IdleReclaim
    | ShrinkSessionCache
    | EvictModel
    | AbortRequests
    | MarkPendingUnload
    | AbortLoad
    | PauseAdmission
    | ResumeAdmission
    | AdjustStoreCacheCap
    | Transition
)


@dataclass(frozen=True)
class Outcome:
    """What executing one action did. Fields that do not apply stay None/empty."""

    action: Action
    ok: bool = True
    accepted: bool | None = None  # PressureReclaim
    bytes_freed: int | None = None  # ClearAuxCaches, ShrinkSessionCache, EvictModel
    entries: int | None = None  # ShrinkSessionCache
    request_ids: tuple[str, ...] = ()  # AbortRequests, EvictModel (aborted first)
    value: int | None = None  # AdjustStoreCacheCap: the new cap
    error: str | None = None

    @staticmethod
    def failed(action: Action, error: str) -> Outcome:
        return Outcome(action=action, ok=False, error=error)
