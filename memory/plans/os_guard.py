"""The OS memory-pressure guard: pure policy with hysteresis.

Input: the operating system's own pressure report, read elsewhere (macOS
`kern.memorystatus_vm_pressure_level`, Linux PSI `/proc/pressure/memory`, the
cgroup's pressure file, or swap-in activity) and reduced to normal / warning /
critical, plus a `now` value and the state of the previous reading. Output: the
new state and shrink actions for the session bank.

Timing rules:
- Act on the rising edge into warning or critical.
- While the level stays raised, re-arm at most every `rearm_s` (120 s).
- normal<->warning flapping cannot retrigger faster than `flap_s` (30 s):
  an edge inside the window waits until the window ends (if still raised).
- While the engine is busy a warning may wait up to `warning_max_defer_s`
  (60 s) so a running prefill is not disturbed; critical is never deferred and
  acts on every rising edge.
- warning -> shrink_to_bytes(budget // 2, protect_active=True);
  critical -> shrink_to_bytes(0, protect_active=True). Active sessions are
  spared: pinned and in-flight sessions are shed only in emergency, which is
  the enforcer's call, not the OS report's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from enum import IntEnum

from memory.actions import REASON_OS_CRITICAL as REASON_CRITICAL
from memory.actions import REASON_OS_WARNING as REASON_WARNING

REARM_S = 120.0
FLAP_S = 30.0
WARNING_MAX_DEFER_S = 60.0


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


@dataclass(frozen=True)
class GuardState:
    """What the guard remembers between readings (part of the governor's policy state)."""

    level: OsPressure = OsPressure.NORMAL
    last_action_at: float | None = None
    pending_since: float | None = None  # a warning action due but not yet taken
    pending_trigger: str = "edge"


@dataclass(frozen=True)
class GuardTiming:
    rearm_s: float = REARM_S
    flap_s: float = FLAP_S
    warning_max_defer_s: float = WARNING_MAX_DEFER_S


def _since_action(state: GuardState, now: float) -> float:
    return math.inf if state.last_action_at is None else now - state.last_action_at


def _act(state: GuardState, now: float, level: OsPressure, target: int, reason: str,
         trigger: str) -> tuple[GuardState, list[PressureAction]]:
    after = replace(state, last_action_at=now, pending_since=None)
    return after, [PressureAction(level=level, target_bytes=target, reason=reason,
                                  trigger=trigger)]


def guard_step(
    state: GuardState,
    level: str | int | OsPressure | None,
    now: float,
    *,
    budget_bytes: int,
    busy: bool = False,
    timing: GuardTiming = GuardTiming(),
) -> tuple[GuardState, list[PressureAction]]:
    """One reading -> (the new state, the actions to take now, usually none)."""
    lvl = level if isinstance(level, OsPressure) else parse_os_pressure(level)
    if lvl is OsPressure.UNKNOWN:
        return state, []  # no information: keep the state, do nothing
    rising = lvl > state.level
    state = replace(state, level=lvl)
    if lvl is OsPressure.NORMAL:
        return replace(state, pending_since=None), []
    if lvl is OsPressure.CRITICAL:
        if rising or _since_action(state, now) >= timing.rearm_s:
            return _act(state, now, lvl, 0, REASON_CRITICAL, "edge" if rising else "rearm")
        return state, []
    if rising and state.pending_since is None:
        state = replace(state, pending_since=now, pending_trigger="edge")
    elif state.pending_since is None and _since_action(state, now) >= timing.rearm_s:
        state = replace(state, pending_since=now, pending_trigger="rearm")
    if state.pending_since is None or _since_action(state, now) < timing.flap_s:
        return state, []
    deferred_for = now - state.pending_since
    if busy and deferred_for < timing.warning_max_defer_s:
        return state, []
    trigger = "deferred" if deferred_for > 0 else state.pending_trigger
    return _act(state, now, lvl, max(0, budget_bytes) // 2, REASON_WARNING, trigger)
