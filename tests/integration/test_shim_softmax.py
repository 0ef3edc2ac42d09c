"""A prefill chunk's softmax and float32 SwiGLU through the CBLAS shim's kernels
(engine/cblas_shim.c `plimsoll_softmax_rows`, `plimsoll_swiglu`): against the NumPy passes
they replace on every instruction set, the masks they take (each row's visible keys one
interval), a float32 decode step's attention over a long cache, and real engines through
them against the stock path (prefill: tests/integration/test_fast_prefill.py
`test_prompts_prefilled_together_keep_the_stock_tokens`)."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import numpy as np
import pytest

from engine import blas, fast_prefill, shim_decode
from engine.demo_models import DEMO_CORPUS, ensure_demo, ensure_demo_variant
from engine.model_engine import EngineSettings, ModelEngine
from tests.integration.test_decode_kernel import _kernel_and_stock, _kernel_isa
from tests.integration.test_fast_prefill import fast_and_stock, greedy
from tests.support.near_tie import agree_but_at_a_near_tie

pytestmark = pytest.mark.skipif(
    fast_prefill.environment_reason() is not None or blas.softmax_rows() is None,
    reason="needs the CBLAS shim under MLX on a Linux CPU")


def _mask(b: int, n: int, s_len: int, first: int, pads: list[int] | None,
          window: int | None) -> np.ndarray:
    """Visible keys (True) of a causal chunk of n queries after `first` keys, with each
    batch entry's left padding and a sliding window: (B | 1, n, S)."""
    q, k = np.arange(first, first + n)[:, None], np.arange(s_len)[None]
    visible = k <= q
    if window:
        visible &= q < k + window
    visible = np.broadcast_to(visible, (len(pads) if pads else 1, n, s_len)).copy()
    for bi, pad in enumerate(pads or []):
        visible[bi, :, :pad] = False
    return visible


def _numpy_softmax(s: np.ndarray, mask: object, half: mx.Dtype, first: int = 0) -> np.ndarray:
    """What the NumPy passes (the path without the shim) give."""
    out = s.copy()
    fast_prefill._numpy_softmax(out, mask, half, first)
    return out


