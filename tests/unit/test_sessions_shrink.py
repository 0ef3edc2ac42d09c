"""shrink_to_bytes and shrink_for_admission: the MTPLX scenarios with exact bytes.

The shrinks open no span: the governor records each one (memory.recording), once.
Their figures are the dry runs' (`plan_shrink_*`, `figures`, `preview_freed`).
"""

from __future__ import annotations

import pytest

from memory.actions import ShrinkMode
from memory.views import BankFigures
from sessions.bank import SessionBank
from tests.support.clock import FakeClock
from tests.support.sessions import SpanRecorder, make_entry


@pytest.fixture
def rec():
    return SpanRecorder()


def mk(rec, active=(), clock=None):
    log: list[tuple[str | None, tuple, str]] = []
    bank = SessionBank(
        clock=clock or FakeClock(), active_sessions=lambda: set(active), max_entries=1000,
        per_session_max_entries=100, tracer=rec.tracer,
        on_evict=lambda es, reason: log.extend((e.session_id, e.tokens, reason) for e in es),
    )
    return bank, log


def remaining(bank):
    return sorted(e.tokens for e in bank.entries())


# -- shrink_to_bytes ---------------------------------------------------------------


def test_dynamic_ceiling_400_400_400_protect_active(rec):
    bank, log = mk(rec, active={"live"})
    bank.put(make_entry([1], 400, "live"))
    bank.put(make_entry([2], 400, "live"))
    bank.put(make_entry([3], 400, "idle"))
    assert bank.shrink_to_bytes(0, protect_active=True) == 1
    assert bank.total_bytes() == 800 and remaining(bank) == [(1,), (2,)]
    assert log == [("idle", (3,), "memory_pressure")]


def test_400_400_400_without_flag_takes_all_three(rec):
    bank, _ = mk(rec, active={"live"})
    for t, s in (([1], "live"), ([2], "live"), ([3], "idle")):
        bank.put(make_entry(t, 400, s))
    assert bank.shrink_to_bytes(0) == 3 and bank.total_bytes() == 0


def test_shrink_to_bytes_order_idle_then_lru_then_larger_then_older(rec):
    clock = FakeClock()
    bank, log = mk(rec, active={"live"}, clock=clock)
    bank.put(make_entry([1], 100, "live"))  # oldest of all, but active: last
    clock.advance(1)
    bank.put(make_entry([2], 100, "a"))
    bank.put(make_entry([3], 300, "b"))  # same instant, larger: before (2,)
    clock.advance(1)
    bank.put(make_entry([4], 100, "c"))
    assert bank.shrink_to_bytes(0) == 4
    assert [t for _, t, _ in log] == [(3,), (2,), (4,), (1,)]


def test_shrink_to_bytes_stops_at_target_and_returns_count(rec):
    clock = FakeClock()
    bank, log = mk(rec, clock=clock)
    for i in range(4):
        clock.advance(1)
        bank.put(make_entry([i], 250, f"s{i}"))
    assert bank.shrink_to_bytes(600) == 2 and bank.total_bytes() == 500
    assert bank.shrink_to_bytes(500) == 0
    assert bank.shrink_to_bytes(-5) == 2 and bank.total_bytes() == 0  # negative: max(0, target)


def test_shrink_to_bytes_respects_protect_keys_and_session_ids(rec):
    bank, _ = mk(rec)
    bank.put(make_entry([1], 100, "a"))
    bank.put(make_entry([2], 100, "b"))
    bank.put(make_entry([3], 100, "c"))
    n = bank.shrink_to_bytes(0, protect_keys=[("m", (1,))], protect_session_ids=["b"])
    assert n == 1 and remaining(bank) == [(1,), (2,)]


