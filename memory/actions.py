"""The one vocabulary of memory actions: plain data every plan returns and the executor performs.

Plans (`memory.plans`) decide; the governor (`memory.governor`) hands each
action to the executor (`memory.executor`) and records it through one table
(`memory.recording`). Nothing here does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from memory.levels import PressureLevel, Tier

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
REASON_MAKE_ROOM_FOR_LOAD = "make_room_for_load"
REASON_ADMISSION_RECLAIM = "admission_pool_reclaim"
REASON_ADMISSION_EVICT = "admission_idle_lru"
REASON_PREFILL_ADMISSION = "prefill_admission"
REASON_ADMISSION_CHAIN = "prefill_admission_chain"
REASON_GUARD_BUDGET = "memory_pressure_guard"
REASON_OS_WARNING = "memory_pressure_warning"
REASON_OS_CRITICAL = "memory_pressure_critical"
REASON_OS_RECLAIM = "os_pressure_reclaim"
REASON_DYNAMIC_CEILING = "dynamic_ceiling"
REASON_IDLE_TTL = "idle_ttl"
REASON_KEEP_ALIVE = "keep_alive"  # a model unused for its keep-alive
REASON_MAX_LOADED_MODELS = "max_loaded_models"
REASON_MAX_MODEL_MEMORY = "max_model_memory"
REASON_PREFILL_EXCEEDS_CEILING = "prefill_exceeds_ceiling"

# -- measurement / transition reasons ------------------------------------------
MEASURE_POLL = "poll"
MEASURE_AFTER_AUX = "after_aux_clear"
MEASURE_AFTER_SHRINK = "after_session_shrink"
MEASURE_AFTER_EVICTION = "after_eviction"
MEASURE_AFTER_RELIEF = "after_relief"
MEASURE_DISABLED = "enforcer_disabled"
MEASURE_LOAD = "before_load"
MEASURE_ADMISSION = "admission"
MEASURE_AFTER_ADMISSION_STEP = "after_admission_step"


class ShrinkMode(enum.StrEnum):
    """Which of the bank's two shrink policies an action runs."""

    TO_BYTES = "shrink_to_bytes"  # LRU, idle sessions first
    FOR_ADMISSION = "shrink_for_admission"  # non-terminal first, then LRU, restore source kept


@dataclass(frozen=True)
class ClearAuxCaches:
    """Drop the cheap auxiliary caches the server keeps, before anything else."""


@dataclass(frozen=True)
class PressureReclaim:
    """Ask an engine to drain the MLX pool at its next step boundary, even under load.

    `wait`: the executor waits (bounded) until the engine has drained, so the
    plan's next measurement sees the freed bytes (admission does; the tick
    only sets the flag and defers).
    """

    model_id: str
    reason: str = REASON_POOL_RECLAIM
    wait: bool = False


@dataclass(frozen=True)
class IdleReclaim:
    """Ask an engine to drain the MLX pool once it is idle."""

    model_id: str
    reason: str = REASON_NO_EVICTABLE


@dataclass(frozen=True)
class ShrinkSessionCache:
    """Evict session snapshots toward `target_bytes` with one of the bank's policies."""

    target_bytes: int
    protect_active: bool = True
    reason: str = REASON_SESSION_SHRINK
    mode: ShrinkMode = ShrinkMode.TO_BYTES
    # FOR_ADMISSION: the prompt whose restore source stays (and its model).
    protect_tokens: tuple[int, ...] | None = None
    model: str | None = None
    protect_session_ids: tuple[str, ...] = ()


@dataclass(frozen=True)
class ExpireSessions:
    """Evict session snapshots idle past the bank's TTL (active sessions spared)."""

    reason: str = REASON_IDLE_TTL


@dataclass(frozen=True)
class EvictModel:
    """Unload an idle model. The executor re-checks it is still idle, unpinned and
    ready first, and does nothing (outcome `skipped`) when it is not."""

    model_id: str
    reason: str
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
    """One step of an engine's store-cache cap (how many snapshot stores may run)."""

    model_id: str
    level: PressureLevel


@dataclass(frozen=True)
class AdjustBatchCap:
    """One step of an engine's decode batch cap (how many sequences may hold KV)."""

    model_id: str
    level: PressureLevel


