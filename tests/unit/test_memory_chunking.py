"""Adaptive prefill chunk sizing and the per-token cost model."""

from __future__ import annotations

import pytest

from memory.chunking import (
    ConversionTransient,
    PrefillCostModel,
    PrefillFigures,
    plan_chunk,
    prefill_target_bytes,
    should_abort_before_chunk,
)
from memory.levels import GIB, MIB, Tier


def test_cost_model_ewma_of_measured_over_estimated_with_one_as_floor():
    figures = PrefillFigures(kv_bytes_per_token=1000)
    model = PrefillCostModel(figures)
    assert model.factor == 1.0 and model.samples == 0
    assert model.linear(0) == (5000, 0)  # its KV and activations, no prompt to attend
    estimate = figures.chunk_bytes(100, 100)
    model = model.observe(100, 2 * estimate, 100)  # the first sample seeds the EWMA
    assert model.ewma_ratio == 2 and model.factor == 2
    model = model.observe(100, 0, 100)  # alpha 0.3: 0.3 * 0 + 0.7 * 2
    assert model.ewma_ratio == pytest.approx(1.4)
    for _ in range(20):
        model = model.observe(100, 0, 100)
    assert model.factor == 1.0  # never below the static estimate
    assert model.samples == 22


def test_cost_model_ignores_empty_chunks_and_clamps_negative_deltas():
    model = PrefillCostModel(PrefillFigures(kv_bytes_per_token=10))
    assert model.observe(0, 10**9, 10) is model
    assert model.observe(10, -5000, 10).ewma_ratio == 0.0
    with pytest.raises(ValueError):
        PrefillCostModel(PrefillFigures(kv_bytes_per_token=-1))
    with pytest.raises(ValueError):
        PrefillCostModel(PrefillFigures(kv_bytes_per_token=1), alpha=0)


def test_prefill_figures_chunk_cost_is_linear_and_attention_grows_with_the_prompt():
    conv = ConversionTransient(weight_bytes=7000, chunk_token_bytes=3, prompt_token_bytes=2)
    f = PrefillFigures(kv_bytes_per_token=100, attention_heads=4, conversion=conv)
    per_token, fixed = f.linear(50)
    assert per_token == 5 * 100 + 4 * 50 * 8 + 3 and fixed == 7000 + 50 * 2
    assert f.chunk_bytes(10, 50) == fixed + 10 * per_token
    assert f.transient_bytes(10, 50) == f.chunk_bytes(10, 50) - 10 * 100
    assert f.chunk_bytes(0, 50) == 0
    assert f.linear(500)[0] > per_token


def test_chunk_shrinks_as_usage_nears_the_tier_fraction_of_the_ceiling():
    cap, bpt = 10 * GIB, MIB
    target = prefill_target_bytes(Tier.BALANCED, cap)  # 0.92 x 10 GiB
    sizes = [
        plan_chunk(
            tier=Tier.BALANCED,
            ceiling_bytes=cap,
            usage_bytes=target - free * MIB,
            bytes_per_token=bpt,
            remaining_tokens=100_000,
        )
        for free in (5000, 2048, 1000, 500, 100, 10, 0)
    ]
    assert sizes == [2048, 2048, 1000, 500, 100, 32, 32]
    assert sizes == sorted(sizes, reverse=True)


def test_chunk_clamps_to_remaining_min_and_max():
    kw = dict(tier=Tier.SAFE, ceiling_bytes=10 * GIB, usage_bytes=0, bytes_per_token=MIB)
    assert plan_chunk(remaining_tokens=0, **kw) == 0
    assert plan_chunk(remaining_tokens=7, **kw) == 7
    assert plan_chunk(remaining_tokens=10_000, max_chunk=512, **kw) == 512
    kw["usage_bytes"] = 20 * GIB
    assert plan_chunk(remaining_tokens=10_000, min_chunk=64, **kw) == 64
    kw["bytes_per_token"] = 0
    assert plan_chunk(remaining_tokens=10_000, **kw) == 2048


def test_pre_chunk_abort_uses_the_margin_not_the_chunk_fraction():
    cap = 100 * GIB
    # Balanced: chunks aim at 0.92, the abort line is 0.93.
    at_target = prefill_target_bytes(Tier.BALANCED, cap)
    assert not should_abort_before_chunk(
        tier=Tier.BALANCED,
        abort_cap_bytes=cap,
        ceiling_bytes=cap,
        usage_bytes=at_target,
        chunk_tokens=1024,
        bytes_per_token=MIB,
    )
    assert should_abort_before_chunk(
        tier=Tier.BALANCED,
        abort_cap_bytes=cap,
        ceiling_bytes=cap,
        usage_bytes=int(cap * 0.93),
        chunk_tokens=1,
        bytes_per_token=1,
    )


@pytest.mark.parametrize(("tier", "fraction", "margin"), [
    (Tier.SAFE, 0.90, 0.90), (Tier.BALANCED, 0.92, 0.93),
    (Tier.AGGRESSIVE, 0.97, 0.97), (Tier.CUSTOM, 0.95, 0.95),
])
def test_seed_chunk_fractions_are_of_the_recomputed_ceiling_and_margins_of_the_stable_cap(
        tier, fraction, margin):
    """The dynamic term binds (50 GiB) under a larger stable cap (58 GiB): the chunk
    target is the tier's fraction of the 50 GiB ceiling, never of the stable cap."""
    ceiling, stable = 50 * GIB, 58 * GIB
    assert prefill_target_bytes(tier, ceiling) == int(ceiling * fraction)
    assert prefill_target_bytes(tier, ceiling) < ceiling
    # One token of headroom under the target: a chunk of one (min_chunk 1).
    usage = int(ceiling * fraction) - MIB
    assert plan_chunk(tier=tier, ceiling_bytes=ceiling, usage_bytes=usage,
                      bytes_per_token=MIB, remaining_tokens=10_000, min_chunk=1) == 1
    # The abort line is the margin of the stable cap, but never past the ceiling.
    line = min(int(stable * margin), ceiling)
    kw = dict(tier=tier, abort_cap_bytes=stable, ceiling_bytes=ceiling, chunk_tokens=1,
              bytes_per_token=1)
    assert not should_abort_before_chunk(usage_bytes=line - 1, **kw)
    assert should_abort_before_chunk(usage_bytes=line, **kw)
