"""admission_plan: the production cascade's order and exact targets, driven by scripted
snapshots (tests/support/plans.py), then live on a real SessionBank through the real
Executor, run by Governor.admit().

The scripted world: ceiling 19 GiB and threshold 16 GiB (tier custom 20 GiB, hard
fraction 0.8, the 0.95 pre-chunk abort margin). The request needs 4 GiB: 2048 missed
tokens x 1 MiB of KV plus the 512-token chunk's activations (512 x 4 x 1 MiB; no
attention-score term with attention_heads=0). Engines: the request's own model `m`
(4 GiB, busy), `idle1` (2 GiB, least recently used), `idle2` (1 GiB), `pinned` (1 GiB).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from opentelemetry.sdk.metrics import MeterProvider

from memory.actions import (
    MEASURE_ADMISSION,
    MEASURE_AFTER_ADMISSION_STEP,
    REASON_ADMISSION_CHAIN,
    REASON_ADMISSION_EVICT,
    REASON_ADMISSION_RECLAIM,
    REASON_GUARD_BUDGET,
    REASON_PREFILL_ADMISSION,
    EvictModel,
    Outcome,
    PressureReclaim,
    Refuse,
    ShrinkMode,
    ShrinkSessionCache,
)
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.governor import Governor
from memory.levels import PressureLevel, Tier
from memory.plans.admission import (
    BINDING_CEILING,
    BINDING_HYPER_CAP,
    BINDING_PAUSED_AT_SOFT,
    BINDING_PREFILL_EXCEEDS_CEILING,
    BINDING_QUEUE_FULL,
    BINDING_THRESHOLD,
    RETRY_AFTER_MEMORY_S,
    RETRY_AFTER_WAIT_S,
    AdmissionRequest,
    AdmissionSettings,
    SchedulerMode,
    Verdict,
    admission_plan,
)
from memory.plans.steps import AdmissionQuery, Execute, Measure, Snapshot
from memory.readings import MemoryReadings
from memory.recording import Recorder
from memory.views import BankFigures, EngineState, EngineView, QueueView
from sessions.bank import SessionBank
from telemetry import names
from telemetry.instruments import Instruments
from tests.support.clock import FakeClock
from tests.support.plans import NoEngines, default_outcome, drive
from tests.support.sessions import SpanRecorder, make_entry

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10
B2 = (4,) * 30  # the active session's terminal: the prompt's restore source
PROMPT = B2 + (7,) * 2048
CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=20, soft_fraction=0.7,
                      hard_fraction=0.8)
CEILING, THRESHOLD = 19 * GiB, 16 * GiB
NEED = 4 * GiB
REQUEST = AdmissionRequest(model="m", prompt_tokens=PROMPT, max_tokens=0,
                           kv_bytes_per_token=MiB, attention_heads=0)
QUERY = AdmissionQuery("m", PROMPT)
ENGINES = (
    EngineView("m", measured_bytes=4 * GiB, active_requests=1, last_used=5.0),
    EngineView("idle1", measured_bytes=2 * GiB, last_used=1.0),
    EngineView("idle2", measured_bytes=1 * GiB, last_used=2.0),
    EngineView("pinned", pinned=True, measured_bytes=1 * GiB, last_used=0.0),
)
READY = ("m", "idle1", "idle2", "pinned")
PINNED_SESSIONS = ("pinned-session",)


def gib(x: float) -> int:
    return int(x * GiB)


def snap(usage: float, bank: float, *, pool: float = 0, max_bytes: float = 64,
         lru: float = 2, chain: float = 2, engines=ENGINES, queue: QueueView | None = None,
         reserved: int = 0) -> Snapshot:
    return Snapshot(
        readings=MemoryReadings(process_bytes=gib(usage), system_total_bytes=64 * GiB,
                                mlx_pool_bytes=gib(pool)),
        engines=engines,
        session_bytes=gib(bank), bank_max_bytes=gib(max_bytes),
        bank=BankFigures(total_bytes=gib(bank), max_bytes=gib(max_bytes),
                         lru_freeable_bytes=gib(lru), chain_freeable_bytes=gib(chain),
                         restore_prefix_tokens=len(B2)),
        reserved_bytes=reserved, queue=queue, pinned_sessions=PINNED_SESSIONS,
    )


def reclaims() -> tuple[PressureReclaim, ...]:
    return tuple(PressureReclaim(m, REASON_ADMISSION_RECLAIM, wait=True) for m in READY)


def guard(target: float) -> ShrinkSessionCache:
    return ShrinkSessionCache(gib(target), protect_active=True, reason=REASON_GUARD_BUDGET,
                              mode=ShrinkMode.TO_BYTES, protect_session_ids=PINNED_SESSIONS)


def prefill_shed(target: float) -> ShrinkSessionCache:
    return ShrinkSessionCache(gib(target), protect_active=True, reason=REASON_PREFILL_ADMISSION,
                              mode=ShrinkMode.FOR_ADMISSION, protect_tokens=PROMPT, model="m",
                              protect_session_ids=PINNED_SESSIONS)


def chain_shed(target: float) -> ShrinkSessionCache:
    return ShrinkSessionCache(gib(target), protect_active=False, reason=REASON_ADMISSION_CHAIN,
                              mode=ShrinkMode.FOR_ADMISSION, protect_tokens=PROMPT, model="m",
                              protect_session_ids=PINNED_SESSIONS)


def evict(model: str, predicted: float) -> EvictModel:
    return EvictModel(model, REASON_ADMISSION_EVICT, predicted_bytes=gib(predicted))


MEASURE = Measure(MEASURE_ADMISSION, QUERY)
REMEASURE = Measure(MEASURE_AFTER_ADMISSION_STEP, QUERY)


@dataclass
class World:
    """Outcomes: the first pool reclaim of `m` frees `pool`; each shrink frees the next
    scripted (entries, bytes); an eviction frees its predicted bytes unless skipped."""

    pool: float = 1
    shrinks: list[tuple[int, float]] = field(default_factory=list)
    skip_evictions: bool = False
    reclaimed: bool = False

    def __call__(self, action) -> Outcome:
        if isinstance(action, PressureReclaim):
            freed = 0
            if action.model_id == "m" and not self.reclaimed:
                self.reclaimed, freed = True, gib(self.pool)
            return Outcome(action, accepted=True, bytes_freed=freed)
        if isinstance(action, ShrinkSessionCache):
            entries, freed = self.shrinks.pop(0)
            return Outcome(action, entries=entries, bytes_freed=gib(freed))
        if isinstance(action, EvictModel) and self.skip_evictions:
            return Outcome(action, skipped="busy")
        return default_outcome(action)


def full_cascade_snapshots(last_usage: float = 12.25) -> list[Snapshot]:
    return [
        snap(18, 6, pool=1, max_bytes=5),  # projected 22: over the ceiling
        snap(17, 6, max_bytes=5),  # after the pool reclaim
        snap(16, 5, max_bytes=5),  # after the guard
        snap(15.5, 4.5, max_bytes=5),  # after the prefill admission shed
        snap(15.25, 4.25, max_bytes=5),  # after the admission-chain shed
        snap(last_usage, 4.25, max_bytes=5),  # after the evictions
    ]


def full_cascade_world(**kw) -> World:
    return World(pool=1, shrinks=[(1, 1), (1, 0.5), (1, 0.25)], **kw)


# -- the production order, every step ----------------------------------------------------------


def test_full_cascade_production_order_and_exact_targets():
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              full_cascade_snapshots(), full_cascade_world())
    assert d.steps == [
        MEASURE,
        # 1. the pool, on every ready engine (busy and pinned ones included), waiting
        Execute(reclaims()),
        REMEASURE,
        # 2. the guard: the bank (6 GiB) is over its 5 GiB budget
        Execute((guard(5),)),
        Execute(reclaims()),  # freed snapshots land in the pool: drain before measuring
        REMEASURE,
        # 3. the prefill admission shed: bank 5 - (16 + 4 - 16 threshold) = 1 GiB
        Execute((prefill_shed(1),)),
        Execute(reclaims()),
        REMEASURE,
        # 4. the admission-chain shed: bank 4.5 - (15.5 + 4 - 19 ceiling) = 4 GiB, larger
        Execute((chain_shed(4),)),
        Execute(reclaims()),
        REMEASURE,
        # 5. idle non-pinned models, LRU first, never the request's own model
        Execute((evict("idle1", 2), evict("idle2", 1))),
        REMEASURE,
    ]
    r = d.result
    assert r.decision.request_bytes == NEED and r.decision.projected_bytes == gib(22)
    assert r.verdict is Verdict.ADMIT_AFTER_SHEDDING and r.admitted
    assert r.binding == BINDING_THRESHOLD and r.refusal is None
    assert r.usage_bytes == gib(12.25) and r.projected_bytes == gib(16.25)
    assert r.tried == ("reclaim_pool:m", "shrink_to_bytes:memory_pressure_guard",
                       "shrink_for_admission:prefill_admission",
                       "shrink_for_admission:prefill_admission_chain",
                       "evict:idle1", "evict:idle2")
    assert r.shed_entries == 3 and r.shed_bytes == gib(1 + 1 + 0.5 + 0.25 + 2 + 1)


def test_still_over_the_ceiling_refuses_naming_what_was_tried_and_the_shortfall():
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              full_cascade_snapshots(last_usage=15.25), full_cascade_world(skip_evictions=True))
    assert d.executes[-2] == (evict("idle1", 2), evict("idle2", 1))
    (refusal,) = d.executes[-1]
    assert isinstance(refusal, Refuse) and d.steps[-1] == Execute((refusal,))
    assert refusal.binding == BINDING_CEILING and refusal.error_reason == "MEMORY_PRESSURE"
    assert refusal.retry_after_s == RETRY_AFTER_MEMORY_S
    # The skipped evictions freed nothing, so they are not among what was tried.
    assert refusal.tried == ("reclaim_pool:m", "shrink_to_bytes:memory_pressure_guard",
                             "shrink_for_admission:prefill_admission",
                             "shrink_for_admission:prefill_admission_chain")
    assert refusal.numbers["shortfall_bytes"] == gib(0.25)  # 15.25 + 4 - 19
    assert refusal.numbers["usage_bytes"] == gib(15.25)
    assert refusal.numbers["projected_after_shed_bytes"] == gib(19.25)
    assert refusal.numbers["projected_bytes"] == gib(22)
    assert refusal.numbers["admission_limit_bytes"] == CEILING
    assert refusal.numbers["shed_line_bytes"] == THRESHOLD
    assert "0.25 GiB" in refusal.message and "prefill_admission_chain" in refusal.message
    r = d.result
    assert r.verdict is Verdict.REJECT and r.refusal == refusal and not r.admitted
    assert r.tried == refusal.tried and r.error_reason == "MEMORY_PRESSURE"


def shrinks_of(d) -> list[ShrinkSessionCache]:
    return [a for a in d.actions if isinstance(a, ShrinkSessionCache)]


def test_the_guard_runs_only_when_the_bank_is_over_its_budget():
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(18, 6, max_bytes=6), snap(15, 4)], World(shrinks=[(1, 2)]),
              repeat_last=True)
    assert shrinks_of(d) == [prefill_shed(0)]  # 6 GiB is not over a 6 GiB budget
    # The governor's dynamic ceiling, when it has one, is the budget instead of max_bytes.
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK,
                             bank_budget_bytes=gib(5.5)),
              [snap(18, 6), snap(17.5, 5.5), snap(15, 4.5)], World(shrinks=[(1, 0.5), (1, 1)]),
              repeat_last=True)
    assert shrinks_of(d) == [guard(5.5), prefill_shed(0)]  # 5.5 - (17.5 + 4 - 16) = 0
    assert d.steps[1] == Execute((guard(5.5),))  # no pool to reclaim: the guard comes first


def test_the_guard_is_skipped_when_the_request_already_fits():
    # Bank over its budget, but 11 + 4 <= 16: admission sheds nothing (the tick holds it).
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(11, 6, pool=1, max_bytes=5)])
    assert d.steps == [MEASURE] and d.result.verdict is Verdict.ADMIT


def test_evictions_run_toward_the_threshold_and_stop_once_the_prediction_fits():
    # After the prefill shed 16.5 + 4 = 20.5 > 19: the chain runs (target 4.5 - 1.5 = 3);
    # after it 17.5 <= 19 but over 16: idle1 (2 GiB) is predicted to bring it to 15.5.
    snaps = [snap(18, 6), snap(16.5, 4.5), snap(13.5, 2.5), snap(11.5, 2.5)]
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              snaps, World(shrinks=[(1, 1.5), (2, 2)]))
    assert [a for a in d.actions if not isinstance(a, PressureReclaim)] == [
        prefill_shed(0), chain_shed(3), evict("idle1", 2)]
    assert d.result.verdict is Verdict.ADMIT_AFTER_SHEDDING
    assert d.result.projected_bytes == gib(15.5)


def test_chain_shed_only_with_the_flag():
    off = AdmissionSettings(chain_shed=False)
    d = drive(admission_plan(REQUEST, CONFIG, off, PressureLevel.OK),
              [snap(18, 6), snap(16.5, 4.5), snap(13.5, 4.5)], World(shrinks=[(1, 1.5)]))
    assert shrinks_of(d) == [prefill_shed(0)]  # no chain shed; straight on to the evictions
    assert [a for a in d.actions if isinstance(a, EvictModel)] == [
        evict("idle1", 2), evict("idle2", 1)]
    assert d.result.admitted and d.result.projected_bytes == gib(17.5)  # over 16, under 19
    on = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
               [snap(18, 6), snap(16.5, 4.5), snap(15, 3), snap(12, 3)],
               World(shrinks=[(1, 1.5), (1, 1.5)]))
    # The chain's target (ceiling) is larger than the prefill shed's (threshold).
    assert shrinks_of(on) == [prefill_shed(0), chain_shed(4.5 - (16.5 + 4 - 19))]


def test_a_shrink_that_freed_nothing_is_remeasured_without_a_reclaim():
    one = ENGINES[:1]  # only the request's own model: nothing to evict
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(15.5, 3, engines=one), snap(15.5, 3, engines=one),
               snap(15.5, 3, engines=one)],
              World(shrinks=[(0, 0), (0, 0)]))
    refusal = d.actions[-1]
    assert d.steps == [MEASURE, Execute((prefill_shed(0),)), REMEASURE,
                       Execute((chain_shed(2.5),)), REMEASURE, Execute((refusal,))]
    assert isinstance(refusal, Refuse) and refusal.tried == ()
    assert "nothing could free memory" in refusal.message
    assert refusal.numbers["shortfall_bytes"] == gib(0.5)


def test_idle_eviction_never_takes_the_requests_own_model_or_a_pinned_one():
    engines = (EngineView("m", measured_bytes=4 * GiB, last_used=0.0),  # idle, oldest
               EngineView("pinned", pinned=True, measured_bytes=GiB, last_used=0.5),
               EngineView("other", measured_bytes=GiB, last_used=3.0),
               EngineView("loading", state=EngineState.LOADING, measured_bytes=GiB))
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(14, 0, engines=engines), snap(13, 0, engines=engines)])
    assert d.steps == [MEASURE, Execute((evict("other", 1),)), REMEASURE]
    assert d.result.verdict is Verdict.ADMIT_AFTER_SHEDDING


def test_hopeless_request_sheds_nothing_and_only_refuses():
    # 25 + 4 = 29; every relief together frees 1 + 2 + 2 + 3 = 8: 21 > 19.
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(25, 6, pool=1, max_bytes=5)])
    assert len(d.steps) == 2 and d.steps[0] == MEASURE
    (refusal,) = d.executes[0]
    assert isinstance(refusal, Refuse) and refusal.binding == BINDING_CEILING
    assert refusal.tried == () and "nothing was shed" in refusal.message
    assert refusal.numbers["shortfall_bytes"] == gib(25 + 4 - 19)
    assert not any(isinstance(a, ShrinkSessionCache | EvictModel | PressureReclaim)
                   for a in d.actions)
    assert d.result.verdict is Verdict.REJECT and d.result.outcomes == ()
    # At 23 GiB, 27 - 8 = 19 is exactly the ceiling: not hopeless, the cascade runs.
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(23, 6, pool=1, max_bytes=5), snap(22, 6, max_bytes=5)],
              World(shrinks=[(0, 0)] * 3), repeat_last=True)
    assert isinstance(d.steps[1], Execute) and d.steps[1].actions == reclaims()


def test_without_the_chain_flag_its_bytes_do_not_count_toward_hope():
    # 22 + 4 = 26; 1 + 2 + 3 = 6 without the chain's 2: 20 > 19 -> hopeless.
    off = AdmissionSettings(chain_shed=False)
    d = drive(admission_plan(REQUEST, CONFIG, off, PressureLevel.OK), [snap(22, 6, pool=1)])
    assert [type(a) for a in d.actions] == [Refuse]


def test_prefill_over_the_floor_is_refused_up_front():
    # The floor is what nothing sheds: the request's model (4 GiB) and the pinned one
    # (1 GiB); 16 GiB above it crosses the 19 GiB ceiling whatever is evicted.
    big = replace(REQUEST, kv_bytes_per_token=4 * MiB)
    d = drive(admission_plan(big, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(9, 0)])
    (refusal,) = d.actions
    assert refusal.binding == BINDING_PREFILL_EXCEEDS_CEILING
    assert refusal.error_reason == "PREFILL_EXCEEDS_CEILING" and refusal.tried == ()
    assert refusal.numbers["floor_bytes"] == 5 * GiB
    assert refusal.numbers["request_bytes"] == 16 * GiB


def test_floor_excludes_idle_models_the_cascade_could_evict():
    # m 4 GiB (busy) + idle1 2 + idle2 1 + pinned 1 = 8 GiB counted as the floor. A 12 GiB
    # request fits above m + pinned (5 + 12 = 17 <= 19) once idle1 and idle2 are evicted.
    big = replace(REQUEST, kv_bytes_per_token=3 * MiB)
    d = drive(admission_plan(big, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(8, 0), snap(5, 0)])
    assert [a for a in d.actions if isinstance(a, EvictModel)] == [
        evict("idle1", 2), evict("idle2", 1)]
    assert d.result.admitted


# -- the gate -----------------------------------------------------------------------------------


def test_under_the_threshold_admits_after_one_measurement():
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
              [snap(12, 6, pool=1)])
    assert d.steps == [MEASURE] and d.result.verdict is Verdict.ADMIT


def test_others_reservations_count_but_not_the_requests_own_ticket():
    s = snap(11, 6, reserved=2 * GiB)
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK), [s],
              World(shrinks=[(0, 0), (0, 0)]), repeat_last=True)
    assert d.result.decision.projected_bytes == gib(17)  # 11 + 4 + 2 > 16
    own = replace(REQUEST, own_reservation_bytes=2 * GiB)
    d = drive(admission_plan(own, CONFIG, AdmissionSettings(), PressureLevel.OK), [s])
    assert d.steps == [MEASURE] and d.result.decision.projected_bytes == gib(15)


def test_hyper_mode_admits_exactly_one():
    hyper = AdmissionSettings(scheduler_mode=SchedulerMode.HYPER, admission_cap=1)
    d = drive(admission_plan(REQUEST, CONFIG, hyper, PressureLevel.OK),
              [snap(10, 0, queue=QueueView(in_flight=0))])
    assert d.result.verdict is Verdict.ADMIT
    d = drive(admission_plan(REQUEST, CONFIG, hyper, PressureLevel.OK),
              [snap(10, 0, queue=QueueView(in_flight=1))])
    assert d.steps == [MEASURE] and d.result.verdict is Verdict.WAIT
    assert d.result.binding == BINDING_HYPER_CAP and d.result.retry_after_s == RETRY_AFTER_WAIT_S
    # Generate holds its slot already: the gate was the queue's, not the plan's.
    slot = replace(REQUEST, holds_slot=True)
    d = drive(admission_plan(slot, CONFIG, hyper, PressureLevel.OK),
              [snap(10, 0, queue=QueueView(in_flight=1, waiting=5))])
    assert d.result.verdict is Verdict.ADMIT


def test_paused_at_soft_waits_and_sheds_nothing_whatever_is_in_flight():
    for in_flight in (0, 1):
        d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.SOFT),
                  [snap(18, 6, pool=1, queue=QueueView(in_flight=in_flight))])
        assert d.steps == [MEASURE]
        assert d.result.verdict is Verdict.WAIT and d.result.binding == BINDING_PAUSED_AT_SOFT
        assert d.result.level is PressureLevel.SOFT
    # A Generate that passed the queue (its slot held) goes through the cascade.
    d = drive(admission_plan(replace(REQUEST, holds_slot=True), CONFIG, AdmissionSettings(),
                             PressureLevel.SOFT),
              [snap(18, 6, pool=1, queue=QueueView(in_flight=0)), snap(17, 6)],
              World(shrinks=[(0, 0), (0, 0)]), repeat_last=True)
    assert d.steps[1] == Execute(reclaims())


def test_queue_full_waits_and_generate_is_refused_at_once():
    d = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.SOFT),
              [snap(10, 0, queue=QueueView(in_flight=1, waiting=32, limit=32))])
    assert d.steps == [MEASURE]
    assert d.result.verdict is Verdict.WAIT and d.result.binding == BINDING_QUEUE_FULL
    assert d.result.error_reason == "QUEUE_FULL"


def test_disabled_enforcement_measures_and_admits():
    d = drive(admission_plan(REQUEST, CONFIG.replace(enabled=False), AdmissionSettings(),
                             PressureLevel.OK), [snap(60, 6, pool=1)])
    assert d.steps == [MEASURE] and d.result.verdict is Verdict.ADMIT


# -- preview (Admit) ---------------------------------------------------------------------------


def test_preview_yields_the_same_reliefs_and_predicts_instead_of_measuring():
    live = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK),
                 full_cascade_snapshots(), full_cascade_world())
    p = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK,
                             preview=True),
              full_cascade_snapshots()[:1], full_cascade_world(), preview=True)
    assert p.measures == [MEASURE]  # one measurement; the rest is predicted
    # The same reliefs with the same targets; the live run adds only the drains it
    # performs after each shrink before re-measuring.
    post_shrink_drains = [i for i, s in enumerate(live.executes)
                          if i > 0 and any(isinstance(a, ShrinkSessionCache)
                                           for a in live.executes[i - 1])]
    assert [s for i, s in enumerate(live.executes) if i not in post_shrink_drains] == p.executes
    assert p.executes == [reclaims(), (guard(5),), (prefill_shed(1),), (chain_shed(4),),
                          (evict("idle1", 2), evict("idle2", 1))]
    r = p.result
    assert r.verdict is Verdict.ADMIT_AFTER_SHEDDING and r.usage_bytes == gib(12.25)
    assert r.tried == live.result.tried and all(o.preview for o in r.outcomes)


def test_preview_refusal_is_predicted_too():
    p = drive(admission_plan(REQUEST, CONFIG, AdmissionSettings(), PressureLevel.OK,
                             preview=True),
              full_cascade_snapshots()[:1], full_cascade_world(skip_evictions=True),
              preview=True)
    (refusal,) = p.executes[-1]
    assert isinstance(refusal, Refuse) and refusal.numbers["shortfall_bytes"] == gib(0.25)
    assert p.result.verdict is Verdict.REJECT and len(p.measures) == 1


# -- live: a real SessionBank through the real Executor, run by Governor.admit() -----------------



class ProcessReader:
    """Scripted readings: the process holds `other` plus whatever the bank holds."""

    def __init__(self, other: int) -> None:
        self.other = other
        self.bank: SessionBank | None = None
        self.reads = 0

    def read(self, mlx_sample=None) -> MemoryReadings:
        self.reads += 1
        return MemoryReadings(process_bytes=self.other + self.bank.total_bytes(),
                              system_total_bytes=64 * GiB, mlx_pool_bytes=0)


def live_world(rec: SpanRecorder):
    """Bank 4 GiB. Idle a: its terminal (2,)*20 (older) and a fork (1,)*10 (newer, so
    non-terminal). Active b: a fork (3,)*10 and its terminal B2, the prompt's restore
    source. The process holds 16 GiB besides: usage 20 GiB."""
    clock = FakeClock()
    evicted: list[tuple[str, tuple, str]] = []
    bank = SessionBank(clock=clock, active_sessions=lambda: {"b"}, max_bytes=64 * GiB,
                       per_session_max_bytes=64 * GiB, tracer=rec.tracer,
                       on_evict=lambda es, r: evicted.extend((e.session_id, e.tokens, r)
                                                             for e in es))
    bank.put(make_entry((2,) * 20, GiB, "a"))
    clock.advance(1)
    bank.put(make_entry((1,) * 10, GiB, "a"))
    clock.advance(1)
    bank.put(make_entry((3,) * 10, GiB, "b"))
    clock.advance(1)
    bank.put(make_entry(B2, GiB, "b"))
    reader = ProcessReader(other=16 * GiB)
    reader.bank = bank
    executor = Executor(reader, NoEngines(), bank=bank)
    recorder = Recorder(inst=Instruments(MeterProvider().get_meter("test")), tracer=rec.tracer)
    governor = Governor(CONFIG, executor, recorder=recorder)
    # 2048 missed tokens x 512 KiB = 1 GiB of KV, plus 512 x 4 x 512 KiB = 1 GiB.
    request = replace(REQUEST, kv_bytes_per_token=512 * KiB)
    return bank, evicted, governor, request, reader


async def test_governor_admit_sheds_non_terminal_first_and_keeps_the_restore_source():
    rec = SpanRecorder()
    bank, evicted, governor, request, reader = live_world(rec)
    r = await governor.admit(request)
    assert r is not None and r.verdict is Verdict.ADMIT_AFTER_SHEDDING
    assert r.decision.projected_bytes == 22 * GiB and r.decision.request_bytes == 2 * GiB
    # The prefill shed (active sessions spared) takes a's fork before a's older terminal;
    # the chain shed (target 2 - (18 + 2 - 19) = 1 GiB) then takes b's fork, never B2.
    assert evicted == [("a", (1,) * 10, REASON_PREFILL_ADMISSION),
                       ("a", (2,) * 20, REASON_PREFILL_ADMISSION),
                       ("b", (3,) * 10, REASON_ADMISSION_CHAIN)]
    assert [e.tokens for e in bank.entries()] == [B2]
    assert bank.restore_source("m", request.prompt_tokens).tokens == B2
    assert [(o.action.reason, o.action.target_bytes, o.non_terminal, o.terminal, o.bytes_freed)
            for o in r.outcomes] == [(REASON_PREFILL_ADMISSION, 0, 1, 1, 2 * GiB),
                                     (REASON_ADMISSION_CHAIN, GiB, 1, 0, GiB)]
    assert r.usage_bytes == 17 * GiB and r.projected_bytes == 19 * GiB
    assert reader.reads == 3  # admission, after each shed
    # The governor records each shrink once; the bank opens no span of its own.
    shrinks = rec.spans(names.SPAN_BANK_SHRINK)
    assert [(s.attributes[names.ATTR_REASON], s.attributes[names.ATTR_SHRINK_MODE],
             s.attributes[names.ATTR_PROTECT_ACTIVE], s.attributes[names.ATTR_TARGET],
             s.attributes[names.ATTR_ENTRIES_EVICTED]) for s in shrinks] == [
        (REASON_PREFILL_ADMISSION, "shrink_for_admission", True, 0, 2),
        (REASON_ADMISSION_CHAIN, "shrink_for_admission", False, GiB, 1)]
    assert rec.spans(names.SPAN_BANK_EVICT) == [] and rec.spans(names.SPAN_ADMISSION_REFUSAL) == []


async def test_governor_admit_preview_predicts_the_same_and_changes_nothing():
    rec = SpanRecorder()
    bank, evicted, governor, request, reader = live_world(rec)
    p = await governor.admit(request, preview=True)
    assert p is not None and p.verdict is Verdict.ADMIT_AFTER_SHEDDING
    assert p.tried == ("shrink_for_admission:prefill_admission",
                       "shrink_for_admission:prefill_admission_chain")
    assert [(o.entries, o.bytes_freed) for o in p.outcomes] == [(2, 2 * GiB), (1, GiB)]
    assert p.usage_bytes == 17 * GiB and reader.reads == 1
    assert bank.entry_count() == 4 and evicted == [] and rec.spans() == []
    live = await governor.admit(request)
    assert live.tried == p.tried and live.usage_bytes == p.usage_bytes


async def test_governor_admit_refuses_a_hopeless_request_and_keeps_the_bank():
    rec = SpanRecorder()
    bank, evicted, governor, request, reader = live_world(rec)
    reader.other = 17 * GiB  # 21 + 2 - (2 + 1 freeable) = 20 > 19
    r = await governor.admit(request)
    assert r.verdict is Verdict.REJECT and r.binding == BINDING_CEILING and r.tried == ()
    assert r.refusal.numbers["shortfall_bytes"] == 4 * GiB
    assert bank.entry_count() == 4 and evicted == []
    (span,) = rec.spans(names.SPAN_ADMISSION_REFUSAL)
    assert span.attributes[names.ATTR_BINDING] == BINDING_CEILING
    assert span.attributes[names.ATTR_ADMISSION_LIMIT] == CEILING
    assert span.attributes[names.ATTR_PROJECTED] == 23 * GiB
