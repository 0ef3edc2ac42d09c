"""decide(): projection, gating and the shed ladder, with exact bytes."""

from __future__ import annotations

from dataclasses import replace

from sessions.admission import (
    BINDING_CEILING,
    BINDING_HYPER_CAP,
    BINDING_PAUSED_AT_HARD,
    BINDING_PAUSED_AT_SOFT,
    BINDING_PREFILL_EXCEEDS_CEILING,
    BINDING_QUEUE_FULL,
    BINDING_THRESHOLD,
    LEVEL_HARD,
    LEVEL_SOFT,
    RETRY_AFTER_MEMORY_S,
    RETRY_AFTER_WAIT_S,
    AdmissionInputs,
    BankFigures,
    SchedulerMode,
    ShedKind,
    ShedStep,
    Verdict,
    decide,
    gate,
    miss_tokens,
    project_bytes,
)

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
    assert project_bytes(i) == 1000 + 60 * 10 + 77 + 3 + 5


def test_at_least_one_token_is_prefilled():
    i = AdmissionInputs(usage_bytes=0, ceiling_bytes=1, threshold_bytes=1, prompt_tokens=10,
                        reusable_prefix_tokens=10, kv_bytes_per_token=7)
    assert miss_tokens(i) == 1 and project_bytes(i) == 7


def test_fits_under_threshold_admits_without_shedding():
    d = decide(ladder_inputs(usage_bytes=5 * GiB))
    assert d.verdict is Verdict.ADMIT and d.shed == () and d.binding is None
    assert d.projected_bytes == 7 * GiB and d.headroom_bytes == 5 * GiB + GiB // 2


