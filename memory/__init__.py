"""Readings, ceiling and levels, the enforcer, the store-cache gate and the prefill chunk sizer.

`memory` knows nothing of gRPC, engines or sessions: it reaches them through
the protocols in `memory.protocols`. Its decisions are pure functions
(`memory.policy`, `memory.ceiling`, `memory.cadence`, `memory.chunking`);
`memory.enforcer` is the thin asyncio loop that runs them.
"""

from memory.actions import (
    AbortLoad,
    AbortRequests,
    Action,
    AdjustStoreCacheCap,
    ClearAuxCaches,
    EvictModel,
    IdleReclaim,
    MarkPendingUnload,
    Outcome,
    PauseAdmission,
    PressureReclaim,
    ResumeAdmission,
    ShrinkSessionCache,
    Transition,
)
from memory.cadence import extend_activity_hint, poll_interval
from memory.ceiling import Limits, compute_limits
from memory.chunking import (
    PrefillCostModel,
    plan_chunk,
    prefill_abort_bytes,
    prefill_target_bytes,
    should_abort_before_chunk,
)
from memory.config import AbortOrder, MemoryConfig, load_memory_config
from memory.enforcer import MemoryEnforcer, TickSample
from memory.levels import GIB, PressureLevel, Tier
from memory.policy import PolicyState, Snapshot, TickResult, tick_plan
from memory.protocols import EnforcerSink, EngineHandle, EnginePool, SessionTier
from memory.readings import MemoryReader, MemoryReadings, read_memory
from memory.store_cache import StoreCacheGate
from memory.views import EngineState, EngineView, RequestView

__all__ = [
    "GIB",
    "AbortLoad",
    "AbortOrder",
    "AbortRequests",
    "Action",
    "AdjustStoreCacheCap",
    "ClearAuxCaches",
    "EngineHandle",
    "EnginePool",
    "EngineState",
    "EngineView",
    "EnforcerSink",
    "EvictModel",
    "IdleReclaim",
    "Limits",
    "MarkPendingUnload",
    "MemoryConfig",
    "MemoryEnforcer",
    "MemoryReader",
    "MemoryReadings",
    "Outcome",
    "PauseAdmission",
    "PolicyState",
    "PrefillCostModel",
    "PressureLevel",
    "PressureReclaim",
    "RequestView",
    "ResumeAdmission",
    "SessionTier",
    "ShrinkSessionCache",
    "Snapshot",
    "StoreCacheGate",
    "Tier",
    "TickResult",
    "TickSample",
    "Transition",
    "compute_limits",
    "extend_activity_hint",
    "load_memory_config",
    "plan_chunk",
    "poll_interval",
    "prefill_abort_bytes",
    "prefill_target_bytes",
    "read_memory",
    "should_abort_before_chunk",
    "tick_plan",
]
