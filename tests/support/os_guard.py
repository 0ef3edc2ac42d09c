"""`PressureGuard`: the pure OS pressure guard (`memory.plans.os_guard.guard_step`)
with its state kept in an object, for tests that feed it readings one by one."""

from __future__ import annotations

from memory.plans.os_guard import (
    FLAP_S,
    REARM_S,
    WARNING_MAX_DEFER_S,
    GuardState,
    GuardTiming,
    OsPressure,
    PressureAction,
    guard_step,
)


class PressureGuard:
    """`guard_step` with its state kept here: for callers outside the governor (tests)."""

    def __init__(self, *, rearm_s: float = REARM_S, flap_s: float = FLAP_S,
                 warning_max_defer_s: float = WARNING_MAX_DEFER_S) -> None:
        self.timing = GuardTiming(rearm_s, flap_s, warning_max_defer_s)
        self.state = GuardState()

    @property
    def level(self) -> OsPressure:
        return self.state.level

    def observe(self, level: str | int | OsPressure, now: float, *, budget_bytes: int,
                busy: bool = False) -> list[PressureAction]:
        self.state, actions = guard_step(self.state, level, now, budget_bytes=budget_bytes,
                                         busy=busy, timing=self.timing)
        return actions
