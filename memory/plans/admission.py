"""Admission: decide before any prefill whether a request fits, and make it fit. Pure.

One plan serves both RPCs: `Generate` runs `admission_plan` live (each relief
is executed and re-measured), `Admit` runs the same plan as a preview (the
governor answers with predicted outcomes and nothing changes), so Admit says
what Generate would do at that instant.

The projection: usage + outstanding reservations + tokens that miss the cache
× KV bytes per token + the prefill transient. The cascade (the session bank's, then the
governor's other reliefs), each step only while the projection is still over
its line, re-measuring after every step that freed anything:

0. the gate: hyper mode admits exactly one request; admission pauses at soft
   and above (new requests wait in the bounded queue; a full queue is a WAIT
   too: Generate is refused at once and retries). (Generate passes the queue
   first and skips the gate here.)
1. reclaim the MLX pool (non-destructive, always first);
2. the memory-pressure guard: a bank over its budget (its dynamic ceiling) is
   brought back with `shrink_to_bytes(protect_active=True)`;
3. the prefill admission shed, when the projection crosses the sustained-
   pressure limit (the hard mark): `shrink_for_admission` — non-terminal first,
   then LRU — with the prompt's restore source protected and active sessions
   spared;
4. the admission-chain shed, when enabled: `shrink_for_admission` again with
   the larger target of its own budget (the ceiling, the per-request line), now
   allowed to take idle entries of active sessions last;
5. idle non-pinned models in the eviction ladder's order (never the request's);
then still over the admission limit (the smaller of the ceiling and the
prefill abort line) -> a typed refusal naming the binding constraint, what was
tried and the numbers; when the room is taken by other clients' reservations
the refusal says so. Between the shed line and the admission limit the request
is admitted. A request that could not fit even after every relief
sheds nothing (reusable state is kept for requests that can fit).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from memory.actions import (
    MEASURE_ADMISSION,
    MEASURE_AFTER_ADMISSION_STEP,
    REASON_ADMISSION_CHAIN,
    REASON_ADMISSION_EVICT,
    REASON_ADMISSION_RECLAIM,
    REASON_GUARD_BUDGET,
    REASON_PREFILL_ADMISSION,
    Action,
    EvictModel,
    Outcome,
    PressureReclaim,
    Refuse,
    ShrinkMode,
    ShrinkSessionCache,
)
from memory.ceiling import Limits, compute_limits
from memory.chunking import ConversionTransient, PrefillFigures, prefill_abort_bytes
from memory.config import MemoryConfig
from memory.levels import PressureLevel
from memory.plans.eviction import freeable_bytes, idle_victims
from memory.plans.steps import AdmissionQuery, Execute, Measure, Snapshot, Step
from memory.views import BankFigures, QueueView

HYPER_ADMISSION_CAP = 1
UNLIMITED_BYTES = 1 << 62
DEFAULT_QUEUE_LIMIT = 32
RETRY_AFTER_WAIT_S = 1.0  # paused / capped / queue full: about one enforcer tick
RETRY_AFTER_MEMORY_S = 2.0  # over the ceiling: give running requests time to finish

# Binding constraints (AdmitResponse.binding_constraint).
BINDING_CEILING = "admission_limit"
BINDING_RESERVATIONS = "reservations"  # others' reservations take the room
BINDING_PREFILL_EXCEEDS_CEILING = "prefill_exceeds_ceiling"
BINDING_PAUSED_AT_SOFT = "paused_at_soft"
BINDING_PAUSED_AT_HARD = "paused_at_hard"
BINDING_PAUSED_AT_EMERGENCY = "paused_at_emergency"
BINDING_QUEUE_FULL = "queue_full"
BINDING_IN_FLIGHT_LIMIT = "in_flight_limit"
BINDING_HYPER_CAP = "hyper_cap"
BINDING_ADMISSION_CAP = "admission_cap"
BINDING_THRESHOLD = "shed_line"  # admitted, but only after shedding

# The google.rpc.ErrorInfo reason Generate ends with when it does not start: a
# refusal's, or (for a gate that makes it wait) the queue timeout's.
ERROR_REASONS: Mapping[str, str] = {
    BINDING_CEILING: "MEMORY_PRESSURE",
    BINDING_RESERVATIONS: "RESERVATIONS_HELD",
    BINDING_PREFILL_EXCEEDS_CEILING: "PREFILL_EXCEEDS_CEILING",
    BINDING_QUEUE_FULL: "QUEUE_FULL",
    BINDING_IN_FLIGHT_LIMIT: "IN_FLIGHT_LIMIT",
    BINDING_PAUSED_AT_SOFT: "ADMISSION_TIMEOUT",
    BINDING_PAUSED_AT_HARD: "ADMISSION_TIMEOUT",
    BINDING_PAUSED_AT_EMERGENCY: "ADMISSION_TIMEOUT",
    BINDING_HYPER_CAP: "ADMISSION_TIMEOUT",
    BINDING_ADMISSION_CAP: "ADMISSION_TIMEOUT",
}


class Verdict(StrEnum):
    ADMIT = "admit"
    ADMIT_AFTER_SHEDDING = "admit_after_shedding"
    WAIT = "wait"
    REJECT = "reject"


class SchedulerMode(StrEnum):
    DEFAULT = "default"
    HYPER = "hyper"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class AdmissionSettings:
    chain_shed: bool = True  # the admission-chain shed (step 4)
    scheduler_mode: SchedulerMode = SchedulerMode.DEFAULT
    admission_cap: int | None = None
    queue_limit: int = DEFAULT_QUEUE_LIMIT


@dataclass(frozen=True)
class AdmissionRequest:
    """A prospective request, as admission needs it."""

    model: str
    prompt_tokens: tuple[int, ...]
    max_tokens: int
    kv_bytes_per_token: int
    attention_heads: int = 1
    prefill_step_size: int = 512
    holds_slot: bool = False  # Generate passed the queue's gate already
    own_reservation_bytes: int = 0  # the ticket it redeems: not someone else's
    # The model's fp32-conversion prefill (engine/fast_prefill.py); None: the stock path.
    prefill_conversion: ConversionTransient | None = None
    # The model's prefill guard's learned factor over the static estimate (>= 1).
    prefill_cost_factor: float = 1.0

    def prefill_figures(self) -> PrefillFigures:
        return PrefillFigures(self.kv_bytes_per_token, self.attention_heads,
                              self.prefill_conversion)


# -- the pure decision ------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionInputs:
    """Everything `decide` looks at; the plan measures, `decide` stays pure.

    `pool_bytes` is the part of `usage_bytes` reclaiming the MLX buffer pool
    would free. `reserved_bytes` are other requests' outstanding Admit tickets.
    `ceiling_bytes` is the admission limit and `threshold_bytes` the shed line
    (`admission_lines`), not the raw ceiling and hard mark.
    `restore_bytes` is what restoring the cached prefix allocates. `floor_bytes`,
    when known, is usage nothing can shed (model weights): a request whose own
    bytes do not fit above it is refused as `prefill_exceeds_ceiling`.
    """

    usage_bytes: int
    ceiling_bytes: int
    threshold_bytes: int
    prompt_tokens: int
    kv_bytes_per_token: int
    pool_bytes: int = 0
    reusable_prefix_tokens: int = 0
    prefill_transient_bytes: int = 0
    restore_bytes: int = 0
    reserved_bytes: int = 0
    # Requests of the same burst admitted before this one, not yet in the reading
    # (`admission_batch_plan`): their own bytes count as if already allocated.
    burst_bytes: int = 0
    level: PressureLevel = PressureLevel.OK
    admitted_in_flight: int = 0
    queue_depth: int = 0
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    chain_shed_enabled: bool = True
    scheduler_mode: SchedulerMode = SchedulerMode.DEFAULT
    admission_cap: int | None = None
    floor_bytes: int | None = None
    bank: BankFigures = field(default_factory=BankFigures)
    gated: bool = True  # False: the request passed the queue's gate already


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    inputs: AdmissionInputs
    projected_bytes: int
    request_bytes: int  # projected - usage: what admitting adds (others' reservations included)
    headroom_bytes: int  # the admission limit (inputs.ceiling_bytes) - usage
    needs_relief: bool = False  # over the sustained limit: the cascade must run
    binding: str | None = None
    retry_after_s: float | None = None
    reason: str = ""
    numbers: Mapping[str, int] = field(default_factory=dict)

    @property
    def admits(self) -> bool:
        return self.verdict in (Verdict.ADMIT, Verdict.ADMIT_AFTER_SHEDDING)

    @property
    def error_reason(self) -> str | None:
        return ERROR_REASONS.get(self.binding or "")


def miss_tokens(inputs: AdmissionInputs) -> int:
    """Prompt tokens to prefill: at least one, since logits come from a prefill."""
    return max(inputs.prompt_tokens - inputs.reusable_prefix_tokens, min(inputs.prompt_tokens, 1))


def own_bytes(inputs: AdmissionInputs) -> int:
    """What this request's prefill adds by itself."""
    return (
        miss_tokens(inputs) * inputs.kv_bytes_per_token
        + inputs.prefill_transient_bytes
        + inputs.restore_bytes
    )


