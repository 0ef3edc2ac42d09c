"""The Generate pipeline: tokenize → admit through the governor → restore → submit → stream.

Also the Admit RPC, which runs the same admission as a preview so it says what
Generate would do at that instant, and the engine-thread hook that stores a
finished session turn in the bank.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry import trace

from engine import kv_snapshot
from engine.errors import (
    MODEL_UNLOADING,
    RESERVATION_LIMIT,
    FailedPrecondition,
    NotFound,
    PlimsollError,
    ResourceExhausted,
    Unavailable,
    Violations,
    check_owner_quota,
)
from engine.pool import KeepAlive, ModelEntry, ModelPool
from engine.request import (
    DEFAULT_MAX_TOKENS,
    ChatMessage,
    Chunk,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
    SamplingParams,
    validate_against_model,
    validate_chat,
    validate_stop,
)
from memory.governor import Governor
from memory.levels import PressureLevel
from memory.plans.admission import (
    BINDING_IN_FLIGHT_LIMIT,
    ERROR_REASONS,
    RETRY_AFTER_WAIT_S,
    AdmissionRequest,
    AdmissionResult,
    Verdict,
    own_bytes,
)
from service.lifecycle import Lifecycle
from service.metrics import RequestMetrics
from sessions.activity import ActiveSessions
from sessions.admission import AdmissionQueue, AdmissionSlot, QueueOutcome
from sessions.bank import SessionBank, SessionEntry
from sessions.cold_tier import ColdTier
from sessions.disk_format import load_snapshot
from sessions.reservations import Grant, Reservation, ReservationBook, request_digest
from telemetry import names, tracer

DEFAULT_CHUNK_TOKENS = 64


@dataclass
class GenerateSpec:
    """A Generate request before tokenization: exactly one of text, token_ids, chat."""

    model: str = ""
    text: str | None = None
    token_ids: list[int] | None = None
    chat: list[ChatMessage] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = 0
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    session_id: str = ""
    admission_ticket: str = ""
    max_tokens_per_chunk: int = 0
    # Replaces the model's keep-alive; None keeps it (renewed by this request).
    keep_alive: KeepAlive | None = None
    owner: str = ""  # the session's owner (the bank's --max-sessions-per-owner)
    stop_token_ids: tuple[int, ...] = ()  # SMG's MLX protocol (service/smg_worker.py)


@dataclass
class Admitted:
    """What the start message reports."""

    request_id: str
    model_id: str
    prompt_tokens: int
    cached_tokens: int  # restored, from RAM or from disk
    pressure_level: PressureLevel
    cached_disk_tokens: int = 0  # of cached_tokens, those restored from the disk tier


@dataclass
class AdmitReport:
    """The answer to ControlService.Admit: what Generate would do at that instant."""

    result: AdmissionResult
    verdict: Verdict
    binding: str | None
    error_reason: str | None
    retry_after_s: float | None
    reason: str
    reserved: Grant | None = None
    ticket_expires_at: float = 0.0  # wall clock

    @classmethod
    def of(cls, result: AdmissionResult) -> AdmitReport:
        return cls(result, result.verdict, result.binding, result.error_reason,
                   result.retry_after_s, result.reason)


@dataclass
class PipelineSettings:
    max_queued_requests: int = 256  # requests in flight (running + waiting) per server
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    admission_timeout_s: float = 30.0
    session_bank: bool = True
    # 8 or 4: bank snapshots (RAM and disk) kept as mlx-lm's quantized KV cache; 0: not.
    session_kv_bits: int = 0
    max_reservations_per_owner: int = 64  # live Admit tickets one owner may hold


class GeneratePipeline:
    def __init__(self, pool: ModelPool, governor: Governor, bank: SessionBank,
                 queue: AdmissionQueue, reservations: ReservationBook,
                 active: ActiveSessions, settings: PipelineSettings, lifecycle: Lifecycle,
                 metrics: RequestMetrics) -> None:
        self.pool = pool
        self.governor = governor
        self.bank = bank
        self.queue = queue
        self.reservations = reservations
        self.active = active
        self.settings = settings
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.in_flight = 0
        self.cold: ColdTier | None = None  # the session cold tier, when on (assembly)
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()

    # -- tokenize and validate --------------------------------------------------------
    def prepare(self, spec: GenerateSpec) -> tuple[ModelEntry, GenerationRequest]:
        """Resolve, tokenize and validate; raises a PlimsollError naming the field."""
        if self.lifecycle.draining:
            raise Unavailable("server is draining; retry on another replica", retry_after_s=1.0,
                              reason="DRAINING")
        # Every bad field is reported at once (one BadRequest listing them all).
        violations = Violations()
        spec.sampling.validate(violations)
        validate_stop(spec.stop, violations)
        try:
            entry = self.pool.ready(spec.model)
        except PlimsollError:
            violations.raise_if_any()  # bad fields first: they would fail on any model
            raise
        info = entry.engine.info if entry.engine else None
        if info is None:
            raise Unavailable(f"model '{entry.model_id}' is being unloaded",
                              retry_after_s=1.0, reason=MODEL_UNLOADING)
        before = len(violations)
        tokens = tokenize(info.tokenizer, spec, violations)
        max_tokens = spec.max_tokens or min(
            self.settings.default_max_tokens, max(1, info.context_length - len(tokens))
        )
        if len(violations) == before:  # a prompt was given: check it against the model
            validate_against_model(tokens, max_tokens, info.vocab_size, info.context_length,
                                   violations)
        violations.raise_if_any()
        request = GenerationRequest(
            request_id=f"req-{self._prefix}-{next(self._ids)}",
            model_id=entry.model_id,
            prompt_tokens=tokens,
            sampling=spec.sampling,
            max_tokens=max_tokens,
            stop=spec.stop,
            ignore_eos=spec.ignore_eos,
            session_id=spec.session_id,
            owner=spec.owner,
            max_tokens_per_chunk=spec.max_tokens_per_chunk,
            stop_token_ids=spec.stop_token_ids,
        )
        return entry, request

    def _admission_request(self, entry: ModelEntry, request: GenerationRequest,
                           holds_slot: bool, own_reservation_bytes: int = 0) -> AdmissionRequest:
        return AdmissionRequest(
            model=entry.model_id,
            prompt_tokens=tuple(request.prompt_tokens),
            max_tokens=request.max_tokens,
            kv_bytes_per_token=entry.kv_bytes_per_token,
            attention_heads=entry.attention_heads,
            prefill_step_size=self.pool.settings.prefill_step_size,
            prefill_conversion=entry.prefill_conversion,
            prefill_cost_factor=_prefill_cost_factor(entry),
            holds_slot=holds_slot,
            own_reservation_bytes=own_reservation_bytes,
        )

    # -- Admit ------------------------------------------------------------------------------
    async def admit(self, spec: GenerateSpec, reserve: bool, ttl_s: float | None,
                    client_request_id: str = "", owner: str = "") -> AdmitReport:
        """ControlService.Admit: the admission Generate would run, as a preview."""
        entry, request = self.prepare(spec)
        # Tickets this request holds are its own bytes, not another client's: the one
        # it would redeem, and the one an earlier try with its client_request_id took.
        own = [self._ticket_for(spec, entry, request, consume=False)]
        if client_request_id:
            earlier = self.reservations.by_client_request_id(client_request_id)
            if earlier is not None and earlier.digest == _digest(request):
                own.append(earlier)
        held = {r.ticket: r.nbytes for r in own if r is not None}
        result = await self.governor.admit(
            self._admission_request(entry, request, False, sum(held.values())),
            preview=True)
        if result is None:
            raise Unavailable("memory could not be measured; retry", retry_after_s=1.0,
                              reason="MEMORY_NOT_MEASURED")
        report = AdmitReport.of(result)
        if self.in_flight >= self.settings.max_queued_requests:
            # Generate checks its in-flight limit before admission: it would be refused.
            report.verdict, report.binding = Verdict.WAIT, BINDING_IN_FLIGHT_LIMIT
            report.error_reason = ERROR_REASONS[BINDING_IN_FLIGHT_LIMIT]
            report.retry_after_s = RETRY_AFTER_WAIT_S
            report.reason = self._in_flight_message()
        if reserve and report.verdict in (Verdict.ADMIT, Verdict.ADMIT_AFTER_SHEDDING):
            if len(own) < 2 or own[-1] is None:  # not a retry of a ticket it holds
                self._check_reservation_quota(owner)
            grant = self.reservations.reserve(
                own_bytes(result.decision.inputs), entry.model_id, _digest(request), ttl_s,
                client_request_id, owner)
            report.reserved = grant
            held = grant.reservation
            report.ticket_expires_at = time.time() + (held.expires_at - time.monotonic())
            if grant.clamped:
                report.reason += (f"; reservation_ttl clamped to the server maximum "
                                  f"{self.reservations.max_ttl_s:g}s")
        return report

    def _check_reservation_quota(self, owner: str) -> None:
        check_owner_quota(owner, self.reservations.owner_count(owner),
                          self.settings.max_reservations_per_owner, what="reservations",
                          flag="--max-reservations-per-owner", reason=RESERVATION_LIMIT,
                          remedy="redeem them, or let their TTLs run out")

    def _ticket_for(self, spec: GenerateSpec, entry: ModelEntry, request: GenerationRequest,
                    *, consume: bool) -> Reservation | None:
        """The reservation `spec.admission_ticket` names, checked against the request it
        was issued for; `consume` redeems it (the Generate that carries it)."""
        if not spec.admission_ticket:
            return None
        book = self.reservations
        held = book.redeem(spec.admission_ticket) if consume else book.get(spec.admission_ticket)
        if held is None:
            raise NotFound(f"admission_ticket '{spec.admission_ticket}' is unknown, expired "
                           "or already redeemed", "ticket",
                           resource_name=spec.admission_ticket)
        if held.model != entry.model_id or held.digest != _digest(request):
            raise FailedPrecondition(
                f"admission_ticket '{spec.admission_ticket}' was issued for another request "
                f"(model '{held.model}'); a ticket is bound to its model, prompt and "
                "max_tokens", reason="TICKET_MISMATCH")
        return held

    def _in_flight_message(self) -> str:
        return (f"{self.in_flight} requests in flight, the limit is "
                f"{self.settings.max_queued_requests}")

    # -- Generate -----------------------------------------------------------------------------
    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Admitted | Event]:
        try:
            entry, request = self.prepare(spec)
            # A ticket ends with the Generate that carries it, however that ends.
            self._ticket_for(spec, entry, request, consume=True)
        except PlimsollError:
            if spec.admission_ticket:
                self.reservations.redeem(spec.admission_ticket)
            raise
        if self.in_flight >= self.settings.max_queued_requests:
            raise ResourceExhausted(
                self._in_flight_message(),
                reason=ERROR_REASONS[BINDING_IN_FLIGHT_LIMIT],
                retry_after_s=RETRY_AFTER_WAIT_S,
                metadata={"in_flight": str(self.in_flight),
                          "limit": str(self.settings.max_queued_requests)},
            )
        self.governor.note_activity()
        span = tracer().start_span(names.SPAN_GENERATE, attributes={
            names.ATTR_REQUEST_ID: request.request_id,
            names.ATTR_MODEL: entry.model_id,
            names.ATTR_PROMPT_TOKENS: len(request.prompt_tokens),
        })
        self.in_flight += 1
        self.pool.acquire(entry)
        if spec.keep_alive is not None:
            entry.keep_alive_s = spec.keep_alive.seconds  # counted from this request's end
        session = request.session_id or None
        self.active.begin(session)
        slot: AdmissionSlot | None = None
        try:
            with trace.use_span(span):  # admission's spans are its children
                slot = await self._wait_for_slot()
                await self._admit(entry, request)
                cache, cached, cached_disk = await self._restore(entry, request)
            span.set_attribute(names.ATTR_CACHED_TOKENS, cached)
            # Not current across the yields: a stream resumes (or is closed by a
            # cancelled client) in whatever context its consumer runs.
            async for event in self._stream(entry, request, cache, cached, span,
                                            cached_disk):
                yield event
        except Exception as exc:
            span.record_exception(exc)
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            raise
        finally:
            if slot is not None:
                slot.release()
            self.active.end(session)
            self.in_flight -= 1
            self.pool.release(entry)
            span.end()

    async def _wait_for_slot(self) -> AdmissionSlot:
        result = await self.queue.acquire(self.settings.admission_timeout_s)
        if result.outcome is QueueOutcome.ADMITTED and result.slot is not None:
            return result.slot
        if result.outcome is QueueOutcome.CLOSED:
            raise Unavailable("server is shutting down; retry on another replica",
                              retry_after_s=1.0, reason="DRAINING")
        full = result.outcome is QueueOutcome.QUEUE_FULL
        level = self.governor.level.label
        self.metrics.admitted("queue_full" if full else "wait_timeout", "")
        raise ResourceExhausted(
            ("admission queue is full" if full else
             f"waited {result.waited_s:.1f}s for admission ({result.binding})")
            + f"; level {level}",
            reason="QUEUE_FULL" if full else "ADMISSION_TIMEOUT",
            retry_after_s=result.retry_after_s or 1.0,
            metadata={"binding": result.binding or "", "level": level,
                      "waiting": str(self.queue.waiting)},
        )

    async def _admit(self, entry: ModelEntry, request: GenerationRequest) -> None:
        result = await self.governor.admit(self._admission_request(entry, request, True))
        if result is None:
            return  # nothing could be measured: the engine's prefill guard still holds
        self.metrics.admitted(result.verdict.value, entry.model_id)
        if result.admitted:
            return
        refusal = result.refusal
        numbers = {k: str(v) for k, v in (refusal.numbers if refusal else {}).items()}
        raise ResourceExhausted(
            f"refused before prefill: {result.reason}",
            reason=result.error_reason or "MEMORY_PRESSURE",
            retry_after_s=result.retry_after_s or 2.0,
            metadata={"binding": result.binding or "",
                      "tried": ",".join(result.tried), **numbers},
        )

    async def _restore(self, entry: ModelEntry, request: GenerationRequest
                       ) -> tuple[list | None, int, int]:
        """(cache, cached tokens, of them from disk): RAM's longest prefix, or disk's when
        longer. A disk restore that fails for any reason falls back to RAM's source or a
        cold prefill: the same tokens come out, only slower."""
        if not (self.settings.session_bank and request.session_id):
            return None, 0, 0
        restored = self.bank.longest_prefix(entry.model_id, request.prompt_tokens)
        ram = (restored.payload, restored.prefix_len, 0) if restored is not None else (None, 0, 0)
        cold = self.cold
        if cold is None:
            return ram
        rec = cold.lookup(entry.model_id, request.prompt_tokens)
        if rec is None or len(rec.tokens) <= ram[1] or entry.engine is None:
            cold.note_hit("ram" if restored is not None else None)
            return ram
        started = time.monotonic()
        if not cold.claim(rec):
            cold.note_hit("ram" if restored is not None else None)
            return ram
        try:
            # The file is read and checked on a worker; the engine thread makes the arrays.
            data = await asyncio.to_thread(cold.read, rec)
            cache = await asyncio.wrap_future(
                entry.engine.call(lambda: load_snapshot(data, rec.compat)))
        except Exception as exc:  # noqa: BLE001 - any failure: restore from RAM or cold
            cold.release(rec)
            cold.note_restore(rec, False, model_id=entry.model_id,
                              seconds=time.monotonic() - started,
                              error=f"{type(exc).__name__}: {exc}")
            cold.note_hit("ram" if restored is not None else None)
            return ram
        cold.release(rec)
        cold.note_restore(rec, True, model_id=entry.model_id, seconds=time.monotonic() - started)
        cold.note_hit("disk")
        return cache, len(rec.tokens), len(rec.tokens)

    async def _stream(self, entry: ModelEntry, request: GenerationRequest,
                      cache: list | None, cached: int, span,
                      cached_disk: int = 0) -> AsyncIterator[Admitted | Event]:
        # Waiting for a slot or for admission took time: the model may have been marked
        # for a pending unload (refuse new work) or unloaded meanwhile.
        self.pool.ready(entry.model_id)
        engine = entry.engine
        if engine is None:
            raise Unavailable(f"model '{entry.model_id}' was unloaded", retry_after_s=1.0)
        sink = _Sink()
        done = False
        progress = _Progress(time.monotonic(), len(request.prompt_tokens), cached)
        try:
            engine.submit(request, sink, cache, cached)
            yield Admitted(request.request_id, entry.model_id, len(request.prompt_tokens),
                           cached, self.governor.level, cached_disk)
            pending: Event | None = None
            while True:
                event = pending or sink.get_nowait() or await sink.get()
                pending = None
                if isinstance(event, Chunk):
                    # Coalesce what queued up while the client was reading.
                    limit = request.max_tokens_per_chunk or DEFAULT_CHUNK_TOKENS
                    while sink and len(event.token_ids) < limit:
                        nxt = sink.get_nowait()
                        if (not isinstance(nxt, Chunk)
                                or len(event.token_ids) + len(nxt.token_ids) > limit):
                            pending = nxt  # an end, or a chunk that would overfill this one
                            break
                        event = Chunk(event.token_ids + nxt.token_ids, event.text + nxt.text)
                    progress.saw(len(event.token_ids))
                    yield event
                    continue
                done = True
                if isinstance(event, Failed):
                    span.set_attribute(names.ATTR_REASON, str(event.error))
                    # Once started, a stream always ends with its usage, then the status.
                    yield progress.aborted()
                    raise event.error
                span.set_attribute(names.ATTR_FINISH_REASON, event.reason.value)
                span.set_attribute(names.ATTR_COMPLETION_TOKENS, event.completion_tokens)
                self.metrics.finished(entry.model_id, event.ttft_seconds,
                                      event.completion_tokens)
                yield event
                return
        finally:
            if not done:
                # The client cancelled or its deadline passed: free the batch slot.
                engine.cancel(request.request_id)

    # -- sessions ---------------------------------------------------------------------------
    def store_session(self, request: GenerationRequest, cache: list, tokens: list[int]) -> None:
        """On the engine thread, when a session's turn ends: keep its terminal snapshot."""
        if not (self.settings.session_bank and request.session_id and tokens):
            return
        # Its own buffers, evaluated now on the engine thread (a writer thread may save
        # it later), quantized (mlx-lm's QuantizedKVCache) when asked.
        cache = kv_snapshot.materialize(cache, self.settings.session_kv_bits)
        nbytes = sum(c.nbytes for c in cache)
        self.bank.put(SessionEntry(model=request.model_id, tokens=tuple(tokens),
                                   session_id=request.session_id, owner=request.owner,
                                   payload=cache,
                                   nbytes=nbytes))


