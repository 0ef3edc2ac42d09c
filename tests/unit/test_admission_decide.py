"""decide() and gate(): projection, floor and gating, with exact bytes.

decide() is the first look only: whether the request fits under the threshold or
needs the relief cascade (`Decision.needs_relief`). The cascade itself, its order
and its targets are the plan's (tests/unit/test_admission_plan.py).
"""

from __future__ import annotations

from dataclasses import replace

from memory.levels import PressureLevel
from memory.plans.admission import (
    BINDING_ADMISSION_CAP,
    BINDING_HYPER_CAP,
    BINDING_PAUSED_AT_EMERGENCY,
    BINDING_PAUSED_AT_HARD,
    BINDING_PAUSED_AT_SOFT,
    BINDING_PREFILL_EXCEEDS_CEILING,
    BINDING_QUEUE_FULL,
    RETRY_AFTER_MEMORY_S,
    RETRY_AFTER_WAIT_S,
    AdmissionInputs,
    SchedulerMode,
    Verdict,
    decide,
    gate,
    miss_tokens,
    own_bytes,
    project_bytes,
)
from memory.views import BankFigures

GiB = 1 << 30
MiB = 1 << 20


def ladder_inputs(**kw) -> AdmissionInputs:
    """usage 8 GiB (0.5 GiB pool), 2048 missed tokens x 1 MiB, threshold 8, ceiling 10.5."""
    base = AdmissionInputs(
        usage_bytes=8 * GiB, pool_bytes=GiB // 2, ceiling_bytes=10 * GiB + GiB // 2,
        threshold_bytes=8 * GiB, prompt_tokens=2078, reusable_prefix_tokens=30,
        kv_bytes_per_token=MiB,
        bank=BankFigures(total_bytes=3 * GiB, lru_freeable_bytes=GiB, chain_freeable_bytes=GiB),
    )
    return replace(base, **kw)


def test_project_bytes_formula():
    i = AdmissionInputs(usage_bytes=1000, ceiling_bytes=10_000, threshold_bytes=9000,
                        prompt_tokens=100, reusable_prefix_tokens=40, kv_bytes_per_token=10,
                        prefill_transient_bytes=77, reserved_bytes=5, restore_bytes=3)
    assert miss_tokens(i) == 60
    assert own_bytes(i) == 60 * 10 + 77 + 3
    assert project_bytes(i) == 1000 + 60 * 10 + 77 + 3 + 5


def test_at_least_one_token_is_prefilled():
    i = AdmissionInputs(usage_bytes=0, ceiling_bytes=1, threshold_bytes=1, prompt_tokens=10,
                        reusable_prefix_tokens=10, kv_bytes_per_token=7)
    assert miss_tokens(i) == 1 and project_bytes(i) == 7


def test_fits_under_threshold_admits_without_relief():
    d = decide(ladder_inputs(usage_bytes=5 * GiB))
    assert d.verdict is Verdict.ADMIT and not d.needs_relief and d.binding is None
    assert d.projected_bytes == 7 * GiB and d.request_bytes == 2 * GiB
    assert d.headroom_bytes == 5 * GiB + GiB // 2
    assert d.retry_after_s is None and d.admits


def test_over_the_threshold_needs_relief_with_exact_numbers():
    # 8 GiB + 2048 x 1 MiB = 10 GiB projected, over the 8 GiB threshold.
    d = decide(ladder_inputs())
    assert d.needs_relief and d.binding is None and d.retry_after_s is None
    assert d.projected_bytes == 10 * GiB and d.request_bytes == 2 * GiB
    assert d.headroom_bytes == 2 * GiB + GiB // 2
    assert d.numbers == {
        "usage_bytes": 8 * GiB, "projected_bytes": 10 * GiB, "shed_line_bytes": 8 * GiB,
        "admission_limit_bytes": 10 * GiB + GiB // 2, "pool_bytes": GiB // 2, "reserved_bytes": 0,
        "miss_tokens": 2048, "kv_bytes_per_token": MiB, "bank_bytes": 3 * GiB,
    }
    assert "over the shed line" in d.reason and "8.00 GiB" in d.reason


def test_exactly_at_the_threshold_needs_no_relief():
    d = decide(ladder_inputs(usage_bytes=6 * GiB))
    assert d.projected_bytes == 8 * GiB and not d.needs_relief


def test_even_past_the_ceiling_decide_only_asks_for_relief():
    # 8 GiB + 5120 x 1 MiB = 13 GiB > 9 GiB: the refusal is the plan's, after the cascade.
    d = decide(ladder_inputs(prompt_tokens=30 + 5 * 1024, ceiling_bytes=9 * GiB))
    assert d.needs_relief and d.projected_bytes == 13 * GiB
    assert d.numbers["miss_tokens"] == 5120 and d.numbers["admission_limit_bytes"] == 9 * GiB


