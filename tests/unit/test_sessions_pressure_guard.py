"""The OS pressure guard's hysteresis (120 s re-arm, 30 s flap, 60 s busy defer) and actions."""

from __future__ import annotations

from sessions.bank import SessionBank
from sessions.pressure_guard import (
    FLAP_S,
    REARM_S,
    WARNING_MAX_DEFER_S,
    OsPressure,
    PressureGuard,
    apply_pressure_actions,
    parse_os_pressure,
)
from sessions.testing import FakeClock, make_entry

BUDGET = 1000


def run(guard, script, busy=False):
    """script: [(t, level)] -> {t: [(reason, target, trigger)]} for ticks that acted."""
    out = {}
    for t, level in script:
        acts = guard.observe(level, t, budget_bytes=BUDGET, busy=busy)
        if acts:
            out[t] = [(a.reason, a.target_bytes, a.trigger) for a in acts]
    return out


def test_constants():
    assert (REARM_S, FLAP_S, WARNING_MAX_DEFER_S) == (120.0, 30.0, 60.0)


def test_rising_edge_into_warning_shrinks_to_half_budget_protecting_active():
    g = PressureGuard()
    (a,) = g.observe("warning", 0.0, budget_bytes=BUDGET)
    assert (a.level, a.target_bytes, a.protect_active, a.reason, a.trigger) == (
        OsPressure.WARNING, 500, True, "memory_pressure_warning", "edge")


def test_sustained_warning_rearms_every_120s():
    acted = run(PressureGuard(), [(t, "warning") for t in (0, 10, 60, 119, 120, 200, 239, 240)])
    assert list(acted) == [0, 120, 240]
    assert acted[120] == [("memory_pressure_warning", 500, "rearm")]


def test_normal_warning_flapping_cannot_retrigger_faster_than_30s():
    script = [(0, "warning"), (10, "normal"), (20, "warning"), (29, "warning"), (30, "warning"),
              (31, "normal"), (45, "warning"), (61, "normal"), (70, "warning")]
    acted = run(PressureGuard(), script)
    assert list(acted) == [0, 30, 70]
    assert acted[30][0][2] == "deferred"  # the edge at 20 acted once the window ended


def test_flap_that_settles_to_normal_inside_the_window_does_nothing():
    acted = run(PressureGuard(), [(0, "warning"), (5, "normal"), (10, "warning"), (15, "normal"),
                                  (40, "normal")])
    assert list(acted) == [0]


def test_critical_never_deferred_and_acts_on_every_rising_edge():
    g = PressureGuard()
    acted = run(g, [(0, "warning"), (5, "critical"), (6, "normal"), (7, "critical"),
                    (60, "critical"), (126, "critical"), (127, "critical")], busy=True)
    assert list(acted) == [5, 7, 127]  # 0: warning deferred (busy); 127 = 7 + 120 re-arm
    assert acted[5] == [("memory_pressure_critical", 0, "edge")]
    assert acted[127] == [("memory_pressure_critical", 0, "rearm")]


def test_warning_defers_up_to_60s_while_busy():
    g = PressureGuard()
    acted = run(g, [(0, "warning"), (30, "warning"), (59, "warning"), (60, "warning")], busy=True)
    assert list(acted) == [60] and acted[60][0][2] == "deferred"
    g = PressureGuard()
    assert g.observe("warning", 0, budget_bytes=BUDGET, busy=True) == []
    assert len(g.observe("warning", 10, budget_bytes=BUDGET, busy=False)) == 1  # idle: act now


def test_warning_after_critical_waits_for_rearm():
    acted = run(PressureGuard(), [(0, "critical"), (10, "warning"), (100, "warning"),
                                  (120, "warning")])
    assert list(acted) == [0, 120]


def test_unknown_readings_change_nothing():
    g = PressureGuard()
    assert run(g, [(0, "warning"), (1, "unknown"), (2, None), (3, 0), (4, "warning")]) == {
        0: [("memory_pressure_warning", 500, "edge")]}
    assert g.level is OsPressure.WARNING


def test_parse_os_pressure_strings_and_macos_ints():
    assert [parse_os_pressure(v) for v in ("Normal", " WARNING ", "critical", 1, 2, 4, 3, "x")] == [
        OsPressure.NORMAL, OsPressure.WARNING, OsPressure.CRITICAL, OsPressure.NORMAL,
        OsPressure.WARNING, OsPressure.CRITICAL, OsPressure.UNKNOWN, OsPressure.UNKNOWN]


def test_apply_actions_to_bank_spares_active_sessions():
    bank = SessionBank(clock=FakeClock(), active_sessions=lambda: {"live"}, max_bytes=BUDGET)
    bank.put(make_entry([1], 300, "live"))
    bank.put(make_entry([2], 300, "idle1"))
    bank.put(make_entry([3], 300, "idle2"))
    g = PressureGuard()
    reclaims: list[int] = []
    res = apply_pressure_actions(g.observe("warning", 0, budget_bytes=bank.effective_max_bytes),
                                 bank, reclaim_pool=lambda: reclaims.append(1) or 42)
    assert (res[0].entries_evicted, res[0].bytes_before, res[0].bytes_after, res[0].pool_freed) == (
        2, 900, 300, 42)
    res = apply_pressure_actions(g.observe("critical", 1, budget_bytes=BUDGET), bank,
                                 reclaim_pool=lambda: reclaims.append(1) or 0)
    assert res[0].entries_evicted == 0 and bank.total_bytes() == 300  # active kept, above target 0
    assert len(reclaims) == 2  # critical reclaims the pool even with nothing evicted
