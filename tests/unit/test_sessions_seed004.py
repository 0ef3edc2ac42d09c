"""Every fact of seeds/004 (MTPLX admission policies, five layers of defense) as a named test.

The layers are plans (memory.plans) that the governor runs; the bank only evicts.
The cascade test runs the production order through Governor.tick() and
Governor.admit() on a real SessionBank and the real Executor.
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import pytest
from opentelemetry.sdk.metrics import MeterProvider

from memory.actions import (
    REASON_ADMISSION_CHAIN,
    REASON_DYNAMIC_CEILING,
    REASON_OS_CRITICAL,
    REASON_OS_WARNING,
    REASON_PREFILL_ADMISSION,
    ShrinkMode,
    ShrinkSessionCache,
)
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.governor import Governor
from memory.levels import PressureLevel, Tier
from memory.plans.admission import (
    BINDING_HYPER_CAP,
    AdmissionInputs,
    AdmissionRequest,
    AdmissionSettings,
    SchedulerMode,
    Verdict,
    admission_plan,
    decide,
    gate,
    validate_scheduler_settings,
)
from memory.plans.bank_ceiling import plan_hold_to_ceiling
from memory.plans.steps import Snapshot
from memory.plans.tick import PolicyState, tick_plan
from memory.readings import MemoryReadings
from memory.recording import Recorder
from memory.views import BankFigures, QueueView
from sessions.admission import AdmissionQueue, QueueOutcome
from sessions.bank import SessionBank
from telemetry import names
from telemetry.instruments import Instruments
from tests.support.clock import FakeClock
from tests.support.os_guard import PressureGuard
from tests.support.plans import NoEngines, drive
from tests.support.sessions import SpanRecorder, make_entry

GiB = 1 << 30
MiB = 1 << 20
# Ceiling 19 GiB, threshold (the sustained-pressure limit, the hard mark) 16 GiB.
CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20, soft_fraction=0.7,
                      hard_fraction=0.8)


def bank_with(active=(), **kw):
    clock = FakeClock()
    bank = SessionBank(clock=clock, active_sessions=lambda: set(active), max_entries=100,
                       max_bytes=64 * GiB, per_session_max_bytes=64 * GiB, **kw)
    return bank, clock


def request_for(prompt) -> AdmissionRequest:
    """One missed token and 3 to decode at 128 MiB each, plus the chunk's 4 rows: 1 GiB."""
    return AdmissionRequest(model="m", prompt_tokens=tuple(prompt), max_tokens=3,
                            kv_bytes_per_token=128 * MiB, attention_heads=0)



class Process:
    """Scripted readings: `other` plus whatever the bank holds, and the OS's report."""

    def __init__(self, bank: SessionBank, other: int, os_pressure: str | None = None) -> None:
        self.bank, self.other, self.os_pressure = bank, other, os_pressure

    def read(self, mlx_sample=None) -> MemoryReadings:
        return MemoryReadings(process_bytes=self.other + self.bank.total_bytes(),
                              system_total_bytes=64 * GiB, mlx_pool_bytes=0,
                              os_pressure=self.os_pressure)


