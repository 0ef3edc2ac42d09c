"""Adaptive prefill chunk sizing against the ceiling recomputed every tick. Pure.

The chunk is as many tokens as fit between current usage and a tier fraction
of the hard ceiling — the one recomputed every tick, dynamic term included —
(0.90 safe, 0.92 balanced, 0.97 aggressive, 0.95 custom), clamped to
[min_chunk, max_chunk]: it shrinks as projected usage nears that line. Before
each chunk, `should_abort_before_chunk` checks the projected usage against the
pre-chunk abort margin (0.90, 0.93, 0.97, 0.95) of the stable abort cap, and
never lets a chunk run past the ceiling itself.

The per-token cost is an EWMA of measured bytes per prefilled token with the
model's static estimate (KV bytes per token + transient) as a floor, so one
lucky chunk that reused pooled buffers never makes the next one overconfident.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from memory.levels import (
    PREFILL_COST_EWMA_ALPHA,
    PREFILL_MAX_CHUNK_TOKENS,
    PREFILL_MIN_CHUNK_TOKENS,
    Tier,
    prefill_abort_margin,
    prefill_chunk_fraction,
)


@dataclass(frozen=True)
class PrefillCostModel:
    """Bytes per prefilled token: max(static estimate, EWMA of measurements)."""

    static_bytes_per_token: float
    alpha: float = PREFILL_COST_EWMA_ALPHA
    ewma_bytes_per_token: float | None = None
    samples: int = 0

    def __post_init__(self) -> None:
        if self.static_bytes_per_token < 0:
            raise ValueError("static_bytes_per_token must be >= 0")
        if not 0 < self.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")

    def observe(self, tokens: int, bytes_delta: int) -> PrefillCostModel:
        """A new model after a chunk of `tokens` grew usage by `bytes_delta`.

        A negative delta (the pool was drained mid-chunk) counts as zero.
        """
        if tokens <= 0:
            return self
        sample = max(0, bytes_delta) / tokens
        if self.ewma_bytes_per_token is None:
            ewma = sample
        else:
            ewma = self.alpha * sample + (1 - self.alpha) * self.ewma_bytes_per_token
        return dataclasses.replace(self, ewma_bytes_per_token=ewma, samples=self.samples + 1)

    @property
    def bytes_per_token(self) -> float:
        measured = self.ewma_bytes_per_token or 0.0
        return max(self.static_bytes_per_token, measured)


def prefill_target_bytes(tier: Tier, ceiling_bytes: int) -> int:
    """The usage a chunk may grow to: the tier's chunk fraction of the ceiling."""
    return int(ceiling_bytes * prefill_chunk_fraction(tier))


def prefill_abort_bytes(tier: Tier, abort_cap_bytes: int) -> int:
    """The pre-chunk abort margin of the stable cap."""
    return int(abort_cap_bytes * prefill_abort_margin(tier))


def prefill_abort_line(tier: Tier, abort_cap_bytes: int, ceiling_bytes: int) -> int:
    """Projected usage above which a chunk must not start: the abort margin of the
    stable cap, and never past the ceiling."""
    return min(prefill_abort_bytes(tier, abort_cap_bytes), ceiling_bytes)


def plan_chunk(
    *,
    tier: Tier,
    ceiling_bytes: int,
    usage_bytes: int,
    bytes_per_token: float,
    remaining_tokens: int,
    min_chunk: int = PREFILL_MIN_CHUNK_TOKENS,
    max_chunk: int = PREFILL_MAX_CHUNK_TOKENS,
) -> int:
    """Tokens for the next prefill chunk (0 when nothing remains).

    Never below `min_chunk` (progress; the pre-chunk check decides whether even
    that may run) and never above `max_chunk` or what remains.
    """
    if remaining_tokens <= 0:
        return 0
    headroom = prefill_target_bytes(tier, ceiling_bytes) - usage_bytes
    if bytes_per_token <= 0:
        fit = max_chunk
    elif headroom <= 0:
        fit = 0
    else:
        fit = math.floor(headroom / bytes_per_token)
    chunk = max(min_chunk, min(max_chunk, fit))
    return min(chunk, remaining_tokens)


def should_abort_before_chunk(
    *,
    tier: Tier,
    abort_cap_bytes: int,
    ceiling_bytes: int,
    usage_bytes: int,
    chunk_tokens: int,
    bytes_per_token: float,
) -> bool:
    """True when usage after this chunk would pass the pre-chunk abort line."""
    projected = usage_bytes + chunk_tokens * max(0.0, bytes_per_token)
    return projected > prefill_abort_line(tier, abort_cap_bytes, ceiling_bytes)


@dataclass(frozen=True)
class ConversionTransient:
    """What a prefill through fp32 conversions (engine/fast_prefill.py) adds at its peak
    beyond the stock path's transient, from figures the model gives once at load:

    - `weight_bytes`: the largest converted layer's weight in fp32 (scales too), alive
      while that layer's product runs; one layer at a time, so not per token;
    - `chunk_token_bytes`: fp32 copies of a chunk token's activations (a layer's input
      and output, attention's queries and output);
    - `prompt_token_bytes`: one layer's keys and values in fp32, per prompt token
      (attention over the whole prompt runs in fp32).
    """

    weight_bytes: int = 0
    chunk_token_bytes: int = 0
    prompt_token_bytes: int = 0

    def bytes_for(self, chunk_tokens: int, prompt_tokens: int) -> int:
        """The transient of a chunk of `chunk_tokens` over a prompt of `prompt_tokens`."""
        if chunk_tokens <= 0:
            return 0
        return (self.weight_bytes + chunk_tokens * self.chunk_token_bytes
                + prompt_tokens * self.prompt_token_bytes)
