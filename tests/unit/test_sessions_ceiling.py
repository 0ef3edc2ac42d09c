"""The bank's dynamic ceiling (mtplx.md section 4) and hold_to_ceiling."""

from __future__ import annotations

from sessions.bank import SessionBank
from sessions.ceiling import (
    DYNAMIC_CEILING_SLACK_BYTES,
    bank_dynamic_ceiling,
    bank_idle_max_bytes,
    dynamic_reserve_bytes,
    hold_to_ceiling,
    working_set_bytes,
)
from sessions.testing import FakeClock, SpanRecorder, make_entry
from telemetry import names

GiB = 1 << 30
MiB = 1 << 20


def test_bank_idle_max_clamped_1_to_48_gib():
    assert bank_idle_max_bytes(64 * GiB, 20 * GiB) == 41 * GiB
    assert bank_idle_max_bytes(16 * GiB, 14 * GiB) == 1 * GiB
    assert bank_idle_max_bytes(192 * GiB, 10 * GiB) == 48 * GiB


def test_reserve_is_max_of_3gib_and_spike_capped_at_min_16gib_and_half_free():
    assert dynamic_reserve_bytes(64 * GiB, 20 * GiB) == 3 * GiB
    assert dynamic_reserve_bytes(64 * GiB, 20 * GiB, spike_bytes=10 * GiB) == 10 * GiB
    assert dynamic_reserve_bytes(64 * GiB, 20 * GiB, spike_bytes=40 * GiB) == 16 * GiB
    assert dynamic_reserve_bytes(16 * GiB, 14 * GiB, spike_bytes=5 * GiB) == 1 * GiB


def test_working_set_is_active_minus_weights_minus_bank():
    assert working_set_bytes(30 * GiB, 20 * GiB, 6 * GiB) == 4 * GiB
    assert working_set_bytes(10 * GiB, 20 * GiB, 0) == 0


def test_dynamic_ceiling_examples():
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 4 * GiB) == 37 * GiB
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 4 * GiB, spike_bytes=10 * GiB) == 30 * GiB
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 40 * GiB) == 1 * GiB  # floor 1 GiB
    assert bank_dynamic_ceiling(192 * GiB, 10 * GiB, 0) == 48 * GiB  # capped at idle max
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 0, bank_idle_max=8 * GiB) == 8 * GiB
    assert bank_dynamic_ceiling(64 * GiB, 20 * GiB, 0, reserve_bytes=0) == 41 * GiB


def bank_400s(rec):
    bank = SessionBank(clock=FakeClock(), active_sessions=lambda: {"live"}, tracer=rec.tracer)
    bank.put(make_entry([1], 400, "live"))
    bank.put(make_entry([2], 400, "live"))
    bank.put(make_entry([3], 400, "idle"))
    return bank


def test_hold_to_ceiling_keeps_active_entries_above_target():
    rec = SpanRecorder()
    bank = bank_400s(rec)
    assert hold_to_ceiling(bank, 0, slack_bytes=0) == 1
    assert bank.total_bytes() == 800 and bank.effective_max_bytes == 0
    (span,) = rec.spans(names.SPAN_BANK_SHRINK)
    assert span.attributes[names.ATTR_REASON] == "dynamic_ceiling"


def test_hold_to_ceiling_slack_256mib():
    slack = DYNAMIC_CEILING_SLACK_BYTES
    assert slack == 256 * MiB
    rec = SpanRecorder()
    bank = bank_400s(rec)
    assert hold_to_ceiling(bank, 1000, slack_bytes=200) == 0  # 1200 <= 1000 + 200
    assert hold_to_ceiling(bank, 999, slack_bytes=200) == 1 and bank.total_bytes() == 800
    assert hold_to_ceiling(bank, 0) == 0  # 800 bytes are well within the default slack


def test_effective_max_is_min_of_static_and_dynamic():
    bank = SessionBank(clock=FakeClock(), max_bytes=10 * GiB)
    hold_to_ceiling(bank, 37 * GiB)
    assert bank.effective_max_bytes == 10 * GiB
    hold_to_ceiling(bank, 3 * GiB)
    assert bank.effective_max_bytes == 3 * GiB