def test_shrink_to_bytes_opens_no_span_and_its_plan_has_the_figures(rec):
    bank, log = mk(rec, active={"live"})
    bank.put(make_entry([1], 400, "live"))
    bank.put(make_entry([3], 400, "idle"))
    plan = bank.plan_shrink_to_bytes(100, protect_active=True, protect_keys=[("m", (9,))])
    assert (plan.target_bytes, plan.bytes_before, plan.bytes_after) == (100, 800, 400)
    assert (plan.entries, plan.freed_bytes, plan.protected_keys) == (1, 400, 1)
    assert bank.shrink_to_bytes(100, protect_active=True, reason="dynamic_ceiling",
                                protect_keys=[("m", (9,))]) == 1
    assert rec.spans() == []
    assert log == [("idle", (3,), "dynamic_ceiling")]
    assert bank.stats().evictions == {"dynamic_ceiling": 1}


def test_plan_shrink_to_bytes_is_a_dry_run_of_the_same_choice(rec):
    clock = FakeClock()
    bank, _ = mk(rec, active={"live"}, clock=clock)
    for i, s in enumerate(["live", "a", "b", "c"]):
        clock.advance(1)
        bank.put(make_entry([i], 100 * (i + 1), s))
    plan = bank.plan_shrink_to_bytes(500, protect_active=True)
    assert bank.total_bytes() == 1000 and bank.entry_count() == 4  # untouched
    assert plan.victims == (("m", (1,)), ("m", (2,))) and plan.bytes_after == 500
    assert bank.shrink_to_bytes(500, protect_active=True) == plan.entries
    assert bank.total_bytes() == plan.bytes_after


# -- shrink_for_admission --------------------------------------------------------------


def sibling_bank(rec, active=(), clock=None):
    """Session s: a fork (non-terminal, older) and its terminal; session t: one terminal."""
    clock = clock or FakeClock()
    bank, log = mk(rec, active=active, clock=clock)
    bank.put(make_entry([1, 1, 1], 300, "s"))  # terminal of s (longest)
    clock.advance(1)
    bank.put(make_entry([2, 2], 200, "s"))  # fork of s: non-terminal
    clock.advance(1)
    bank.put(make_entry([3, 3, 3, 3], 500, "t"))  # terminal of t
    return bank, log


def test_sibling_non_terminal_taken_first_even_if_newer(rec):
    bank, log = sibling_bank(rec)
    assert bank.shrink_for_admission(800) == (1, 0)
    assert log == [("s", (2, 2), "prefill_admission_chain")]


def test_terminal_entries_only_in_phase_two(rec):
    bank, log = sibling_bank(rec)
    assert bank.shrink_for_admission(500) == (1, 1)
    assert [t for _, t, _ in log] == [(2, 2), (1, 1, 1)]  # phase 2 is LRU: s's terminal is older
    assert bank.total_bytes() == 500


def test_no_op_when_already_under_target(rec):
    bank, log = sibling_bank(rec)
    assert bank.shrink_for_admission(1000) == (0, 0) and log == []
    assert rec.spans() == [] and bank.stats().evictions == {}


def test_restore_source_of_protect_tokens_is_protected(rec):
    bank, log = sibling_bank(rec)
    # The prompt extends (1,1,1): that entry is its restore source and stays.
    assert bank.shrink_for_admission(0, protect_tokens=[1, 1, 1, 7, 7], model="m") == (1, 1)
    assert remaining(bank) == [(1, 1, 1)] and bank.total_bytes() == 300


def test_one_token_overlap_does_not_protect(rec):
    bank, _ = sibling_bank(rec)
    # Shares only the first token with (1,1,1): not a restore source, so not protected.
    assert bank.shrink_for_admission(0, protect_tokens=[1, 9, 9], model="m") == (1, 2)
    assert bank.total_bytes() == 0


def test_prompt_equal_to_an_entry_does_not_protect_it(rec):
    bank, _ = sibling_bank(rec)
    assert bank.shrink_for_admission(0, protect_tokens=[1, 1, 1], model="m") == (1, 2)


def test_protect_tokens_without_model_protects_restore_source_in_every_model(rec):
    bank, _ = mk(rec)
    bank.put(make_entry([1, 1], 100, None, model="a"))
    bank.put(make_entry([1, 1], 100, None, model="b"))
    bank.put(make_entry([5], 100, None, model="b"))
    # b's (5,) is non-terminal in b's anonymous lineage; both (1, 1) entries are restore sources.
    assert bank.shrink_for_admission(0, protect_tokens=[1, 1, 2]) == (1, 0)
    assert sorted(e.model for e in bank.entries()) == ["a", "b"] and bank.total_bytes() == 200


