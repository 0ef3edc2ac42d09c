"""Decode rows of dense bfloat16/float16 and affine-quantized layers through the CBLAS
shim's kernels (engine/cblas_shim.c `plimsoll_half_gemv`, `plimsoll_quant_gemv`), run by
MLX's own product of a registered weight (engine/shim_decode.py, engine/fast_prefill.py):
the kernels against float64 NumPy, the registry, and real engines against MLX's own
product."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import platform
import re
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import blas, fast_prefill, shim_decode
from engine.demo_models import DEMO_CORPUS, ensure_demo, ensure_demo_variant
from engine.model_engine import EngineSettings, ModelEngine
from plimsoll.v1 import control_pb2, inference_pb2
from service.cli import build_parser
from telemetry import names
from tests.integration.test_fast_prefill import LOGIT_TOL_4BIT, STEP, greedy, prompts
from tests.support.near_tie import agree_but_at_a_near_tie
from tools.harness.server import free_port, start_server, wait_all_serving

pytestmark = pytest.mark.skipif(
    fast_prefill.environment_reason() is not None or blas.half_gemv() is None,
    reason="needs the CBLAS shim under MLX on a Linux CPU")


@contextlib.contextmanager
def _kernel_isa(isa: str):
    """The decode kernels on `isa` inside the block (skipped where the CPU lacks it), the
    best the CPU has again after it."""
    try:
        if blas.limit_kernel_isa(isa) != isa:
            pytest.skip(f"this CPU has no {isa}")
        yield
    finally:
        blas.limit_kernel_isa(blas.KERNEL_ISAS[-1])


def _bits(w: np.ndarray, dtype: mx.Dtype) -> tuple[np.ndarray, np.ndarray]:
    """The weight's half-precision bits, and the values they stand for in float64."""
    h = mx.array(w).astype(dtype)
    return np.array(h.view(mx.uint16)), np.array(h.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_kernel_matches_float64(isa, dtype):
    """Every row count up to 32, widths with and without a tail past the vector loop, a
    range of output columns, float16 subnormals among the weights."""
    kind = blas.HALF_BF16 if dtype == mx.bfloat16 else blas.HALF_F16
    kernel = blas.half_gemv()
    rng = np.random.default_rng(1)
    with _kernel_isa(isa):
        for n, k in ((40, 512), (33, 1000), (7, 31), (5, 1536)):
            w = rng.standard_normal((n, k)).astype(np.float32)
            if dtype == mx.float16:
                w[0, :4] = [3e-6, -1e-7, 6e-8, 0.0]  # subnormal in float16
            bits, w64 = _bits(w, dtype)
            for m in (1, 2, 3, 6, 32):
                x = rng.standard_normal((m, k)).astype(np.float32)
                y = np.full((m, n), np.nan, dtype=np.float32)
                j0, j1 = (0, n) if m not in (3, 6) else (2, n - 1)
                assert kernel(kind, m, k, x.ctypes.data, k, bits.ctypes.data, k,
                              y.ctypes.data, n, j0, j1) == 0
                want = x.astype(np.float64) @ w64.T
                got = y[:, j0:j1]
                scale = np.abs(x).astype(np.float64) @ np.abs(w64).T
                assert np.all(np.abs(got - want[:, j0:j1]) <= 1e-5 * scale[:, j0:j1] + 1e-30)
                assert np.isnan(y[:, :j0]).all() and np.isnan(y[:, j1:]).all()
        if dtype == mx.float16:
            bits = np.array([[0x7C00, 0x3C00]], dtype=np.uint16)  # +inf, 1.0
            x = np.array([[1.0, 2.0]], dtype=np.float32)
            y = np.zeros((1, 1), dtype=np.float32)
            kernel(kind, 1, 2, x.ctypes.data, 2, bits.ctypes.data, 2, y.ctypes.data, 1, 0, 1)
            assert y[0, 0] == np.inf
        x = np.zeros((33, 8), dtype=np.float32)
        y = np.zeros((33, 1), dtype=np.float32)
        bits = np.zeros((1, 8), dtype=np.uint16)
        assert kernel(kind, 33, 8, x.ctypes.data, 8, bits.ctypes.data, 8,
                      y.ctypes.data, 1, 0, 1) == -1  # more rows than one call takes
        assert kernel(7, 1, 8, x.ctypes.data, 8, bits.ctypes.data, 8,
                      y.ctypes.data, 1, 0, 1) == -1  # no such kind


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_every_half_precision_value_widens_exactly(isa, dtype):
    """All 65,536 bit patterns (subnormals, infinities, NaNs among them), once in the
    vector loop (column 0) and once in the scalar tail (column 32 of 33)."""
    kind = blas.HALF_BF16 if dtype == mx.bfloat16 else blas.HALF_F16
    patterns = np.arange(1 << 16, dtype=np.uint32)
    if dtype == mx.float16:
        want = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
    else:
        want = (patterns << 16).view(np.float32)
    with _kernel_isa(isa):
        for column in (0, 32):
            bits = np.zeros((patterns.size, 33), dtype=np.uint16)
            bits[:, column] = patterns
            x = np.zeros((1, 33), dtype=np.float32)
            x[0, column] = 1.0
            y = np.empty((1, patterns.size), dtype=np.float32)
            assert blas.half_gemv()(kind, 1, 33, x.ctypes.data, 33, bits.ctypes.data, 33,
                                    y.ctypes.data, patterns.size, 0, patterns.size) == 0
            nan = np.isnan(want)
            assert np.array_equal(np.isnan(y[0]), nan), column
            assert np.array_equal(y[0][~nan], want[~nan]), column


def test_the_best_kernel_the_cpu_has_runs():
    flags: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    x86 = platform.machine() == "x86_64"
    want = "portable"
    if x86 and {"avx2", "fma", "f16c"} <= flags:
        want = "avx512" if {"avx512f", "avx512bw", "avx512vl"} <= flags else "avx2"
    assert blas.half_kernel_isa() == want, sorted(flags & {"avx2", "fma", "f16c", "avx512f"})


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_avx512_sums_what_avx2_sums_bit_for_bit(dtype):
    """Its 16 lanes hold two of AVX2's 8-lane sums each: the same bits, for every row
    count up to 32 and widths with tails past either loop (so that greedy output does
    not depend on which of the two the CPU has). Float32 weights run AVX2 under both."""
    kind = blas.HALF_BF16 if dtype == mx.bfloat16 else blas.HALF_F16
    rng = np.random.default_rng(7)
    kernel = blas.half_gemv()
    for n, k in ((40, 512), (33, 1000), (7, 31), (5, 1544), (3, 16), (6, 40)):
        w, _ = _bits(rng.standard_normal((n, k)).astype(np.float32), dtype)
        for m in (1, 2, 3, 4, 5, 8, 32):
            x = rng.standard_normal((m, k)).astype(np.float32)
            out = {}
            for isa in ("avx2", "avx512"):
                y = np.full((m, n), np.nan, dtype=np.float32)
                with _kernel_isa(isa):
                    assert kernel(kind, m, k, x.ctypes.data, k, w.ctypes.data, k,
                                  y.ctypes.data, n, 0, n) == 0
                out[isa] = y
            assert np.array_equal(out["avx2"], out["avx512"]), (n, k, m)


def test_the_kernel_isa_follows_the_environment(monkeypatch, caplog):
    for raw, want in (("avx2", "avx2"), (" Portable ", "portable"), ("", "avx512")):
        monkeypatch.setenv(blas.KERNEL_ISA_ENV, raw)
        assert blas.kernel_isa_limit() == want
    monkeypatch.setenv(blas.KERNEL_ISA_ENV, "sse9")
    assert blas.kernel_isa_limit() == "avx512" and blas.KERNEL_ISA_ENV in caplog.text


@pytest.fixture(scope="module")
def tiny_bf16():
    return ensure_demo_variant("tiny", "bf16")


@pytest.mark.parametrize("variant", ["bf16", "4bit"])
async def test_engines_decode_through_it_and_part_from_stock_only_at_near_ties(variant):
    """All prompts at once (decode rows of up to five sequences, the LM head too), dense
    bfloat16 or 4-bit layers: every one through the kernel every step (the shim counts
    MLX's products that ran it), and greedy tokens MLX's own product's but where its best
    two logits are within two bfloat16 steps. `fast_decode="fp32"` takes the kernel
    without measuring; `fast_decode_kernel=False` (`--no-decode-kernel`) leaves MLX's
    product."""
    path = ensure_demo_variant("tiny", variant)
    dense = variant == "bf16"
    wrapped = fast_prefill._FastLinear if dense else fast_prefill._FastQuantizedLinear
    loop = asyncio.get_running_loop()
    fast = ModelEngine("kernel", str(path), loop,
                       EngineSettings(prefill_step_size=STEP, fast_decode="fp32"))
    stock = ModelEngine("stock", str(path), loop,
                        EngineSettings(prefill_step_size=STEP, fast_decode_kernel=False))
    try:
        await asyncio.gather(asyncio.wrap_future(fast.start()),
                             asyncio.wrap_future(stock.start()))
        plan, plain = fast.fast_prefill, stock.fast_prefill
        assert (plan.decode_half, plan.decode_quant) == (dense, not dense)
        what = "dense layers" if dense else "quantized layers"
        assert f"{what} through the" in plan.decode_reason
        assert "kernel (set)" in plan.decode_reason
        assert not plain.decode_half and not plain.decode_quant
        head = fast.info.model.lm_head
        assert isinstance(head, wrapped) and head._decode_only
        if dense:
            assert not isinstance(stock.info.model.lm_head, fast_prefill._FastLinear)
        before = blas.half_calls()
        ids = prompts(fast.info.tokenizer)
        got, want = await asyncio.gather(
            asyncio.gather(*(greedy(fast, f"k{i}", p) for i, p in enumerate(ids))),
            asyncio.gather(*(greedy(stock, f"s{i}", p) for i, p in enumerate(ids))))
        layers = sum(isinstance(m, wrapped) for _, m in fast.info.model.named_modules())
        assert blas.half_calls() - before >= layers * 20
        for p, a, b in zip(ids, got, want, strict=True):
            agree_but_at_a_near_tie(path, p, a, b)
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


@contextlib.asynccontextmanager
async def _kernel_and_stock(path):
    """Two engines on real threads: the kernel taken without measuring
    (`fast_decode="fp32"`) and MLX's own products (`fast_decode_kernel=False`)."""
    loop = asyncio.get_running_loop()
    fast = ModelEngine("kernel", str(path), loop, EngineSettings(fast_decode="fp32"))
    stock = ModelEngine("stock", str(path), loop, EngineSettings(fast_decode_kernel=False))
    try:
        await asyncio.gather(asyncio.wrap_future(fast.start()),
                             asyncio.wrap_future(stock.start()))
        yield fast, stock
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


@pytest.mark.parametrize("variant", ["bf16", "4bit"])
async def test_a_short_prompt_is_prefilled_through_the_kernel(variant):
    """A prompt shorter than a prefill chunk the fast prefill converts
    (fast_prefill.DEFAULT_MIN_TOKENS) runs its few rows through the kernel too (MLX's own
    half-precision and quantized products of 2-15 rows take 10-200x as long): an 8-token
    prompt (one chunk) runs as many kernel products as a 1-token one's decode step and the
    last block's keys and values of its first 7 rows besides, and greedy tokens of short prompts are MLX's own product's but at near
    ties. `fast_decode="fp32"` takes the kernel without measuring: on the tiny model's
    small layers the measurement at load can go either way (a CI host chose MLX's product
    for tiny bf16); the choice by measurement is asserted on the served small 4-bit model."""
    path = ensure_demo_variant("tiny", variant)
    wrapped = fast_prefill._FastLinear if variant == "bf16" else fast_prefill._FastQuantizedLinear
    async with _kernel_and_stock(path) as (fast, stock):
        plan = fast.fast_prefill
        assert (plan.decode_half, plan.decode_quant) == (variant == "bf16", variant == "4bit")
        layers = sum(isinstance(m, wrapped) and not m._decode_only
                     for _, m in fast.info.model.named_modules())
        tokenizer = fast.info.tokenizer
        ids = [tokenizer.encode(t)[:n] for t, n in
               (("Hello there", 3), ("The quick brown fox jumps", 6), ("def main():", 12))]
        calls = []
        for prompt in ([5], list(range(5, 13))):
            before = blas.half_calls()
            await greedy(fast, f"one{len(prompt)}", prompt, max_tokens=1)
            calls.append(blas.half_calls() - before)
        # The 8 rows run through every product together, the last token's with them
        # (engine/final_chunk.py), and the last block's keys and values of the first 7
        # once more, for the cache: two kernel products more than the 1-token prompt's one
        # step (through MLX's products instead, the chunk would run far fewer).
        assert fast.prefill_last_token
        assert calls[0] >= layers and calls[1] - calls[0] == 2, (calls, layers)
        got, want = await asyncio.gather(
            asyncio.gather(*(greedy(fast, f"k{i}", p) for i, p in enumerate(ids))),
            asyncio.gather(*(greedy(stock, f"s{i}", p) for i, p in enumerate(ids))))
        for p, a, b in zip(ids, got, want, strict=True):
            agree_but_at_a_near_tie(path, p, a, b,
                                    max_gap=None if variant == "bf16" else 2 * LOGIT_TOL_4BIT)


async def test_prefill_chunks_below_the_measured_rows_run_through_the_kernel():
    """Where the kernel measured faster than a conversion at more rows than min_tokens
    (plan.kernel_below, set here as a measurement would), a prefill chunk of fewer rows
    runs every product through the kernel and converts none; at the default it converts.
    Greedy tokens stay within the 4-bit tolerance of MLX's own product either way."""
    path = ensure_demo_variant("tiny", "4bit")
    async with _kernel_and_stock(path) as (fast, stock):
        plan = fast.fast_prefill
        assert plan.decode_quant and plan.kernel_below >= plan.min_tokens == 16
        layers = sum(isinstance(m, fast_prefill._FastQuantizedLinear) and not m._decode_only
                     for _, m in fast.info.model.named_modules())
        blocks = len(fast.info.model.layers)
        # Every block's products are run and counted but the last block's: lazy there (of
        # it only the keys and values feed the cache), run if read, never counted.
        needed = layers - layers // blocks
        prompt = list(range(7, 32))  # one chunk of 25 rows, the last token's with them
        counts = {}
        for below in (plan.min_tokens, 33):
            plan.kernel_below = below
            before = plan.through_kernel, plan.converted
            got = await greedy(fast, f"rows{below}", prompt)
            counts[below] = (plan.through_kernel - before[0], plan.converted - before[1])
            want = await greedy(stock, f"stock{below}", prompt)
            agree_but_at_a_near_tie(path, prompt, got, want, max_gap=2 * LOGIT_TOL_4BIT)
        assert counts == {plan.min_tokens: (0, needed), 33: (needed, 0)}, counts


@pytest.mark.parametrize("timings, below", [
    ({16: (1.0, 2.0), 24: (1.5, 2.0), 32: (2.0, 2.0)}, 25),  # the first step it loses
    ({16: (1.0, 1.1)}, 16),  # a win within the margin is none
    ({r: (1.0, 9.0) for r in fast_prefill.KERNEL_ROW_STEPS}, 65),  # never past the last
])
def test_the_kernel_rows_are_chosen_from_the_timings(monkeypatch, timings, below):
    """choose_kernel_rows on scripted timings (the small 4-bit model: every step's products
    fit its largest conversion): kernel_below rises past each step the kernel wins by
    DECODE_MARGIN, stops at the first it does not, and says so in the log."""
    import mlx_lm

    model, _ = mlx_lm.load(str(ensure_demo_variant("small", "4bit")))
    plan = fast_prefill.install(model, decode="fp32")
    try:
        layers = [m for _, m in model.named_modules()
                  if isinstance(m, fast_prefill._FastQuantizedLinear)]
        plan.kernel_below = plan.min_tokens
        asked = []

        def scripted(_plan, _m, rows, _repeats):
            asked.append(rows)
            return timings[rows]

        monkeypatch.setattr(fast_prefill, "measure_kernel_rows", scripted)
        words = fast_prefill.choose_kernel_rows(plan, layers)
        assert plan.kernel_below == below and asked == sorted(timings)
        assert (f"up to {below - 1} rows" in words) if below > 16 else words == ""
    finally:
        fast_prefill.uninstall(plan)
    assert plan.kernel_below == plan.min_tokens


def test_the_kernel_rows_measured_at_load_hold_no_more_than_a_conversion():
    """The defaults on the small 4-bit model: whatever the load measured, kernel_below is
    min_tokens or one past a measured step, and a chunk just below it holds no more
    through the kernel, in any layer it takes, than the largest conversion admission
    counts; the measurement leaves the plan's counters as they were."""
    import mlx_lm

    model, _ = mlx_lm.load(str(ensure_demo_variant("small", "4bit")))
    plan = fast_prefill.install(model)
    try:
        assert plan.kernel_below == plan.min_tokens or (
            plan.kernel_below - 1 in fast_prefill.KERNEL_ROW_STEPS
            and f"up to {plan.kernel_below - 1} rows" in plan.decode_reason), plan.decode_reason
        rows = max(plan.kernel_below - 1, plan.min_tokens)
        for _, m in model.named_modules():
            view = shim_decode.shown_view(m)
            # (not the LM head: a prefill chunk's logits are never evaluated)
            if (isinstance(m, fast_prefill._FastQuantizedLinear) and view is not None
                    and not m._decode_only):
                assert (shim_decode.product_bytes(m, view, rows)
                        <= plan.transient.weight_bytes)
        assert plan.converted == plan.through_kernel == 0
        biggest = max((m for _, m in model.named_modules()
                       if isinstance(m, fast_prefill._FastQuantizedLinear)
                       and not m._decode_only), key=lambda m: m["weight"].size)
        kernel_ms, converted_ms = fast_prefill.measure_kernel_rows(plan, biggest, 16, 1)
        assert kernel_ms > 0 and converted_ms > 0
        assert plan.converted == plan.through_kernel == 0
    finally:
        fast_prefill.uninstall(plan)


def test_the_choice_is_measured_at_load_and_can_be_turned_off(tiny_bf16):
    import gc

    import mlx_lm

    gc.collect()  # other tests' models, collected now rather than during this one
    base = blas.half_registered()
    model, _ = mlx_lm.load(str(tiny_bf16))
    plan = fast_prefill.install(model)  # the defaults
    try:
        assert "ms stock" in plan.decode_reason and "ms kernel" in plan.decode_reason
        dense = [m for _, m in model.named_modules() if isinstance(m, fast_prefill._FastLinear)]
        stock_ms, kernel_ms = fast_prefill.measure_shim_decode(shim_decode.show_layers(dense))
        assert stock_ms > 0 and kernel_ms > 0
    finally:
        fast_prefill.uninstall(plan)
    assert not plan.decode_half and blas.half_registered() == base
    off = fast_prefill.install(model, decode_kernel=False)
    try:
        assert not off.decode_half and "kernel" not in off.decode_reason
    finally:
        fast_prefill.uninstall(off)
    model, _ = mlx_lm.load(str(ensure_demo_variant("tiny", "4bit")))
    plan = fast_prefill.install(model)
    try:  # measured against the float32 quantized product where that was chosen first
        assert "quantized layers" in plan.decode_reason and "ms kernel" in plan.decode_reason
        assert ("ms float32" if plan.decode_fp32 else "ms stock") in plan.decode_reason
    finally:
        fast_prefill.uninstall(plan)
    assert not plan.decode_quant and blas.half_registered() == base


def _bf16_linear(n: int, k: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(k, n, bias=bias)
    layer.set_dtype(mx.bfloat16)
    mx.eval(layer.parameters())
    return layer


@pytest.mark.parametrize("bias", [False, True])
def test_a_shown_weight_is_multiplied_by_the_kernel_inside_mlx(bias):
    """MLX's float32 product by the registered view is the kernel's (the direct call's
    result bit for bit, close to MLX's own product), lazily: nothing runs until eval.
    Every row count up to HALF_ROWS and past it (the shim splits)."""
    layer = _bf16_linear(40, 96, bias)
    [shown] = shim_decode.show_layers([layer])
    view = shim_decode.shown_view(shown)
    try:
        for rows in (1, 2, 3, 5, 32, 33):
            x = mx.random.normal((rows, 1, 96), key=mx.random.key(rows)).astype(mx.bfloat16)
            before = blas.half_calls()
            got = shim_decode.product(layer, view, x)
            assert blas.half_calls() == before  # lazy
            mx.eval(got)
            assert blas.half_calls() == before + -(-rows // blas.HALF_ROWS)  # 32 at a time
            assert got.shape == (rows, 1, 40) and got.dtype == mx.bfloat16
            assert mx.array_equal(got, shim_decode.kernel_reference(layer, x)).item()
            stock = nn.Linear.__call__(layer, x)
            assert mx.allclose(got.astype(mx.float32), stock.astype(mx.float32),
                               atol=0.05, rtol=0.02).item()
    finally:
        shim_decode.hide(layer)


def _large_layers() -> list[nn.Module]:
    """bfloat16 layers of 4 MiB of weight with rows of 2 KB and of 4 KB, a 4-bit layer of
    4 MiB (products from blas.KERNEL_PARALLEL_MIN_BYTES are shared; a half-precision
    one-row product only from rows of HALF_ONE_ROW_SHARED_MIN_ROW_BYTES), and a bfloat16
    one below the first bound."""
    big = _bf16_linear(2048, 1024, False)
    long_rows = _bf16_linear(1024, 2048, False)
    q = _quantized(4096, 2048, 4, 64, mx.bfloat16)
    small = _bf16_linear(256, 512, False)
    assert 2048 * 1024 * 2 >= blas.KERNEL_PARALLEL_MIN_BYTES > 256 * 512 * 2
    assert 1024 * 2 < blas.HALF_ONE_ROW_SHARED_MIN_ROW_BYTES <= 2048 * 2
    return [big, long_rows, q, small]


def test_large_products_are_shared_with_the_helper_threads_for_the_same_bits():
    """A product of at least KERNEL_PARALLEL_MIN_BYTES of weight is split between MLX's
    thread and the helpers in blocks of columns: the direct single-thread call's result bit
    for bit, at 1, 4 and 33 rows; the helpers compute some of the columns (within a few
    seconds of products: they run only on a core nothing else wants). A smaller product
    stays on one thread, and so does one row of a half-precision weight whose rows hold
    under HALF_ONE_ROW_SHARED_MIN_ROW_BYTES (with the same bits)."""
    if blas.kernel_threads() < 2:
        pytest.skip("one usable CPU: no helper threads")
    layers = _large_layers()
    shown = shim_decode.show_layers(layers)
    assert len(shown) == 4
    helpers = [t for t in threading.enumerate()
               if t.name.startswith("plimsoll-kernel-")]
    assert len(helpers) == blas.kernel_threads() - 1 and all(t.daemon for t in helpers)
    try:
        for i, layer in enumerate(layers[:3]):
            view, k = shim_decode.shown_view(layer), shim_decode.in_features(layer)
            for rows in (1, 4, 33):
                x = mx.random.normal((rows, 1, k), key=mx.random.key(rows)).astype(
                    mx.bfloat16)
                before = blas.kernel_shared()[0]
                got = shim_decode.product(layer, view, x)
                mx.eval(got)
                one_thread = i == 0 and rows == 1  # 2 KB rows of bfloat16
                assert (blas.kernel_shared()[0] > before) != one_thread, (i, rows)
                assert mx.array_equal(got, shim_decode.kernel_reference(layer, x)).item()
        x = mx.random.normal((4, 1, 1024), key=mx.random.key(9)).astype(mx.bfloat16)
        view = shim_decode.shown_view(layers[0])
        _, _, helped = blas.kernel_shared()
        deadline = time.monotonic() + 5.0
        while blas.kernel_shared()[2] == helped and time.monotonic() < deadline:
            mx.eval(shim_decode.product(layers[0], view, x))
        assert blas.kernel_shared()[2] > helped
        before = blas.kernel_shared()[0]
        small = layers[3]
        mx.eval(shim_decode.product(small, shim_decode.shown_view(small),
                                    mx.ones((1, 1, 512), dtype=mx.bfloat16)))
        assert blas.kernel_shared()[0] == before
    finally:
        for layer in layers:
            shim_decode.hide(layer)


def test_a_forked_child_runs_large_products_on_its_own_thread():
    """A child forked after the helpers started has none: the shim's cblas_sgemm, called
    directly in it for a registered weight, runs the product on the child's one thread
    (the same bits as in the parent, where it was shared) instead of waiting forever."""
    import os
    import warnings

    if blas.kernel_threads() < 2:
        pytest.skip("one usable CPU: no helper threads")
    layer = _bf16_linear(2048, 1024, False)
    [shown] = shim_decode.show_layers([layer])
    view = shim_decode.shown_view(shown)
    (weight,) = shim_decode._own_buffer(view)
    sgemm = next(lib for lib in blas._handles if hasattr(lib, "plimsoll_half_isa")).cblas_sgemm
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    sgemm.restype = None
    x = np.random.default_rng(3).standard_normal((2, 1024)).astype(np.float32)

    def product() -> np.ndarray:  # 2 rows of x, each two fake rows of 512 floats
        c = np.zeros((4, 2048), dtype=np.float32)
        sgemm(101, 111, 112, 4, 2048, 512, 1.0, x.ctypes.data, 512, weight.ctypes.data, 512,
              0.0, c.ctypes.data, 2048)
        return c[:2]

    try:
        before = blas.kernel_shared()[0]
        want = product()
        assert blas.kernel_shared()[0] == before + 1 and np.isfinite(want).all()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # the child: no MLX, no pytest, only the call
            code = 0 if np.array_equal(product(), want) and \
                blas.kernel_shared()[0] == before + 1 else 3
            os._exit(code)
        deadline = time.monotonic() + 30.0
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's product never finished")
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        shim_decode.hide(layer)


def test_kernel_threads_follow_the_blas_and_the_variable(monkeypatch):
    monkeypatch.delenv(blas.KERNEL_THREADS_ENV, raising=False)
    assert blas.kernel_threads() == min(blas.state().threads, blas.KERNEL_MAX_THREADS)
    for raw, want in (("1", 1), ("3", 3), ("0", 1), ("64", blas.KERNEL_MAX_THREADS)):
        monkeypatch.setenv(blas.KERNEL_THREADS_ENV, raw)
        assert blas.kernel_threads() == want
    monkeypatch.setenv(blas.KERNEL_THREADS_ENV, "many")
    assert blas.kernel_threads() == min(blas.state().threads, blas.KERNEL_MAX_THREADS)


def test_registrations_end_with_the_plan_the_layer_or_its_weight(tiny_bf16):
    """uninstall unregisters every weight; so does dropping a model without it; a
    layer whose weight is replaced is unregistered and goes back to MLX's product."""
    import gc

    import mlx_lm

    base = blas.half_registered()
    model, _ = mlx_lm.load(str(tiny_bf16))
    plan = fast_prefill.install(model, decode="fp32")
    dense = [m for _, m in model.named_modules() if isinstance(m, fast_prefill._FastLinear)]
    assert plan.decode_half and blas.half_registered() == base + len(dense)
    fast_prefill.uninstall(plan)
    assert blas.half_registered() == base

    plan = fast_prefill.install(model, decode="fp32")
    layer = model.layers[0].mlp.down_proj
    layer.weight = layer.weight * 1  # a weight update
    assert shim_decode.shown_view(layer) is None
    assert blas.half_registered() == base + len(dense) - 1
    x = mx.ones((1, 1, layer.weight.shape[1]), dtype=mx.bfloat16)
    before = blas.half_calls()
    assert mx.array_equal(layer(x), nn.Linear.__call__(layer, x)).item()
    assert blas.half_calls() == before
    del model, plan, layer, dense
    gc.collect()
    assert blas.half_registered() == base


def test_a_registered_weight_in_a_shape_it_was_not_registered_for_gives_nan():
    """Never the BLAS's reading of the weight's bits: an odd number of rows (half a real
    row), or x stored transposed."""
    layer = _bf16_linear(40, 96, False)
    [shown] = shim_decode.show_layers([layer])
    view = shim_decode.shown_view(shown)
    try:
        for a in (mx.ones((3, 48)), mx.ones((48, 4)).T):
            before = blas.half_calls()
            got = a @ view.T
            mx.eval(got)
            assert got.shape == (a.shape[0], 40) and mx.isnan(got).all().item(), a.shape
            assert blas.half_calls() == before
    finally:
        shim_decode.hide(layer)


def test_unregistered_float32_products_are_left_to_the_blas():
    """A float32 product whose weight was never registered (or no longer is) is OpenBLAS's
    as before, even with the shapes a shown one has."""
    layer = _bf16_linear(40, 96, False)
    [shown] = shim_decode.show_layers([layer])
    view = shim_decode.shown_view(shown)
    x = mx.random.normal((2, 48), key=mx.random.key(3))
    w = mx.random.normal((40, 48), key=mx.random.key(4))
    before = blas.half_calls()
    want = np.asarray(x).astype(np.float64) @ np.asarray(w).astype(np.float64).T
    assert np.allclose(np.asarray(x @ w.T), want, atol=1e-4)
    shim_decode.hide(layer)
    as_floats = np.asarray(view).astype(np.float64)  # the bits, read as float32
    got = x @ view.T
    mx.eval(got)
    assert blas.half_calls() == before
    x64 = np.asarray(x).astype(np.float64)
    ref = x64 @ as_floats.T
    # Bounded by the sum of the terms' sizes, not the result's: the bits read as float32
    # are of every size, and a sum that cancels to near zero is off by far more than 1e-4
    # of itself in any float32 order (seen: one output in a full run).
    bound = 1e-5 * (np.abs(x64) @ np.abs(as_floats).T) + 1e-30
    got64 = np.asarray(got).astype(np.float64)
    assert ((np.abs(got64 - ref) <= bound) | (np.isnan(got64) & np.isnan(ref))).all()


def _ulps(got: mx.array, want: mx.array) -> float:
    """The largest difference in units of the dtype's last place at the largest |value|
    of the same head's output (a score rounded the other way moves every output of the
    head by about that much, a small one by as much as a large one)."""
    eps = 2.0 ** (-7 if want.dtype == mx.bfloat16 else -10)
    w = mx.abs(want.astype(mx.float32)).max(axis=-1, keepdims=True)
    unit = 2.0 ** mx.floor(mx.log2(w)) * eps
    return mx.max(mx.abs(got.astype(mx.float32) - want.astype(mx.float32)) / unit).item()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_decode_attention_is_mlxs_own_but_for_the_summation_order(dtype, mask):
    """One query per sequence, grouped heads, a batch with padding masks: within one unit
    in the last place of MLX's own attention, and equal nearly everywhere."""
    b, h, kv, s_len, d = 3, 8, 2, 203, 64
    k1, k2, k3, k4 = mx.random.split(mx.random.key(s_len), 4)
    q = mx.random.normal((b, h, 1, d), key=k1).astype(dtype)
    k = mx.random.normal((b, kv, s_len, d), key=k2).astype(dtype)
    v = mx.random.normal((b, kv, s_len, d), key=k3).astype(dtype)
    keep = mx.random.uniform(shape=(b, 1, 1, s_len), key=k4) > 0.2
    m = {None: None, "bool": keep,
         "additive": mx.where(keep, 0.0, -1e4).astype(dtype)}[mask]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d ** -0.5, mask=m)
    got = shim_decode.decode_attention(q, k, v, d ** -0.5, m)
    assert got.shape == want.shape and got.dtype == dtype
    assert _ulps(got, want) <= 1.0
    assert mx.mean((got == want).astype(mx.float32)).item() > 0.9
    if mask == "bool":  # a sequence with every key hidden: MLX's lowest-value fill
        none = mx.zeros((b, 1, 1, s_len), dtype=mx.bool_)
        assert mx.array_equal(shim_decode.decode_attention(q, k, v, d ** -0.5, none),
                              mx.fast.scaled_dot_product_attention(
                                  q, k, v, scale=d ** -0.5, mask=none)).item()


def test_decode_attention_runs_only_where_the_plan_decodes_through_the_shim(tiny_bf16):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_bf16))
    q = mx.zeros((1, 4, 1, 32), dtype=mx.bfloat16)
    k = mx.zeros((1, 2, 9, 32), dtype=mx.bfloat16)
    ok = fast_prefill._decode_attention_ok
    for decode, chosen in (("fp32", True), ("stock", False)):
        plan = fast_prefill.install(model, decode=decode)
        try:
            assert plan.decode_half is chosen
            assert ok(q, k, None, None, None, {}) is chosen
            assert not ok(mx.zeros((1, 4, 2, 32), dtype=mx.bfloat16), k, None, None, None, {})
            assert not ok(q.astype(mx.float32), k.astype(mx.float32), None, None, None, {})
            assert not ok(q, k, "causal", None, None, {})
            assert not ok(q, k, None, mx.zeros((4,)), None, {})  # attention sinks
            if chosen:  # the float32 copies within what admission counts, and past it
                fits = fast_prefill.decode_attention_bytes(plan) // (2 * 4 * 2 * 32)
                assert fits > 100
                assert ok(q, mx.zeros((1, 2, fits, 32), dtype=mx.bfloat16), None, None,
                          None, {})
                assert not ok(q, mx.zeros((1, 2, fits + 1, 32), dtype=mx.bfloat16), None,
                              None, None, {})
        finally:
            fast_prefill.uninstall(plan)
    assert not ok(q, k, None, None, None, {})  # no plan bound


