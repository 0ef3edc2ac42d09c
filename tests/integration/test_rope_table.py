"""A prefill chunk's RoPE from a table (engine/rope_table.py), on real MLX: the stock
`mx.fast.rope` bit for bit, whatever the setting, dtype, offset or batch."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import rope_utils

from engine import compiled_decode, rope_table
from engine.model_engine import EngineSettings, ModelEngine
from tests.integration.test_fast_prefill import greedy

pytestmark = pytest.mark.skipif(
    compiled_decode.environment_reason() is not None,
    reason=f"the table RoPE is not used here: {compiled_decode.environment_reason()}")


@pytest.fixture(autouse=True)
def fresh_tables():
    rope_table.clear()
    yield
    rope_table.clear()


@pytest.fixture
def every_chunk(monkeypatch):
    """Every chunk takes the table (the threshold is a test of its own)."""
    monkeypatch.setattr(rope_table, "MIN_ANGLES", 0)


async def test_engines_with_the_table_decode_the_stock_tokens(demo_path, monkeypatch):
    """Real engine threads, the defaults a user gets: prompts long enough for the table
    (one alone, then three of different lengths at once: a left-padded batch) give the
    tokens of an engine with the stock ops, and the table was built and read."""
    loop = asyncio.get_running_loop()
    # The half-precision decode kernel sums in another order: off on both, so that only
    # the RoPE differs.
    fast = ModelEngine("table", str(demo_path), loop, EngineSettings(fast_decode_kernel=False))
    stock = ModelEngine("stock", str(demo_path), loop,
                        EngineSettings(compiled_decode=False, fast_decode_kernel=False))
    built, read = [], []
    build, rotate = rope_table._build, rope_table.rotate
    monkeypatch.setattr(rope_table, "_build", lambda *a: built.append(a[2]) or build(*a))
    monkeypatch.setattr(rope_table, "rotate", lambda *a: read.append(1) or rotate(*a))
    try:
        await asyncio.gather(asyncio.wrap_future(fast.start()),
                             asyncio.wrap_future(stock.start()))
        prompts = [list(range(5 + i, 5 + i + n)) for i, n in enumerate((300, 200, 260))]
        assert await greedy(fast, "f0", prompts[0]) == await greedy(stock, "s0", prompts[0])
        got, want = await asyncio.gather(
            asyncio.gather(*(greedy(fast, f"f{i}", p) for i, p in enumerate(prompts))),
            asyncio.gather(*(greedy(stock, f"s{i}", p) for i, p in enumerate(prompts))))
        assert got == want
        assert built and len(read) > len(built)  # each build read by the other layers
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


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
@pytest.mark.usefixtures("every_chunk")
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
@pytest.mark.usefixtures("every_chunk")
def test_a_batchs_offsets_match_the_stock_op(make):
    """mlx-lm's batch cache: an offset per sequence, negative under left padding."""
    module = _compiled(make())
    for offsets in ([0, -3, -40], [17, 100, 2], [-5], [9, 9, 9]):
        off = mx.array(offsets)
        x = mx.random.normal((len(offsets), 50, 4, 64)).transpose(0, 2, 1, 3)
        assert mx.array_equal(module(x, offset=off), _stock(module, x, off)).item(), offsets


@pytest.mark.usefixtures("every_chunk")
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


@pytest.mark.usefixtures("every_chunk")
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


@pytest.mark.usefixtures("every_chunk")
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