class _Sink:
    """A stream's events from the engine (which calls `put_nowait` on the loop): a deque
    and at most one waiter, lighter per token than an `asyncio.Queue`."""

    __slots__ = ("_events", "_waiter")

    def __init__(self) -> None:
        self._events: collections.deque[Event] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None

    def __bool__(self) -> bool:
        return bool(self._events)

    def put_nowait(self, event: Event) -> None:
        self._events.append(event)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> Event | None:
        return self._events.popleft() if self._events else None

    async def get(self) -> Event:
        while not self._events:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._events.popleft()


@dataclass
class _Progress:
    """What a stream has sent so far: the usage of a stream that ends early."""

    submitted_at: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0
    first_at: float | None = None
    last_at: float | None = None

    def saw(self, tokens: int) -> None:
        now = time.monotonic()
        self.first_at = self.first_at or now
        self.last_at = now
        self.completion_tokens += tokens

    def aborted(self) -> Finished:
        first = self.first_at or time.monotonic()
        return Finished(
            reason=FinishReason.ABORTED, prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens, completion_tokens=self.completion_tokens,
            queue_seconds=0.0, ttft_seconds=max(0.0, first - self.submitted_at)
            if self.first_at else 0.0,
            decode_seconds=max(0.0, (self.last_at or first) - first))