def project_bytes(inputs: AdmissionInputs) -> int:
    """usage + missed tokens x KV bytes/token + prefill transient (+ restore, + others'
    tickets, + the burst's earlier admissions)."""
    return inputs.usage_bytes + own_bytes(inputs) + inputs.reserved_bytes + inputs.burst_bytes


def gate(
    level: PressureLevel,
    admitted_in_flight: int,
    *,
    mode: SchedulerMode = SchedulerMode.DEFAULT,
    admission_cap: int | None = None,
    queue_depth: int = 0,
    queue_limit: int = DEFAULT_QUEUE_LIMIT,
) -> tuple[Verdict, str] | None:
    """The admission gate shared by `decide` and the queue: None when open."""
    cap = HYPER_ADMISSION_CAP if mode is SchedulerMode.HYPER else admission_cap
    blocked: str | None = None
    if cap is not None and admitted_in_flight >= cap:
        blocked = BINDING_HYPER_CAP if mode is SchedulerMode.HYPER else BINDING_ADMISSION_CAP
    elif level >= PressureLevel.SOFT:
        blocked = f"paused_at_{PressureLevel(level).label}"
    if blocked is None:
        return None
    if queue_depth >= queue_limit:
        return Verdict.WAIT, BINDING_QUEUE_FULL  # refused at once; retrying may succeed
    return Verdict.WAIT, blocked