@pytest.mark.parametrize("mask", [None, "bool", "additive"])
def test_decode_attention_over_the_caches_buffers_is_over_their_prefix(mask):
    """Converting a cache's whole buffers and slicing them gives the attention over
    their first rows bit for bit: the rows past them never reach a product."""
    b, h, kv, s_len, cap, d = 2, 8, 2, 203, 256, 64
    k1, k2, k3, k4 = mx.random.split(mx.random.key(cap), 4)
    q = mx.random.normal((b, h, 1, d), key=k1).astype(mx.bfloat16)
    kb = mx.random.normal((b, kv, cap, d), key=k2).astype(mx.bfloat16)
    vb = mx.random.normal((b, kv, cap, d), key=k3).astype(mx.bfloat16)
    keep = mx.random.uniform(shape=(b, 1, 1, s_len), key=k4) > 0.2
    m = {None: None, "bool": keep,
         "additive": mx.where(keep, 0.0, -1e4).astype(mx.bfloat16)}[mask]
    k, v = kb[..., :s_len, :], vb[..., :s_len, :]
    want = shim_decode.decode_attention(q, k, v, d ** -0.5, m)
    got = shim_decode.decode_attention(q, k, v, d ** -0.5, m, (kb, vb))
    assert got.dtype == want.dtype and mx.array_equal(got, want).item()