def _digest(request: GenerationRequest) -> str:
    return request_digest(request.model_id, request.prompt_tokens, request.max_tokens)


def tokenize(tokenizer, spec: GenerateSpec, violations: Violations | None = None
             ) -> list[int]:
    """The prompt's tokens. A bad prompt's violations go into `violations` when given
    (and [] comes back), else they are raised."""
    v = Violations() if violations is None else violations
    before = len(v)
    tokens = _tokenize(tokenizer, spec, v)
    if violations is None:
        v.raise_if_any()
    return tokens if len(v) == before else []


def _tokenize(tokenizer, spec: GenerateSpec, v: Violations) -> list[int]:
    given = [x is not None for x in (spec.text, spec.token_ids, spec.chat)]
    if sum(given) != 1:
        v.invalid("prompt", "prompt must be exactly one of text, token_ids or chat")
        return []
    if spec.text is not None:
        if not spec.text:
            v.invalid("text", "text is empty")
            return []
        return list(tokenizer.encode(spec.text))
    if spec.token_ids is not None:
        if not spec.token_ids:
            v.invalid("token_ids.ids", "token_ids.ids is empty")
            return []
        return list(spec.token_ids)
    before = len(v)
    validate_chat(spec.chat or [], v)
    if not tokenizer.has_chat_template:
        v.invalid("chat", "chat needs a chat template, which this model's tokenizer does "
                  "not have; send text")
    if len(v) > before:
        return []
    messages = [{"role": m.role, "content": m.content} for m in spec.chat]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def _prefill_cost_factor(entry: ModelEntry) -> float:
    """What the model's prefill guard has learned over the static estimate: admission
    projects with it so that the guard lets an admitted prompt run."""
    planner = entry.engine.prefill_planner if entry.engine is not None else None
    return getattr(planner, "cost_factor", 1.0)