def decide(inputs: AdmissionInputs) -> Decision:
    """The first look: gate, floor and projection. Pure: no clock, no I/O."""
    projected = project_bytes(inputs)
    request = projected - inputs.usage_bytes
    numbers = {
        "usage_bytes": inputs.usage_bytes,
        "projected_bytes": projected,
        "shed_line_bytes": inputs.threshold_bytes,
        "admission_limit_bytes": inputs.ceiling_bytes,
        "pool_bytes": inputs.pool_bytes,
        "reserved_bytes": inputs.reserved_bytes,
        **({"burst_bytes": inputs.burst_bytes} if inputs.burst_bytes else {}),
        "miss_tokens": miss_tokens(inputs),
        "kv_bytes_per_token": inputs.kv_bytes_per_token,
        "bank_bytes": inputs.bank.total_bytes,
    }
    base = Decision(
        verdict=Verdict.ADMIT, inputs=inputs, projected_bytes=projected, request_bytes=request,
        headroom_bytes=inputs.ceiling_bytes - inputs.usage_bytes, numbers=numbers,
    )
    own = own_bytes(inputs)
    if inputs.floor_bytes is not None and inputs.floor_bytes + own > inputs.ceiling_bytes:
        return replace(
            base, verdict=Verdict.REJECT, binding=BINDING_PREFILL_EXCEEDS_CEILING,
            retry_after_s=RETRY_AFTER_MEMORY_S,
            numbers={**numbers, "floor_bytes": inputs.floor_bytes, "request_bytes": own},
            reason=(f"prefill needs {_gib(own)} above the {_gib(inputs.floor_bytes)} floor, "
                    f"over the {_gib(inputs.ceiling_bytes)} admission limit even with nothing "
                    "else running"),
        )
    gated = gate(
        inputs.level, inputs.admitted_in_flight, mode=inputs.scheduler_mode,
        admission_cap=inputs.admission_cap, queue_depth=inputs.queue_depth,
        queue_limit=inputs.queue_limit,
    ) if inputs.gated else None
    if gated is not None:
        verdict, binding = gated
        return replace(
            base, verdict=verdict, binding=binding, retry_after_s=RETRY_AFTER_WAIT_S,
            reason=f"{binding}: {inputs.admitted_in_flight} admitted, "
                   f"{inputs.queue_depth}/{inputs.queue_limit} waiting",
        )
    if projected <= inputs.threshold_bytes:
        return replace(base, reason=f"projected {_gib(projected)} fits under the shed line "
                                    f"{_gib(inputs.threshold_bytes)}")
    return replace(base, needs_relief=True,
                   reason=f"projected {_gib(projected)} is over the shed line "
                          f"{_gib(inputs.threshold_bytes)}")