# (batch, heads, queries, keys, keys cached before the chunk, left pads, sliding window)
SHAPES = [(1, 8, 256, 256, 0, None, None), (1, 3, 100, 300, 200, None, None),
          (3, 2, 7, 33, 26, [0, 5, 26], None), (2, 4, 17, 40, 23, [3, 0], 9),
          (2, 2, 9, 9, 0, [9, 2], None)]  # the last: an entry whose keys are all padding


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
@pytest.mark.parametrize("half", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:4])))
def test_the_shims_softmax_is_the_numpy_passes(isa, half, shape):
    """Causal (given as "causal" or as a mask array), left-padded and sliding-window
    chunks: float32 weights within 1e-6 of NumPy's (the exp's last bits), bfloat16 and
    float16 ones equal but for a handful of roundings that a last bit tipped, each one
    step; the hidden keys 0."""
    b, h, n, s_len, first, pads, window = shape
    rng = np.random.default_rng(n * s_len)
    s = (rng.standard_normal((b, h, n, s_len)) * 6).astype(np.float32)
    visible = _mask(b, n, s_len, first, pads, window)
    causal_only = not pads and not window
    mask = "causal" if causal_only else mx.array(visible[:, None])
    lo, hi = fast_prefill._visible_windows(mask, n, s_len, first)
    want = _numpy_softmax(s, mask, half, first)
    with _kernel_isa(isa):
        got = s.copy()
        assert blas.softmax_rows()(fast_prefill.SHIM_SOFTMAX_KINDS[half], got.ctypes.data, 0,
                                   b * h * n, s_len, lo.ctypes.data, hi.ctypes.data, n, h * n,
                                   lo.shape[0]) == 0
    hidden = ~np.broadcast_to(visible[:, None] if visible.shape[0] == b else visible,
                              (b, h, n, s_len))
    assert (got[hidden] == 0).all()
    diff = np.abs(got - want)
    if half == mx.float32:
        assert diff.max() <= 1e-6
    else:
        assert (diff > 0).sum() <= max(4, diff.size // 10_000)
        # One step at each value (float16: 2^-24 at least, its subnormals' spacing).
        step = (np.abs(want) * 2.0 ** -7 + 1e-30 if half == mx.bfloat16
                else np.maximum(np.abs(want) * 2.0 ** -10, 2.0 ** -24))
        assert (diff <= step).all()


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
@pytest.mark.parametrize("half", [mx.float32, mx.bfloat16, mx.float16])
def test_a_nan_score_makes_its_row_nan_as_numpys(isa, half):
    """A NaN among a row's visible scores (a broken model's) makes the whole row NaN, as
    NumPy's passes make it; the other rows are untouched by it."""
    s = np.zeros((1, 1, 2, 8), np.float32)
    s[0, 0, 0, 3] = np.nan
    want = _numpy_softmax(s, None, half)
    got = s[0, 0].copy()
    lo, hi = np.zeros((1, 2), np.int64), np.full((1, 2), 8, np.int64)
    with _kernel_isa(isa):
        assert blas.softmax_rows()(fast_prefill.SHIM_SOFTMAX_KINDS[half], got.ctypes.data, 0,
                                   2, 8, lo.ctypes.data, hi.ctypes.data, 2, 2, 1) == 0
    assert np.isnan(got[0]).all() and np.isnan(want[0, 0, 0]).all()
    assert np.array_equal(got[1], want[0, 0, 1])


def test_windows_are_taken_from_interval_masks_only():
    """No mask, a causal one and boolean masks whose rows are each one interval become
    windows (found once for a mask every layer of a chunk shares); an additive mask or a
    row with a gap stays with the NumPy passes."""
    n, s_len = 4, 10
    lo, hi = fast_prefill._visible_windows(None, n, s_len, 6)
    assert (lo == 0).all() and (hi == s_len).all()
    lo, hi = fast_prefill._visible_windows("causal", n, s_len, 6)
    assert lo.tolist() == [[0] * 4] and hi.tolist() == [[7, 8, 9, 10]]
    padded = mx.array(_mask(2, n, s_len, 6, [3, 0], 5)[:, None])
    lo, hi = fast_prefill._visible_windows(padded, n, s_len, 6)
    assert lo.tolist() == [[3, 3, 4, 5], [2, 3, 4, 5]] and hi.tolist() == [[7, 8, 9, 10]] * 2
    assert fast_prefill._visible_windows(padded, n, s_len, 6)[0] is lo  # found once
    gap = np.ones((1, 1, n, s_len), bool)
    gap[0, 0, 2, 5] = False
    assert fast_prefill._visible_windows(mx.array(gap), n, s_len, 6) is None
    assert fast_prefill._visible_windows(mx.zeros((1, 1, n, s_len)), n, s_len, 6) is None


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
def test_the_shims_swiglu_is_numpys(isa):
    """silu(g) * u within 2e-6 relative of NumPy's (1 / (1 + exp(-g))) * g * u, gates far
    below zero (exp(-g) past float32) 0 as NumPy's, at any count."""
    rng = np.random.default_rng(1)
    g = (rng.standard_normal(100_003) * 10).astype(np.float32)
    g[:4] = [-200.0, 200.0, -89.0, 87.0]
    u = rng.standard_normal(g.size).astype(np.float32)
    with np.errstate(over="ignore"):
        want = np.reciprocal(np.exp(-g) + np.float32(1)) * g * u
    with _kernel_isa(isa):
        for count in (g.size, 17, 3):
            got = np.full(g.size, np.nan, np.float32)
            assert blas.swiglu()(got.ctypes.data, g.ctypes.data, u.ctypes.data, count) == 0
            assert np.isnan(got[count:]).all()  # nothing past the count is written
            rel = np.abs(got[:count] - want[:count]) / np.maximum(np.abs(want[:count]), 1e-30)
            assert rel.max() <= 2e-6
    assert got[0] == 0


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16])
def test_half_precision_roundings_at_the_edges_are_numpys(isa, half):
    """The weights of a row of equal scores are 1/keys rounded: float16 normals and
    subnormals (from 16,385 keys) and bfloat16 ones, bit for bit NumPy's rounding. A
    score past the dtype's largest value rounds to inf and its row is NaN, as NumPy's
    passes make it."""
    kind = fast_prefill.SHIM_SOFTMAX_KINDS[half]
    dtype = np.float16 if half == mx.float16 else None
    with _kernel_isa(isa):
        for cols in (1, 3, 7, 10, 1000, 3000, 20_000, 100_000):
            s = np.zeros((1, cols), np.float32)
            lo, hi = np.zeros((1, 1), np.int64), np.full((1, 1), cols, np.int64)
            assert blas.softmax_rows()(kind, s.ctypes.data, 0, 1, cols, lo.ctypes.data,
                                       hi.ctypes.data, 1, 1, 1) == 0
            want = _numpy_softmax(np.zeros((1, 1, 1, cols), np.float32), None, half)[0, 0]
            assert np.array_equal(s, want), cols
            if dtype is not None:
                assert (s == np.float32(1 / np.float32(cols)).astype(dtype)).all()
        big = np.array([[[[1e5 if half == mx.float16 else 3.4e38, 0.0, 1.0]]]], np.float32)
        got = big[0, 0].copy()
        lo, hi = np.zeros((1, 1), np.int64), np.full((1, 1), 3, np.int64)
        blas.softmax_rows()(kind, got.ctypes.data, 0, 1, 3, lo.ctypes.data, hi.ctypes.data,
                            1, 1, 1)
        with np.errstate(all="ignore"):  # inf - inf, and the cast past float16
            want = _numpy_softmax(big, None, half)[0, 0]
        assert np.array_equal(got, want, equal_nan=True) and np.isnan(want).any(), (got, want)