class Desk:
    """The admission side: a queue view with `in_flight` admitted requests."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.paused: PressureLevel | None = None

    def set_paused(self, level):
        self.paused = level

    def queue_view(self) -> QueueView:
        return QueueView(in_flight=self.in_flight)

    def reserved_bytes(self) -> int:
        return 0

    def pinned_sessions(self) -> tuple[str, ...]:
        return ()


def governed(bank: SessionBank, rec: SpanRecorder, other: int, **settings):
    process, desk = Process(bank, other), Desk()
    recorder = Recorder(inst=Instruments(MeterProvider().get_meter("t")), tracer=rec.tracer)
    governor = Governor(CONFIG, Executor(process, NoEngines(), bank=bank, desk=desk),
                        recorder=recorder, admission=AdmissionSettings(**settings))
    return governor, process, desk


def shrink_spans(rec):
    return [(s.attributes[names.ATTR_REASON], s.attributes[names.ATTR_SHRINK_MODE],
             s.attributes[names.ATTR_PROTECT_ACTIVE], s.attributes[names.ATTR_TARGET])
            for s in rec.spans(names.SPAN_BANK_SHRINK)]


# Layer 1: memory-pressure guard -------------------------------------------------------------


def test_seed004_pressure_guard_responds_to_os_pressure_with_shrink_to_bytes():
    # The OS starts swapping (macOS "warning"): the tick's guard shrinks the bank to half
    # its budget with shrink_to_bytes, active sessions protected.
    snap = Snapshot(readings=MemoryReadings(process_bytes=GiB, system_total_bytes=64 * GiB,
                                            os_pressure="warning"),
                    session_bytes=GiB, bank_max_bytes=GiB)
    d = drive(tick_plan(PolicyState(), MemoryConfig(), 0.0), [snap])
    assert [a for a in d.actions if isinstance(a, ShrinkSessionCache)] == [ShrinkSessionCache(
        target_bytes=GiB // 2, protect_active=True, reason=REASON_OS_WARNING,
        mode=ShrinkMode.TO_BYTES)]
    (a,) = PressureGuard().observe("warning", 0.0, budget_bytes=GiB)
    assert (a.target_bytes, a.protect_active) == (GiB // 2, True)


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
    # Target to keep the bank under 2 GiB
    evicted = bank.shrink_to_bytes(target_bytes=2 * 1024**3, protect_active=True)
    print(f"Evicted {evicted} entries to respect memory pressure")
    assert isinstance(evicted, int) and evicted == 1 and bank.total_bytes() == 2 * GiB


# Layer 2: prefill admission shed ---------------------------------------------------------------


def admission_snap(usage: int) -> Snapshot:
    return Snapshot(readings=MemoryReadings(process_bytes=usage, system_total_bytes=64 * GiB),
                    bank=BankFigures(total_bytes=3 * GiB, max_bytes=64 * GiB,
                                     lru_freeable_bytes=GiB, restore_prefix_tokens=3))


def test_seed004_prefill_shed_triggers_only_when_projection_exceeds_the_limit():
    prompt = (3, 3, 3, 4)
    healthy = drive(admission_plan(request_for(prompt), CONFIG, AdmissionSettings(),
                                   PressureLevel.OK), [admission_snap(15 * GiB)])
    assert healthy.result.verdict is Verdict.ADMIT and healthy.actions == []  # 16 <= 16
    over = drive(admission_plan(request_for(prompt), CONFIG, AdmissionSettings(),
                                PressureLevel.OK),
                 [admission_snap(16 * GiB), admission_snap(16 * GiB)])
    assert over.actions[0] == ShrinkSessionCache(
        target_bytes=2 * GiB, protect_active=True, reason=REASON_PREFILL_ADMISSION,
        mode=ShrinkMode.FOR_ADMISSION, protect_tokens=prompt, model="m")  # 3 - (17 - 16)
    inputs = AdmissionInputs(usage_bytes=GiB, ceiling_bytes=10 * GiB, threshold_bytes=9 * GiB,
                             prompt_tokens=1000, kv_bytes_per_token=1024)
    assert not decide(inputs).needs_relief
    assert decide(replace(inputs, usage_bytes=9 * GiB)).needs_relief


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
    # Assume the upcoming request needs 1 GiB more than the current budget
    non_term, term = bank.shrink_for_admission(
        target_bytes=bank.total_nbytes + 1 * 1024**3,
        protect_tokens=[123, 456, 789],   # tokens that must stay intact
        reason="prefill_admission_chain",
    )
    print(f"Admission shed removed {non_term} non-terminal and {term} terminal entries")
    assert (non_term, term) == (0, 0) and bank.entry_count() == 1


# Layer 3: admission chain shed ---------------------------------------------------------------------


@pytest.mark.parametrize("enabled", [True, False])
async def test_seed004_chain_shed_flag_controls_shrink_for_admission(enabled):
    rec = SpanRecorder()
    bank, clock = bank_with(active={"b"})
    bank.put(make_entry([1], GiB, "a"))  # idle: the prefill shed takes it
    clock.advance(1)
    bank.put(make_entry([2], GiB, "b"))  # active non-terminal: only the chain shed
    clock.advance(1)
    bank.put(make_entry([3, 3, 3], GiB, "b"))  # the prompt's restore source
    # 17 + 3 = 20 GiB, + 1 GiB for the request = 21: over the 19 GiB ceiling.
    governor, _, _ = governed(bank, rec, 17 * GiB, chain_shed=enabled)
    r = await governor.admit(request_for([3, 3, 3, 4]))
    assert r.admitted is enabled
    if enabled:
        # The prefill shed's target is 3 - (21 - 16) -> 0; the chain's the larger 2 - (20 - 19).
        assert shrink_spans(rec) == [
            (REASON_PREFILL_ADMISSION, "shrink_for_admission", True, 0),
            (REASON_ADMISSION_CHAIN, "shrink_for_admission", False, GiB)]
        assert sorted(e.tokens for e in bank.entries()) == [(3, 3, 3)]
    else:  # without the chain shed every other relief together cannot reach the ceiling
        assert r.verdict is Verdict.REJECT and r.tried == ()
        assert bank.entry_count() == 3 and shrink_spans(rec) == []


# Layer 4: hyper mode -------------------------------------------------------------------------------------


async def test_seed004_hyper_mode_caps_admission_at_exactly_one():
    assert gate(PressureLevel.OK, 0, mode=SchedulerMode.HYPER) is None
    assert gate(PressureLevel.OK, 1, mode=SchedulerMode.HYPER) == (Verdict.WAIT,
                                                                    BINDING_HYPER_CAP)
    q = AdmissionQueue(mode=SchedulerMode.HYPER)
    first = await q.acquire()
    second = await q.acquire(0.01)
    assert first.admitted and second.outcome is QueueOutcome.TIMEOUT and q.in_flight == 1
    first.slot.release()


def test_seed004_hyper_mode_rejects_multi_admission_launch_flags():
    with pytest.raises(ValueError):
        validate_scheduler_settings("hyper", 2)
    assert validate_scheduler_settings("hyper", 1).admission_cap == 1


# Layer 5: dynamic ceiling ------------------------------------------------------------------------------


def test_seed004_dynamic_ceiling_tolerates_overage_when_only_active_entries_remain():
    bank, _ = bank_with(active={"run"})
    bank.put(make_entry([1], 400, "run"))
    bank.put(make_entry([2], 400, "run"))
    hold = plan_hold_to_ceiling(bank.total_bytes(), 0, slack_bytes=0)
    assert hold == ShrinkSessionCache(0, protect_active=True, reason=REASON_DYNAMIC_CEILING)
    assert bank.shrink_to_bytes(hold.target_bytes, protect_active=hold.protect_active) == 0
    assert bank.total_bytes() == 800


# Workflow cascade ---------------------------------------------------------------------------------------


async def test_seed004_cascade_order_and_spans():
    rec = SpanRecorder()
    bank, clock = bank_with(active={"b"}, tracer=rec.tracer)
    bank.put(make_entry([1], GiB, "a"))
    bank.put(make_entry([2], GiB, "b"))
    bank.put(make_entry([3, 3], GiB, "b"))
    governor, process, desk = governed(bank, rec, 2 * GiB)
    # 1. system pressure (critical) -> shrink_to_bytes: global LRU eviction of idle sessions
    process.os_pressure = "critical"
    tick = await governor.tick()
    assert tick.level is PressureLevel.OK and [e.session_id for e in bank.entries()] == ["b", "b"]
    # The conversation goes on: c adds a terminal, then a newer non-terminal fork.
    process.os_pressure = None
    clock.advance(1)
    bank.put(make_entry([5, 5], GiB, "c"))
    clock.advance(1)
    bank.put(make_entry([6], GiB, "c"))
    # 2. prefill projection -> shrink_for_admission, non-terminal first (17 + 4 + 1 = 22);
    # 3. the admission chain -> shrink_for_admission with the larger ceiling target.
    process.other = 17 * GiB
    r = await governor.admit(request_for([3, 3, 9]))
    assert r.verdict is Verdict.ADMIT_AFTER_SHEDDING
    assert [(o.non_terminal, o.terminal) for o in r.outcomes] == [(1, 1), (1, 0)]
    assert [e.tokens for e in bank.entries()] == [(3, 3)]  # the restore source survives
    assert shrink_spans(rec) == [
        (REASON_OS_CRITICAL, "shrink_to_bytes", True, 0),
        (REASON_PREFILL_ADMISSION, "shrink_for_admission", True, 0),
        (REASON_ADMISSION_CHAIN, "shrink_for_admission", False, GiB)]
    assert rec.spans(names.SPAN_BANK_EVICT) == []  # the bank opened none of its own
    # 4. hyper mode overrides the rest: with one admitted, the next waits, nothing shed.
    governor.admission_settings = AdmissionSettings(scheduler_mode=SchedulerMode.HYPER,
                                                    admission_cap=1)
    bank.put(make_entry([7], GiB, "d"))
    desk.in_flight = 1
    r = await governor.admit(request_for([3, 3, 9]))
    assert r.verdict is Verdict.WAIT and r.binding == BINDING_HYPER_CAP
    assert bank.entry_count() == 2 and len(shrink_spans(rec)) == 3
