"""The assembled service behind the servicers: model pool, request flow, draining.

Servicers map wire ↔ domain; this module owns the order of things for a
Generate: resolve the model, tokenize, validate, admit, submit to the model's
engine thread, stream its events, and clean up however the stream ends.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engine.errors import InvalidArgument, ResourceExhausted, Unavailable
from engine.pool import ModelEntry, ModelPool
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
from telemetry import names, tracer

log = logging.getLogger(__name__)

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


@dataclass
class Admitted:
    """What the start message reports."""

    request_id: str
    model_id: str
    prompt_tokens: int
    cached_tokens: int
    pressure_level: int


@dataclass
class RuntimeSettings:
    max_queued_requests: int = 256  # per server; beyond it RESOURCE_EXHAUSTED/QUEUE_FULL
    default_max_tokens: int = DEFAULT_MAX_TOKENS


class Runtime:
    def __init__(self, pool: ModelPool, settings: RuntimeSettings | None = None) -> None:
        self.pool = pool
        self.settings = settings or RuntimeSettings()
        self.draining = False
        self._ids = itertools.count(1)
        self._prefix = os.urandom(3).hex()
        self.in_flight = 0

    async def load_model(self, source: str, model_id: str = "") -> ModelEntry:
        if self.draining:
            raise Unavailable("server is draining", retry_after_s=1.0)
        return await self.pool.load(source, model_id)

    def pressure_level(self) -> int:
        return 1  # PRESSURE_LEVEL_OK until the enforcer reports otherwise

    # -- Generate -------------------------------------------------------------------
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
        engine = entry.engine
        sink: asyncio.Queue[Event] = asyncio.Queue()
        with tracer().start_as_current_span(names.SPAN_GENERATE) as span:
            span.set_attribute(names.ATTR_REQUEST_ID, request.request_id)
            span.set_attribute(names.ATTR_MODEL, entry.model_id)
            span.set_attribute(names.ATTR_PROMPT_TOKENS, len(request.prompt_tokens))
            self.pool.acquire(entry)
            self.in_flight += 1
            done = False
            try:
                engine.submit(request, sink)
                yield Admitted(request.request_id, entry.model_id, len(request.prompt_tokens),
                               0, self.pressure_level())
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
                    yield event
                    return
            finally:
                self.in_flight -= 1
                self.pool.release(entry)
                if not done:
                    # The client cancelled or its deadline passed: free the batch slot.
                    engine.cancel(request.request_id)


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