@pytest.mark.parametrize("mask", ["none", "padded", "gap"])
def test_a_long_decode_steps_attention_is_mlx_s(mask):
    """One float32 query per sequence over 700 keys, 8 heads on 2 key heads: the shim's
    softmax on evaluated scores (NumPy's passes for a mask with a gap) gives MLX's own
    attention within 1e-5, each sequence seeing only its keys."""
    b, s_len = 3, 700
    mx.random.seed(4)
    q = mx.random.normal((b, 8, 1, 32))
    k, v = mx.random.normal((b, 2, s_len, 32)), mx.random.normal((b, 2, s_len, 32))
    visible = np.ones((b, 1, 1, s_len), bool)
    visible[1, ..., :200] = False  # left padding
    visible[2, ..., :650] = False
    if mask == "gap":
        visible[0, ..., 300:310] = False
    m = None if mask == "none" else mx.array(visible)
    got = fast_prefill._long_decode_attention(q, k, v, 0.125, m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=m)
    assert got.shape == want.shape == (b, 8, 1, 32)
    assert mx.abs(got - want).max().item() <= 1e-5


# The largest logit gap at which two bfloat16 paths decoding over a long cache may part.
LONG_CONTEXT_GAP = 0.05


def _keys_attended(monkeypatch, name: str) -> list[int]:
    """The keys of every call of fast_prefill's attention `name` from now on."""
    calls: list[int] = []
    attention = getattr(fast_prefill, name)

    def counted(*args):
        calls.append(args[1].shape[2])
        return attention(*args)

    monkeypatch.setattr(fast_prefill, name, counted)
    return calls


