"""What a generation request is, once it has left the wire, and what it emits."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from enum import Enum

from engine.errors import Violations

DEFAULT_MAX_TOKENS = 256
MAX_LISTED_IDS = 16  # out-of-vocabulary ids listed one by one in BadRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def validate(self, violations: Violations | None = None) -> None:
        """Every bad field under "sampling."; into `violations` when given (the caller
        raises once for all), else raised here (InvalidArgument, every one listed)."""
        v = Violations() if violations is None else violations
        t = self.temperature
        if math.isnan(t) or math.isinf(t) or t < 0:
            v.invalid("sampling.temperature",
                      f"sampling.temperature must be a finite number >= 0, got {t}")
        p = self.top_p
        if math.isnan(p) or not 0 < p <= 1:
            v.invalid("sampling.top_p", f"sampling.top_p must be in (0, 1], got {p}")
        if self.top_k < 0:
            v.invalid("sampling.top_k", f"sampling.top_k must be >= 0, got {self.top_k}")
        m = self.min_p
        if math.isnan(m) or not 0 <= m < 1:
            v.invalid("sampling.min_p", f"sampling.min_p must be in [0, 1), got {m}")
        r = self.repetition_penalty
        if math.isnan(r) or math.isinf(r) or r <= 0:
            v.invalid("sampling.repetition_penalty",
                      f"sampling.repetition_penalty must be a finite number > 0, got {r}")
        if violations is None:
            v.raise_if_any()


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
    # Token ids that end the sequence like EOS does (withheld from the output), and
    # also under ignore_eos: SMG's MLX protocol sends stops as ids, not strings.
    stop_token_ids: tuple[int, ...] = ()
    owner: str = ""  # who it is for (GenerateRequest.owner): the bank's per-owner cap
    created_at: float = field(default_factory=time.monotonic)


def validate_against_model(
    prompt_tokens: list[int], max_tokens: int, vocab_size: int, context_length: int,
    violations: Violations | None = None,
) -> None:
    """Checks that need the model: token ids in the vocabulary, lengths within context.
    Every violation goes into `violations` when given, else they are raised here."""
    v = Violations() if violations is None else violations
    if not prompt_tokens:
        v.invalid("prompt", "prompt is empty: give text, token_ids or chat")
    bad = [(i, t) for i, t in enumerate(prompt_tokens) if t >= vocab_size]
    for i, t in bad[:MAX_LISTED_IDS]:
        v.invalid(f"token_ids.ids[{i}]",
                  f"token_ids.ids[{i}] is {t}, outside the vocabulary of {vocab_size}")
    if len(bad) > MAX_LISTED_IDS:
        v.invalid("token_ids.ids", f"token_ids.ids holds {len(bad) - MAX_LISTED_IDS} more "
                  f"ids outside the vocabulary of {vocab_size}")
    if len(prompt_tokens) >= context_length:
        v.out_of_range("prompt",
                       f"prompt is {len(prompt_tokens)} tokens; the model's context is "
                       f"{context_length}")
    elif len(prompt_tokens) + max_tokens > context_length:
        v.out_of_range("max_tokens",
                       f"max_tokens {max_tokens} + prompt {len(prompt_tokens)} tokens exceeds "
                       f"the model's context of {context_length}")
    if violations is None:
        v.raise_if_any()


# Stop strings are matched against every decoded character: bounded so that a request
# cannot make each token's check arbitrarily slow (OpenAI allows 4 strings).
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def validate_stop(stop: tuple[str, ...] | list[str],
                  violations: Violations | None = None) -> None:
    """Stop strings: none may be empty (it would match at once); at most
    MAX_STOP_STRINGS of at most MAX_STOP_CHARS characters each."""
    v = Violations() if violations is None else violations
    if len(stop) > MAX_STOP_STRINGS:
        v.out_of_range("stop", f"stop has {len(stop)} strings; the limit is {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop[:MAX_STOP_STRINGS]):
        if not s:
            v.invalid(f"stop[{i}]", f"stop[{i}] is empty: a stop string needs a character")
        elif len(s) > MAX_STOP_CHARS:
            v.out_of_range(f"stop[{i}]", f"stop[{i}] is {len(s)} characters; the limit is "
                           f"{MAX_STOP_CHARS}")
    if violations is None:
        v.raise_if_any()


ROLES = ("system", "user", "assistant", "tool")


def validate_chat(messages: list[ChatMessage] | tuple[ChatMessage, ...],
                  violations: Violations | None = None) -> None:
    """Chat messages: at least one, each with a known role."""
    v = Violations() if violations is None else violations
    if not messages:
        v.invalid("chat.messages", "chat.messages is empty: give at least one message")
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            v.invalid(f"chat.messages[{i}].role",
                      f"chat.messages[{i}].role must be system, user, assistant or tool, "
                      f"got '{m.role}'")
    if violations is None:
        v.raise_if_any()


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORTED = "aborted"  # ended early by the server; a status follows


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
    matched_stop: str = ""  # the stop string that ended it, if one did
    matched_stop_token: int | None = None  # the stop token id (or EOS) that ended it


@dataclass
class Failed:
    error: Exception


Event = Chunk | Finished | Failed
