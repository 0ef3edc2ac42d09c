"""run_admission (Generate) and the dry run (Admit) against a real bank and a scripted process.

The scripted process models MLX: usage = other + bank bytes + pool; an evicted
entry's bytes land in the pool (arrays freed go to MLX's buffer cache) until the
pool is reclaimed.
"""

from __future__ import annotations

from dataclasses import replace

from sessions.admission import (
    BINDING_CEILING,
    AdmissionInputs,
    ShedKind,
    Verdict,
    bank_figures,
    decide,
    preview_shed,
    run_admission,
)
from sessions.bank import SessionBank
from sessions.testing import FakeClock, SpanRecorder, make_entry
from telemetry import names

GiB = 1 << 30
MiB = 1 << 20
B2 = (4,) * 30  # the active session's terminal: the prompt's restore source
PROMPT = B2 + (7,) * 2048


class Process:
    def __init__(self, other: int, pool: int) -> None:
        self.other, self.pool, self.bank = other, pool, None
        self.calls: list[str] = []

    def on_evict(self, entries, reason) -> None:
        self.pool += sum(e.nbytes for e in entries)

    def usage(self) -> int:
        return self.other + self.bank.total_bytes() + self.pool

    def reclaim_pool(self) -> int:
        self.calls.append("reclaim")
        freed, self.pool = self.pool, 0
        return freed

    def remeasure(self) -> int:
        self.calls.append("measure")
        return self.usage()