async def test_long_decodes_take_the_shims_softmax_and_keep_the_stock_tokens(demo_path,
                                                                             monkeypatch):
    """Real engine threads with the defaults: a float32 model decoding past
    DECODE_SOFTMAX_MIN_KEYS keys (two sequences together, one alone) attends through
    the shim's softmax, and its greedy output is the stock path's."""
    calls = _keys_attended(monkeypatch, "_long_decode_attention")
    async with fast_and_stock(demo_path) as (fast, stock, _):
        ids = fast.info.tokenizer.encode(DEMO_CORPUS) * 12
        prompts = [ids[:fast_prefill.DECODE_SOFTMAX_MIN_KEYS + 40],
                   ids[5:fast_prefill.DECODE_SOFTMAX_MIN_KEYS + 90]]
        assert len(prompts[1]) > fast_prefill.DECODE_SOFTMAX_MIN_KEYS
        got = await asyncio.gather(*(greedy(fast, f"f{i}", p, 12)
                                     for i, p in enumerate(prompts)))
        together = len(calls)
        assert together > 0 and min(calls) >= fast_prefill.DECODE_SOFTMAX_MIN_KEYS
        got.append(await greedy(fast, "alone", prompts[0], 12))
        assert len(calls) > together
        want = await asyncio.gather(*(greedy(stock, f"s{i}", p, 12)
                                      for i, p in enumerate([*prompts, prompts[0]])))
        assert got == want


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
@pytest.mark.parametrize("kind", [blas.HALF_BF16, blas.HALF_F16, blas.HALF_F32])
def test_the_shims_rows_sum_is_float64_numpys(isa, kind):
    """y = x @ w over rows of w as stored (bfloat16, float16 or float32, rows further
    apart than they are long, as a cache's are): within float32 rounding of float64
    NumPy, for 1-5 rows of x and widths of one to seventeen vectors; arguments it does
    not take refused."""
    rng = np.random.default_rng(kind)
    dtype = {blas.HALF_BF16: mx.bfloat16, blas.HALF_F16: mx.float16,
             blas.HALF_F32: mx.float32}[kind]
    fn = blas.half_rows_sum()
    with _kernel_isa(isa):
        for m, s_len, d in [(1, 5, 8), (2, 700, 64), (3, 33, 136), (4, 1000, 128),
                            (5, 300, 64)]:
            x = rng.random((m, s_len)).astype(np.float32)
            x /= x.sum(axis=1, keepdims=True)
            stored = mx.array(rng.standard_normal((s_len, d + 24)).astype(np.float32))
            stored = stored.astype(dtype)
            values = np.array(stored.astype(mx.float32)).astype(np.float64)[:, :d]
            bits = np.array(stored.view(mx.uint16) if kind != blas.HALF_F32 else stored)
            y = np.full((m, d), np.nan, np.float32)
            assert fn(kind, m, s_len, d, x.ctypes.data, s_len, bits.ctypes.data, d + 24,
                      y.ctypes.data, d) == 0
            assert np.abs(y - x.astype(np.float64) @ values).max() <= 1e-5
        assert fn(kind, 1, 5, 12, x.ctypes.data, 5, bits.ctypes.data, 12, y.ctypes.data,
                  12) == -1  # not a multiple of 8 columns


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("mask", ["none", "padded", "gap"])
def test_a_long_half_precision_decode_attention_is_the_kernels_one(dtype, mask):
    """Over a cache read where it is stored (the first 700 of 1,024 rows a head), the
    products through the shim's kernels give `shim_decode.decode_attention`'s result but
    for some elements one step of the dtype apart (the sums' order: 0-4 of 1,536 in
    bfloat16, ~4 % in float16, whose steps are finer); a mask with a gap takes NumPy's
    softmax."""
    b, h, kv, s_len, d = 3, 8, 2, 700, 64
    mx.random.seed(6)
    q = mx.random.normal((b, h, 1, d)).astype(dtype)
    buffers = [mx.random.normal((b, kv, 1024, d)).astype(dtype) for _ in range(2)]
    mx.eval(*buffers)
    k, v = (x[:, :, :s_len, :] for x in buffers)
    visible = np.ones((b, 1, 1, s_len), bool)
    visible[1, ..., :200] = False
    visible[2, ..., :650] = False
    if mask == "gap":
        visible[0, ..., 300:310] = False
    m = None if mask == "none" else mx.array(visible)
    got = fast_prefill._long_half_decode_attention(q, k, v, 0.125, m)
    want = shim_decode.decode_attention(q, k, v, 0.125, m)
    g, w = (np.array(x.astype(mx.float32)) for x in (got, want))
    # One step at each value, and near zero what one weight's last bit moves (a weight
    # rounded the other way by the two softmaxes' exps: ~2^-6 of a step of 0.01 times a
    # value of ~1).
    bits = 7 if dtype == mx.bfloat16 else 10
    step = np.abs(w) * 2.0 ** -bits + 2.0 ** -(bits + 6)
    assert (np.abs(g - w) <= step).all() and (g != w).sum() <= g.size // 10


