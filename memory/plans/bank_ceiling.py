"""The session bank's dynamic ceiling: what the bank may hold once the rest is counted.

The bank may only use what is left once the weights, the running working set
and a reserve for allocation spikes are accounted for; the governor recomputes
it every tick and `plan_hold_to_ceiling` trims the bank toward it, sparing
active sessions (so the bank may stay above it rather than force a re-prefill).
Pure.
"""

from __future__ import annotations

from memory.actions import REASON_DYNAMIC_CEILING, ShrinkMode, ShrinkSessionCache
from memory.levels import GIB as GiB
from memory.levels import MIB as MiB

MIN_BANK_CEILING_BYTES = 1 * GiB
MAX_BANK_IDLE_BYTES = 48 * GiB
BASE_RESERVE_BYTES = 3 * GiB
MAX_RESERVE_BYTES = 16 * GiB
DYNAMIC_CEILING_SLACK_BYTES = 256 * MiB


def _clamp(x: int, lo: int, hi: int) -> int:
    return min(max(x, lo), hi)  # hi wins when lo > hi: an operator cap is a cap


def bank_idle_max_bytes(usable_bytes: int, weights_bytes: int) -> int:
    """The bank's budget when nothing runs: clamp(usable - weights - 3 GiB, 1 GiB, 48 GiB)."""
    return _clamp(usable_bytes - weights_bytes - BASE_RESERVE_BYTES,
                  MIN_BANK_CEILING_BYTES, MAX_BANK_IDLE_BYTES)


def dynamic_reserve_bytes(usable_bytes: int, weights_bytes: int, spike_bytes: int = 0) -> int:
    """max(3 GiB, observed peak-minus-active spike), capped at min(16 GiB, (usable - weights) / 2)."""
    cap = max(0, min(MAX_RESERVE_BYTES, (usable_bytes - weights_bytes) // 2))
    return min(max(BASE_RESERVE_BYTES, spike_bytes), cap)


def working_set_bytes(active_bytes: int, weights_bytes: int, bank_bytes: int) -> int:
    """What running requests use: active memory minus weights minus the bank itself."""
    return max(0, active_bytes - weights_bytes - bank_bytes)


def bank_dynamic_ceiling(
    usable_bytes: int,
    weights_bytes: int,
    working_set: int,
    *,
    spike_bytes: int = 0,
    reserve_bytes: int | None = None,
    bank_idle_max: int | None = None,
) -> int:
    """clamp(usable - weights - reserve - working set, 1 GiB, bank_idle_max)."""
    if reserve_bytes is None:
        reserve_bytes = dynamic_reserve_bytes(usable_bytes, weights_bytes, spike_bytes)
    if bank_idle_max is None:
        bank_idle_max = bank_idle_max_bytes(usable_bytes, weights_bytes)
    return _clamp(usable_bytes - weights_bytes - reserve_bytes - working_set,
                  MIN_BANK_CEILING_BYTES, bank_idle_max)


def plan_hold_to_ceiling(
    bank_bytes: int, ceiling_bytes: int, slack_bytes: int = DYNAMIC_CEILING_SLACK_BYTES
) -> ShrinkSessionCache | None:
    """Over the ceiling by more than the slack: shrink_to_bytes(ceiling, protect_active=True).

    The slack keeps a bank hovering at its ceiling from shrinking on every tick.
    """
    if bank_bytes <= ceiling_bytes + slack_bytes:
        return None
    return ShrinkSessionCache(target_bytes=ceiling_bytes, protect_active=True,
                              reason=REASON_DYNAMIC_CEILING, mode=ShrinkMode.TO_BYTES)