def test_active_sessions_last_in_phase_two(rec):
    clock = FakeClock()
    bank, log = mk(rec, active={"live"}, clock=clock)
    bank.put(make_entry([1], 300, "live"))  # oldest but active
    clock.advance(1)
    bank.put(make_entry([2], 300, "idle"))
    assert bank.shrink_for_admission(300) == (0, 1)
    assert log[0][0] == "idle"
    assert bank.shrink_for_admission(0) == (0, 1)  # phase 2 takes active ones last, not never


def test_phase_one_lru_order_larger_first_on_ties(rec):
    clock = FakeClock()
    bank, log = mk(rec, clock=clock)
    bank.put(make_entry([9, 9, 9, 9], 1, "s"))  # terminal
    bank.put(make_entry([1], 100, "s"))
    bank.put(make_entry([2], 200, "s"))  # same instant, larger
    clock.advance(1)
    bank.put(make_entry([3], 50, "s"))
    assert bank.shrink_for_admission(0) == (3, 1)
    assert [t for _, t, _ in log] == [(2,), (1,), (3,), (9, 9, 9, 9)]


def test_anonymous_entries_form_one_lineage_per_model(rec):
    bank, log = mk(rec)
    bank.put(make_entry([1, 2, 3], 100, None))  # anonymous terminal in model m
    bank.put(make_entry([4], 100, None))  # anonymous non-terminal in model m
    bank.put(make_entry([5], 100, None, model="m2"))  # terminal of m2's lineage
    assert bank.shrink_for_admission(200) == (1, 0)
    assert log[0][1] == (4,)


def test_live_ref_of_active_session_is_skipped_idle_one_is_taken(rec):
    clock = FakeClock()
    bank, log = mk(rec, active={"live"}, clock=clock)
    bank.put(make_entry([1], 400, "live", live_ref=True))  # frees nothing while running
    clock.advance(1)
    bank.put(make_entry([2], 400, "idle", live_ref=True))  # last holder: frees its bytes
    assert bank.shrink_for_admission(0) == (0, 1)
    assert [t for _, t, _ in log] == [(2,)] and bank.total_bytes() == 400


def test_reason_reaches_hook_and_stats_and_no_span_opens(rec):
    bank, log = sibling_bank(rec)
    plan = bank.plan_shrink_for_admission(500, model="m", protect_tokens=[3, 3, 3, 3, 0])
    assert (plan.non_terminal, plan.terminal) == (1, 1)
    assert (plan.bytes_before, plan.bytes_after, plan.target_bytes) == (1000, 500, 500)
    assert plan.protected_keys == 1
    assert bank.shrink_for_admission(500, reason="prefill_admission", model="m",
                                     protect_tokens=[3, 3, 3, 3, 0]) == (1, 1)
    assert {r for *_, r in log} == {"prefill_admission"}
    assert bank.stats().evictions == {"prefill_admission": 2}
    assert rec.spans() == []


def test_shrink_for_admission_protect_active_never_takes_active_sessions(rec):
    clock = FakeClock()
    bank, log = mk(rec, active={"live"}, clock=clock)
    bank.put(make_entry([1, 1], 300, "live"))  # live's terminal, oldest
    bank.put(make_entry([5], 100, "live"))  # live's non-terminal
    clock.advance(1)
    bank.put(make_entry([2], 300, "idle"))
    assert bank.shrink_for_admission(0, protect_active=True) == (0, 1)
    assert log == [("idle", (2,), "prefill_admission_chain")]
    assert bank.total_bytes() == 400  # above the target: the active session is spared
    # Without the flag (the chain shed) the active session goes too: non-terminal first.
    assert bank.shrink_for_admission(0) == (1, 1)
    assert [t for _, t, _ in log[1:]] == [(5,), (1, 1)]


