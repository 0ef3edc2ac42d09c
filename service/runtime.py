"""The assembled service behind the servicers: pool, enforcer, session bank, admission.

Servicers map wire ↔ domain; this module owns the order of things for a
Generate: resolve the model, tokenize, validate, wait for an admission slot,
run admission (shedding cache if it must), restore the cached prefix, submit to
the model's engine thread, stream its events, and clean up however the stream
ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.errors import (
    InvalidArgument,
    NotFound,
    PlimsollError,
    ResourceExhausted,
    Unavailable,
)
from engine.pool import ModelEntry, ModelPool, ModelState
from engine.request import (
    DEFAULT_MAX_TOKENS,
    ChatMessage,
    Chunk,
    Event,
    Failed,
    GenerationRequest,
    SamplingParams,
    validate_against_model,
)
from memory.ceiling import Limits, compute_limits
from memory.chunking import prefill_abort_bytes
from memory.config import MemoryConfig
from memory.enforcer import MemoryEnforcer
from memory.levels import PressureLevel
from memory.readings import MemoryReader, MemoryReadings
from service.enforcement import PoolAdapter, PrefillGuard
from service.leases import ModelLeases
from service.metrics import RequestMetrics
from sessions.activity import ActiveSessions, SessionPins
from sessions.admission import (
    AdmissionInputs,
    AdmissionQueue,
    Decision,
    QueueOutcome,
    ReservationBook,
    SchedulerMode,
    bank_figures,
    decide,
    preview_shed,
    run_admission,
    validate_scheduler_settings,
)
from sessions.bank import SessionBank, SessionEntry
from sessions.ceiling import bank_dynamic_ceiling, hold_to_ceiling
from sessions.pressure_guard import PressureGuard, apply_pressure_actions
from telemetry import names, tracer

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 64
GIB = 1024**3


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


@dataclass
class Admitted:
    """What the start message reports."""

    request_id: str
    model_id: str
    prompt_tokens: int
    cached_tokens: int
    pressure_level: int


@dataclass
class AdmitReport:
    """The answer to ControlService.Admit."""

    decision: Decision
    level: int
    shed_entries: int
    shed_bytes: int
    ticket: str = ""
    ticket_expires_at: float = 0.0  # wall clock


@dataclass
class RuntimeSettings:
    max_queued_requests: int = 256  # requests in flight (running + waiting) per server
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    scheduler_mode: SchedulerMode = SchedulerMode.DEFAULT
    admission_queue_limit: int = 32  # requests waiting for a slot while admission pauses
    admission_timeout_s: float = 30.0
    chain_shed: bool = True  # the admission-chain shed (shrink_for_admission)
    session_bank: bool = True
    bank_max_bytes: int = 8 * GIB
    bank_per_session_max_bytes: int = 4 * GIB
    bank_max_entries: int = 256
    bank_idle_ttl_s: float = 3600.0
    reservation_ttl_s: float = 30.0


class Runtime:
    def __init__(
        self,
        pool: ModelPool,
        settings: RuntimeSettings | None = None,
        memory: MemoryConfig | None = None,
        sink=None,
    ) -> None:
        self.pool = pool
        self.settings = settings or RuntimeSettings()
        self.memory_config = (memory or MemoryConfig()).validate()
        validate_scheduler_settings(self.settings.scheduler_mode, pool.settings.max_num_seqs,
                                    queue_limit=self.settings.admission_queue_limit)
        self.draining = False
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()
        self.in_flight = 0

        self.reader = MemoryReader()
        self._measured: tuple[float, MemoryReadings, Limits] | None = None
        self.model_leases = ModelLeases()
        self.session_pins = SessionPins(time.monotonic)
        self.active_sessions = ActiveSessions(self.session_pins)
        self.bank = SessionBank(
            max_bytes=self.settings.bank_max_bytes,
            per_session_max_bytes=self.settings.bank_per_session_max_bytes,
            max_entries=self.settings.bank_max_entries,
            idle_ttl_s=self.settings.bank_idle_ttl_s,
            active_sessions=self.active_sessions,
        )
        self.reservations = ReservationBook(time.monotonic,
                                            default_ttl_s=self.settings.reservation_ttl_s)
        self.queue = AdmissionQueue(queue_limit=self.settings.admission_queue_limit,
                                    mode=self.settings.scheduler_mode)
        self.sink = sink
        self.enforcer: MemoryEnforcer | None = None
        if self.memory_config.enabled:
            self.enforcer = MemoryEnforcer(
                self.memory_config, self.reader, PoolAdapter(pool, self.figures),
                session_tier=self.bank if self.settings.session_bank else None,
                sink=self,
            )
            pool.load_guard = self._make_room_for_load
            # A load or unload changes the cadence (30 s empty, 10 s idle, 1 s busy).
            pool.listeners.append(self.enforcer.wake)
            pool.listeners.append(self._attach_prefill_guards)
        self.pressure_guard = PressureGuard()
        self.metrics = RequestMetrics(self._request_counts)
        pool.on_finish_hook = self._store_session
        pool.listeners.append(self._drop_sessions_of_unloaded_models)

    def _request_counts(self) -> tuple[int, int]:
        engines = [e.engine for e in self.pool.entries() if e.engine is not None]
        running = sum(e.stats.active_requests for e in engines)
        waiting = sum(e.stats.waiting_requests for e in engines) + self.queue.waiting
        return running, waiting

    # -- memory figures ---------------------------------------------------------------
    @property
    def level(self) -> PressureLevel:
        if self.enforcer is None:
            return PressureLevel.OK
        return self.enforcer.level

    def pressure_level(self) -> int:
        return int(self.level)

    def _mlx_sample(self) -> tuple[int, int] | None:
        # Never call MLX here: take the largest of the engine threads' own samples.
        samples = [(e.engine.stats.mlx_active_bytes, e.engine.stats.mlx_pool_bytes)
                   for e in self.pool.entries() if e.engine is not None
                   and e.engine.stats.sampled_at]
        return max(samples) if samples else (0, 0)

    def measure(self, max_age_s: float = 0.0) -> tuple[MemoryReadings, Limits]:
        """Fresh readings and limits; `max_age_s` lets a burst of admissions share one."""
        now = time.monotonic()
        if self._measured is not None and now - self._measured[0] <= max_age_s:
            return self._measured[1], self._measured[2]
        readings = self.reader.read(self._mlx_sample)
        limits = compute_limits(readings, self.memory_config)
        self._measured = (now, readings, limits)
        return readings, limits

    def figures(self) -> tuple[int, int]:
        """(usage, ceiling) of the latest tick, for abort statuses."""
        if self.enforcer and self.enforcer.readings and self.enforcer.limits:
            return self.enforcer.readings.process_bytes, self.enforcer.limits.ceiling_bytes
        readings, limits = self.measure()
        return readings.process_bytes, limits.ceiling_bytes

    # -- enforcer sink: per-tick housekeeping and publishing --------------------------
    def on_transition(self, transition, readings, limits) -> None:
        self.queue.set_level(int(transition.to_level))
        if self.sink is not None:
            self.sink.on_transition(transition, readings, limits)

    def on_action(self, action, outcome) -> None:
        if self.sink is not None:
            self.sink.on_action(action, outcome)

    def _attach_prefill_guards(self) -> None:
        cfg = self.memory_config
        for e in self.pool.entries():
            if e.engine is not None and e.state == ModelState.READY \
                    and e.engine.prefill_planner is None:
                guard = PrefillGuard(e.kv_bytes_per_token, cfg.prefill_min_chunk_tokens,
                                     min(cfg.prefill_max_chunk_tokens,
                                         self.pool.settings.prefill_step_size))
                if self.enforcer and self.enforcer.readings and self.enforcer.limits:
                    guard.update(self.enforcer.readings, self.enforcer.limits)
                e.engine.prefill_planner = guard

    def on_sample(self, sample) -> None:
        self.queue.set_level(int(sample.level))
        for e in self.pool.entries():
            planner = e.engine.prefill_planner if e.engine is not None else None
            if isinstance(planner, PrefillGuard):
                planner.update(sample.readings, sample.limits)
        self._expire_leases()
        self.reservations.expire()
        if self.settings.session_bank:
            self.bank.expire_idle()
            self._os_pressure_guard(sample)
            weights = sum(e.measured_bytes for e in self.pool.entries()
                          if e.state == ModelState.READY)
            usage = sample.readings.process_bytes
            working = max(0, usage - weights - self.bank.total_bytes())
            hold_to_ceiling(self.bank, bank_dynamic_ceiling(
                sample.limits.ceiling_bytes, weights, working,
                bank_idle_max=self.settings.bank_max_bytes))
        if self.sink is not None:
            self.sink.on_sample(sample)

    def expire_leases(self) -> None:
        self._expire_leases()

    def _os_pressure_guard(self, sample) -> None:
        """The operating system's own pressure report drives the bank: warning → half
        its budget, critical → zero, active sessions protected (with hysteresis)."""
        busy = any(v.busy for v in sample.engines)
        actions = self.pressure_guard.observe(sample.readings.os_pressure, sample.at,
                                              budget_bytes=self.bank.effective_max_bytes,
                                              busy=busy)
        if actions:
            apply_pressure_actions(actions, self.bank, reclaim_pool=self._flag_pool_reclaim)

    def _flag_pool_reclaim(self) -> int:
        for e in self.pool.entries():
            if e.engine is not None:
                e.engine.request_pressure_reclaim()
        return 0

    def _expire_leases(self) -> None:
        for lease in self.model_leases.expire():
            self._recount_pins(lease.model_id)
        self.session_pins.expire()

    def _recount_pins(self, model_id: str) -> None:
        with contextlib.suppress(NotFound):
            self.pool.get(model_id).pins = self.model_leases.count(model_id)

    # -- models -----------------------------------------------------------------------
    async def load_model(self, source: str, model_id: str = "") -> ModelEntry:
        if self.draining:
            raise Unavailable("server is draining", retry_after_s=1.0)
        if self.enforcer:
            self.enforcer.wake(active=True)
        entry = await self.pool.load(source, model_id)
        if self.enforcer:
            self.enforcer.wake()
        settle_heap()
        return entry

    async def unload_model(self, model_id: str, force: bool):
        result = await self.pool.unload(model_id, force=force)
        if self.enforcer:
            self.enforcer.wake()
        return result

    async def _make_room_for_load(self, entry: ModelEntry, estimate: int | None) -> None:
        """Before a load: evict idle LRU non-pinned models down to the soft mark;
        refuse when the model cannot fit under the ceiling even then."""
        if estimate is None:
            return  # a repository not downloaded yet: the enforcer handles what follows
        readings, limits = self.measure()
        usage = readings.process_bytes - readings.pool_bytes
        victims = [e for e in self.pool.lru() if e is not entry and not e.pinned
                   and not e.busy]
        while usage + estimate > limits.soft_bytes and victims:
            victim = victims.pop(0)
            log.info("evicting %s to make room for %s", victim.model_id, entry.model_id)
            with tracer().start_as_current_span(names.SPAN_EVICT) as span:
                span.set_attribute(names.ATTR_MODEL, victim.model_id)
                span.set_attribute(names.ATTR_REASON, f"make_room_for:{entry.model_id}")
                result = await self.pool.unload(victim.model_id, force=True,
                                                reason=f"make room for {entry.model_id}")
                span.set_attribute(names.ATTR_BYTES_FREED, result.freed_bytes)
            if self.sink is not None:
                self.sink.on_load_eviction(victim.model_id, entry.model_id, result.freed_bytes)
            usage -= max(result.freed_bytes, victim.measured_bytes)
        if usage + estimate > limits.ceiling_bytes:
            raise ResourceExhausted(
                f"model '{entry.model_id}' needs about {estimate} bytes; usage {usage} + "
                f"that exceeds the ceiling {limits.ceiling_bytes} ({limits.binding_term})",
                reason="MEMORY_PRESSURE",
                retry_after_s=10.0,
                metadata={"estimated_bytes": str(estimate), "usage_bytes": str(usage),
                          "ceiling_bytes": str(limits.ceiling_bytes),
                          "binding_term": limits.binding_term},
            )

    # -- pins -------------------------------------------------------------------------------
    async def pin_model(self, model_id: str, owner: str, ttl_s: float | None):
        try:
            entry = self.pool.get(model_id)
        except NotFound:
            entry = None
        while entry is not None and entry.state == ModelState.UNLOADING:
            await asyncio.sleep(0.05)  # let the unload finish, then load it again
        if entry is None or entry.state == ModelState.UNLOADED:
            # Pinning an unloaded model loads it: by id when known, else as a source.
            source = entry.source if entry is not None else model_id
            entry = await self.load_model(source, entry.model_id if entry else "")
        lease = self.model_leases.pin(entry.model_id, owner, ttl_s)
        self._recount_pins(entry.model_id)
        self._expire_after(ttl_s)
        return lease

    def pin_session(self, session_id: str, owner: str, ttl_s: float | None):
        pin = self.session_pins.pin(session_id, owner, ttl_s)
        self._expire_after(ttl_s)
        return pin

    def _expire_after(self, ttl_s: float | None) -> None:
        # An expired lease unpins on time, not at the next (maybe 10 s away) tick.
        if ttl_s:
            asyncio.get_running_loop().call_later(ttl_s + 0.01, self._expire_leases)

    def unpin(self, lease_id: str):
        lease = self.model_leases.unpin(lease_id)
        if lease is not None:
            self._recount_pins(lease.model_id)
            return lease
        pin = self.session_pins.unpin(lease_id)
        if pin is None:
            raise NotFound(f"lease '{lease_id}' is not held (expired or never taken)",
                           "lease")
        return pin

    # -- Generate ----------------------------------------------------------------------------
    def prepare(self, spec: GenerateSpec) -> tuple[ModelEntry, GenerationRequest]:
        """Resolve, tokenize and validate; raises a PlimsollError naming the field."""
        if self.draining:
            raise Unavailable("server is draining; retry on another replica", retry_after_s=1.0)
        spec.sampling.validate()
        entry = self.pool.ready(spec.model)
        info = entry.engine.info if entry.engine else None
        if info is None:
            raise Unavailable(f"model '{entry.model_id}' is not ready", retry_after_s=1.0)
        tokens = tokenize(info.tokenizer, spec)
        max_tokens = spec.max_tokens or min(
            self.settings.default_max_tokens, max(1, info.context_length - len(tokens))
        )
        validate_against_model(tokens, max_tokens, info.vocab_size, info.context_length)
        request = GenerationRequest(
            request_id=f"req-{self._prefix}-{next(self._ids)}",
            model_id=entry.model_id,
            prompt_tokens=tokens,
            sampling=spec.sampling,
            max_tokens=max_tokens,
            stop=spec.stop,
            ignore_eos=spec.ignore_eos,
            session_id=spec.session_id,
            max_tokens_per_chunk=spec.max_tokens_per_chunk,
        )
        return entry, request

    def _admission_inputs(self, entry: ModelEntry, request: GenerationRequest,
                          holds_slot: bool = False) -> AdmissionInputs:
        """`holds_slot`: Generate already passed the queue's gate (pause, hyper cap), so
        only memory is left to decide; Admit asks the gate too."""
        readings, limits = self.measure(max_age_s=0.05)
        protect = self._protected_sessions()
        figs = bank_figures(self.bank, entry.model_id, request.prompt_tokens,
                            protect_session_ids=protect)
        prompt = len(request.prompt_tokens)
        miss = max(1, prompt - figs.restore_prefix_tokens)
        # Admit nothing the prefill guard would abort mid-prompt: its line is the
        # tier's pre-chunk margin of the stable cap, below the ceiling.
        abort_line = prefill_abort_bytes(limits.tier, limits.abort_cap_bytes)
        return AdmissionInputs(
            usage_bytes=readings.process_bytes,
            pool_bytes=readings.pool_bytes,
            ceiling_bytes=min(limits.ceiling_bytes, abort_line),
            threshold_bytes=min(limits.hard_bytes, abort_line),
            prompt_tokens=len(request.prompt_tokens) + request.max_tokens,
            reusable_prefix_tokens=figs.restore_prefix_tokens,
            kv_bytes_per_token=entry.kv_bytes_per_token,
            prefill_transient_bytes=prefill_transient_bytes(
                entry, min(miss, self.pool.settings.prefill_step_size), prompt),
            reserved_bytes=self.reservations.reserved_bytes(),
            level=int(self.level),
            admitted_in_flight=0 if holds_slot else self.queue.in_flight,
            queue_depth=self.queue.waiting,
            queue_limit=self.settings.admission_queue_limit,
            chain_shed_enabled=self.settings.chain_shed,
            scheduler_mode=self.settings.scheduler_mode,
            floor_bytes=sum(e.measured_bytes for e in self.pool.entries()
                            if e.state == ModelState.READY),
            bank=figs,
        )

    def _protected_sessions(self) -> tuple[str, ...]:
        # Pinned sessions are never shed, except in emergency.
        if self.level >= PressureLevel.EMERGENCY:
            return ()
        return tuple(self.session_pins.active_ids())

    def _reclaim_pool(self) -> int:
        """Runs in a worker thread: each engine drains its own MLX pool."""
        return sum(e.engine.reclaim_now() for e in self.pool.entries() if e.engine is not None)

    def admit(self, spec: GenerateSpec, reserve: bool, ttl_s: float | None) -> AdmitReport:
        """ControlService.Admit: the same decision Generate makes, without running it."""
        entry, request = self.prepare(spec)
        if self.enforcer is None:
            inputs = AdmissionInputs(usage_bytes=0, ceiling_bytes=2**62,
                                     threshold_bytes=2**62, prompt_tokens=1,
                                     kv_bytes_per_token=0, level=1)
        else:
            inputs = self._admission_inputs(entry, request)
        d = decide(inputs)
        preview = preview_shed(d, self.bank, model=entry.model_id,
                               prompt_tokens=request.prompt_tokens,
                               protect_session_ids=self._protected_sessions())
        report = AdmitReport(d, int(self.level), preview.entries, preview.bytes)
        if reserve and d.admits:
            ticket = self.reservations.reserve(d.request_bytes, entry.model_id, ttl_s)
            report.ticket = ticket.ticket
            report.ticket_expires_at = time.time() + (ticket.expires_at - time.monotonic())
        return report

    async def generate(self, spec: GenerateSpec) -> AsyncIterator[Admitted | Event]:
        entry, request = self.prepare(spec)
        if self.in_flight >= self.settings.max_queued_requests:
            raise ResourceExhausted(
                f"{self.in_flight} requests in flight, the limit is "
                f"{self.settings.max_queued_requests}",
                reason="QUEUE_FULL",
                retry_after_s=1.0,
                metadata={"in_flight": str(self.in_flight),
                          "limit": str(self.settings.max_queued_requests)},
            )
        if spec.admission_ticket and self.reservations.redeem(spec.admission_ticket) is None:
            raise NotFound(f"admission_ticket '{spec.admission_ticket}' is unknown or expired",
                           "admission_ticket")
        if self.enforcer:
            self.enforcer.note_activity()
        with tracer().start_as_current_span(names.SPAN_GENERATE) as span:
            span.set_attribute(names.ATTR_REQUEST_ID, request.request_id)
            span.set_attribute(names.ATTR_MODEL, entry.model_id)
            span.set_attribute(names.ATTR_PROMPT_TOKENS, len(request.prompt_tokens))
            self.in_flight += 1
            self.pool.acquire(entry)
            session = request.session_id or None
            self.active_sessions.begin(session)
            slot = None
            try:
                slot = await self._wait_for_slot()
                cache, cached = await self._admit_and_restore(entry, request)
                span.set_attribute(names.ATTR_CACHED_TOKENS, cached)
                async for event in self._stream(entry, request, cache, cached, span):
                    yield event
            finally:
                if slot is not None:
                    slot.release()
                self.active_sessions.end(session)
                self.in_flight -= 1
                self.pool.release(entry)

    async def _wait_for_slot(self):
        result = await self.queue.acquire(self.settings.admission_timeout_s)
        if result.outcome is QueueOutcome.ADMITTED:
            return result.slot
        full = result.outcome is QueueOutcome.QUEUE_FULL
        self.metrics.admitted("queue_full" if full else "wait_timeout", "")
        raise ResourceExhausted(
            ("admission queue is full" if full else
             f"waited {result.waited_s:.1f}s for admission ({result.binding})")
            + f"; level {self.level.label}",
            reason="QUEUE_FULL" if full else "MEMORY_PRESSURE",
            retry_after_s=result.retry_after_s or 1.0,
            metadata={"binding": result.binding or "", "level": self.level.label,
                      "waiting": str(self.queue.waiting)},
        )

    async def _admit_and_restore(self, entry: ModelEntry, request: GenerationRequest):
        if self.enforcer is not None:
            inputs = self._admission_inputs(entry, request, holds_slot=True)
            decision = decide(inputs)
            if not decision.admits or decision.shed:
                outcome = await asyncio.to_thread(
                    run_admission, decision, self.bank, self._reclaim_pool,
                    lambda: self.measure()[0].process_bytes,
                    model=entry.model_id, prompt_tokens=request.prompt_tokens,
                    protect_session_ids=self._protected_sessions(),
                )
                self.metrics.admitted(outcome.verdict.value if outcome.admitted else "reject",
                                      entry.model_id)
                if not outcome.admitted:
                    numbers = {k: str(v) for k, v in outcome.numbers.items()}
                    raise ResourceExhausted(
                        f"refused before prefill: {outcome.reason or decision.reason}",
                        reason=outcome.error_reason or "MEMORY_PRESSURE",
                        retry_after_s=outcome.retry_after_s or 2.0,
                        metadata={"binding": outcome.binding or "", **numbers},
                    )
            else:
                self.metrics.admitted(decision.verdict.value, entry.model_id)
        if not (self.settings.session_bank and request.session_id):
            return None, 0
        restored: SessionEntry | None = self.bank.longest_prefix(entry.model_id,
                                                                 request.prompt_tokens)
        if restored is None:
            return None, 0
        return restored.payload, restored.prefix_len

    async def _stream(self, entry, request, cache, cached, span):
        engine = entry.engine
        if engine is None:
            raise Unavailable(f"model '{entry.model_id}' was unloaded", retry_after_s=1.0)
        sink: asyncio.Queue[Event] = asyncio.Queue()
        done = False
        try:
            engine.submit(request, sink, cache, cached)
            yield Admitted(request.request_id, entry.model_id, len(request.prompt_tokens),
                           cached, self.pressure_level())
            pending: Event | None = None
            while True:
                event = pending or await sink.get()
                pending = None
                if isinstance(event, Chunk):
                    # Coalesce what queued up while the client was reading.
                    limit = request.max_tokens_per_chunk or DEFAULT_CHUNK_TOKENS
                    while not sink.empty() and len(event.token_ids) < limit:
                        nxt = sink.get_nowait()
                        if not isinstance(nxt, Chunk):
                            pending = nxt
                            break
                        event = Chunk(event.token_ids + nxt.token_ids, event.text + nxt.text)
                    yield event
                    continue
                done = True
                if isinstance(event, Failed):
                    span.set_attribute(names.ATTR_REASON, str(event.error))
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

    # -- sessions -------------------------------------------------------------------------
    def _store_session(self, request: GenerationRequest, cache: list, tokens: list[int]) -> None:
        """On the engine thread, when a session's turn ends: keep its terminal snapshot."""
        if not (self.settings.session_bank and request.session_id and tokens):
            return
        nbytes = sum(c.nbytes for c in cache)
        self.bank.put(SessionEntry(model=request.model_id, tokens=tuple(tokens),
                                   session_id=request.session_id, payload=cache,
                                   nbytes=nbytes))

    def _drop_sessions_of_unloaded_models(self) -> None:
        # KV snapshots are only good with the weights that made them; however a model
        # went (UnloadModel, the enforcer, a pending unload), its cache goes too.
        for e in self.pool.entries():
            if e.state == ModelState.UNLOADED:
                self.bank.drop_model(e.model_id)

    def drop_session(self, session_id: str) -> tuple[int, int]:
        entries, freed = self.bank.drop_session(session_id)
        if not entries:
            raise NotFound(f"session '{session_id}' has no cached entries", "session_id")
        return entries, freed


