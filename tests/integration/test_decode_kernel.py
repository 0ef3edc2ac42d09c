"""Decode rows of dense bfloat16/float16 layers through the CBLAS shim's kernel
(engine/cblas_shim.c `plimsoll_half_gemv`, engine/fast_prefill.py): the kernel against
float64 NumPy, and real engines against MLX's own product."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import platform

import mlx.core as mx
import numpy as np
import pytest

from engine import blas, fast_prefill
from engine.demo_models import ensure_demo_variant
from engine.model_engine import EngineSettings, ModelEngine
from service.cli import build_parser
from tests.integration.test_fast_prefill import STEP, greedy, prompts
from tests.support.near_tie import agree_but_at_a_near_tie

pytestmark = pytest.mark.skipif(
    fast_prefill.environment_reason() is not None or blas.half_gemv() is None,
    reason="needs the CBLAS shim under MLX on a Linux CPU")


def _shim() -> ctypes.CDLL:
    return next(lib for lib in blas._handles if hasattr(lib, "plimsoll_half_use_portable"))


def _bits(w: np.ndarray, dtype: mx.Dtype) -> tuple[np.ndarray, np.ndarray]:
    """The weight's half-precision bits, and the values they stand for in float64."""
    h = mx.array(w).astype(dtype)
    return np.array(h.view(mx.uint16)), np.array(h.astype(mx.float32)).astype(np.float64)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_kernel_matches_float64(portable, dtype):
    """Every row count up to 32, widths with and without a tail past the vector loop, a
    range of output columns, float16 subnormals among the weights."""
    shim = _shim()
    kind = blas.HALF_BF16 if dtype == mx.bfloat16 else blas.HALF_F16
    kernel = blas.half_gemv()
    rng = np.random.default_rng(1)
    try:
        shim.plimsoll_half_use_portable(int(portable))
        for n, k in ((40, 512), (33, 1000), (7, 31), (5, 1536)):
            w = rng.standard_normal((n, k)).astype(np.float32)
            if dtype == mx.float16:
                w[0, :4] = [3e-6, -1e-7, 6e-8, 0.0]  # subnormal in float16
            bits, w64 = _bits(w, dtype)
            for m in (1, 3, 32):
                x = rng.standard_normal((m, k)).astype(np.float32)
                y = np.full((m, n), np.nan, dtype=np.float32)
                j0, j1 = (0, n) if m != 3 else (2, n - 1)
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
    finally:
        shim.plimsoll_half_use_portable(0)


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_every_half_precision_value_widens_exactly(portable, dtype):
    """All 65,536 bit patterns (subnormals, infinities, NaNs among them), once in the
    vector loop (column 0) and once in the scalar tail (column 32 of 33)."""
    shim = _shim()
    kind = blas.HALF_BF16 if dtype == mx.bfloat16 else blas.HALF_F16
    patterns = np.arange(1 << 16, dtype=np.uint32)
    if dtype == mx.float16:
        want = patterns.astype(np.uint16).view(np.float16).astype(np.float32)
    else:
        want = (patterns << 16).view(np.float32)
    try:
        shim.plimsoll_half_use_portable(int(portable))
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
    finally:
        shim.plimsoll_half_use_portable(0)


def test_avx2_runs_where_the_cpu_has_it():
    flags: set[str] = set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    want = "avx2" if platform.machine() == "x86_64" and {"avx2", "fma", "f16c"} <= flags \
        else "portable"
    assert blas.half_kernel_isa() == want, sorted(flags & {"avx2", "fma", "f16c"})


@pytest.fixture(scope="module")
def tiny_bf16():
    return ensure_demo_variant("tiny", "bf16")


async def test_engines_decode_through_it_and_part_from_stock_only_at_near_ties(tiny_bf16):
    """All prompts at once (decode rows of up to five sequences, the LM head too): greedy
    tokens are MLX's own product's but where its best two logits are within two bfloat16
    steps; `fast_decode_kernel=False` (`--no-decode-kernel`) leaves MLX's product."""
    loop = asyncio.get_running_loop()
    fast = ModelEngine("kernel", str(tiny_bf16), loop,
                       EngineSettings(prefill_step_size=STEP, fast_decode="fp32"))
    stock = ModelEngine("stock", str(tiny_bf16), loop,
                        EngineSettings(prefill_step_size=STEP, fast_decode_kernel=False))
    try:
        await asyncio.gather(asyncio.wrap_future(fast.start()),
                             asyncio.wrap_future(stock.start()))
        plan = fast.fast_prefill
        assert plan.decode_half and "half-precision kernel (set)" in plan.decode_reason
        head = fast.info.model.lm_head
        assert isinstance(head, fast_prefill._FastLinear) and head._decode_only
        assert not stock.fast_prefill.decode_half
        assert not isinstance(stock.info.model.lm_head, fast_prefill._FastLinear)
        calls = {"n": 0}
        product = fast_prefill._half_decode_product

        def counted(m, x):
            calls["n"] += 1
            return product(m, x)

        fast_prefill._half_decode_product = counted
        try:
            ids = prompts(fast.info.tokenizer)
            got, want = await asyncio.gather(
                asyncio.gather(*(greedy(fast, f"k{i}", p) for i, p in enumerate(ids))),
                asyncio.gather(*(greedy(stock, f"s{i}", p) for i, p in enumerate(ids))))
        finally:
            fast_prefill._half_decode_product = product
        layers = sum(isinstance(m, fast_prefill._FastLinear)
                     for _, m in fast.info.model.named_modules())
        assert calls["n"] >= layers * 20  # every dense layer and the head, every step
        for p, a, b in zip(ids, got, want, strict=True):
            agree_but_at_a_near_tie(tiny_bf16, p, a, b)
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


def test_the_choice_is_measured_at_load_and_can_be_turned_off(tiny_bf16):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_bf16))
    plan = fast_prefill.install(model)  # the defaults
    try:
        assert "ms stock" in plan.decode_reason and "ms kernel" in plan.decode_reason
        stock_ms, kernel_ms = fast_prefill.measure_half_decode(
            [m for _, m in model.named_modules() if isinstance(m, fast_prefill._FastLinear)])
        assert stock_ms > 0 and kernel_ms > 0
    finally:
        fast_prefill.uninstall(plan)
    assert not plan.decode_half
    off = fast_prefill.install(model, decode_kernel=False)
    try:
        assert not off.decode_half and "kernel" not in off.decode_reason
    finally:
        fast_prefill.uninstall(off)


def test_serve_has_a_flag_that_turns_it_off():
    parser = build_parser()
    assert parser.parse_args(["serve"]).decode_kernel is True
    assert parser.parse_args(["serve", "--no-decode-kernel"]).decode_kernel is False
