"""What a generation request is, once it has left the wire, and what it emits."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

from engine.errors import InvalidArgument, OutOfRange

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def validate(self) -> None:
        t = self.temperature
        if math.isnan(t) or math.isinf(t) or t < 0:
            raise InvalidArgument(
                f"sampling.temperature must be a finite number >= 0, got {t}",
                "sampling.temperature",
            )
        p = self.top_p
        if math.isnan(p) or not 0 < p <= 1:
            raise InvalidArgument(
                f"sampling.top_p must be in (0, 1], got {p}", "sampling.top_p"
            )
        if self.top_k < 0:
            raise InvalidArgument(
                f"sampling.top_k must be >= 0, got {self.top_k}", "sampling.top_k"
            )
        m = self.min_p
        if math.isnan(m) or not 0 <= m < 1:
            raise InvalidArgument(
                f"sampling.min_p must be in [0, 1), got {m}", "sampling.min_p"
            )
        r = self.repetition_penalty
        if math.isnan(r) or math.isinf(r) or r <= 0:
            raise InvalidArgument(
                f"sampling.repetition_penalty must be a finite number > 0, got {r}",
                "sampling.repetition_penalty",
            )


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass
class GenerationRequest:
    """A request as the engine sees it: the prompt already tokenized."""

    request_id: str
    model_id: str
    prompt_tokens: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    session_id: str = ""
    max_tokens_per_chunk: int = 0
    created_at: float = field(default_factory=time.monotonic)


def validate_against_model(
    prompt_tokens: list[int], max_tokens: int, vocab_size: int, context_length: int
) -> None:
    """Checks that need the model: token ids in the vocabulary, lengths within context."""
    if not prompt_tokens:
        raise InvalidArgument("prompt is empty: give text, token_ids or chat", "prompt")
    bad = next((t for t in prompt_tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"token_ids.ids contains {bad}, outside the vocabulary of {vocab_size}",
            "token_ids.ids",
        )
    if len(prompt_tokens) >= context_length:
        raise OutOfRange(
            f"prompt is {len(prompt_tokens)} tokens; the model's context is "
            f"{context_length}",
            "prompt",
        )
    if len(prompt_tokens) + max_tokens > context_length:
        raise OutOfRange(
            f"max_tokens {max_tokens} + prompt {len(prompt_tokens)} tokens exceeds the "
            f"model's context of {context_length}",
            "max_tokens",
        )


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"


@dataclass
class Chunk:
    token_ids: list[int]
    text: str


@dataclass
class Finished:
    reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    queue_seconds: float
    ttft_seconds: float
    decode_seconds: float


@dataclass
class Failed:
    error: Exception


Event = Chunk | Finished | Failed