@dataclass(frozen=True)
class PropagateLimits:
    """Hand this tick's ceiling to every engine (prefill chunk sizing and its abort line)."""

    ceiling_bytes: int
    abort_cap_bytes: int
    non_mlx_bytes: int  # process usage beyond MLX's active memory and pool
    tier: Tier = Tier.BALANCED


@dataclass(frozen=True)
class Refuse:
    """The plan cannot make room: the caller answers with a typed refusal."""

    binding: str  # the constraint that binds (see memory.plans.admission BINDING_*)
    error_reason: str  # google.rpc.ErrorInfo reason
    message: str
    retry_after_s: float
    numbers: Mapping[str, int] = field(default_factory=dict)
    tried: tuple[str, ...] = ()  # the reliefs that ran before refusing


@dataclass(frozen=True)
class RefuseLoad(Refuse):
    """A model load that cannot fit: refused before anything is loaded."""


@dataclass(frozen=True)
class PrefillAborted:
    """Reported by an engine thread: it ended a request before a prefill chunk that
    would cross the pre-chunk abort margin. Recorded, never performed."""

    model_id: str
    request_id: str
    prompt_tokens: int
    remaining_tokens: int
    chunk_tokens: int
    reason: str = REASON_PREFILL_EXCEEDS_CEILING


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
    | ExpireSessions
    | EvictModel
    | AbortRequests
    | MarkPendingUnload
    | AbortLoad
    | PauseAdmission
    | ResumeAdmission
    | AdjustStoreCacheCap
    | AdjustBatchCap
    | PropagateLimits
    | Refuse
    | RefuseLoad
    | PrefillAborted
    | Transition
)

# Actions after which memory may have been freed: the next measurement must be fresh.
FREEING_ACTIONS = (PressureReclaim, ShrinkSessionCache, ExpireSessions, EvictModel,
                   AbortRequests, ClearAuxCaches)


@dataclass(frozen=True)
class Outcome:
    """What executing one action did. Fields that do not apply stay None/empty."""

    action: Action
    ok: bool = True
    accepted: bool | None = None  # PressureReclaim
    bytes_freed: int | None = None  # ClearAuxCaches, ShrinkSessionCache, EvictModel
    entries: int | None = None  # ShrinkSessionCache, ExpireSessions
    non_terminal: int | None = None  # ShrinkSessionCache (FOR_ADMISSION)
    terminal: int | None = None
    request_ids: tuple[str, ...] = ()  # AbortRequests, EvictModel (ended by the unload)
    value: int | None = None  # AdjustStoreCacheCap / AdjustBatchCap: the new cap
    skipped: str | None = None  # why the action was not carried out (state changed)
    preview: bool = False  # a dry run's prediction (Admit), nothing was done
    error: str | None = None

    @property
    def done(self) -> bool:
        """Carried out: not failed, not skipped, not a prediction."""
        return self.ok and self.skipped is None and not self.preview

    @staticmethod
    def failed(action: Action, error: str) -> Outcome:
        return Outcome(action=action, ok=False, error=error)


def model_of(action: Action) -> str | None:
    """The model an action is about, if any."""
    match action:
        case (PressureReclaim(model_id=m) | IdleReclaim(model_id=m) | EvictModel(model_id=m)
              | AbortRequests(model_id=m) | MarkPendingUnload(model_id=m) | AbortLoad(model_id=m)
              | AdjustStoreCacheCap(model_id=m) | AdjustBatchCap(model_id=m)
              | PrefillAborted(model_id=m)):
            return m
        case ShrinkSessionCache(model=m):
            return m
    return None


def reason_of(action: Action) -> str | None:
    """Why the plan took an action, if it says."""
    match action:
        case (PressureReclaim(reason=r) | IdleReclaim(reason=r) | ShrinkSessionCache(reason=r)
              | ExpireSessions(reason=r) | EvictModel(reason=r) | AbortRequests(reason=r)
              | MarkPendingUnload(reason=r) | AbortLoad(reason=r) | PrefillAborted(reason=r)
              | Transition(reason=r)):
            return r
        case Refuse(message=r):
            return r
    return None