def test_the_caches_buffers_are_taken_only_for_what_it_just_handed_out(tiny_bf16,
                                                                        monkeypatch):
    """`_cache_buffers` gives a bfloat16 cache's buffers to the attention only for the
    very keys and values the cache returned on the bound thread, once, within the bound;
    a float16 cache, other arrays, another cache or no plan keep the prefix's conversion."""
    import mlx_lm
    from mlx_lm.models.cache import BatchKVCache, KVCache

    model, _ = mlx_lm.load(str(tiny_bf16))
    plan = fast_prefill.install(model, decode="fp32")
    try:
        assert plan.decode_half
        # The tiny model's bound is 192 tokens of float32 copies: within it, a cache's
        # first buffer (256 rows) is not taken.
        fits = fast_prefill.decode_attention_bytes(plan) // (2 * 4 * 2 * 32)
        assert fits < KVCache.step
        small = KVCache()
        small.step = fits
        new = mx.ones((1, 2, 5, 32), dtype=mx.bfloat16)
        k, v = small.update_and_fetch(new, new)
        assert fast_prefill._cache_buffers(small, k, v) == (small.keys, small.values)
        small.step = fits + 1  # a buffer one row past the bound
        k, v = small.update_and_fetch(mx.ones((1, 2, fits, 32), dtype=mx.bfloat16),
                                      mx.ones((1, 2, fits, 32), dtype=mx.bfloat16))
        assert small.keys.shape[2] > fits
        assert fast_prefill._cache_buffers(small, k, v) is None
        monkeypatch.setattr(fast_prefill, "decode_attention_bytes", lambda plan: 1 << 40)
        for cache in (KVCache(), BatchKVCache([0])):
            k, v = cache.update_and_fetch(new, new)
            assert fast_prefill._cache_buffers(cache, k, v) == (cache.keys, cache.values)
            assert fast_prefill._cache_buffers(cache, k, v) is None  # taken once
            k, v = cache.update_and_fetch(new, new)
            assert fast_prefill._cache_buffers(cache, k * 1, v) is None
            k, v = cache.update_and_fetch(new, new)
            assert fast_prefill._cache_buffers(KVCache(), k, v) is None
        half = KVCache()
        k, v = half.update_and_fetch(new.astype(mx.float16), new.astype(mx.float16))
        assert fast_prefill._cache_buffers(half, k, v) is None
        fetched: list = []
        other = threading.Thread(target=lambda: fetched.append(
            KVCache().update_and_fetch(new, new)))
        other.start()
        other.join()
        assert fast_prefill._cache_buffers(KVCache(), *fetched[0]) is None  # unbound thread
    finally:
        fast_prefill.uninstall(plan)


