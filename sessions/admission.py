"""Admission: decide before any prefill whether a request fits, and shed to make it fit.

One code path serves both RPCs:
- `Admit` (dry run): `bank_figures` -> `decide` -> `preview_shed`; nothing changes.
- `Generate`: the same `decide`, then `run_admission` performs the shed steps
  in order, re-measuring after each and stopping as soon as the request fits.

The ladder (DESIGN "Sessions and admission"), applied only when the projection
would cross the threshold (the level mark to stay under):
1. reclaim the MLX buffer pool (non-destructive, always first);
2. `shrink_to_bytes(protect_active=True)` - idle sessions' entries, LRU;
3. when the admission-chain shed is enabled, `shrink_for_admission(protect_tokens=prompt)`;
then, still over the *ceiling* -> a typed refusal naming the binding
constraint and the numbers. Between threshold and ceiling the request is
admitted. The prompt's own restore source is protected at every step: losing
it would add its tokens back to the prefill and invalidate the projection.

Gating happens before the memory ladder: admission pauses at soft (and above)
unless nothing is admitted (the first request always passes), hyper mode admits
exactly one request at a time, and waiting is bounded by the queue limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from opentelemetry import trace

import telemetry
from telemetry import names

from .bank import REASON_ADMISSION_CHAIN, REASON_PREFILL_ADMISSION, EntryKey, ShrinkPlan

if TYPE_CHECKING:
    from .bank import SessionBank

# Pressure levels as ints (proto PressureLevel numbering).
LEVEL_OK = 1
LEVEL_SOFT = 2
LEVEL_HARD = 3
LEVEL_EMERGENCY = 4
_LEVEL_NAMES = {LEVEL_OK: "ok", LEVEL_SOFT: "soft", LEVEL_HARD: "hard", LEVEL_EMERGENCY: "emergency"}

HYPER_ADMISSION_CAP = 1
DEFAULT_QUEUE_LIMIT = 32
DEFAULT_QUEUE_TIMEOUT_S = 30.0
DEFAULT_RESERVATION_TTL_S = 30.0
RETRY_AFTER_WAIT_S = 1.0  # paused / capped / queue full: about one enforcer tick
RETRY_AFTER_MEMORY_S = 2.0  # over the ceiling: give running requests time to finish

# Binding constraints (AdmitResponse.binding_constraint).
BINDING_CEILING = "ceiling"
BINDING_PREFILL_EXCEEDS_CEILING = "prefill_exceeds_ceiling"
BINDING_PAUSED_AT_SOFT = "paused_at_soft"
BINDING_PAUSED_AT_HARD = "paused_at_hard"
BINDING_PAUSED_AT_EMERGENCY = "paused_at_emergency"
BINDING_QUEUE_FULL = "queue_full"
BINDING_HYPER_CAP = "hyper_cap"
BINDING_ADMISSION_CAP = "admission_cap"
BINDING_THRESHOLD = "threshold"  # admitted, but only after shedding

# google.rpc.ErrorInfo reasons for refusals.
ERROR_REASONS: Mapping[str, str] = {
    BINDING_CEILING: "MEMORY_PRESSURE",
    BINDING_PREFILL_EXCEEDS_CEILING: "PREFILL_EXCEEDS_CEILING",
    BINDING_QUEUE_FULL: "QUEUE_FULL",
    BINDING_PAUSED_AT_SOFT: "MEMORY_PRESSURE",
    BINDING_PAUSED_AT_HARD: "MEMORY_PRESSURE",
    BINDING_PAUSED_AT_EMERGENCY: "MEMORY_PRESSURE",
    BINDING_HYPER_CAP: "QUEUE_FULL",
    BINDING_ADMISSION_CAP: "QUEUE_FULL",
}

# Attribute names not (yet) in telemetry.names.
ATTR_THRESHOLD = "plimsoll.threshold_bytes"
ATTR_BINDING = "plimsoll.binding_constraint"


class Verdict(StrEnum):
    ADMIT = "admit"
    ADMIT_AFTER_SHEDDING = "admit_after_shedding"
    WAIT = "wait"
    REJECT = "reject"


class ShedKind(StrEnum):
    RECLAIM_POOL = "reclaim_pool"
    SHRINK_TO_BYTES = "shrink_to_bytes"
    SHRINK_FOR_ADMISSION = "shrink_for_admission"


class SchedulerMode(StrEnum):
    DEFAULT = "default"
    HYPER = "hyper"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


# -- scheduler settings --------------------------------------------------------


@dataclass(frozen=True)
class SchedulerSettings:
    mode: SchedulerMode
    max_num_seqs: int
    admission_cap: int | None  # None: no admission-level cap (the engine batches)
    queue_limit: int


def validate_scheduler_settings(
    mode: SchedulerMode | str,
    max_num_seqs: int,
    *,
    admission_cap: int | None = None,
    prefill_batch_size: int | None = None,
    completion_batch_size: int | None = None,
    queue_limit: int = DEFAULT_QUEUE_LIMIT,
) -> SchedulerSettings:
    """Check start-up settings; hyper mode refuses anything that allows more than one."""
    try:
        mode = SchedulerMode(mode)
    except ValueError:
        choices = ", ".join(m.value for m in SchedulerMode)
        raise ValueError(f"--scheduler-mode must be one of {choices}, got {mode!r}") from None
    for flag, value in (("--max-num-seqs", max_num_seqs), ("--admission-cap", admission_cap),
                        ("--prefill-batch-size", prefill_batch_size),
                        ("--completion-batch-size", completion_batch_size)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be >= 1, got {value}")
    if queue_limit < 0:
        raise ValueError(f"--queue-limit must be >= 0, got {queue_limit}")
    if mode is SchedulerMode.HYPER:
        for flag, value in (("--max-num-seqs", max_num_seqs), ("--admission-cap", admission_cap),
                            ("--prefill-batch-size", prefill_batch_size),
                            ("--completion-batch-size", completion_batch_size)):
            if value is not None and value > HYPER_ADMISSION_CAP:
                raise ValueError(
                    f"--scheduler-mode hyper admits exactly one request at a time, but "
                    f"{flag}={value} would allow {value}; set {flag}=1 or use "
                    f"--scheduler-mode default"
                )
        admission_cap = HYPER_ADMISSION_CAP
    return SchedulerSettings(mode, max_num_seqs, admission_cap, queue_limit)


# -- inputs and decision -------------------------------------------------------


@dataclass(frozen=True)
class BankFigures:
    """Dry-run figures from the bank (see `bank_figures`)."""

    total_bytes: int = 0
    lru_freeable_bytes: int = 0  # shrink_to_bytes(0, protect_active=True) could free
    lru_freeable_entries: int = 0
    chain_freeable_bytes: int = 0  # shrink_for_admission(0, prompt) could free after that
    chain_freeable_entries: int = 0
    restore_prefix_tokens: int = 0  # the prompt's restore source length


@dataclass(frozen=True)
class AdmissionInputs:
    """Everything `decide` looks at; the caller measures, `decide` stays pure.

    `pool_bytes` is the part of `usage_bytes` that reclaiming the MLX buffer
    pool would free. `reserved_bytes` are other requests' outstanding Admit
    tickets (`ReservationBook.reserved_bytes(excluding=own ticket)`).
    `restore_bytes` is what restoring the cached prefix allocates (a deep copy
    of the snapshot; 0 when restored by reference). `floor_bytes`, when known,
    is usage nothing can shed (model weights): a request whose own bytes do not
    fit above it is refused as `prefill_exceeds_ceiling` (retrying won't help).
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
    level: int = LEVEL_OK
    admitted_in_flight: int = 0
    queue_depth: int = 0
    queue_limit: int = DEFAULT_QUEUE_LIMIT
    chain_shed_enabled: bool = True
    scheduler_mode: SchedulerMode = SchedulerMode.DEFAULT
    admission_cap: int | None = None
    floor_bytes: int | None = None
    bank: BankFigures = field(default_factory=BankFigures)


@dataclass(frozen=True)
class ShedStep:
    kind: ShedKind
    expected_free_bytes: int
    target_bytes: int | None = None  # the bank target, for the two shrinks


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    inputs: AdmissionInputs
    projected_bytes: int  # before any shedding
    projected_after_shed_bytes: int
    request_bytes: int  # projected - usage: what admitting adds (others' reservations included)
    headroom_bytes: int  # ceiling - usage
    shed: tuple[ShedStep, ...] = ()
    binding: str | None = None
    retry_after_s: float | None = None
    reason: str = ""
    numbers: Mapping[str, int] = field(default_factory=dict)

    @property
    def admits(self) -> bool:
        return self.verdict in (Verdict.ADMIT, Verdict.ADMIT_AFTER_SHEDDING)

    @property
    def shed_bytes(self) -> int:
        return sum(s.expected_free_bytes for s in self.shed)

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
    """usage + missed tokens x KV bytes/token + prefill transient (+ restore, + others' tickets)."""
    return inputs.usage_bytes + own_bytes(inputs) + inputs.reserved_bytes


def gate(
    level: int,
    admitted_in_flight: int,
    *,
    mode: SchedulerMode = SchedulerMode.DEFAULT,
    admission_cap: int | None = None,
    queue_depth: int = 0,
    queue_limit: int = DEFAULT_QUEUE_LIMIT,
) -> tuple[Verdict, str] | None:
    """The admission gate shared by `decide` and `AdmissionQueue`: None when open."""
    cap = HYPER_ADMISSION_CAP if mode is SchedulerMode.HYPER else admission_cap
    blocked: str | None = None
    if cap is not None and admitted_in_flight >= cap:
        blocked = BINDING_HYPER_CAP if mode is SchedulerMode.HYPER else BINDING_ADMISSION_CAP
    elif level >= LEVEL_SOFT and admitted_in_flight > 0:
        # Paused under pressure, but the first request when nothing is admitted passes.
        blocked = f"paused_at_{_LEVEL_NAMES.get(level, 'emergency')}"
    if blocked is None:
        return None
    if queue_depth >= queue_limit:
        return Verdict.REJECT, BINDING_QUEUE_FULL
    return Verdict.WAIT, blocked


def decide(inputs: AdmissionInputs) -> Decision:
    """The admission decision for `inputs`. Pure: no clock, no I/O, no bank access."""
    projected = project_bytes(inputs)
    request = projected - inputs.usage_bytes
    numbers = {
        "usage_bytes": inputs.usage_bytes,
        "projected_bytes": projected,
        "threshold_bytes": inputs.threshold_bytes,
        "ceiling_bytes": inputs.ceiling_bytes,
        "pool_bytes": inputs.pool_bytes,
        "reserved_bytes": inputs.reserved_bytes,
        "miss_tokens": miss_tokens(inputs),
        "kv_bytes_per_token": inputs.kv_bytes_per_token,
        "bank_bytes": inputs.bank.total_bytes,
    }
    base = Decision(
        verdict=Verdict.ADMIT, inputs=inputs, projected_bytes=projected,
        projected_after_shed_bytes=projected, request_bytes=request,
        headroom_bytes=inputs.ceiling_bytes - inputs.usage_bytes, numbers=numbers,
    )
    own = own_bytes(inputs)
    if inputs.floor_bytes is not None and inputs.floor_bytes + own > inputs.ceiling_bytes:
        return replace(
            base, verdict=Verdict.REJECT, binding=BINDING_PREFILL_EXCEEDS_CEILING,
            numbers={**numbers, "floor_bytes": inputs.floor_bytes, "request_bytes": own},
            reason=(f"prefill needs {_gib(own)} above the {_gib(inputs.floor_bytes)} floor, "
                    f"over the {_gib(inputs.ceiling_bytes)} ceiling even with nothing else running"),
        )
    gated = gate(
        inputs.level, inputs.admitted_in_flight, mode=inputs.scheduler_mode,
        admission_cap=inputs.admission_cap, queue_depth=inputs.queue_depth,
        queue_limit=inputs.queue_limit,
    )
    if gated is not None:
        verdict, binding = gated
        return replace(
            base, verdict=verdict, binding=binding, retry_after_s=RETRY_AFTER_WAIT_S,
            reason=f"{binding}: {inputs.admitted_in_flight} admitted, "
                   f"{inputs.queue_depth}/{inputs.queue_limit} waiting",
        )
    if projected <= inputs.threshold_bytes:
        return replace(base, reason=f"projected {_gib(projected)} fits under the threshold")
    steps, after = _ladder(inputs, projected)
    numbers = {**numbers, "projected_after_shed_bytes": after,
               "shed_bytes": sum(s.expected_free_bytes for s in steps)}
    if after > inputs.ceiling_bytes:
        return replace(
            base, verdict=Verdict.REJECT, shed=steps, projected_after_shed_bytes=after,
            binding=BINDING_CEILING, retry_after_s=RETRY_AFTER_MEMORY_S,
            numbers={**numbers, "shortfall_bytes": after - inputs.ceiling_bytes},
            reason=(f"projected {_gib(after)} after shedding {_gib(projected - after)} exceeds "
                    f"the ceiling {_gib(inputs.ceiling_bytes)} by "
                    f"{_gib(after - inputs.ceiling_bytes)} (usage {_gib(inputs.usage_bytes)}, "
                    f"{miss_tokens(inputs)} tokens x {inputs.kv_bytes_per_token} B)"),
        )
    verdict = Verdict.ADMIT_AFTER_SHEDDING if steps else Verdict.ADMIT
    return replace(
        base, verdict=verdict, shed=steps, projected_after_shed_bytes=after,
        binding=BINDING_THRESHOLD if steps else None, numbers=numbers,
        reason=f"projected {_gib(projected)} -> {_gib(after)} after shedding "
               f"(threshold {_gib(inputs.threshold_bytes)}, ceiling {_gib(inputs.ceiling_bytes)})",
    )


def _ladder(inputs: AdmissionInputs, projected: int) -> tuple[tuple[ShedStep, ...], int]:
    """Expected steps (in order, until the projection fits the threshold) and the result.

    Bank shrinks evict whole entries, so a step frees at least the deficit when
    enough is freeable; the expectation counts min(freeable, deficit).
    """
    steps: list[ShedStep] = []
    p = projected
    bank_now = inputs.bank.total_bytes
    pool = min(inputs.pool_bytes, inputs.usage_bytes)
    if pool > 0:
        steps.append(ShedStep(ShedKind.RECLAIM_POOL, pool))
        p -= pool
    rungs = [(ShedKind.SHRINK_TO_BYTES, inputs.bank.lru_freeable_bytes)]
    if inputs.chain_shed_enabled:
        rungs.append((ShedKind.SHRINK_FOR_ADMISSION, inputs.bank.chain_freeable_bytes))
    for kind, freeable in rungs:
        deficit = p - inputs.threshold_bytes
        if deficit <= 0:
            break
        free = min(freeable, deficit)
        if free > 0:
            steps.append(ShedStep(kind, free, target_bytes=max(0, bank_now - deficit)))
            p -= free
            bank_now -= free
    return tuple(steps), p


# -- bank dry runs -----------------------------------------------------------------


def _restore_keys(bank: SessionBank, model: str | None, prompt: Sequence[int] | None) -> tuple[EntryKey, ...]:
    if model is None or prompt is None:
        return ()
    src = bank.restore_source(model, prompt)
    return (src.key,) if src is not None else ()


def bank_figures(
    bank: SessionBank,
    model: str,
    prompt_tokens: Sequence[int],
    *,
    protect_session_ids: Iterable[str] = (),
) -> BankFigures:
    """What the ladder's two bank steps could free at most, without freeing it."""
    sids = tuple(protect_session_ids)
    keys = _restore_keys(bank, model, prompt_tokens)
    lru = bank.plan_shrink_to_bytes(0, protect_active=True, protect_keys=keys, protect_session_ids=sids)
    chain = bank.plan_shrink_for_admission(
        0, protect_tokens=prompt_tokens, model=model, protect_session_ids=sids,
        assume_evicted=lru.victims,
    )
    src = bank.restore_source(model, prompt_tokens)
    return BankFigures(
        total_bytes=lru.bytes_before,
        lru_freeable_bytes=lru.freed_bytes,
        lru_freeable_entries=lru.entries,
        chain_freeable_bytes=chain.freed_bytes,
        chain_freeable_entries=chain.entries,
        restore_prefix_tokens=src.prefix_len if src is not None else 0,
    )


@dataclass(frozen=True)
class ShedPreview:
    """Exactly what a decision's bank steps would evict now (Admit's "what would be shed")."""

    pool_bytes: int = 0
    lru: ShrinkPlan | None = None
    chain: ShrinkPlan | None = None

    @property
    def entries(self) -> int:
        return sum(p.entries for p in (self.lru, self.chain) if p is not None)

    @property
    def bank_bytes(self) -> int:
        return sum(p.freed_bytes for p in (self.lru, self.chain) if p is not None)

    @property
    def bytes(self) -> int:
        return self.pool_bytes + self.bank_bytes


def preview_shed(
    decision: Decision,
    bank: SessionBank | None,
    *,
    model: str | None,
    prompt_tokens: Sequence[int] | None,
    protect_session_ids: Iterable[str] = (),
) -> ShedPreview:
    pool = sum(s.expected_free_bytes for s in decision.shed if s.kind is ShedKind.RECLAIM_POOL)
    if bank is None:
        return ShedPreview(pool_bytes=pool)
    sids = tuple(protect_session_ids)
    keys = _restore_keys(bank, model, prompt_tokens)
    lru = chain = None
    for step in decision.shed:
        if step.kind is ShedKind.SHRINK_TO_BYTES:
            lru = bank.plan_shrink_to_bytes(
                step.target_bytes or 0, protect_active=True, protect_keys=keys,
                protect_session_ids=sids,
            )
        elif step.kind is ShedKind.SHRINK_FOR_ADMISSION:
            chain = bank.plan_shrink_for_admission(
                step.target_bytes or 0, protect_tokens=prompt_tokens, model=model,
                protect_session_ids=sids, assume_evicted=lru.victims if lru else (),
            )
    return ShedPreview(pool_bytes=pool, lru=lru, chain=chain)


# -- execution -------------------------------------------------------------------


@dataclass(frozen=True)
class StepResult:
    kind: ShedKind
    usage_before: int
    usage_after: int
    target_bytes: int | None = None
    pool_freed: int = 0
    entries_evicted: int = 0
    non_terminal: int = 0
    terminal: int = 0


@dataclass(frozen=True)
class AdmissionOutcome:
    admitted: bool
    verdict: Verdict
    decision: Decision
    usage_bytes: int  # as last measured
    projected_bytes: int  # usage_bytes + decision.request_bytes
    steps: tuple[StepResult, ...] = ()
    binding: str | None = None
    retry_after_s: float | None = None
    reason: str = ""
    numbers: Mapping[str, int] = field(default_factory=dict)

    @property
    def entries_evicted(self) -> int:
        return sum(s.entries_evicted for s in self.steps)

    @property
    def error_reason(self) -> str | None:
        return ERROR_REASONS.get(self.binding or "")


def run_admission(
    decision: Decision,
    bank: SessionBank | None,
    reclaim_pool: Callable[[], int],
    remeasure: Callable[[], int],
    *,
    model: str | None = None,
    prompt_tokens: Sequence[int] | None = None,
    protect_session_ids: Iterable[str] = (),
    tracer: trace.Tracer | None = None,
) -> AdmissionOutcome:
    """Perform a decision's ladder against real measurements (the Generate path).

    `reclaim_pool()` clears the MLX buffer pool and returns bytes freed (run it
    where MLX may be called: the engine thread); `remeasure()` returns process
    usage. Each step re-measures and the ladder stops as soon as usage + the
    request's bytes fit under the threshold. Bank targets are recomputed from
    the fresh measurement, not taken from the plan. A bank step runs only if
    the bank could still bring the request under the ceiling, so reusable
    state is never shed for a request that will be refused anyway; after a
    bank step evicts anything the pool is reclaimed again (freed arrays land
    in the pool first).
    """
    tr = tracer or telemetry.tracer()
    inputs = decision.inputs
    if decision.verdict is Verdict.WAIT:
        return _outcome(decision, False, inputs.usage_bytes, ())
    if decision.verdict is Verdict.ADMIT:
        return _outcome(decision, True, inputs.usage_bytes, ())
    if decision.binding in (BINDING_QUEUE_FULL, BINDING_PREFILL_EXCEEDS_CEILING):
        _record_refusal(tr, decision, decision.binding, inputs.usage_bytes, decision.reason)
        return _outcome(decision, False, inputs.usage_bytes, ())

    need = decision.request_bytes
    sids = tuple(protect_session_ids)
    steps: list[StepResult] = []
    with tr.start_as_current_span(names.SPAN_ADMISSION_SHED) as span:
        usage = inputs.usage_bytes
        if usage + need > inputs.threshold_bytes:
            freed = reclaim_pool()
            after = remeasure()
            steps.append(StepResult(ShedKind.RECLAIM_POOL, usage, after, pool_freed=freed))
            usage = after
        if bank is not None:
            usage = _bank_steps(bank, decision, usage, reclaim_pool, remeasure,
                                model, prompt_tokens, sids, steps)
        _shed_attrs(span, decision, steps, usage, model)
    admitted = usage + need <= inputs.ceiling_bytes
    if admitted:
        return _outcome(decision, True, usage, tuple(steps))
    reason = (f"projected {_gib(usage + need)} after shedding exceeds the ceiling "
              f"{_gib(inputs.ceiling_bytes)} by {_gib(usage + need - inputs.ceiling_bytes)}")
    _record_refusal(tr, decision, BINDING_CEILING, usage, reason)
    return _outcome(decision, False, usage, tuple(steps), binding=BINDING_CEILING, reason=reason)


def _bank_steps(
    bank: SessionBank,
    decision: Decision,
    usage: int,
    reclaim_pool: Callable[[], int],
    remeasure: Callable[[], int],
    model: str | None,
    prompt: Sequence[int] | None,
    sids: tuple[str, ...],
    steps: list[StepResult],
) -> int:
    inputs = decision.inputs
    need = decision.request_bytes
    if usage + need <= inputs.threshold_bytes:
        return usage
    keys = _restore_keys(bank, model, prompt)
    if model is not None and prompt is not None:
        figures = bank_figures(bank, model, prompt, protect_session_ids=sids)
    else:
        lru = bank.plan_shrink_to_bytes(0, protect_active=True, protect_session_ids=sids)
        figures = BankFigures(bank.total_bytes(), lru.freed_bytes, lru.entries)
    freeable = figures.lru_freeable_bytes
    if inputs.chain_shed_enabled:
        freeable += figures.chain_freeable_bytes
    if usage + need - freeable > inputs.ceiling_bytes:
        return usage  # hopeless: keep the bank for requests that can fit

    def deficit() -> int:
        return usage + need - inputs.threshold_bytes

    rungs = [ShedKind.SHRINK_TO_BYTES]
    if inputs.chain_shed_enabled:
        rungs.append(ShedKind.SHRINK_FOR_ADMISSION)
    for kind in rungs:
        if deficit() <= 0:
            break
        target = max(0, bank.total_bytes() - deficit())
        nt = t = 0
        if kind is ShedKind.SHRINK_TO_BYTES:
            n = bank.shrink_to_bytes(target, protect_active=True, reason=REASON_PREFILL_ADMISSION,
                                     protect_keys=keys, protect_session_ids=sids)
        else:
            nt, t = bank.shrink_for_admission(target, protect_tokens=prompt, model=model,
                                              reason=REASON_ADMISSION_CHAIN,
                                              protect_session_ids=sids)
            n = nt + t
        pool = reclaim_pool() if n else 0
        after = remeasure()
        steps.append(StepResult(kind, usage, after, target, pool, n, nt, t))
        usage = after
    return usage


def _outcome(
    decision: Decision,
    admitted: bool,
    usage: int,
    steps: tuple[StepResult, ...],
    *,
    binding: str | None = None,
    reason: str | None = None,
) -> AdmissionOutcome:
    projected = usage + decision.request_bytes
    if admitted:
        shed = any(s.pool_freed or s.entries_evicted for s in steps)
        verdict = Verdict.ADMIT_AFTER_SHEDDING if shed else Verdict.ADMIT
    else:
        verdict = Verdict.WAIT if decision.verdict is Verdict.WAIT else Verdict.REJECT
    binding = binding or (None if admitted else decision.binding)
    numbers = dict(decision.numbers)
    numbers.update(usage_bytes=usage, projected_after_shed_bytes=projected)
    if binding == BINDING_CEILING:
        numbers["shortfall_bytes"] = projected - decision.inputs.ceiling_bytes
    retry = None if admitted else (
        RETRY_AFTER_MEMORY_S if binding == BINDING_CEILING else decision.retry_after_s
    )
    return AdmissionOutcome(
        admitted=admitted, verdict=verdict, decision=decision, usage_bytes=usage,
        projected_bytes=projected, steps=steps, binding=binding, retry_after_s=retry,
        reason=reason or decision.reason, numbers=numbers,
    )


def _shed_attrs(span: trace.Span, decision: Decision, steps: list[StepResult], usage: int,
                model: str | None) -> None:
    inputs = decision.inputs
    span.set_attributes({
        names.ATTR_USAGE: usage,
        names.ATTR_BYTES_BEFORE: inputs.usage_bytes,
        names.ATTR_BYTES_AFTER: usage,
        names.ATTR_BYTES_FREED: max(0, inputs.usage_bytes - usage),
        names.ATTR_PROJECTED: decision.projected_bytes,
        names.ATTR_CEILING: inputs.ceiling_bytes,
        ATTR_THRESHOLD: inputs.threshold_bytes,
        names.ATTR_ENTRIES_EVICTED: sum(s.entries_evicted for s in steps),
        names.ATTR_NON_TERMINAL_EVICTED: sum(s.non_terminal for s in steps),
        names.ATTR_TERMINAL_EVICTED: sum(s.terminal for s in steps),
        names.ATTR_PROMPT_TOKENS: inputs.prompt_tokens,
        names.ATTR_CACHED_TOKENS: inputs.reusable_prefix_tokens,
        names.ATTR_REASON: ",".join(s.kind.value for s in steps) or "none",
    })
    if model is not None:
        span.set_attribute(names.ATTR_MODEL, model)


def _record_refusal(tr: trace.Tracer, decision: Decision, binding: str | None, usage: int,
                    reason: str) -> None:
    inputs = decision.inputs
    with tr.start_as_current_span(names.SPAN_ADMISSION_REFUSAL) as span:
        span.set_attributes({
            ATTR_BINDING: binding or "",
            names.ATTR_VERDICT: Verdict.REJECT.value,
            names.ATTR_USAGE: usage,
            names.ATTR_PROJECTED: usage + decision.request_bytes,
            names.ATTR_CEILING: inputs.ceiling_bytes,
            ATTR_THRESHOLD: inputs.threshold_bytes,
            names.ATTR_LEVEL: inputs.level,
            names.ATTR_PROMPT_TOKENS: inputs.prompt_tokens,
            names.ATTR_REASON: reason,
        })


# -- reservations ------------------------------------------------------------------


@dataclass(frozen=True)
class Reservation:
    ticket: str
    nbytes: int
    model: str
    created_at: float
    expires_at: float


class ReservationBook:
    """Admit tickets: bytes set aside for a following Generate, until redeemed or expired.

    Outstanding tickets count against every *other* request's projection.
    """

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        default_ttl_s: float = DEFAULT_RESERVATION_TTL_S,
        id_factory: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._clock = clock
        self._default_ttl_s = default_ttl_s
        self._new_id = id_factory
        self._lock = threading.Lock()
        self._tickets: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._tickets)

    def reserve(self, nbytes: int, model: str, ttl_s: float | None = None) -> Reservation:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        ttl = ttl_s if ttl_s else self._default_ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        now = self._clock()
        res = Reservation(self._new_id(), nbytes, model, now, now + ttl)
        with self._lock:
            self._tickets[res.ticket] = res
        return res

    def get(self, ticket: str) -> Reservation | None:
        with self._lock:
            res = self._tickets.get(ticket)
        return res if res is not None and self._clock() < res.expires_at else None

    def redeem(self, ticket: str) -> Reservation | None:
        """Consume a ticket; None when unknown or expired (an expired one is dropped)."""
        with self._lock:
            res = self._tickets.pop(ticket, None)
        if res is None or self._clock() >= res.expires_at:
            return None
        return res

    def cancel(self, ticket: str) -> Reservation | None:
        with self._lock:
            return self._tickets.pop(ticket, None)

    def expire(self, now: float | None = None) -> list[Reservation]:
        now = self._clock() if now is None else now
        with self._lock:
            gone = [r for r in self._tickets.values() if now >= r.expires_at]
            for r in gone:
                del self._tickets[r.ticket]
        return gone

    def reserved_bytes(
        self, excluding: str | None = None, *, model: str | None = None, now: float | None = None
    ) -> int:
        """Bytes held by live tickets other than `excluding` (optionally one model's)."""
        now = self._clock() if now is None else now
        with self._lock:
            return sum(
                r.nbytes for r in self._tickets.values()
                if r.ticket != excluding and now < r.expires_at
                and (model is None or r.model == model)
            )


