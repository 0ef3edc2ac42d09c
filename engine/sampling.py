"""Per-request samplers and logits processors built from mlx-lm's pieces.

mlx-lm's `make_sampler` draws from MLX's global random state, so two requests in
one batch would disturb each other's sequence. Each request here carries its own
key, split every step, so a fixed seed repeats its output whatever else runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    greedy_sampler,
    make_logits_processors,
)

from engine.request import SamplingParams

Sampler = Callable[[mx.array], mx.array]


class SeededSampler:
    """Top-p / min-p / top-k filtering, then a categorical draw with this request's key."""

    def __init__(self, params: SamplingParams) -> None:
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4))
        self._key = mx.random.key(seed)
        self._inv_temp = 1.0 / params.temperature
        self._params = params

    def __call__(self, logprobs: mx.array) -> mx.array:
        p = self._params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        self._key, sub = mx.random.split(self._key)
        return mx.random.categorical(logprobs * self._inv_temp, key=sub)


def make_request_sampler(params: SamplingParams) -> Sampler:
    # Greedy requests share one function object so the batch samples them in one call.
    if params.temperature == 0:
        return greedy_sampler
    return SeededSampler(params)


def make_request_processors(params: SamplingParams) -> list:
    if params.repetition_penalty == 1.0:
        return []
    return make_logits_processors(repetition_penalty=params.repetition_penalty)
