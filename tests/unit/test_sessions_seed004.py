"""Every fact of seeds/004 (MTPLX admission policies, five layers of defense) as a named test."""

from __future__ import annotations

import inspect

import pytest

from sessions.admission import (
    AdmissionInputs,
    BankFigures,
    SchedulerMode,
    ShedKind,
    Verdict,
    bank_figures,
    decide,
    run_admission,
    validate_scheduler_settings,
)
from sessions.bank import SessionBank
from sessions.pressure_guard import PressureGuard, apply_pressure_actions
from sessions.testing import FakeClock, SpanRecorder, make_entry
from telemetry import names

GiB = 1 << 30


def bank_with(active=(), **kw):
    clock = FakeClock()
    bank = SessionBank(clock=clock, active_sessions=lambda: set(active), max_entries=100,
                       max_bytes=64 * GiB, per_session_max_bytes=64 * GiB, **kw)
    return bank, clock


# Layer 1: memory-pressure guard -------------------------------------------------------------


def test_seed004_pressure_guard_responds_to_os_pressure_with_shrink_to_bytes():
    bank, _ = bank_with()
    bank.put(make_entry([1], GiB, "s"))
    actions = PressureGuard().observe("warning", 0.0, budget_bytes=GiB)  # the OS starts swapping
    (res,) = apply_pressure_actions(actions, bank)
    assert res.action.target_bytes == GiB // 2 and res.entries_evicted == 1


def test_seed004_shrink_to_bytes_accepts_target_and_optional_protect_active():
    params = inspect.signature(SessionBank.shrink_to_bytes).parameters
    assert "target_bytes" in params and params["protect_active"].default is False
    assert params["protect_active"].kind is inspect.Parameter.KEYWORD_ONLY


def test_seed004_protect_active_evicts_only_lru_idle_entries_until_budget_met():
    bank, clock = bank_with(active={"run"})
    bank.put(make_entry([1], 100, "run"))
    for i in (2, 3, 4):
        clock.advance(1)
        bank.put(make_entry([i], 100, f"idle{i}"))
    assert bank.shrink_to_bytes(200, protect_active=True) == 2
    assert sorted(e.tokens for e in bank.entries()) == [(1,), (4,)]  # the two oldest idle went


def test_seed004_example_guard_2gib_returns_evicted_count():
    bank, _ = bank_with()
    for i in range(3):
        bank.put(make_entry([i], GiB, f"s{i}"))
    evicted = bank.shrink_to_bytes(target_bytes=2 * GiB, protect_active=True)
    assert isinstance(evicted, int) and evicted == 1 and bank.total_bytes() == 2 * GiB


# Layer 2: prefill admission shed ---------------------------------------------------------------


def test_seed004_prefill_shed_triggers_only_when_projection_exceeds_the_limit():
    healthy = decide(AdmissionInputs(usage_bytes=GiB, ceiling_bytes=10 * GiB,
                                     threshold_bytes=9 * GiB, prompt_tokens=1000,
                                     kv_bytes_per_token=1024))
    assert healthy.verdict is Verdict.ADMIT and healthy.shed == ()
    over = decide(AdmissionInputs(usage_bytes=9 * GiB, ceiling_bytes=10 * GiB,
                                  threshold_bytes=9 * GiB, prompt_tokens=1000,
                                  kv_bytes_per_token=1024,
                                  bank=BankFigures(3 * GiB, 0, 0, GiB, 1)))
    assert [s.kind for s in over.shed] == [ShedKind.SHRINK_FOR_ADMISSION]


def test_seed004_shrink_for_admission_removes_non_terminal_first_then_lru():
    bank, clock = bank_with()
    bank.put(make_entry([1, 1, 1], 100, "s"))  # terminal, older
    clock.advance(1)
    bank.put(make_entry([2], 100, "s"))  # non-terminal
    assert bank.shrink_for_admission(100) == (1, 0)
    assert bank.shrink_for_admission(0) == (0, 1)


def test_seed004_protect_tokens_keep_entries_the_prompt_needs():
    bank, _ = bank_with()
    bank.put(make_entry([123, 456], 100, "s"))
    bank.put(make_entry([9], 100, "t"))
    assert bank.shrink_for_admission(0, protect_tokens=[123, 456, 789], model="m") == (0, 1)
    assert [e.tokens for e in bank.entries()] == [(123, 456)]


