"""What the policy sees of each engine: frozen snapshots, no handles, no MLX."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EngineState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"


@dataclass(frozen=True)
class RequestView:
    """One in-flight request, for graded aborts (youngest or largest first)."""

    request_id: str
    started_at: float  # monotonic seconds
    bytes_estimate: int | None = None  # KV + transient it holds; None when unknown


@dataclass(frozen=True)
class EngineView:
    """One model's engine as the enforcer sees it at a measurement."""

    model_id: str
    state: EngineState = EngineState.READY
    pinned: bool = False
    # None: the engine cannot report (treated as busy).
    active_requests: int | None = 0
    requests: tuple[RequestView, ...] = ()
    last_used: float = 0.0  # monotonic seconds; the LRU key
    measured_bytes: int | None = None  # measured after load; predicts what an unload frees
    pending_unload: bool = False
    store_cache_cap: int = 1
    max_num_seqs: int = 1
    # Seconds since its load finished, at this measurement; None: unknown or not ready
    # (never inside a warm-up). Idle eviction spares a model this young (see
    # memory.plans.eviction).
    loaded_age_s: float | None = None
    # Unloaded once unused this long (memory.plans.model_limits); None: kept loaded.
    keep_alive_s: float | None = None

    @property
    def busy(self) -> bool:
        return self.active_requests is None or self.active_requests > 0

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    @property
    def loading(self) -> bool:
        return self.state is EngineState.LOADING


@dataclass(frozen=True)
class BankFigures:
    """The session bank as admission sees it for one prompt (dry-run figures)."""

    total_bytes: int = 0
    max_bytes: int | None = None  # the bank's configured budget
    lru_freeable_bytes: int = 0  # shrink_to_bytes(0, protect_active=True) could free
    lru_freeable_entries: int = 0
    chain_freeable_bytes: int = 0  # shrink_for_admission(0, prompt) could free after that
    chain_freeable_entries: int = 0
    restore_prefix_tokens: int = 0  # the prompt's restore source length
    # The disk tier's source when it is longer than RAM's (then restore_prefix_tokens is
    # its length): a disk restore allocates its bytes, which RAM's source already holds.
    restore_disk_tokens: int = 0
    restore_disk_bytes: int = 0


@dataclass(frozen=True)
class QueueView:
    """The admission gate's state: requests holding a slot and requests waiting."""

    in_flight: int = 0
    waiting: int = 0
    limit: int = 32
