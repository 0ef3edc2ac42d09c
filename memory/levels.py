"""Pressure levels, tiers and the constants of the memory policy.

Every number the enforcer, the ceiling and the prefill chunk sizer use is named
here, with the tier tables. Nothing in this module does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from types import MappingProxyType

GIB = 1 << 30
MIB = 1 << 20


class PressureLevel(enum.IntEnum):
    """Graded memory pressure; values match the proto enum ``plimsoll.v1.PressureLevel``.

    The order matters: a higher value is more pressure, so ``level >= SOFT``
    reads as "at or above the soft mark".
    """

    OK = 1
    SOFT = 2
    HARD = 3
    EMERGENCY = 4

    @property
    def label(self) -> str:
        return self.name.lower()


class Tier(enum.StrEnum):
    """How much of the machine the process may take."""

    SAFE = "safe"
    BALANCED = "balanced"
    AGGRESSIVE = "aggressive"
    CUSTOM = "custom"


def _frozen(table: dict[Tier, float]) -> Mapping[Tier, float]:
    return MappingProxyType(table)


# -- static reserve: what the ceiling leaves to the operating system ----------
SMALL_SYSTEM_THRESHOLD_BYTES = 24 * GIB
STATIC_RESERVE_SMALL_BYTES = 4 * GIB  # every tier on a machine under 24 GiB
STATIC_RESERVE_LARGE_BYTES: Mapping[Tier, int] = MappingProxyType(
    {Tier.SAFE: 8 * GIB, Tier.BALANCED: 6 * GIB, Tier.AGGRESSIVE: 4 * GIB}
)
STATIC_RESERVE_CUSTOM_BYTES = 2 * GIB  # custom tier, any machine size
# Never reserve more than half of a tiny machine, so a 4 GiB VM
# still gets a usable static term instead of zero.
STATIC_RESERVE_MAX_FRACTION = 0.5

# -- dynamic term (macOS vm statistics): share of "active" pages counted as givable
ACTIVE_RECLAIM_RATIO: Mapping[Tier, float] = _frozen(
    {Tier.SAFE: 0.2, Tier.BALANCED: 0.5, Tier.AGGRESSIVE: 0.8}
)

# -- container term: reserve = min(tier static reserve, 10 % of the limit) ----
# A cgroup charges page cache, kernel stacks and socket buffers that RSS does
# not show; 10 % covers them on small limits (a 2 GiB limit keeps ~1.8 GiB),
# while large limits keep at most the tier's own reserve.
CONTAINER_RESERVE_FRACTION = 0.10
CONTAINER_RESERVE_MIN_BYTES = 64 * MIB

# -- watermarks ----------------------------------------------------------------
SOFT_THRESHOLD: Mapping[Tier, float] = _frozen(
    {Tier.SAFE: 0.85, Tier.BALANCED: 0.90, Tier.AGGRESSIVE: 0.925, Tier.CUSTOM: 0.85}
)
HARD_THRESHOLD = 0.95

# -- emergency (not the hard mark) --------------------------------------------
EMERGENCY_MARGIN_BYTES = 2 * GIB  # usage >= ceiling + 2 GiB
EMERGENCY_POLLS = 2  # or usage >= ceiling for 2 consecutive polls

# -- pool reclaim and its grace -------------------------------------------------
POOL_RECLAIM_FLOOR_BYTES = 2 * GIB  # ask engines to drain the MLX pool only above this
PRESSURE_RECLAIM_GRACE_POLLS_MAX = 5  # polls of deferred enforcement per episode

# -- cadence ---------------------------------------------------------------------
ACTIVE_POLL_S = 1.0  # not ok, hint live, loading, or any engine busy
IDLE_POLL_S = 10.0  # models loaded and idle
EMPTY_POLL_S = 30.0  # nothing loaded
ACTIVITY_HINT_MIN_S = 2.0  # wake(active=True) opens at least this fast-poll window

# -- adaptive prefill chunking ----------------------------------------------------
PREFILL_CHUNK_FRACTION: Mapping[Tier, float] = _frozen(
    {Tier.SAFE: 0.90, Tier.BALANCED: 0.92, Tier.AGGRESSIVE: 0.97, Tier.CUSTOM: 0.95}
)
PREFILL_ABORT_MARGIN: Mapping[Tier, float] = _frozen(
    {Tier.SAFE: 0.90, Tier.BALANCED: 0.93, Tier.AGGRESSIVE: 0.97, Tier.CUSTOM: 0.95}
)
PREFILL_MIN_CHUNK_TOKENS = 32
PREFILL_MAX_CHUNK_TOKENS = 2048
PREFILL_COST_EWMA_ALPHA = 0.3


def static_reserve_bytes(tier: Tier, total_bytes: int) -> int:
    """Bytes the static term leaves to the OS for this tier and machine size."""
    if tier is Tier.CUSTOM:
        reserve = STATIC_RESERVE_CUSTOM_BYTES
    elif total_bytes < SMALL_SYSTEM_THRESHOLD_BYTES:
        reserve = STATIC_RESERVE_SMALL_BYTES
    else:
        reserve = STATIC_RESERVE_LARGE_BYTES[tier]
    return min(reserve, int(total_bytes * STATIC_RESERVE_MAX_FRACTION))


def container_reserve_bytes(tier: Tier, total_bytes: int, limit_bytes: int) -> int:
    """Bytes the container term keeps below a cgroup limit (see the constants above)."""
    share = max(CONTAINER_RESERVE_MIN_BYTES, int(limit_bytes * CONTAINER_RESERVE_FRACTION))
    return min(static_reserve_bytes(tier, total_bytes), share)


def soft_threshold(tier: Tier) -> float:
    return SOFT_THRESHOLD[tier]


def active_reclaim_ratio(tier: Tier) -> float | None:
    """Share of active pages the dynamic term may count; None for custom (no dynamic term)."""
    return ACTIVE_RECLAIM_RATIO.get(tier)


def prefill_chunk_fraction(tier: Tier) -> float:
    return PREFILL_CHUNK_FRACTION[tier]


def prefill_abort_margin(tier: Tier) -> float:
    return PREFILL_ABORT_MARGIN[tier]