def _buffers_taken(monkeypatch) -> list[bool]:
    """Whether each decode attention from now on was given its cache's buffers."""
    taken: list[bool] = []
    buffers = fast_prefill._cache_buffers

    def counted(cache, keys, values):
        found = buffers(cache, keys, values)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(fast_prefill, "_cache_buffers", counted)
    return taken


async def test_engines_decode_over_the_caches_buffers_with_the_same_tokens(tiny_bf16,
                                                                           monkeypatch):
    """Real engine threads, the decode kernels taken: bfloat16 sequences decoding
    together (one batch cache) and alone convert their caches' whole buffers, and give
    the tokens of the same engine converting the prefix."""
    taken = _buffers_taken(monkeypatch)
    # The tiny model's bound (192 tokens of float32 copies) is below a cache's first
    # buffer; the small model's (768) holds three.
    monkeypatch.setattr(fast_prefill, "decode_attention_bytes", lambda plan: 1 << 40)
    async with _kernel_and_stock(tiny_bf16) as (fast, _):
        assert fast.fast_prefill.decode_half
        ids = fast.info.tokenizer.encode(DEMO_CORPUS) * 4
        runs = [ids[:150], ids[9:120]]

        async def decode() -> list[list[int]]:
            together = await asyncio.gather(*(greedy(fast, f"t{i}-{len(taken)}", p, 12)
                                              for i, p in enumerate(runs)))
            return [*together, await greedy(fast, f"alone-{len(taken)}", runs[0], 12)]

        got = await decode()
        assert sum(taken) > 0
        monkeypatch.setattr(fast_prefill, "_cache_buffers", lambda *args: None)
        assert got == await decode()