# -- from a snapshot to inputs ------------------------------------------------------


def prefill_transient_bytes(request: AdmissionRequest, miss: int) -> int:
    """The peak a prefill adds beyond its KV, at its last chunk (attention over the whole
    prompt): `PrefillFigures.transient_bytes`, and what the model's learned cost factor
    adds to the chunk, so that the prefill guard, which projects every chunk the same
    way, lets an admitted request run."""
    chunk = min(miss, request.prefill_step_size)
    prompt = len(request.prompt_tokens)
    figures = request.prefill_figures()
    extra = (request.prefill_cost_factor - 1) * figures.chunk_bytes(chunk, prompt)
    return figures.transient_bytes(chunk, prompt) + math.ceil(max(0.0, extra))


@dataclass(frozen=True)
class AdmissionLines:
    limit_bytes: int  # projected usage must stay under it to be admitted
    shed_bytes: int  # over it, the cascade sheds before admitting


def admission_lines(limits: Limits) -> AdmissionLines:
    """Admit nothing the prefill guard would abort mid-prompt: its line is the tier's
    pre-chunk margin of the stable cap, below the ceiling."""
    abort_line = prefill_abort_bytes(limits.tier, limits.abort_cap_bytes)
    return AdmissionLines(min(limits.ceiling_bytes, abort_line),
                          min(limits.hard_bytes, abort_line))


