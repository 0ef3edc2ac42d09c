"""A prefill chunk's RoPE from a table (engine/rope_table.py), on real MLX: the stock
`mx.fast.rope` bit for bit, whatever the setting, dtype, offset or batch."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import rope_utils

from engine import compiled_decode, rope_table

pytestmark = pytest.mark.skipif(
    compiled_decode.environment_reason() is not None,
    reason=f"the table RoPE is not used here: {compiled_decode.environment_reason()}")


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch):
    """Every chunk takes the table unless a test says otherwise (the threshold is its own
    test), and no table outlives a test."""
    monkeypatch.setattr(rope_table, "MIN_ANGLES", 0)
    rope_table.clear()
    yield
    rope_table.clear()


def _compiled(module: nn.Module) -> nn.Module:
    module.__class__ = compiled_decode._COMPILED[type(module)]
    return module


def _stock(module: nn.Module, x: mx.array, offset) -> mx.array:
    return compiled_decode._STOCK[type(module)].__call__(module, x, offset)


SETTINGS = [
    lambda: nn.RoPE(64),
    lambda: nn.RoPE(64, traditional=True),
    lambda: nn.RoPE(32, base=500000, scale=0.25),  # a part of the head rotated, positions scaled
    lambda: nn.RoPE(48, traditional=True, base=1e6),
    lambda: rope_utils.Llama3RoPE(64, base=500000, scaling_config={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}),
]


@pytest.mark.parametrize("make", SETTINGS)
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_int_offsets_match_the_stock_op(make, dtype):
    module = _compiled(make())
    for tokens, offset in [(255, 0), (7, 3), (128, 1000), (300, 2900), (2, 5000)]:
        # Laid out as attention makes it: (batch, tokens, heads, dim) transposed.
        x = mx.random.normal((1, tokens, 4, 64)).astype(dtype).transpose(0, 2, 1, 3)
        got, want = module(x, offset=offset), _stock(module, x, offset)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert mx.array_equal(got, want).item(), (tokens, offset)
    # One table for the setting, holding the last chunk's positions only.
    assert len(rope_table._tables) == 1
    table = next(iter(rope_table._tables.values()))
    assert (table.lo, table.hi) == (5000, 5002)


@pytest.mark.parametrize("make", SETTINGS[:2] + SETTINGS[4:])
def test_a_batchs_offsets_match_the_stock_op(make):
    """mlx-lm's batch cache: an offset per sequence, negative under left padding."""
    module = _compiled(make())
    for offsets in ([0, -3, -40], [17, 100, 2], [-5], [9, 9, 9]):
        off = mx.array(offsets)
        x = mx.random.normal((len(offsets), 50, 4, 64)).transpose(0, 2, 1, 3)
        assert mx.array_equal(module(x, offset=off), _stock(module, x, off)).item(), offsets


def test_decode_calls_and_other_shapes_leave_the_table_alone():
    module = _compiled(nn.RoPE(64))
    x = mx.random.normal((3, 4, 1, 64))  # one token per sequence: the compiled op
    assert mx.array_equal(module(x, offset=mx.array([4, 9, 1])),
                          _stock(module, x, mx.array([4, 9, 1]))).item()
    x3 = mx.random.normal((4, 20, 64))  # not (batch, heads, tokens, dim): stock
    assert mx.array_equal(module(x3, offset=2), _stock(module, x3, 2)).item()
    assert not rope_table._tables


def test_short_chunks_keep_the_stock_op(monkeypatch):
    monkeypatch.setattr(rope_table, "MIN_ANGLES", 2048)
    module = _compiled(nn.RoPE(64))  # 32 angles a token
    short = mx.random.normal((1, 4, 63, 64))
    assert mx.array_equal(module(short, offset=5), _stock(module, short, 5)).item()
    assert not rope_table._tables
    long = mx.random.normal((1, 4, 64, 64))
    assert mx.array_equal(module(long, offset=5), _stock(module, long, 5)).item()
    assert rope_table._tables


def test_every_layer_of_a_chunk_reads_one_build(monkeypatch):
    module = _compiled(nn.RoPE(64))
    builds = []
    build = rope_table._build
    monkeypatch.setattr(rope_table, "_build", lambda *a: builds.append(a[2]) or build(*a))
    x = mx.random.normal((1, 4, 100, 64))
    for _ in range(6):  # a chunk's layers
        module(x, offset=300)
    module(x, offset=400)  # the next chunk
    assert builds == [300, 400]


def test_chunks_past_the_table_bound_take_the_stock_op(monkeypatch):
    monkeypatch.setattr(rope_table, "MAX_TABLE_BYTES", 64 * 4 * 100)
    module = _compiled(nn.RoPE(64))
    x = mx.random.normal((1, 4, 100, 64))
    assert mx.array_equal(module(x, offset=100), _stock(module, x, 100)).item()
    assert rope_table._tables  # 100 rows fit
    rope_table.clear()
    x = mx.random.normal((1, 4, 101, 64))
    assert mx.array_equal(module(x, offset=100), _stock(module, x, 100)).item()
    assert not rope_table._tables