async def test_the_small_bf16_model_decodes_over_its_caches_buffers_by_default(monkeypatch):
    """The small bfloat16 demo model with the defaults (the decode kernels chosen by
    their measurement at load, the bound as it is): a 300-token prompt's decode steps
    convert the cache's whole buffers, and give the tokens of the prefix's conversion."""
    taken = _buffers_taken(monkeypatch)
    async with _small_bf16_engine() as engine:
        prompt = (engine.info.tokenizer.encode(DEMO_CORPUS) * 8)[:300]
        got = await greedy(engine, "buffers", prompt, 8)
        assert taken and all(taken)
        monkeypatch.setattr(fast_prefill, "_cache_buffers", lambda *args: None)
        assert got == await greedy(engine, "prefix", prompt, 8)


@contextlib.asynccontextmanager
async def _small_bf16_engine() -> AsyncIterator[ModelEngine]:
    """The small bfloat16 demo model on an engine thread with the defaults (the decode
    kernels chosen by their measurement at load); skips where they measured slower."""
    engine = ModelEngine("small", str(ensure_demo("small")), asyncio.get_running_loop(),
                         EngineSettings())
    try:
        await asyncio.wrap_future(engine.start())
        if not engine.fast_prefill.decode_half:
            pytest.skip(f"the kernels measured slower here: {engine.fast_prefill.decode_reason}")
        yield engine
    finally:
        await asyncio.wrap_future(engine.stop())