@pytest.mark.parametrize("where", ["past the bound", "from the switch"])
async def test_long_half_precision_decodes_take_the_shims_kernels(monkeypatch, where):
    """Real engine threads on the tiny bfloat16 model, the decode kernels taken (as the
    defaults take them where they measure faster: on the small and medium demo models):
    two sequences decoding past the cache `decode_attention_bytes` lets the kernels'
    attention copy to float32, or from HALF_DECODE_KERNELS_MIN_KEYS keys within it
    (shorter ones keep that attention), take the products over the cache as stored, and
    their greedy tokens part from MLX's own attention and products only at a near-tie."""
    path = ensure_demo_variant("tiny", "bf16")
    calls = _keys_attended(monkeypatch, "_long_half_decode_attention")
    if where == "from the switch":  # every cache within the bound
        monkeypatch.setattr(fast_prefill, "decode_attention_bytes", lambda plan: 1 << 40)
    async with _kernel_and_stock(path) as (fast, stock):
        plan = fast.fast_prefill
        assert plan.decode_half
        layer = fast.info.model.layers[0].self_attn
        per_token = 2 * layer.n_kv_heads * layer.head_dim * 4  # keys and values, float32
        longest = (fast_prefill.decode_attention_bytes(plan) // per_token
                   if where == "past the bound" else
                   fast_prefill.HALF_DECODE_KERNELS_MIN_KEYS - 1)
        ids = fast.info.tokenizer.encode(DEMO_CORPUS) * 60
        if where == "from the switch":
            await greedy(fast, "short", ids[:longest - 20], 12)
            assert calls == []
        prompts = [ids[:longest + 30], ids[7:longest + 90]]
        got = await asyncio.gather(*(greedy(fast, f"f{i}", p, 12)
                                     for i, p in enumerate(prompts)))
        assert calls and min(calls) > longest
        want = await asyncio.gather(*(greedy(stock, f"s{i}", p, 12)
                                      for i, p in enumerate(prompts)))
        # Over a thousand cached tokens MLX's own bfloat16 attention itself strays from
        # the step-by-step reference by more than six steps of a logit (seen: 0.027 at
        # 0.60, where three tokens were within it): a stated tolerance instead.
        for p, a, w in zip(prompts, got, want, strict=True):
            agree_but_at_a_near_tie(path, p, a, w, max_gap=LONG_CONTEXT_GAP)


async def test_the_small_bf16_model_decodes_a_long_cache_through_the_kernels_by_default(
        monkeypatch):
    """The small bfloat16 demo model with the defaults (which take the decode kernels
    where they measure faster at load, as here they do): a sequence decoding past 1,100
    cached tokens takes the products over the cache as stored, and its greedy tokens
    part from an engine with MLX's own attention and products only at a near-tie."""
    path = ensure_demo("small")  # bfloat16
    calls = _keys_attended(monkeypatch, "_long_half_decode_attention")
    loop = asyncio.get_running_loop()
    fast = ModelEngine("fast", str(path), loop, EngineSettings())
    stock = ModelEngine("stock", str(path), loop, EngineSettings(fast_decode_kernel=False))
    try:
        await asyncio.gather(asyncio.wrap_future(fast.start()),
                             asyncio.wrap_future(stock.start()))
        if not fast.fast_prefill.decode_half:
            pytest.skip(f"the kernels measured slower here: {fast.fast_prefill.decode_reason}")
        prompt = (fast.info.tokenizer.encode(DEMO_CORPUS) * 60)[:1100]
        got = await greedy(fast, "fast", prompt, 8)
        assert calls and min(calls) >= 1100
        want = await greedy(stock, "stock", prompt, 8)
        agree_but_at_a_near_tie(path, prompt, got, want, max_gap=LONG_CONTEXT_GAP)
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))
