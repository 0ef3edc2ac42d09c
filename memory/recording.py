"""The one table from each memory action to its span, its metric and its WatchPressure event.

The governor opens the span before the executor does the work (so the work's
own spans, an unload's for instance, are its children) and fills in what
happened after; metrics count only what was carried out. Every name comes from
`telemetry.names`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

import telemetry
from memory import actions as act
from memory.actions import Action, Outcome
from memory.levels import PressureLevel
from telemetry import names
from telemetry.instruments import Instruments, instruments

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Entry:
    span: str | None  # None: no span (bookkeeping actions)
    event: str | None  # the WatchPressure action kind; None: not an event


TABLE: dict[type, Entry] = {
    act.ClearAuxCaches: Entry(names.SPAN_RECLAIM, "clear_aux_caches"),
    act.PressureReclaim: Entry(names.SPAN_RECLAIM, "pressure_reclaim"),
    act.IdleReclaim: Entry(names.SPAN_RECLAIM, "idle_reclaim"),
    act.ShrinkSessionCache: Entry(names.SPAN_BANK_SHRINK, "shrink_sessions"),
    act.ExpireSessions: Entry(names.SPAN_BANK_EXPIRE, "expire_sessions"),
    act.EvictModel: Entry(names.SPAN_EVICT, "evict_model"),
    act.AbortRequests: Entry(names.SPAN_ABORT, "abort_requests"),
    act.MarkPendingUnload: Entry(names.SPAN_EVICT, "mark_pending_unload"),
    act.AbortLoad: Entry(names.SPAN_LOAD_ABORT, "abort_load"),
    act.PrefillAborted: Entry(names.SPAN_PREFILL_ABORT, "prefill_abort"),
    act.Refuse: Entry(names.SPAN_ADMISSION_REFUSAL, "refuse"),
    act.RefuseLoad: Entry(names.SPAN_LOAD_REFUSAL, "refuse_load"),
    act.PauseAdmission: Entry(None, "pause_admission"),
    act.ResumeAdmission: Entry(None, "resume_admission"),
    act.AdjustStoreCacheCap: Entry(None, "store_cache_cap"),
    act.AdjustBatchCap: Entry(None, "batch_cap"),
    act.PropagateLimits: Entry(None, None),
    act.Transition: Entry(names.SPAN_LEVEL_TRANSITION, None),  # published as a transition
}


def entry_for(action: Action) -> Entry:
    return TABLE[type(action)]


def event_kind(action: Action) -> str | None:
    return TABLE[type(action)].event


def before(action: Action, level: PressureLevel, usage: int) -> dict[str, Any]:
    """What is known before the work: the decision."""
    attrs: dict[str, Any] = {names.ATTR_LEVEL: level.label, names.ATTR_USAGE: usage}
    model = act.model_of(action)
    if model:
        attrs[names.ATTR_MODEL] = model
    reason = act.reason_of(action)
    if reason:
        attrs[names.ATTR_REASON] = reason
    match action:
        case act.PressureReclaim() | act.IdleReclaim():
            attrs[names.ATTR_RECLAIM_KIND] = ("pressure" if isinstance(action, act.PressureReclaim)
                                              else "idle")
        case act.ClearAuxCaches():
            attrs[names.ATTR_REASON] = "aux_caches"
            attrs[names.ATTR_RECLAIM_KIND] = "aux_caches"
        case act.ShrinkSessionCache(target_bytes=target, protect_active=protect, mode=mode):
            attrs[names.ATTR_TARGET] = target
            attrs[names.ATTR_PROTECT_ACTIVE] = protect
            attrs[names.ATTR_SHRINK_MODE] = mode.value
        case act.EvictModel(predicted_bytes=predicted) if predicted is not None:
            attrs[names.ATTR_TARGET] = predicted
        case act.MarkPendingUnload():
            attrs[names.ATTR_PENDING_UNLOAD] = True
        case act.AbortRequests(keep_loaded=keep, request_ids=ids):
            attrs[names.ATTR_KEEP_LOADED] = keep
            attrs[names.ATTR_ABORT_KIND] = "request"
            if ids is not None:
                attrs[names.ATTR_REQUEST_IDS] = list(ids)
        case act.AbortLoad():
            attrs[names.ATTR_ABORT_KIND] = "load"
        case act.PrefillAborted():
            attrs[names.ATTR_ABORT_KIND] = "prefill"
            attrs[names.ATTR_REQUEST_IDS] = [action.request_id]
            attrs[names.ATTR_PROMPT_TOKENS] = action.prompt_tokens
            attrs[names.ATTR_REMAINING_TOKENS] = action.remaining_tokens
            attrs[names.ATTR_CHUNK_TOKENS] = action.chunk_tokens
        case act.Refuse():
            attrs[names.ATTR_BINDING] = action.binding
            attrs[names.ATTR_REASON] = action.message
            attrs[names.ATTR_TRIED] = list(action.tried)
            for key, attr in (("projected_bytes", names.ATTR_PROJECTED),
                              ("admission_limit_bytes", names.ATTR_ADMISSION_LIMIT),
                              ("shed_line_bytes", names.ATTR_SHED_LINE)):
                if key in action.numbers:
                    attrs[attr] = action.numbers[key]
        case act.Transition():
            attrs.update({
                names.ATTR_FROM_LEVEL: action.from_level.label,
                names.ATTR_LEVEL: action.to_level.label,
                names.ATTR_USAGE: action.usage_bytes,
                names.ATTR_CEILING: action.ceiling_bytes,
                names.ATTR_TARGET: action.soft_bytes,
                names.ATTR_REASON: action.reason,
            })
    return attrs


# Outcome field -> span attribute, for what happened.
_AFTER = (
    ("bytes_freed", names.ATTR_BYTES_FREED),
    ("entries", names.ATTR_ENTRIES_EVICTED),
    ("non_terminal", names.ATTR_NON_TERMINAL_EVICTED),
    ("terminal", names.ATTR_TERMINAL_EVICTED),
    ("accepted", names.ATTR_ACCEPTED),
    ("value", names.ATTR_CAP),
    ("skipped", names.ATTR_SKIPPED),
    ("error", names.ATTR_ERROR),
)


def after(outcome: Outcome) -> dict[str, Any]:
    """What happened."""
    attrs: dict[str, Any] = {
        attr: value for field, attr in _AFTER
        if (value := getattr(outcome, field)) is not None
    }
    if outcome.request_ids:
        attrs[names.ATTR_REQUEST_IDS] = list(outcome.request_ids)
    return attrs


class Recorder:
    """Spans and counters for actions, through `TABLE`."""

    def __init__(self, inst: Instruments | None = None,
                 tracer: trace.Tracer | None = None) -> None:
        self._inst = inst
        self._tracer = tracer

    @property
    def tracer(self) -> trace.Tracer:
        return self._tracer or telemetry.tracer()

    @property
    def inst(self) -> Instruments:
        return self._inst or instruments()

    @contextlib.contextmanager
    def span(self, action: Action, level: PressureLevel, usage: int
             ) -> Iterator[trace.Span | None]:
        name = entry_for(action).span
        if name is None:
            yield None
            return
        with self.tracer.start_as_current_span(name, attributes=before(action, level, usage)) as span:
            yield span

    def finish(self, span: trace.Span | None, outcome: Outcome) -> None:
        if span is not None:
            span.set_attributes(after(outcome))
            if not outcome.ok:
                span.set_status(trace.Status(trace.StatusCode.ERROR, outcome.error or ""))
        self.count(outcome)
        if isinstance(outcome.action, act.EvictModel | act.AbortRequests | act.AbortLoad | act.MarkPendingUnload
                      | act.PrefillAborted) or not outcome.ok:
            log.warning("memory action %s -> %s", outcome.action,
                        outcome.skipped or outcome.error or "done")

    def count(self, outcome: Outcome) -> None:
        if not outcome.done:
            return
        inst = self.inst
        match outcome.action:
            case act.EvictModel(model_id=m, reason=reason):
                inst.evictions.add(1, {names.ATTR_REASON: reason, names.ATTR_MODEL: m,
                                       names.ATTR_EVICTION_KIND: "model"})
            case act.AbortRequests(model_id=m, reason=reason) if outcome.request_ids:
                inst.aborts.add(len(outcome.request_ids), {
                    names.ATTR_REASON: reason, names.ATTR_MODEL: m,
                    names.ATTR_ABORT_KIND: "request"})
            case act.AbortLoad(model_id=m, reason=reason):
                inst.aborts.add(1, {names.ATTR_REASON: reason, names.ATTR_MODEL: m,
                                    names.ATTR_ABORT_KIND: "load"})
            case act.PrefillAborted(model_id=m, reason=reason):
                inst.aborts.add(1, {names.ATTR_REASON: reason, names.ATTR_MODEL: m,
                                    names.ATTR_ABORT_KIND: "prefill"})
            case act.ShrinkSessionCache(reason=reason) | act.ExpireSessions(reason=reason) \
                    if outcome.entries:
                inst.shrinks.add(1, {names.ATTR_REASON: reason})
                inst.evictions.add(outcome.entries, {
                    names.ATTR_REASON: reason, names.ATTR_EVICTION_KIND: "session_entry"})
            case act.PressureReclaim() | act.IdleReclaim() | act.ClearAuxCaches():
                kind = before(outcome.action, PressureLevel.OK, 0)[names.ATTR_RECLAIM_KIND]
                inst.reclaims.add(1, {names.ATTR_RECLAIM_KIND: kind})
            case act.Refuse(binding=binding, error_reason=reason):
                inst.refusals.add(1, {names.ATTR_BINDING: binding, names.ATTR_REASON: reason})
            case act.Transition(from_level=a, to_level=b):
                inst.transitions.add(1, {names.ATTR_FROM_LEVEL: a.label,
                                         names.ATTR_LEVEL: b.label})