def admission_inputs(snap: Snapshot, request: AdmissionRequest, limits: Limits,
                     level: PressureLevel, settings: AdmissionSettings) -> AdmissionInputs:
    bank = snap.bank or BankFigures()
    queue = snap.queue or QueueView(limit=settings.queue_limit)
    prompt = len(request.prompt_tokens)
    miss = max(1, prompt - bank.restore_prefix_tokens)
    lines = admission_lines(limits)
    return AdmissionInputs(
        usage_bytes=snap.readings.process_bytes,
        pool_bytes=snap.readings.pool_bytes,
        ceiling_bytes=lines.limit_bytes,
        threshold_bytes=lines.shed_bytes,
        prompt_tokens=prompt + request.max_tokens,
        reusable_prefix_tokens=bank.restore_prefix_tokens,
        kv_bytes_per_token=request.kv_bytes_per_token,
        prefill_transient_bytes=prefill_transient_bytes(request, miss),
        restore_bytes=bank.restore_disk_bytes,
        reserved_bytes=max(0, snap.reserved_bytes - request.own_reservation_bytes),
        level=level,
        admitted_in_flight=0 if request.holds_slot else queue.in_flight,
        queue_depth=0 if request.holds_slot else queue.waiting,
        queue_limit=queue.limit,
        chain_shed_enabled=settings.chain_shed,
        scheduler_mode=settings.scheduler_mode,
        admission_cap=settings.admission_cap,
        # Weights nothing will shed: the request's own model, pinned and busy ones
        # (idle others are the cascade's last relief).
        floor_bytes=sum(e.measured_bytes or 0 for e in snap.engines
                        if e.ready and (e.model_id == request.model or e.pinned or e.busy)),
        bank=bank,
        gated=not request.holds_slot,
    )


# -- the plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class AdmissionResult:
    verdict: Verdict
    decision: Decision
    level: PressureLevel
    usage_bytes: int  # as last measured (or predicted, in a preview)
    outcomes: tuple[Outcome, ...] = ()  # the reliefs that ran (or would run)
    refusal: Refuse | None = None

    @property
    def admitted(self) -> bool:
        return self.verdict in (Verdict.ADMIT, Verdict.ADMIT_AFTER_SHEDDING)

    @property
    def projected_bytes(self) -> int:
        return self.usage_bytes + self.decision.request_bytes

    # A refusal, when there is one, speaks for the result; else the first look does.
    @property
    def binding(self) -> str | None:
        return (self.refusal or self.decision).binding

    @property
    def retry_after_s(self) -> float | None:
        return (self.refusal or self.decision).retry_after_s

    @property
    def reason(self) -> str:
        return self.refusal.message if self.refusal else self.decision.reason

    @property
    def error_reason(self) -> str | None:
        return (self.refusal or self.decision).error_reason

    @property
    def shed_entries(self) -> int:
        return sum(o.entries or 0 for o in self.outcomes
                   if isinstance(o.action, ShrinkSessionCache))

    @property
    def shed_bytes(self) -> int:
        return sum(o.bytes_freed or 0 for o in self.outcomes)

    @property
    def tried(self) -> tuple[str, ...]:
        return tuple(_describe(o.action) for o in self.outcomes)


def _describe(action: Action) -> str:
    if isinstance(action, ShrinkSessionCache):
        return f"{action.mode.value}:{action.reason}"
    if isinstance(action, EvictModel):
        return f"evict:{action.model_id}"
    if isinstance(action, PressureReclaim):
        return f"reclaim_pool:{action.model_id}"
    return type(action).__name__


def _refusal(d: Decision, binding: str, usage: int, tried: Sequence[str], why: str) -> Refuse:
    inputs = d.inputs
    projected = usage + d.request_bytes
    if (binding == BINDING_CEILING and inputs.reserved_bytes
            and projected - inputs.reserved_bytes <= inputs.ceiling_bytes):
        # It would fit but for other clients' outstanding tickets.
        binding = BINDING_RESERVATIONS
        why += (f"; {_gib(inputs.reserved_bytes)} held by other clients' reservations "
                "takes the room")
    return Refuse(
        binding=binding,
        error_reason=ERROR_REASONS.get(binding, "MEMORY_PRESSURE"),
        message=why,
        retry_after_s=d.retry_after_s or RETRY_AFTER_MEMORY_S,
        numbers={**d.numbers, "usage_bytes": usage, "projected_after_shed_bytes": projected,
                 "shortfall_bytes": max(0, projected - inputs.ceiling_bytes)},
        tried=tuple(tried),
    )