def test_reserved_tickets_of_others_count_against_the_projection():
    d = decide(ladder_inputs(usage_bytes=5 * GiB, reserved_bytes=GiB + 1))
    assert d.projected_bytes == 8 * GiB + 1 and d.request_bytes == 3 * GiB + 1
    assert d.needs_relief
    assert not decide(ladder_inputs(usage_bytes=5 * GiB, reserved_bytes=GiB)).needs_relief


def test_paused_at_soft_even_with_nothing_admitted():
    # Seed 000: at soft the enforcer pauses new admissions; nothing passes the pause.
    for in_flight in (0, 1):
        d = decide(ladder_inputs(usage_bytes=GiB, level=PressureLevel.SOFT,
                                 admitted_in_flight=in_flight))
        assert d.verdict is Verdict.WAIT and d.binding == BINDING_PAUSED_AT_SOFT
        assert d.retry_after_s == RETRY_AFTER_WAIT_S and not d.needs_relief
        # Generate waits in the queue: if it never starts, its admission times out.
        assert d.error_reason == "ADMISSION_TIMEOUT"
    d = decide(ladder_inputs(usage_bytes=GiB, level=PressureLevel.HARD, admitted_in_flight=2))
    assert d.binding == BINDING_PAUSED_AT_HARD
    d = decide(ladder_inputs(usage_bytes=GiB, level=PressureLevel.EMERGENCY,
                             admitted_in_flight=1))
    assert d.binding == BINDING_PAUSED_AT_EMERGENCY


def test_queue_full_is_a_wait_that_generate_answers_at_once():
    d = decide(ladder_inputs(level=PressureLevel.SOFT, admitted_in_flight=1, queue_depth=4,
                             queue_limit=4))
    assert d.verdict is Verdict.WAIT and d.binding == BINDING_QUEUE_FULL
    assert d.error_reason == "QUEUE_FULL" and d.retry_after_s == RETRY_AFTER_WAIT_S
    assert not d.needs_relief


def test_hyper_mode_admits_exactly_one():
    i = ladder_inputs(usage_bytes=GiB, scheduler_mode=SchedulerMode.HYPER, admission_cap=8)
    assert decide(i).verdict is Verdict.ADMIT
    d = decide(replace(i, admitted_in_flight=1))
    assert d.verdict is Verdict.WAIT and d.binding == BINDING_HYPER_CAP
    assert d.error_reason == "ADMISSION_TIMEOUT"


def test_admission_cap_in_default_mode():
    i = ladder_inputs(usage_bytes=GiB, admission_cap=2, admitted_in_flight=1)
    assert decide(i).verdict is Verdict.ADMIT
    d = decide(replace(i, admitted_in_flight=2))
    assert d.verdict is Verdict.WAIT and d.binding == BINDING_ADMISSION_CAP


def test_prefill_that_can_never_fit_is_refused_up_front():
    d = decide(ladder_inputs(floor_bytes=9 * GiB))  # 9 + 2 > 10.5
    assert d.verdict is Verdict.REJECT and d.binding == BINDING_PREFILL_EXCEEDS_CEILING
    assert not d.needs_relief and d.error_reason == "PREFILL_EXCEEDS_CEILING"
    # Inverted from the previous API (None): the refusal now carries the memory retry hint.
    assert d.retry_after_s == RETRY_AFTER_MEMORY_S
    assert d.numbers["floor_bytes"] == 9 * GiB and d.numbers["request_bytes"] == 2 * GiB
    assert "floor" in d.reason and "10.50 GiB" in d.reason
    assert decide(ladder_inputs(floor_bytes=8 * GiB + GiB // 2)).verdict is Verdict.ADMIT


def test_the_floor_check_comes_before_the_gate():
    d = decide(ladder_inputs(floor_bytes=9 * GiB, level=PressureLevel.SOFT, admitted_in_flight=1))
    assert d.binding == BINDING_PREFILL_EXCEEDS_CEILING


def test_gate_function():
    ok, soft, hard = PressureLevel.OK, PressureLevel.SOFT, PressureLevel.HARD
    assert gate(ok, 5) is None
    assert gate(soft, 0) == (Verdict.WAIT, BINDING_PAUSED_AT_SOFT)  # nothing passes a pause
    assert gate(soft, 1) == (Verdict.WAIT, BINDING_PAUSED_AT_SOFT)
    assert gate(hard, 1) == (Verdict.WAIT, BINDING_PAUSED_AT_HARD)
    assert gate(ok, 3, admission_cap=3) == (Verdict.WAIT, BINDING_ADMISSION_CAP)
    assert gate(ok, 0, mode=SchedulerMode.HYPER) is None
    assert gate(ok, 1, mode=SchedulerMode.HYPER, admission_cap=8) == (
        Verdict.WAIT, BINDING_HYPER_CAP)
    assert gate(ok, 1, mode=SchedulerMode.HYPER, queue_depth=2, queue_limit=2) == (
        Verdict.WAIT, BINDING_QUEUE_FULL)
    assert gate(ok, 1, queue_depth=99, queue_limit=2) is None  # open gate: no queue check
