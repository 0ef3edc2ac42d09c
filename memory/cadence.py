"""How often the enforcer polls, and the activity hint every `wake()` extends. Pure."""

from __future__ import annotations

from collections.abc import Iterable

from memory.levels import (
    ACTIVE_POLL_S,
    ACTIVITY_HINT_MIN_S,
    EMPTY_POLL_S,
    IDLE_POLL_S,
    PressureLevel,
)
from memory.views import EngineView

# OS pressure reports that keep the enforcer on the fast cadence: the kernel
# often sees trouble before our own figures cross a mark.
FAST_OS_PRESSURE = frozenset({"warning", "critical"})


def poll_interval(
    level: PressureLevel,
    now: float,
    activity_hint_until: float,
    any_loading: bool,
    engines: Iterable[EngineView],
    *,
    active_s: float = ACTIVE_POLL_S,
    idle_s: float = IDLE_POLL_S,
    empty_s: float = EMPTY_POLL_S,
    os_pressure: str | None = None,
) -> float:
    """1 s while not ok, a hint is live, a model is loading, or any engine is busy
    (or cannot report); 10 s with models loaded and idle; 30 s with none loaded."""
    if level != PressureLevel.OK or now < activity_hint_until or any_loading:
        return active_s
    if os_pressure in FAST_OS_PRESSURE:
        return active_s
    loaded = False
    for engine in engines:
        if engine.loading or engine.busy:
            return active_s
        loaded = True
    return idle_s if loaded else empty_s


def extend_activity_hint(now: float, hint_until: float, active_s: float = ACTIVE_POLL_S) -> float:
    """Every `wake()`: keep polling fast for at least max(2 s, 2 × the active interval)."""
    return max(hint_until, now + max(ACTIVITY_HINT_MIN_S, 2.0 * active_s))