def admission_plan(
    request: AdmissionRequest,
    config: MemoryConfig,
    settings: AdmissionSettings,
    level: PressureLevel,
    *,
    gate_level: PressureLevel | None = None,
    bank_budget_bytes: int | None = None,
    preview: bool = False,
) -> Generator[Step, Any, AdmissionResult]:
    """The cascade of the module docstring. `level` is the pressure level now;
    `gate_level` the one the gate pauses at (default: `level`). `preview`: outcomes
    are predictions and the plan predicts usage instead of measuring again."""
    query = AdmissionQuery(request.model, request.prompt_tokens)
    snap: Snapshot = yield Measure(MEASURE_ADMISSION, query)
    return (yield from _decide_measured(request, snap, config, settings, level,
                                        gate_level=gate_level,
                                        bank_budget_bytes=bank_budget_bytes, preview=preview))


def admission_batch_plan(
    requests: Sequence[AdmissionRequest],
    config: MemoryConfig,
    settings: AdmissionSettings,
    level: PressureLevel,
    *,
    gate_level: PressureLevel | None = None,
    bank_budget_bytes: int | None = None,
) -> Generator[Step, Any, tuple[AdmissionResult, ...]]:
    """Live admission of a burst: ONE measurement (readings, and the bank's figures for
    every prompt), then each request decided in order by `admission_plan`'s cascade,
    each seeing the own bytes of the ones admitted before it (`burst_bytes`): they are
    not in the reading yet. A relief that ran takes a fresh measurement as it always
    does; the requests after it are then measured once more (the bank changed).

    For one request it is `admission_plan` (same steps, same result)."""
    results: list[AdmissionResult] = []
    burst = 0
    snap: Snapshot | None = None
    banks: dict[int, BankFigures | None] = {}
    for i, request in enumerate(requests):
        if snap is None:
            rest = requests[i:]
            query = AdmissionQuery(
                request.model, request.prompt_tokens,
                more=tuple(AdmissionQuery(r.model, r.prompt_tokens) for r in rest[1:]))
            snap = yield Measure(MEASURE_ADMISSION, query)
            figures = (snap.bank, *snap.more_banks)
            banks = {i + k: figures[k] if k < len(figures) else None
                     for k in range(len(rest))}
        mine = replace(snap, bank=banks.get(i), more_banks=())
        relieved = False

        def watch(gen):
            # Forward the cascade's steps; note whether it measured again.
            nonlocal relieved
            reply = None
            while True:
                try:
                    step = gen.send(reply)
                except StopIteration as stop:
                    return stop.value
                if isinstance(step, Measure):
                    relieved = True
                reply = yield step

        result = yield from watch(_decide_measured(
            request, mine, config, settings, level, gate_level=gate_level,
            bank_budget_bytes=bank_budget_bytes, burst_bytes=burst))
        results.append(result)
        if result.admitted:
            burst += own_bytes(result.decision.inputs)
        if relieved:
            snap = None  # memory was freed and the bank changed: measure again
    return tuple(results)