async def test_the_small_bf16_model_shares_a_batchs_decode_products_not_one_sequences():
    """The small bfloat16 demo model with the defaults: a lone sequence's decode steps run
    every product on MLX's thread (its rows of 512 weights, 1 KB, are under
    HALF_ONE_ROW_SHARED_MIN_ROW_BYTES: shared, such a step was slower here), two
    sequences' steps share their large products with the helper threads. Decode steps
    alone are counted: a run of 12 tokens against one of 4 from the same prompts."""
    if blas.kernel_threads() < 2:
        pytest.skip("one usable CPU: no helper threads")
    async with _small_bf16_engine() as engine:
        ids = engine.info.tokenizer.encode(DEMO_CORPUS)
        prompts_ = [ids[:40], ids[40:80]]

        async def shared_by(sequences: int, tokens: int) -> int:
            before = blas.kernel_shared()[0]
            await asyncio.gather(*(greedy(engine, f"s{sequences}-{tokens}-{i}", p, tokens)
                                   for i, p in enumerate(prompts_[:sequences])))
            return blas.kernel_shared()[0] - before

        assert await shared_by(1, 12) == await shared_by(1, 4)
        assert await shared_by(2, 12) > await shared_by(2, 4)


def _quantized(n: int, k: int, bits: int, group: int, scales: mx.Dtype,
               seed: int = 0) -> nn.QuantizedLinear:
    layer = nn.Linear(k, n, bias=False)
    layer.set_dtype(mx.bfloat16)
    q = nn.QuantizedLinear.from_linear(layer, group_size=group, bits=bits)
    q.scales, q.biases = q.scales.astype(scales), q.biases.astype(scales)
    mx.eval(q.parameters())
    return q