def test_ladder_order_reclaim_then_lru_then_chain_exact_bytes():
    d = decide(ladder_inputs())
    assert d.verdict is Verdict.ADMIT_AFTER_SHEDDING and d.binding == BINDING_THRESHOLD
    assert d.projected_bytes == 10 * GiB and d.request_bytes == 2 * GiB
    assert d.shed == (
        ShedStep(ShedKind.RECLAIM_POOL, GiB // 2),
        ShedStep(ShedKind.SHRINK_TO_BYTES, GiB, target_bytes=3 * GiB - (GiB + GiB // 2)),
        ShedStep(ShedKind.SHRINK_FOR_ADMISSION, GiB // 2, target_bytes=2 * GiB - GiB // 2),
    )
    assert d.projected_after_shed_bytes == 8 * GiB and d.shed_bytes == 2 * GiB


def test_ladder_stops_at_the_first_step_that_fits():
    d = decide(ladder_inputs(threshold_bytes=9 * GiB + GiB // 2))
    assert [s.kind for s in d.shed] == [ShedKind.RECLAIM_POOL]
    d = decide(ladder_inputs(threshold_bytes=9 * GiB))
    assert [s.kind for s in d.shed] == [ShedKind.RECLAIM_POOL, ShedKind.SHRINK_TO_BYTES]
    assert d.shed[1] == ShedStep(ShedKind.SHRINK_TO_BYTES, GiB // 2, target_bytes=2 * GiB + GiB // 2)


def test_still_over_ceiling_after_the_ladder_is_refused_with_numbers():
    d = decide(ladder_inputs(prompt_tokens=30 + 5 * 1024, ceiling_bytes=9 * GiB))
    assert d.verdict is Verdict.REJECT and d.binding == BINDING_CEILING
    assert d.projected_bytes == 13 * GiB
    assert d.projected_after_shed_bytes == 13 * GiB - GiB // 2 - 2 * GiB
    assert d.numbers["shortfall_bytes"] == GiB + GiB // 2
    assert d.numbers["ceiling_bytes"] == 9 * GiB and d.numbers["miss_tokens"] == 5120
    assert d.retry_after_s == RETRY_AFTER_MEMORY_S and d.error_reason == "MEMORY_PRESSURE"
    assert "ceiling" in d.reason and "9.00 GiB" in d.reason


def test_between_threshold_and_ceiling_is_admitted():
    # Nothing to shed, 0.5 GiB over the threshold, under the ceiling.
    d = decide(ladder_inputs(pool_bytes=0, bank=BankFigures(), usage_bytes=6 * GiB + GiB // 2))
    assert d.verdict is Verdict.ADMIT and d.shed == ()
    d = decide(ladder_inputs(pool_bytes=0, bank=BankFigures(), usage_bytes=9 * GiB))
    assert d.verdict is Verdict.REJECT and d.numbers["shortfall_bytes"] == GiB // 2


def test_chain_shed_disabled_skips_step_three():
    d = decide(ladder_inputs(chain_shed_enabled=False))
    assert [s.kind for s in d.shed] == [ShedKind.RECLAIM_POOL, ShedKind.SHRINK_TO_BYTES]
    assert d.verdict is Verdict.ADMIT_AFTER_SHEDDING
    assert d.projected_after_shed_bytes == 8 * GiB + GiB // 2  # over threshold, under ceiling
    d = decide(ladder_inputs(chain_shed_enabled=False, ceiling_bytes=8 * GiB + GiB // 4))
    assert d.verdict is Verdict.REJECT and d.binding == BINDING_CEILING
    assert decide(ladder_inputs(ceiling_bytes=8 * GiB + GiB // 4)).admits  # enabled: fits


def test_reserved_tickets_of_others_count_against_the_projection():
    d = decide(ladder_inputs(usage_bytes=5 * GiB, reserved_bytes=GiB + 1))
    assert d.projected_bytes == 8 * GiB + 1 and d.verdict is Verdict.ADMIT_AFTER_SHEDDING
    assert decide(ladder_inputs(usage_bytes=5 * GiB, reserved_bytes=GiB)).verdict is Verdict.ADMIT


def test_paused_at_soft_but_first_request_passes():
    assert decide(ladder_inputs(usage_bytes=GiB, level=LEVEL_SOFT)).verdict is Verdict.ADMIT
    d = decide(ladder_inputs(usage_bytes=GiB, level=LEVEL_SOFT, admitted_in_flight=1))
    assert d.verdict is Verdict.WAIT and d.binding == BINDING_PAUSED_AT_SOFT
    assert d.retry_after_s == RETRY_AFTER_WAIT_S
    d = decide(ladder_inputs(usage_bytes=GiB, level=LEVEL_HARD, admitted_in_flight=2))
    assert d.binding == BINDING_PAUSED_AT_HARD


def test_first_request_at_soft_still_goes_through_the_memory_ladder():
    d = decide(ladder_inputs(level=LEVEL_SOFT, ceiling_bytes=9 * GiB, prompt_tokens=30 + 5120))
    assert d.verdict is Verdict.REJECT and d.binding == BINDING_CEILING


def test_queue_full_rejects_instead_of_waiting():
    d = decide(ladder_inputs(level=LEVEL_SOFT, admitted_in_flight=1, queue_depth=4, queue_limit=4))
    assert d.verdict is Verdict.REJECT and d.binding == BINDING_QUEUE_FULL
    assert d.error_reason == "QUEUE_FULL"


def test_hyper_mode_admits_exactly_one():
    i = ladder_inputs(usage_bytes=GiB, scheduler_mode=SchedulerMode.HYPER, admission_cap=8)
    assert decide(i).verdict is Verdict.ADMIT
    d = decide(replace(i, admitted_in_flight=1))
    assert d.verdict is Verdict.WAIT and d.binding == BINDING_HYPER_CAP


def test_prefill_that_can_never_fit_is_refused_up_front():
    d = decide(ladder_inputs(floor_bytes=9 * GiB))  # 9 + 2 > 10.5
    assert d.verdict is Verdict.REJECT and d.binding == BINDING_PREFILL_EXCEEDS_CEILING
    assert d.retry_after_s is None and d.error_reason == "PREFILL_EXCEEDS_CEILING"
    assert decide(ladder_inputs(floor_bytes=8 * GiB)).admits


def test_gate_function():
    assert gate(1, 5) is None
    assert gate(2, 0) is None
    assert gate(2, 1) == (Verdict.WAIT, BINDING_PAUSED_AT_SOFT)
    assert gate(1, 3, admission_cap=3) == (Verdict.WAIT, "admission_cap")
    assert gate(1, 1, mode=SchedulerMode.HYPER, queue_depth=2, queue_limit=2) == (
        Verdict.REJECT, BINDING_QUEUE_FULL)