def _decide_measured(
    request: AdmissionRequest,
    snap: Snapshot,
    config: MemoryConfig,
    settings: AdmissionSettings,
    level: PressureLevel,
    *,
    gate_level: PressureLevel | None = None,
    bank_budget_bytes: int | None = None,
    preview: bool = False,
    burst_bytes: int = 0,
) -> Generator[Step, Any, AdmissionResult]:
    """`admission_plan` once its first measurement is in."""
    query = AdmissionQuery(request.model, request.prompt_tokens)
    limits = compute_limits(snap.readings, config)
    gated_at = level if gate_level is None else gate_level
    inputs = admission_inputs(snap, request, limits, gated_at, settings)
    if burst_bytes:
        inputs = replace(inputs, burst_bytes=burst_bytes)
    if not config.enabled:  # measured and reported, never enforced
        inputs = replace(inputs, ceiling_bytes=UNLIMITED_BYTES, threshold_bytes=UNLIMITED_BYTES,
                         floor_bytes=None)
    d = decide(inputs)
    inputs = d.inputs
    if d.verdict is Verdict.REJECT and d.binding == BINDING_PREFILL_EXCEEDS_CEILING:
        refusal = _refusal(d, d.binding, inputs.usage_bytes, (), d.reason)
        yield Execute((refusal,))
        return AdmissionResult(Verdict.REJECT, d, level, inputs.usage_bytes, refusal=refusal)
    if not d.needs_relief:
        return AdmissionResult(d.verdict, d, level, inputs.usage_bytes)

    need = d.request_bytes
    usage = inputs.usage_bytes
    bank_total = inputs.bank.total_bytes
    ready = [e for e in snap.engines if e.ready]
    victims = idle_victims(snap.engines, exclude=(request.model,),
                           warmup_s=config.load_warmup_s)  # a just-loaded model is spared
    # The pool is never asked for in an emergency, or when reclaim is off.
    may_reclaim = config.pressure_reclaim and level is not PressureLevel.EMERGENCY
    freeable = ((min(inputs.pool_bytes, usage) if may_reclaim else 0)
                + inputs.bank.lru_freeable_bytes
                + (inputs.bank.chain_freeable_bytes if settings.chain_shed else 0)
                + freeable_bytes(victims))
    if usage + need - freeable > inputs.ceiling_bytes:
        why = (f"projected {_gib(usage + need)} exceeds the admission limit "
               f"{_gib(inputs.ceiling_bytes)} even if every relief freed its "
               f"{_gib(freeable)}; nothing was shed")
        refusal = _refusal(d, BINDING_CEILING, usage, (), why)
        yield Execute((refusal,))
        return AdmissionResult(Verdict.REJECT, d, level, usage, refusal=refusal)

    done: list[Outcome] = []
    pinned = () if level >= PressureLevel.EMERGENCY else snap.pinned_sessions

    def over(line: int) -> bool:
        return usage + need > line

    def run(actions: Sequence[Action]) -> Generator[Step, Any, None]:
        nonlocal usage, bank_total
        if not actions:
            return
        outcomes: list[Outcome] = list((yield Execute(tuple(actions))))
        done.extend(o for o in outcomes if (o.done or o.preview) and _freed(o))
        shrank = sum(o.bytes_freed or 0 for o in outcomes
                     if isinstance(o.action, ShrinkSessionCache) and (o.done or o.preview))
        if preview:
            usage -= sum(o.bytes_freed or 0 for o in outcomes)
            bank_total -= shrank
            return
        if shrank and ready and may_reclaim and not all(isinstance(a, PressureReclaim)
                                                         for a in actions):
            # Freed snapshots land in the MLX pool first: drain it before measuring.
            yield Execute(tuple(PressureReclaim(e.model_id, REASON_ADMISSION_RECLAIM, wait=True)
                                for e in ready))
        fresh: Snapshot = yield Measure(MEASURE_AFTER_ADMISSION_STEP, query)
        usage = fresh.readings.process_bytes
        bank_total = fresh.bank.total_bytes if fresh.bank is not None else bank_total

    # 1. the pool (non-destructive)
    if may_reclaim and inputs.pool_bytes > 0 and over(inputs.threshold_bytes):
        yield from run([PressureReclaim(e.model_id, REASON_ADMISSION_RECLAIM, wait=True)
                        for e in ready])
    # 2. the memory-pressure guard: the bank back under its budget
    budget = bank_budget_bytes if bank_budget_bytes is not None else inputs.bank.max_bytes
    if budget is not None and bank_total > budget and over(inputs.threshold_bytes):
        yield from run([ShrinkSessionCache(budget, protect_active=True, reason=REASON_GUARD_BUDGET,
                                           protect_session_ids=pinned)])
    # 3. the prefill admission shed, past the sustained-pressure limit
    if over(inputs.threshold_bytes) and bank_total > 0:
        target = max(0, bank_total - (usage + need - inputs.threshold_bytes))
        yield from run([ShrinkSessionCache(
            target, protect_active=True, reason=REASON_PREFILL_ADMISSION,
            mode=ShrinkMode.FOR_ADMISSION, protect_tokens=request.prompt_tokens,
            model=request.model, protect_session_ids=pinned)])
    # 4. the admission-chain shed: the larger target of the per-request budget
    if settings.chain_shed and over(inputs.ceiling_bytes) and bank_total > 0:
        target = max(0, bank_total - (usage + need - inputs.ceiling_bytes))
        yield from run([ShrinkSessionCache(
            target, protect_active=False, reason=REASON_ADMISSION_CHAIN,
            mode=ShrinkMode.FOR_ADMISSION, protect_tokens=request.prompt_tokens,
            model=request.model, protect_session_ids=pinned)])
    # 5. idle non-pinned models, least recently used first
    if over(inputs.threshold_bytes) and victims:
        evictions, predicted = [], usage
        for v in victims:
            if predicted + need <= inputs.threshold_bytes:
                break
            evictions.append(EvictModel(v.model_id, REASON_ADMISSION_EVICT,
                                        predicted_bytes=v.measured_bytes))
            predicted -= v.measured_bytes or 0
        yield from run(evictions)

    if over(inputs.ceiling_bytes):
        tried = [_describe(o.action) for o in done]
        why = (f"projected {_gib(usage + need)} after shedding exceeds the admission limit "
               f"{_gib(inputs.ceiling_bytes)} by {_gib(usage + need - inputs.ceiling_bytes)} "
               f"(tried: {', '.join(tried) or 'nothing could free memory'})")
        refusal = _refusal(d, BINDING_CEILING, usage, tried, why)
        yield Execute((refusal,))
        return AdmissionResult(Verdict.REJECT, d, level, usage, tuple(done), refusal)
    verdict = Verdict.ADMIT_AFTER_SHEDDING if done else Verdict.ADMIT
    d = replace(d, binding=BINDING_THRESHOLD if done else None,
                reason=(f"projected {_gib(d.projected_bytes)} -> {_gib(usage + need)} after "
                        f"shedding (shed line {_gib(inputs.threshold_bytes)}, admission limit "
                        f"{_gib(inputs.ceiling_bytes)})"))
    return AdmissionResult(verdict, d, level, usage, tuple(done))