@pytest.mark.parametrize("isa", blas.KERNEL_ISAS)
@pytest.mark.parametrize(("bits", "group", "scales"),
                         [(4, 64, mx.bfloat16), (4, 32, mx.float16), (4, 128, mx.float32),
                          (8, 64, mx.bfloat16), (8, 32, mx.float16)])
def test_the_quantized_kernel_matches_float64(isa, bits, group, scales):
    """scale * q + bias per group, exactly (unrounded), for row counts up to 32 and past
    them; float32 x so that the output is not rounded either."""
    n, k = 37, 4 * group
    q = _quantized(n, k, bits, group, scales)
    ints = mx.dequantize(q.weight, mx.ones_like(q.scales).astype(mx.float32),
                         mx.zeros_like(q.biases).astype(mx.float32), group, bits)
    s = np.repeat(np.asarray(q.scales.astype(mx.float32)), group, axis=1).astype(np.float64)
    b = np.repeat(np.asarray(q.biases.astype(mx.float32)), group, axis=1).astype(np.float64)
    w64 = s * np.asarray(ints).astype(np.float64) + b
    with _kernel_isa(isa):
        for rows in (1, 2, 3, 4, 5, 33):
            x = mx.random.normal((rows, 1, k), key=mx.random.key(rows))
            got = np.asarray(shim_decode.kernel_reference(q, x)).reshape(rows, n)
            x64 = np.asarray(x).reshape(rows, k).astype(np.float64)
            want = x64 @ w64.T
            scale = np.abs(x64) @ np.abs(w64).T
            assert np.all(np.abs(got - want) <= 1e-5 * scale), rows


@pytest.mark.parametrize(("bits", "group", "scales"),
                         [(4, 64, mx.bfloat16), (4, 32, mx.float16), (8, 64, mx.float32),
                          (8, 128, mx.bfloat16)])
def test_the_quantized_kernel_sums_the_same_on_avx512_and_avx2(bits, group, scales):
    """Bit for bit, for every row count up to 32 and widths of one to seven groups (the
    kernel sums up to four groups side by side, and the rest one at a time)."""
    for groups in (1, 2, 3, 4, 5, 7):
        q = _quantized(19, groups * group, bits, group, scales)
        for rows in (1, 2, 3, 4, 5, 32):
            x = mx.random.normal((rows, 1, groups * group), key=mx.random.key(rows))
            out = {}
            for isa in ("avx2", "avx512"):
                with _kernel_isa(isa):
                    out[isa] = np.asarray(shim_decode.kernel_reference(q, x))
            assert np.array_equal(out["avx2"], out["avx512"]), (groups, rows)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_shown_quantized_layer_runs_the_kernel_inside_mlx(bits):
    """Lazily, counted by the shim, the direct call's result bit for bit, and close to
    MLX's own float32 quantized product; a layer the kernel does not take (group 16 is fine, 3 bits is not) keeps
    MLX's product."""
    q = _quantized(48, 256, bits, 64, mx.bfloat16)
    [shown] = shim_decode.show_layers([q])
    view = shim_decode.shown_view(shown)
    try:
        for rows in (1, 3, 8):
            x = mx.random.normal((rows, 1, 256), key=mx.random.key(rows)).astype(mx.bfloat16)
            before = blas.half_calls()
            got = shim_decode.product(q, view, x)
            assert blas.half_calls() == before
            mx.eval(got)
            assert blas.half_calls() == before + 1
            assert got.shape == (rows, 1, 48) and got.dtype == mx.bfloat16
            assert mx.array_equal(got, shim_decode.kernel_reference(q, x)).item()
            # MLX's float32 quantized product (its bfloat16 one accumulates in bfloat16),
            # within a bfloat16 rounding of the output.
            f32 = mx.quantized_matmul(x.astype(mx.float32), q.weight,
                                      q.scales.astype(mx.float32),
                                      q.biases.astype(mx.float32), transpose=True,
                                      group_size=64, bits=bits)
            assert mx.allclose(got.astype(mx.float32), f32, atol=1e-3, rtol=2 ** -7).item()
    finally:
        shim_decode.hide(q)
    assert shim_decode.show(_quantized(8, 64, 3, 64, mx.bfloat16)) is None


def test_a_quantized_product_sums_its_groups_once_or_per_call_for_the_same_bits():
    """The kernel sums each row's groups itself. A product of 32,768 values a row in
    groups of 32 holds 16 rows' sums (engine/cblas_shim.c QUANT_SUMS), taken once by
    MLX's thread for every block of columns (and the helpers, the weight being large
    enough to share); at 17 rows each call takes its own. The direct call's result bit
    for bit either way, and within a bfloat16 rounding of MLX's float32 product."""
    n, k, group = 80, 32768, 32
    assert n * k // 2 >= blas.KERNEL_PARALLEL_MIN_BYTES
    q = _quantized(n, k, 4, group, mx.bfloat16)
    [shown] = shim_decode.show_layers([q])
    view = shim_decode.shown_view(shown)
    try:
        for rows in (1, 16, 17):
            x = mx.random.normal((rows, 1, k), key=mx.random.key(rows)).astype(mx.bfloat16)
            before = blas.half_calls()
            got = shim_decode.product(q, view, x)
            mx.eval(got)
            assert blas.half_calls() == before + 1
            assert mx.array_equal(got, shim_decode.kernel_reference(q, x)).item(), rows
            f32 = mx.quantized_matmul(x.astype(mx.float32), q.weight,
                                      q.scales.astype(mx.float32),
                                      q.biases.astype(mx.float32), transpose=True,
                                      group_size=group, bits=4)
            assert mx.allclose(got.astype(mx.float32), f32, atol=1e-2, rtol=2 ** -7).item()
    finally:
        shim_decode.hide(q)