def test_seed004_example_admission_shed_above_total_is_a_no_op():
    bank, _ = bank_with()
    bank.put(make_entry([123, 456], GiB, "s"))
    non_term, term = bank.shrink_for_admission(
        target_bytes=bank.total_bytes() + 1 * GiB, protect_tokens=[123, 456, 789],
        reason="prefill_admission_chain",
    )
    assert (non_term, term) == (0, 0) and bank.entry_count() == 1


# Layer 3: admission chain shed ---------------------------------------------------------------------


def chain_case(chain_enabled: bool):
    bank, clock = bank_with(active={"b"})
    bank.put(make_entry([1], GiB, "a"))  # idle: the LRU pass
    clock.advance(1)
    bank.put(make_entry([2], GiB, "b"))  # active non-terminal: only the chain shed
    clock.advance(1)
    bank.put(make_entry([3, 3, 3], GiB, "b"))
    prompt = [3, 3, 3, 4]
    usage = [8 * GiB]

    def on_evict_total():
        return 5 * GiB + bank.total_bytes()

    inputs = AdmissionInputs(usage_bytes=usage[0], ceiling_bytes=7 * GiB + GiB // 2,
                             threshold_bytes=7 * GiB,
                             prompt_tokens=4, reusable_prefix_tokens=3, kv_bytes_per_token=GiB,
                             chain_shed_enabled=chain_enabled,
                             bank=bank_figures(bank, "m", prompt))
    return bank, prompt, inputs, on_evict_total


@pytest.mark.parametrize("enabled", [True, False])
def test_seed004_chain_shed_flag_controls_shrink_for_admission(enabled):
    bank, prompt, inputs, measure = chain_case(enabled)
    d = decide(inputs)
    kinds = [s.kind for s in d.shed]
    assert kinds[0] is ShedKind.SHRINK_TO_BYTES  # the standard LRU shed comes first
    assert (ShedKind.SHRINK_FOR_ADMISSION in kinds) is enabled
    out = run_admission(d, bank, lambda: 0, measure, model="m", prompt_tokens=prompt)
    assert out.admitted is enabled
    if enabled:
        assert [s.kind for s in out.steps][1:] == kinds  # after the pool reclaim
        assert sorted(e.tokens for e in bank.entries()) == [(3, 3, 3)]
    else:  # without the chain shed the LRU pass alone cannot reach the ceiling: refuse, keep all
        assert d.verdict is Verdict.REJECT and bank.entry_count() == 3


# Layer 4: hyper mode -------------------------------------------------------------------------------------


def test_seed004_hyper_mode_caps_admission_at_exactly_one():
    inputs = AdmissionInputs(usage_bytes=0, ceiling_bytes=GiB, threshold_bytes=GiB,
                             prompt_tokens=1, kv_bytes_per_token=1,
                             scheduler_mode=SchedulerMode.HYPER)
    assert decide(inputs).verdict is Verdict.ADMIT
    from dataclasses import replace
    assert decide(replace(inputs, admitted_in_flight=1)).verdict is Verdict.WAIT


def test_seed004_hyper_mode_rejects_multi_admission_launch_flags():
    with pytest.raises(ValueError):
        validate_scheduler_settings("hyper", 2)
    assert validate_scheduler_settings("hyper", 1).admission_cap == 1


# Layer 5: dynamic ceiling ------------------------------------------------------------------------------


def test_seed004_dynamic_ceiling_tolerates_overage_when_only_active_entries_remain():
    bank, _ = bank_with(active={"run"})
    bank.put(make_entry([1], 400, "run"))
    bank.put(make_entry([2], 400, "run"))
    assert bank.shrink_to_bytes(0, protect_active=True) == 0 and bank.total_bytes() == 800


# Workflow cascade ---------------------------------------------------------------------------------------


def test_seed004_cascade_order_and_spans():
    rec = SpanRecorder()
    bank, clock = bank_with(active={"b"}, tracer=rec.tracer)
    bank.put(make_entry([1], GiB, "a"))
    bank.put(make_entry([2], GiB, "b"))
    bank.put(make_entry([3, 3], GiB, "b"))
    # 1. system pressure -> shrink_to_bytes
    apply_pressure_actions(PressureGuard().observe("critical", 0.0, budget_bytes=GiB), bank)
    # 2./3. prefill projection -> shrink_for_admission, non-terminal first
    assert bank.shrink_for_admission(GiB, protect_tokens=[3, 3, 9], model="m") == (1, 0)
    assert [s.name for s in rec.spans()] == [names.SPAN_BANK_SHRINK,
                                             names.SPAN_BANK_SHRINK_FOR_ADMISSION]
    assert rec.spans()[0].attributes[names.ATTR_REASON] == "memory_pressure_critical"