def setup(active=("b",), pool=GiB // 2, tracer=None):
    """Bank 3 GiB: idle a1, a2 (0.5 each), active b1 (1, non-terminal), b2 (1, terminal)."""
    proc = Process(other=4 * GiB + GiB // 2, pool=pool)
    clock = FakeClock()
    bank = SessionBank(clock=clock, active_sessions=lambda: set(active),
                       on_evict=proc.on_evict, max_bytes=64 * GiB, per_session_max_bytes=64 * GiB,
                       tracer=tracer)
    proc.bank = bank
    bank.put(make_entry((1,) * 10, GiB // 2, "a"))
    clock.advance(1)
    bank.put(make_entry((2,) * 20, GiB // 2, "a"))
    clock.advance(1)
    bank.put(make_entry((3,) * 10, GiB, "b"))
    clock.advance(1)
    bank.put(make_entry(B2, GiB, "b"))
    return bank, proc


def inputs_for(bank, proc, **kw) -> AdmissionInputs:
    figures = bank_figures(bank, "m", PROMPT)
    base = AdmissionInputs(
        usage_bytes=proc.usage(), pool_bytes=proc.pool, ceiling_bytes=10 * GiB + GiB // 2,
        threshold_bytes=8 * GiB, prompt_tokens=len(PROMPT),
        reusable_prefix_tokens=figures.restore_prefix_tokens, kv_bytes_per_token=MiB,
        bank=figures,
    )
    return replace(base, **kw)


def test_bank_figures_dry_run():
    bank, proc = setup()
    f = bank_figures(bank, "m", PROMPT)
    assert (f.total_bytes, f.lru_freeable_bytes, f.chain_freeable_bytes) == (3 * GiB, GiB, GiB)
    assert (f.lru_freeable_entries, f.chain_freeable_entries, f.restore_prefix_tokens) == (2, 1, 30)
    assert bank.entry_count() == 4


def test_admit_dry_run_reports_what_would_be_shed_without_shedding():
    bank, proc = setup()
    d = decide(inputs_for(bank, proc))
    assert proc.usage() == 8 * GiB and d.verdict is Verdict.ADMIT_AFTER_SHEDDING
    p = preview_shed(d, bank, model="m", prompt_tokens=PROMPT)
    assert p.pool_bytes == GiB // 2 and p.lru.victims == (("m", (1,) * 10), ("m", (2,) * 20))
    assert p.chain.victims == (("m", (3,) * 10),) and p.chain.non_terminal == 1
    assert (p.entries, p.bank_bytes, p.bytes) == (3, 2 * GiB, 2 * GiB + GiB // 2)
    assert bank.entry_count() == 4 and proc.pool == GiB // 2 and proc.calls == []


def test_generate_executes_ladder_in_order_with_exact_bytes():
    rec = SpanRecorder()
    bank, proc = setup(tracer=rec.tracer)
    d = decide(inputs_for(bank, proc))
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m",
                        prompt_tokens=PROMPT, tracer=rec.tracer)
    assert out.admitted and out.verdict is Verdict.ADMIT_AFTER_SHEDDING
    assert [(s.kind, s.usage_before, s.usage_after) for s in out.steps] == [
        (ShedKind.RECLAIM_POOL, 8 * GiB, 7 * GiB + GiB // 2),
        (ShedKind.SHRINK_TO_BYTES, 7 * GiB + GiB // 2, 6 * GiB + GiB // 2),
        (ShedKind.SHRINK_FOR_ADMISSION, 6 * GiB + GiB // 2, 5 * GiB + GiB // 2),
    ]
    lru, chain = out.steps[1], out.steps[2]
    assert (lru.target_bytes, lru.entries_evicted, lru.pool_freed) == (GiB + GiB // 2, 2, GiB)
    assert (chain.target_bytes, chain.non_terminal, chain.terminal) == (GiB + GiB // 2, 1, 0)
    assert out.usage_bytes == 5 * GiB + GiB // 2 and out.projected_bytes == 7 * GiB + GiB // 2
    assert [e.tokens for e in bank.entries()] == [B2]  # restore source kept
    assert proc.calls == ["reclaim", "measure", "reclaim", "measure", "reclaim", "measure"]
    (span,) = rec.spans(names.SPAN_ADMISSION_SHED)
    assert span.attributes[names.ATTR_ENTRIES_EVICTED] == 3
    assert span.attributes[names.ATTR_BYTES_FREED] == 2 * GiB + GiB // 2
    (lru_span,) = rec.spans(names.SPAN_BANK_SHRINK)
    (chain_span,) = rec.spans(names.SPAN_BANK_SHRINK_FOR_ADMISSION)
    assert lru_span.parent.span_id == span.context.span_id  # nested under the shed span
    assert lru_span.attributes[names.ATTR_REASON] == "prefill_admission"
    assert chain_span.attributes[names.ATTR_REASON] == "prefill_admission_chain"
    assert rec.spans(names.SPAN_ADMISSION_REFUSAL) == []


def test_generate_stops_as_soon_as_it_fits():
    bank, proc = setup()
    d = decide(inputs_for(bank, proc, threshold_bytes=9 * GiB + GiB // 2))
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m", prompt_tokens=PROMPT)
    assert out.admitted and [s.kind for s in out.steps] == [ShedKind.RECLAIM_POOL]
    assert bank.entry_count() == 4


def test_reality_better_than_plan_skips_bank_steps():
    bank, proc = setup()
    d = decide(inputs_for(bank, proc, pool_bytes=0))  # plan did not count the pool
    assert [s.kind for s in d.shed][0] is ShedKind.SHRINK_TO_BYTES
    proc.pool = 3 * GiB  # reclaim frees more than planned
    proc.other -= 2 * GiB + GiB // 2
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m", prompt_tokens=PROMPT)
    assert out.admitted and [s.kind for s in out.steps] == [ShedKind.RECLAIM_POOL]
    assert bank.entry_count() == 4


def test_chain_disabled_runs_no_chain_step():
    bank, proc = setup()
    d = decide(inputs_for(bank, proc, chain_shed_enabled=False))
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m", prompt_tokens=PROMPT)
    assert out.admitted and [s.kind for s in out.steps] == [ShedKind.RECLAIM_POOL, ShedKind.SHRINK_TO_BYTES]
    assert sorted(e.tokens for e in bank.entries()) == [(3,) * 10, B2]
    assert out.projected_bytes == 8 * GiB + GiB // 2  # over the threshold, under the ceiling


def test_refusal_past_ceiling_keeps_the_bank_and_records_a_span():
    bank, proc = setup()
    rec = SpanRecorder()
    d = decide(inputs_for(bank, proc, ceiling_bytes=9 * GiB, kv_bytes_per_token=MiB * 5 // 2))
    assert d.verdict is Verdict.REJECT and d.request_bytes == 5 * GiB
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m",
                        prompt_tokens=PROMPT, tracer=rec.tracer)
    assert not out.admitted and out.verdict is Verdict.REJECT and out.binding == BINDING_CEILING
    assert [s.kind for s in out.steps] == [ShedKind.RECLAIM_POOL]  # non-destructive only
    assert bank.entry_count() == 4
    assert out.numbers["shortfall_bytes"] == 7 * GiB + GiB // 2 + 5 * GiB - 9 * GiB
    (span,) = rec.spans(names.SPAN_ADMISSION_REFUSAL)
    assert span.attributes[names.ATTR_CEILING] == 9 * GiB
    assert span.attributes[names.ATTR_PROJECTED] == 12 * GiB + GiB // 2


def test_refusal_after_shedding_when_measurement_disappoints():
    bank, proc = setup()
    d = decide(inputs_for(bank, proc, ceiling_bytes=8 * GiB + GiB // 4))
    assert d.admits
    proc.other += GiB  # something grew meanwhile
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m", prompt_tokens=PROMPT)
    assert not out.admitted and out.binding == BINDING_CEILING and out.retry_after_s == 2.0


def test_wait_and_queue_full_decisions_do_nothing():
    bank, proc = setup()
    d = decide(inputs_for(bank, proc, level=2, admitted_in_flight=1))
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m", prompt_tokens=PROMPT)
    assert not out.admitted and out.verdict is Verdict.WAIT and proc.calls == []
    rec = SpanRecorder()
    d = decide(inputs_for(bank, proc, level=2, admitted_in_flight=1, queue_limit=0))
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, tracer=rec.tracer)
    assert out.verdict is Verdict.REJECT and out.error_reason == "QUEUE_FULL" and proc.calls == []
    assert len(rec.spans(names.SPAN_ADMISSION_REFUSAL)) == 1


def test_admit_verdict_needs_no_measurement():
    bank, proc = setup(pool=0)
    d = decide(inputs_for(bank, proc, threshold_bytes=10 * GiB))
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure)
    assert out.admitted and out.verdict is Verdict.ADMIT and out.steps == () and proc.calls == []


def test_pinned_sessions_passed_as_protected_are_never_shed():
    bank, proc = setup()
    d = decide(replace(inputs_for(bank, proc), bank=bank_figures(bank, "m", PROMPT,
                                                                 protect_session_ids=["a"])))
    out = run_admission(d, bank, proc.reclaim_pool, proc.remeasure, model="m",
                        prompt_tokens=PROMPT, protect_session_ids=["a"])
    assert out.admitted and {e.session_id for e in bank.entries()} == {"a", "b"}
    assert (3,) * 10 not in {e.tokens for e in bank.entries()}