def prefill_transient_bytes(entry: ModelEntry, chunk: int, prompt: int) -> int:
    """The peak a prefill adds beyond its KV: the last chunk's attention scores over
    the whole prompt (fp32, and a softmax copy), plus activations of a few KV rows
    per token. Measured on the tiny model: 4,000 tokens at step 512 peak ~40 MiB."""
    scores = chunk * entry.attention_heads * prompt * 4 * 2
    return scores + chunk * entry.kv_bytes_per_token * 4


def settle_heap() -> None:
    """After start-up or a load: collect once and freeze what survives, so the
    long-lived objects (models, tokenizers, stubs) are never scanned again by a full
    collection — one took ~75 ms on the event loop, stalling every stream."""
    gc.collect()
    gc.freeze()


def tokenize(tokenizer, spec: GenerateSpec) -> list[int]:
    given = [x is not None for x in (spec.text, spec.token_ids, spec.chat)]
    if sum(given) != 1:
        raise InvalidArgument("prompt: set exactly one of text, token_ids or chat", "prompt")
    if spec.text is not None:
        if not spec.text:
            raise InvalidArgument("prompt.text is empty", "text")
        return list(tokenizer.encode(spec.text))
    if spec.token_ids is not None:
        if not spec.token_ids:
            raise InvalidArgument("prompt.token_ids.ids is empty", "token_ids.ids")
        return list(spec.token_ids)
    if not spec.chat:
        raise InvalidArgument("prompt.chat.messages is empty", "chat.messages")
    for i, m in enumerate(spec.chat):
        if m.role not in ("system", "user", "assistant", "tool"):
            raise InvalidArgument(
                f"chat.messages[{i}].role must be system, user, assistant or tool, "
                f"got '{m.role}'",
                f"chat.messages[{i}].role",
            )
    if not getattr(tokenizer, "has_chat_template", False):
        raise InvalidArgument("this model's tokenizer has no chat template; send text",
                              "chat")
    messages = [{"role": m.role, "content": m.content} for m in spec.chat]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True))


__all__ = ["Admitted", "GenerateSpec", "PlimsollError", "Runtime", "RuntimeSettings"]