# -- waiting -----------------------------------------------------------------------


class QueueOutcome(StrEnum):
    ADMITTED = "admitted"
    TIMEOUT = "timeout"
    QUEUE_FULL = "queue_full"


@dataclass
class AdmissionSlot:
    """A held admission; release it when the request ends (idempotent)."""

    _queue: AdmissionQueue
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._queue._release()


@dataclass(frozen=True)
class QueueResult:
    outcome: QueueOutcome
    slot: AdmissionSlot | None = None
    waited_s: float = 0.0
    binding: str | None = None  # what made it wait (or fail)
    retry_after_s: float | None = None

    @property
    def admitted(self) -> bool:
        return self.outcome is QueueOutcome.ADMITTED


class AdmissionQueue:
    """Bounded FIFO waiting for the admission gate (pause at soft, hyper/admission cap).

    Asyncio-only: call every method on the event loop's thread. The gate is
    `gate()`, the same function `decide` uses, so Admit's WAIT and Generate's
    queue agree. The memory ladder is separate: run it once a slot is held.
    """

    def __init__(
        self,
        *,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        mode: SchedulerMode = SchedulerMode.DEFAULT,
        admission_cap: int | None = None,
        level: int = LEVEL_OK,
    ) -> None:
        self.queue_limit = queue_limit
        self.mode = mode
        self.admission_cap = admission_cap
        self._level = level
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def level(self) -> int:
        return self._level

    def blocked_by(self) -> str | None:
        """What currently blocks a new admission (None when the gate is open)."""
        g = gate(self._level, self._in_flight, mode=self.mode, admission_cap=self.admission_cap,
                 queue_limit=1 << 62)
        return g[1] if g is not None else None

    def set_level(self, level: int) -> None:
        """The enforcer reports the pressure level; dropping below soft resumes admissions."""
        self._level = level
        self._pump()

    async def acquire(self, timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S) -> QueueResult:
        loop = asyncio.get_running_loop()
        blocked = self.blocked_by()
        if blocked is None and not self._waiters:
            self._in_flight += 1
            return QueueResult(QueueOutcome.ADMITTED, AdmissionSlot(self))
        if len(self._waiters) >= self.queue_limit:
            return QueueResult(QueueOutcome.QUEUE_FULL, binding=BINDING_QUEUE_FULL,
                               retry_after_s=RETRY_AFTER_WAIT_S)
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        started = loop.time()
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        except asyncio.CancelledError:
            self._abandon(fut)
            raise
        waited = loop.time() - started
        if fut.done() and not fut.cancelled():
            return QueueResult(QueueOutcome.ADMITTED, AdmissionSlot(self), waited_s=waited)
        self._abandon(fut)
        return QueueResult(QueueOutcome.TIMEOUT, waited_s=waited,
                           binding=self.blocked_by() or blocked, retry_after_s=RETRY_AFTER_WAIT_S)

    def _abandon(self, fut: asyncio.Future[None]) -> None:
        """A waiter gives up: if it was granted meanwhile, hand the slot back."""
        if fut.done() and not fut.cancelled():
            self._release()
            return
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        fut.cancel()

    def _release(self) -> None:
        self._in_flight = max(0, self._in_flight - 1)
        self._pump()

    def _pump(self) -> None:
        """Grant waiters in FIFO order while the gate is open."""
        while self._waiters and self.blocked_by() is None:
            fut = self._waiters.popleft()
            if fut.done():
                continue
            self._in_flight += 1
            fut.set_result(None)


def queue_from_settings(settings: SchedulerSettings, *, level: int = LEVEL_OK) -> AdmissionQueue:
    """An `AdmissionQueue` honouring validated start-up settings."""
    return AdmissionQueue(queue_limit=settings.queue_limit, mode=settings.mode,
                          admission_cap=settings.admission_cap, level=level)
