"""Adaptive prefill chunk sizing against the ceiling recomputed every tick. Pure.

The chunk is as many tokens as fit between current usage and a tier fraction
of the hard ceiling — the one recomputed every tick, dynamic term included —
(0.90 safe, 0.92 balanced, 0.97 aggressive, 0.95 custom), clamped to
[min_chunk, max_chunk]: it shrinks as projected usage nears that line. Before
each chunk, `should_abort_before_chunk` checks the projected usage against the
pre-chunk abort margin (0.90, 0.93, 0.97, 0.95) of the stable abort cap, and
never lets a chunk run past the ceiling itself.

A chunk's cost is `PrefillFigures.chunk_bytes` (its KV, its attention over the
prompt, a conversion's float32 layer) times a factor learned from measured peaks
(`PrefillCostModel`, never below 1); admission projects a whole prompt with the
same figures and factor.
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
class PrefillFigures:
    """What a model's prefill costs, from figures the model gives once at load. The one
    estimate both admission (for a whole prompt) and the prefill guard (before each
    chunk) project with, so that a request admitted is a request the guard lets run."""

    kv_bytes_per_token: int
    attention_heads: int = 1
    # The fp32-conversion prefill (engine/fast_prefill.py); None: the stock path.
    conversion: ConversionTransient | None = None

    def linear(self, prompt_tokens: int) -> tuple[int, int]:
        """(bytes per chunk token, bytes per chunk whatever its size) of a chunk over a
        prompt of `prompt_tokens`. Per token: its KV, activations of a few KV rows, its
        attention scores over the whole prompt (fp32, and a softmax copy), a conversion's
        fp32 activations. Per chunk: a conversion's fp32 layer and one layer's fp32 keys
        and values. Measured on the tiny model: 4,000 tokens at step 512 peak ~40 MiB."""
        c = self.conversion or ConversionTransient()
        per_token = (self.kv_bytes_per_token * 5 + self.attention_heads * prompt_tokens * 8
                     + c.chunk_token_bytes)
        return per_token, c.weight_bytes + prompt_tokens * c.prompt_token_bytes

    def chunk_bytes(self, chunk_tokens: int, prompt_tokens: int) -> int:
        """A chunk's peak growth: its KV and its transient."""
        if chunk_tokens <= 0:
            return 0
        per_token, fixed = self.linear(prompt_tokens)
        return fixed + chunk_tokens * per_token

    def transient_bytes(self, chunk_tokens: int, prompt_tokens: int) -> int:
        """What a chunk adds at its peak beyond the KV it stores."""
        return self.chunk_bytes(chunk_tokens, prompt_tokens) - max(0, chunk_tokens) * (
            self.kv_bytes_per_token)


@dataclass(frozen=True)
class PrefillCostModel:
    """A model's chunk cost: the static estimate (`PrefillFigures.chunk_bytes`) times a
    factor learned from measured peaks, an EWMA of measured / estimated that never goes
    below 1, so one lucky chunk that reused pooled buffers never makes the next one
    overconfident. The ratio, not bytes per token, is learned: a chunk's attention grows
    with the prompt, so a per-token figure learned on a long prompt would overstate a
    short one."""

    figures: PrefillFigures
    alpha: float = PREFILL_COST_EWMA_ALPHA
    ewma_ratio: float | None = None
    samples: int = 0

    def __post_init__(self) -> None:
        if self.figures.kv_bytes_per_token < 0:
            raise ValueError("kv_bytes_per_token must be >= 0")
        if not 0 < self.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")

    def observe(self, tokens: int, bytes_delta: int, prompt_tokens: int) -> PrefillCostModel:
        """A new model after a chunk of `tokens` over a prompt of `prompt_tokens` grew
        usage by `bytes_delta` at its peak. A negative delta (the pool was drained
        mid-chunk) counts as zero."""
        estimate = self.figures.chunk_bytes(tokens, max(tokens, prompt_tokens))
        if tokens <= 0 or estimate <= 0:
            return self
        sample = max(0, bytes_delta) / estimate
        if self.ewma_ratio is None:
            ewma = sample
        else:
            ewma = self.alpha * sample + (1 - self.alpha) * self.ewma_ratio
        return dataclasses.replace(self, ewma_ratio=ewma, samples=self.samples + 1)

    @property
    def factor(self) -> float:
        return max(1.0, self.ewma_ratio or 0.0)

    def linear(self, prompt_tokens: int) -> tuple[float, int]:
        """`PrefillFigures.linear` times the learned factor: what `plan_chunk` sizes a
        chunk with."""
        per_token, fixed = self.figures.linear(prompt_tokens)
        return self.factor * per_token, math.ceil(self.factor * fixed)


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
