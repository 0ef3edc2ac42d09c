"""The OS memory-pressure guard: pure policy with hysteresis.

Input: the operating system's own pressure report, read elsewhere (macOS
`kern.memorystatus_vm_pressure_level`, Linux PSI `/proc/pressure/memory`, the
cgroup's pressure file, or swap-in activity) and reduced to normal / warning /
critical, plus a `now` value. Output: shrink actions for the session bank.

Timing rules (MTPLX's guard):
- Act on the rising edge into warning or critical.
- While the level stays raised, re-arm at most every `rearm_s` (120 s).
- normal<->warning flapping cannot retrigger faster than `flap_s` (30 s):
  an edge inside the window waits until the window ends (if still raised).
- While the engine is busy a warning may wait up to `warning_max_defer_s`
  (60 s) so a running prefill is not disturbed; critical is never deferred and
  acts on every rising edge.
- warning -> shrink_to_bytes(budget // 2, protect_active=True);
  critical -> shrink_to_bytes(0, protect_active=True). Active sessions are
  spared (DESIGN: pinned and in-flight sessions are shed only in emergency,
  which is the enforcer's call, not the OS report's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .bank import SessionBank

REARM_S = 120.0
FLAP_S = 30.0
WARNING_MAX_DEFER_S = 60.0

REASON_WARNING = "memory_pressure_warning"
REASON_CRITICAL = "memory_pressure_critical"


class OsPressure(IntEnum):
    """Values as macOS reports them (kern.memorystatus_vm_pressure_level)."""

    UNKNOWN = 0
    NORMAL = 1
    WARNING = 2
    CRITICAL = 4


_BY_NAME = {p.name.lower(): p for p in OsPressure}


def parse_os_pressure(value: str | int | None) -> OsPressure:
    """"normal" / "warning" / "critical" (any case) or macOS's 1 / 2 / 4; else UNKNOWN."""
    if value is None:
        return OsPressure.UNKNOWN
    if isinstance(value, str):
        return _BY_NAME.get(value.strip().lower(), OsPressure.UNKNOWN)
    try:
        return OsPressure(int(value))
    except ValueError:
        return OsPressure.UNKNOWN


@dataclass(frozen=True)
class PressureAction:
    level: OsPressure
    target_bytes: int
    reason: str
    trigger: str  # "edge", "rearm" or "deferred"
    protect_active: bool = True


class PressureGuard:
    """Turns a stream of OS pressure readings into bank shrink actions."""

    def __init__(
        self,
        *,
        rearm_s: float = REARM_S,
        flap_s: float = FLAP_S,
        warning_max_defer_s: float = WARNING_MAX_DEFER_S,
    ) -> None:
        self.rearm_s = rearm_s
        self.flap_s = flap_s
        self.warning_max_defer_s = warning_max_defer_s
        self._level = OsPressure.NORMAL
        self._last_action_at: float | None = None
        self._pending_since: float | None = None  # a warning action due but not yet taken
        self._pending_trigger = "edge"

    @property
    def level(self) -> OsPressure:
        return self._level

    def _since_action(self, now: float) -> float:
        return math.inf if self._last_action_at is None else now - self._last_action_at

    def observe(
        self, level: str | int | OsPressure, now: float, *, budget_bytes: int, busy: bool = False
    ) -> list[PressureAction]:
        """One reading -> the actions to take now (usually none)."""
        lvl = level if isinstance(level, OsPressure) else parse_os_pressure(level)
        if lvl is OsPressure.UNKNOWN:
            return []  # no information: keep the state, do nothing
        rising = lvl > self._level
        self._level = lvl
        if lvl is OsPressure.NORMAL:
            self._pending_since = None
            return []
        if lvl is OsPressure.CRITICAL:
            if rising or self._since_action(now) >= self.rearm_s:
                return [self._act(now, lvl, 0, REASON_CRITICAL, "edge" if rising else "rearm")]
            return []
        if rising and self._pending_since is None:
            self._pending_since, self._pending_trigger = now, "edge"
        elif self._pending_since is None and self._since_action(now) >= self.rearm_s:
            self._pending_since, self._pending_trigger = now, "rearm"
        if self._pending_since is None or self._since_action(now) < self.flap_s:
            return []
        deferred_for = now - self._pending_since
        if busy and deferred_for < self.warning_max_defer_s:
            return []
        trigger = "deferred" if deferred_for > 0 else self._pending_trigger
        return [self._act(now, lvl, max(0, budget_bytes) // 2, REASON_WARNING, trigger)]

    def _act(self, now: float, level: OsPressure, target: int, reason: str,
             trigger: str) -> PressureAction:
        self._last_action_at = now
        self._pending_since = None
        return PressureAction(level=level, target_bytes=target, reason=reason, trigger=trigger)


@dataclass(frozen=True)
class GuardResult:
    action: PressureAction
    entries_evicted: int
    bytes_before: int
    bytes_after: int
    pool_freed: int = 0


def apply_pressure_actions(
    actions: Sequence[PressureAction],
    bank: SessionBank,
    *,
    reclaim_pool: Callable[[], int] | None = None,
) -> list[GuardResult]:
    """Apply the guard's actions to the bank. `reclaim_pool` (e.g. flag the engines to
    clear the MLX pool) runs when something was evicted or the level is critical."""
    results = []
    for a in actions:
        before = bank.total_bytes()
        n = bank.shrink_to_bytes(a.target_bytes, protect_active=a.protect_active, reason=a.reason)
        pool = 0
        if reclaim_pool is not None and (n or a.level is OsPressure.CRITICAL):
            pool = reclaim_pool()
        results.append(GuardResult(a, n, before, bank.total_bytes(), pool))
    return results