def test_shrink_for_admission_protect_session_ids(rec):
    bank, _ = sibling_bank(rec)
    assert bank.shrink_for_admission(0, protect_session_ids=["s"]) == (0, 1)
    assert remaining(bank) == [(1, 1, 1), (2, 2)]


# -- dry runs for admission ---------------------------------------------------------------


def admission_bank(rec):
    """Bank 3.5 units: idle a (old terminal 100, newer fork 50), active b (fork 100,
    terminal 100 = the prompt's restore source)."""
    clock = FakeClock()
    bank, log = mk(rec, active={"b"}, clock=clock)
    bank.put(make_entry([2] * 4, 100, "a"))
    clock.advance(1)
    bank.put(make_entry([1] * 2, 50, "a"))
    clock.advance(1)
    bank.put(make_entry([3] * 2, 100, "b"))
    clock.advance(1)
    bank.put(make_entry([4] * 3, 100, "b"))
    return bank, log


PROMPT = (4, 4, 4, 7, 7)


def test_figures_are_what_each_admission_step_could_free_at_most(rec):
    bank, log = admission_bank(rec)
    f = bank.figures("m", PROMPT)
    assert f == BankFigures(total_bytes=350, max_bytes=bank.max_bytes, lru_freeable_bytes=150,
                            lru_freeable_entries=2, chain_freeable_bytes=100,
                            chain_freeable_entries=1, restore_prefix_tokens=3)
    assert bank.entry_count() == 4 and log == []  # nothing was taken
    # A pinned session is spared by both steps.
    f = bank.figures("m", PROMPT, protect_session_ids=["a"])
    assert (f.lru_freeable_bytes, f.chain_freeable_bytes) == (0, 100)
    assert bank.figures("other", PROMPT).restore_prefix_tokens == 0


def test_preview_freed_plans_on_top_of_what_earlier_steps_took(rec):
    bank, log = admission_bank(rec)
    n, freed, keys = bank.preview_freed(
        0, mode=ShrinkMode.FOR_ADMISSION.value, protect_active=True, protect_tokens=PROMPT,
        model="m", protect_session_ids=(), assume_evicted=())
    assert (n, freed, keys) == (2, 150, (("m", (1, 1)), ("m", (2, 2, 2, 2))))  # fork first
    n, freed, keys2 = bank.preview_freed(
        0, mode=ShrinkMode.FOR_ADMISSION.value, protect_active=False, protect_tokens=PROMPT,
        model="m", protect_session_ids=(), assume_evicted=keys)
    assert (n, freed, keys2) == (1, 100, (("m", (3, 3)),))  # the restore source stays
    n, freed, keys3 = bank.preview_freed(
        200, mode=ShrinkMode.TO_BYTES.value, protect_active=True, protect_tokens=None,
        model=None, protect_session_ids=(), assume_evicted=())
    assert (n, freed, keys3) == (2, 150, (("m", (2, 2, 2, 2)), ("m", (1, 1))))  # plain LRU
    assert bank.entry_count() == 4 and log == []


def test_plan_for_admission_matches_execution_and_assume_evicted(rec):
    bank, _ = sibling_bank(rec)
    plan = bank.plan_shrink_for_admission(500)
    assert bank.entry_count() == 3
    assert (plan.non_terminal, plan.terminal, plan.bytes_after) == (1, 1, 500)
    # Planned as if t's entry were gone: s's fork is still phase 1, nothing more needed.
    p2 = bank.plan_shrink_for_admission(300, assume_evicted=[("m", (3, 3, 3, 3))])
    assert (p2.bytes_before, p2.non_terminal, p2.terminal, p2.bytes_after) == (500, 1, 0, 300)
    # With s's terminal assumed gone, its fork becomes terminal.
    p3 = bank.plan_shrink_for_admission(0, assume_evicted=[("m", (1, 1, 1))])
    assert (p3.non_terminal, p3.terminal) == (0, 2)
    assert bank.shrink_for_admission(500) == (plan.non_terminal, plan.terminal)
    assert bank.total_bytes() == plan.bytes_after