def test_a_tied_dense_lm_head_decodes_through_the_kernel():
    """A tied model's LM head is its embedding's `as_linear` (most small bfloat16 models):
    decode rows and a chunk shorter than a prefill's go through the kernel, lookups and
    prefill rows stay MLX's."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2,
                           intermediate_size=128, num_attention_heads=4, rms_norm_eps=1e-5,
                           vocab_size=500, num_key_value_heads=2, tie_word_embeddings=True)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    embed = model.model.embed_tokens
    ids = mx.array([[3, 17, 499]])
    looked_up = embed(ids)
    plan = fast_prefill.install(model, decode="fp32")
    try:
        assert plan.decode_half and isinstance(embed, fast_prefill._FastEmbedding)
        assert shim_decode.shown_view(embed) is not None
        assert mx.array_equal(embed(ids), looked_up).item()
        x = mx.random.normal((2, 1, 64), key=mx.random.key(5)).astype(mx.bfloat16)
        before = blas.half_calls()
        got = embed.as_linear(x)
        mx.eval(got)
        assert blas.half_calls() == before + 1 and got.shape == (2, 1, 500)
        assert mx.array_equal(got, shim_decode.kernel_reference(embed, x)).item()
        short = mx.random.normal((1, 3, 64), key=mx.random.key(6)).astype(mx.bfloat16)
        before = blas.half_calls()
        got = embed.as_linear(short)
        mx.eval(got)
        assert blas.half_calls() == before + 1
        assert mx.array_equal(got, shim_decode.kernel_reference(embed, short)).item()
        rows = mx.random.normal((1, plan.min_tokens, 64), key=mx.random.key(6)).astype(
            mx.bfloat16)
        before = blas.half_calls()
        assert mx.array_equal(embed.as_linear(rows), rows @ embed.weight.T).item()
        assert blas.half_calls() == before
    finally:
        fast_prefill.uninstall(plan)
    assert type(embed) is nn.Embedding and shim_decode.shown_view(embed) is None


def _generate(inference, model_id: str, ids: list[int], max_tokens: int) -> list[int]:
    req = inference_pb2.GenerateRequest(
        model_id=model_id, token_ids=inference_pb2.TokenIds(ids=ids), max_tokens=max_tokens,
        ignore_eos=True,
        sampling=inference_pb2.SamplingParams(temperature=0))
    return [t for m in inference.Generate(req, timeout=120)
            if m.WhichOneof("event") == "chunk" for t in m.chunk.token_ids]


def _prefill_products(port: int) -> dict[str, float]:
    """plimsoll_prefill_layer_products_total by path, from a server's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {"converted": 0.0, "kernel": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == names.METRIC_PREFILL_PRODUCTS:
                out[sample.labels[names.LABEL_PATH]] += sample.value
    return out


def _kernel_rows_from_log(log: str, min_tokens: int) -> int:
    """The most rows of a prefill chunk the load chose to run through the kernel (its log
    line; min_tokens - 1 where it kept the conversion from min_tokens)."""
    found = re.search(r"prefill chunks of up to (\d+) rows through the kernel", log)
    return int(found.group(1)) if found else min_tokens - 1


def test_a_served_4bit_model_decodes_through_the_kernel_for_several_clients(tmp_path):
    """`plimsoll serve` on the small 4-bit model with the defaults (the kernel measures
    faster at load: ~0.4 against ~3 ms on its largest layer) and with --no-decode-kernel,
    side by side. Four clients at once on each over gRPC, prompts of 18 to 61 tokens (its
    large products on every usable CPU, as its log says), then one prompt whose chunk has
    as many rows as the load chose to run through the kernel and one a row longer: the
    first's layer products counted on /metrics as `kernel`, the second's as `converted`.
    Greedy tokens agree but where the stock path's best two logits are within twice the
    stated 4-bit tolerance. Then SIGTERM with four streams in flight ends every stream (a
    two-second drain) and the server exits cleanly."""
    path = ensure_demo_variant("small", "4bit")
    prompts = [list(range(5 + 3 * i, 23 + 7 * i + (28 if i == 3 else 0))) for i in range(4)]
    assert [len(p) for p in prompts] == [18, 22, 26, 58]
    port = free_port()
    # A short drain, so that the streams still decoding at SIGTERM are ended by it.
    servers = [start_server(tmp_path, "--model", str(path), "--drain-seconds", "2", *args,
                            wait=False)
               for args in (("--metrics-port", str(port)), ("--no-decode-kernel",))]
    try:
        wait_all_serving(servers)
        fast_log, stock_log = servers[0].log(), servers[1].log()
        assert "quantized layers through the" in fast_log, fast_log[-2000:]
        assert "quantized layers through the" not in stock_log
        if blas.kernel_threads() > 1:  # the LM head (2 MiB) is shared with a helper
            assert f"or more on {blas.kernel_threads()} threads" in fast_log, fast_log[-2000:]
        min_tokens = EngineSettings().fast_prefill_min_tokens
        rows = _kernel_rows_from_log(fast_log, min_tokens)
        # A prompt of n tokens is prefilled as one chunk of n rows, its last token with the
        # others (engine/final_chunk.py).
        # (Tokens from 100 parted from the stock server's at a near tie 0.21 apart, 0.01
        # past the tolerance, 11 tokens in: the stock server converts that chunk too.)
        probes = [list(range(300, 300 + rows)), list(range(500, 500 + rows + 1))]
        answers, counts = [], []
        for srv in servers:
            with srv.stubs() as (control, inference):
                model = control.ListModels(control_pb2.ListModelsRequest(),
                                           timeout=30).models[0].model_id
                with ThreadPoolExecutor(len(prompts)) as pool:
                    got = list(pool.map(
                        lambda p, inf=inference, m=model: _generate(inf, m, p, 24), prompts))
                for probe in probes:
                    before = _prefill_products(port) if srv is servers[0] else None
                    got.append(_generate(inference, model, probe, 24))
                    if before is not None:
                        after = _prefill_products(port)
                        counts.append({k: after[k] - before[k] for k in after})
                answers.append(got)
        through_kernel, one_row_more = counts
        if rows >= min_tokens:
            assert through_kernel["kernel"] > 0 and through_kernel["converted"] == 0, counts
        else:  # the load kept the conversion: such a chunk is a short prompt's, lazy
            assert through_kernel == {"converted": 0, "kernel": 0}, counts
        assert one_row_more["converted"] > 0 and one_row_more["kernel"] == 0, counts
        for p, a, b in zip(prompts + probes, *answers, strict=True):
            assert len(a) == len(b) == 24
            # Each path is within the stated 4-bit tolerance of the stock one's logits
            # (MLX's bfloat16 quantized product): they may part where its best two are
            # within twice that.
            agree_but_at_a_near_tie(path, p, a, b, max_gap=2 * LOGIT_TOL_4BIT)
        with servers[0].stubs() as (control, inference), ThreadPoolExecutor(4) as pool:
            streams = [pool.submit(_generate, inference, model, p, 2000) for p in prompts]
            time.sleep(1.0)  # every stream decoding
            assert not any(f.done() for f in streams)
            assert servers[0].stop() == 0
            for f in streams:
                try:
                    f.result(timeout=60)  # ended, with whatever the drain answered
                except grpc.RpcError as err:
                    assert err.code() in (grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.CANCELLED,
                                          grpc.StatusCode.ABORTED), err
    except BaseException:
        for srv in servers:
            print(f"server log tail:\n{srv.log()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for srv in servers:
            srv.stop()


def test_serve_has_a_flag_that_turns_it_off():
    parser = build_parser()
    assert parser.parse_args(["serve"]).decode_kernel is True
    assert parser.parse_args(["serve", "--no-decode-kernel"]).decode_kernel is False