def _freed(o: Outcome) -> bool:
    return bool(o.bytes_freed) or bool(o.entries)


def validate_scheduler_settings(
    mode: SchedulerMode | str,
    max_num_seqs: int,
    *,
    admission_cap: int | None = None,
    prefill_batch_size: int | None = None,
    completion_batch_size: int | None = None,
    queue_limit: int = DEFAULT_QUEUE_LIMIT,
) -> AdmissionSettings:
    """Check start-up settings; hyper mode refuses anything that allows more than one."""
    try:
        mode = SchedulerMode(mode)
    except ValueError:
        choices = ", ".join(m.value for m in SchedulerMode)
        raise ValueError(f"--scheduler-mode must be one of {choices}, got {mode!r}") from None
    flags = (("--max-num-seqs", max_num_seqs), ("--admission-cap", admission_cap),
             ("--prefill-batch-size", prefill_batch_size),
             ("--completion-batch-size", completion_batch_size))
    for flag, value in flags:
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if queue_limit < 0:
        raise ValueError(f"--queue-limit must be >= 0, got {queue_limit}")
    if mode is SchedulerMode.HYPER:
        for flag, value in flags:
            if value is not None and value > HYPER_ADMISSION_CAP:
                raise ValueError(
                    f"--scheduler-mode hyper admits exactly one request at a time, but "
                    f"{flag}={value} would allow {value}; set {flag}=1 or use "
                    f"--scheduler-mode default"
                )
        admission_cap = HYPER_ADMISSION_CAP
    return AdmissionSettings(scheduler_mode=mode, admission_cap=admission_cap,
                             queue_limit=queue_limit)
