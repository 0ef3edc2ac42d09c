"""The fast prefill path (engine/fast_prefill.py) on real MLX, real engines, a real server.

bfloat16 and 4-bit variants of the tiny demo model are made with mlx-lm's own convert
(`ensure_demo_variant`). The fast path needs an optimized BLAS under MLX on a Linux CPU;
where that cannot be loaded every test here is skipped, saying why.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import warnings
from collections.abc import AsyncIterator

import grpc
import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_map
from mlx_lm.models.cache import make_prompt_cache

from engine import blas, fast_prefill, shim_decode
from engine.demo_models import DEMO_CORPUS, ensure_demo_variant
from engine.loading import load_model
from engine.model_engine import EngineSettings, ModelEngine
from engine.request import Chunk, Failed, Finished, GenerationRequest
from memory.chunking import ConversionTransient, PrefillFigures, prefill_abort_line
from memory.config import MemoryConfig
from memory.levels import Tier
from plimsoll.v1 import control_pb2, control_pb2_grpc
from service.assembly import ServiceSettings
from service.cli import build_parser
from service.engines import PrefillGuard
from service.server import PlimsollServer, ServerConfig
from tests.integration.test_admit_predicts_generate import request
from tests.support.memory_fakes import ScriptedReader, readings
from tests.support.random_models import MINICPM3, write_random_model

pytestmark = pytest.mark.skipif(
    fast_prefill.environment_reason() is not None,
    reason=f"fast prefill cannot run here: {fast_prefill.environment_reason()}")

# Prompts of the demo corpus, each long enough (>= 16 tokens) to be prefilled through the
# fast path; the last spans several chunks at the step used below.
TEXTS = (
    "Once upon a time, in a small village by the sea, " * 3,
    "The Plimsoll line is the mark on a ship's hull " * 3,
    "def fibonacci(n: int) -> int:\n" * 3,
    "Q: What is the capital of France?\nA:" * 3,
)
LONG_TOKENS = 600
STEP = 256
GENERATED = 24
# 4-bit: the largest |logit| difference allowed between the fast and the stock path
# (measured 0.035 on these prompts). The stock path is itself 0.033 from an exact float32
# reference (MLX's bfloat16 quantized kernel accumulates in bfloat16), the fast one 0.008.
LOGIT_TOL_4BIT = 0.1


@pytest.fixture(scope="module")
def tiny_bf16():
    return ensure_demo_variant("tiny", "bf16")


@pytest.fixture(scope="module")
def tiny_4bit():
    return ensure_demo_variant("tiny", "4bit")


def prompts(tokenizer) -> list[list[int]]:
    out = [tokenizer.encode(t) for t in TEXTS]
    ids = tokenizer.encode(DEMO_CORPUS)
    out.append((ids * (LONG_TOKENS // len(ids) + 1))[:LONG_TOKENS])
    assert all(len(p) > fast_prefill.DEFAULT_MIN_TOKENS for p in out)
    return out


async def greedy(engine: ModelEngine, rid: str, ids: list[int],
                 max_tokens: int = GENERATED) -> list[int]:
    sink: asyncio.Queue = asyncio.Queue()
    engine.submit(GenerationRequest(rid, engine.model_id, ids, max_tokens=max_tokens,
                                    ignore_eos=True), sink)
    tokens: list[int] = []
    while True:
        event = await asyncio.wait_for(sink.get(), 60)
        if isinstance(event, Chunk):
            tokens += event.token_ids
        elif isinstance(event, Failed):
            raise AssertionError(event.error)
        elif isinstance(event, Finished):
            return tokens


@contextlib.asynccontextmanager
async def fast_and_stock(path) -> AsyncIterator[tuple[ModelEngine, ModelEngine, list]]:
    """Two real engines on one model, started together and stopped after: the defaults
    ("fast") and the fast prefill off ("stock"); with what each start reported."""
    loop = asyncio.get_running_loop()
    fast = ModelEngine("fast", str(path), loop, EngineSettings())
    stock = ModelEngine("stock", str(path), loop, EngineSettings(fast_prefill=False))
    try:
        facts = await asyncio.gather(asyncio.wrap_future(fast.start()),
                                     asyncio.wrap_future(stock.start()))
        yield fast, stock, facts
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


async def test_bf16_greedy_output_is_the_stock_paths_and_the_flag_turns_it_off(tiny_bf16):
    loop = asyncio.get_running_loop()
    # The prefill path alone (decode on MLX's own product): its output is exactly stock.
    fast = ModelEngine("fast", str(tiny_bf16), loop,
                       EngineSettings(prefill_step_size=STEP, fast_decode_kernel=False))
    stock = ModelEngine("stock", str(tiny_bf16), loop,
                        EngineSettings(prefill_step_size=STEP, fast_prefill=False))
    try:
        fast_facts, stock_facts = await asyncio.gather(
            asyncio.wrap_future(fast.start()), asyncio.wrap_future(stock.start()))
        plan = fast.fast_prefill
        assert plan is not None and plan.enabled and plan.dtype == "bfloat16"
        assert fast_facts.prefill_conversion == plan.transient
        # Off by the flag: nothing wrapped, nothing for admission to count.
        assert not stock.fast_prefill.enabled and stock.fast_prefill.layers == 0
        assert "turned off" in stock.fast_prefill.reason
        assert stock_facts.prefill_conversion is None
        wrapped = (fast_prefill._FastLinear, fast_prefill._FastQuantizedLinear)
        assert not any(isinstance(m, wrapped) for _, m in stock.info.model.named_modules())
        assert any(isinstance(m, wrapped) for _, m in fast.info.model.named_modules())
        for i, ids in enumerate(prompts(fast.info.tokenizer)):
            before = plan.converted
            got, want = await asyncio.gather(greedy(fast, f"f{i}", ids),
                                             greedy(stock, f"s{i}", ids))
            assert plan.converted > before  # the prefill went through the fast path
            assert got == want, f"prompt {i} ({len(ids)} tokens)"
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


async def test_fp32_greedy_output_is_the_stock_paths_with_numpy_elementwise(demo_path):
    """A float32 model (the default demo model): nothing is wrapped or converted, but
    attention and SwiGLU of its prefill chunks run in NumPy; greedy output is the stock
    path's, and `--no-fast-prefill` leaves every kernel MLX's."""
    # The default step: the long prompt's first chunk (512 tokens) takes attention's
    # causal blocks (fast_prefill.CAUSAL_ROWS).
    async with fast_and_stock(demo_path) as (fast, stock, (fast_facts, stock_facts)):
        plan = fast.fast_prefill
        assert plan is not None and plan.enabled and plan.dtype == "float32"
        assert "float32 model" in plan.summary() and plan.layers == 0
        assert plan.min_tokens == fast_prefill.FLOAT32_MIN_TOKENS
        # One activation-sized float32 array per chunk token; no weight is converted.
        assert fast_facts.prefill_conversion == plan.transient
        assert plan.transient.weight_bytes == 0 and plan.transient.chunk_token_bytes > 0
        assert stock_facts.prefill_conversion is None
        wrapped = (fast_prefill._FastLinear, fast_prefill._FastQuantizedLinear)
        assert not any(isinstance(m, wrapped) for _, m in fast.info.model.named_modules())
        for i, ids in enumerate(prompts(fast.info.tokenizer)):
            before, stock_before = plan.in_numpy, stock.fast_prefill.in_numpy
            got, want = await asyncio.gather(greedy(fast, f"f{i}", ids),
                                             greedy(stock, f"s{i}", ids))
            # The prefill's elementwise parts ran in NumPy from FLOAT32_MIN_TOKENS on.
            long_enough = len(ids) >= fast_prefill.FLOAT32_MIN_TOKENS
            assert (plan.in_numpy > before) == long_enough, len(ids)
            assert stock.fast_prefill.in_numpy == stock_before
            assert got == want, f"prompt {i} ({len(ids)} tokens)"


@pytest.mark.parametrize("softmax", ["shim", "numpy"])
async def test_prompts_prefilled_together_keep_the_stock_tokens(demo_path, monkeypatch,
                                                                softmax):
    """Four prompts submitted at once (left padding: a mask array) and one alone, on real
    engine threads with the defaults: each one's greedy output is the stock path's. With
    the CBLAS shim loaded (the default on Linux) the chunks' softmax and SwiGLU run
    through its kernels (tests/integration/test_shim_softmax.py); without it (MKL) in
    NumPy, whose softmax then held several whole heads a block (129-150 tokens on the demo
    model's 4 heads: 3 heads a block). That the grouping gives each head's own bits is
    checked where tokens would not show it:
    `test_small_heads_softmaxed_together_give_each_heads_own_result`."""
    if softmax == "shim" and blas.softmax_rows() is None:
        pytest.skip("no CBLAS shim here")
    grouped: list[int] = []
    heads_per_block = fast_prefill._heads_per_block

    def watched(n: int, s_len: int) -> int:
        grouped.append(heads_per_block(n, s_len))
        return grouped[-1]

    calls = {"softmax": 0, "swiglu": 0}
    kernels = fast_prefill._shim_kernels

    def counted():
        def counting(name, fn):
            def call(*args):
                calls[name] += 1
                return fn(*args)
            return call

        return tuple(counting(name, fn) for name, fn in zip(calls, kernels(), strict=True))

    monkeypatch.setattr(fast_prefill, "_heads_per_block", watched)
    monkeypatch.setattr(fast_prefill, "_shim_kernels",
                        counted if softmax == "shim" else lambda: (None, None))
    async with fast_and_stock(demo_path) as (fast, stock, _):
        ids = fast.info.tokenizer.encode(DEMO_CORPUS) * 4
        batch = [ids[7 * i:7 * i + length] for i, length in enumerate((129, 136, 143, 150))]
        assert all(len(p) >= fast_prefill.FLOAT32_MIN_TOKENS for p in batch)
        got = await asyncio.gather(*(greedy(fast, f"f{i}", p) for i, p in enumerate(batch)))
        together = dict(calls)
        got.append(await greedy(fast, "alone", ids[:200]))
        want = await asyncio.gather(*(greedy(stock, f"s{i}", p)
                                      for i, p in enumerate([*batch, ids[:200]])))
        assert got == want
        if softmax == "shim":
            assert together["softmax"] > 0 and together["swiglu"] > 0 and not grouped
            assert calls["softmax"] > together["softmax"]  # the prompt alone: causal
        else:
            assert grouped and max(grouped) > 1, grouped
            assert calls == {"softmax": 0, "swiglu": 0}


def test_fp32_logits_stay_within_a_millionth_of_the_stock_path(demo_path):
    """NumPy's exp against MLX's: the last position's logits of a long prompt."""
    info = load_model(str(demo_path))
    model = info.model
    ids = mx.array([prompts(info.tokenizer)[-1]])

    def logits() -> mx.array:
        out = model(ids, cache=make_prompt_cache(model))[0, -1]
        mx.eval(out)
        return out

    stock = logits()
    plan = fast_prefill.install(model)
    try:
        assert plan.dtype == "float32"
        fast = logits()
        assert plan.in_numpy > 0
    finally:
        fast_prefill.uninstall(plan)
    diff = mx.abs(fast - stock).max().item()
    scale = mx.abs(stock).max().item()
    assert diff <= 1e-5 * max(1.0, scale), (diff, scale)
    assert mx.argmax(fast).item() == mx.argmax(stock).item()


def test_the_last_block_is_left_to_mlx_s_lazy_ops(demo_path):
    """mlx-lm evaluates a prefill chunk's cache only: the NumPy attention and SwiGLU run in
    every block but the last (whose query, attention and MLP nobody reads), the cache comes
    out as the stock path's, and uninstalling gives the block its own class back."""
    info = load_model(str(demo_path))
    model = info.model
    blocks = list(model.layers)
    ids = mx.array([prompts(info.tokenizer)[-1]])
    assert ids.shape[1] >= fast_prefill.FLOAT32_MIN_TOKENS

    def prefill() -> list:
        cache = make_prompt_cache(model)
        model(ids, cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    stock = prefill()
    own_class = type(blocks[-1])
    plan = fast_prefill.install(model)
    try:
        fast = prefill()
        assert plan.in_numpy == 2 * (len(blocks) - 1), plan.in_numpy
    finally:
        fast_prefill.uninstall(plan)
    assert type(blocks[-1]) is own_class
    for ours, theirs in zip(fast, stock, strict=True):
        for a, b in zip(ours.state, theirs.state, strict=True):
            assert mx.abs(a - b).max().item() <= 1e-4


@pytest.mark.parametrize("variant", ["bf16", "4bit"])
def test_the_last_blocks_products_stay_lazy_in_half_precision_and_quantized(variant):
    """The last block's products of a prefill chunk are neither converted nor run through
    the kernel at once: of them only the keys' and values' run, as the cache is evaluated
    (small bf16 model, 256 tokens: 1.19x faster prefill). The cache comes out bit for bit
    as when every block's products are evaluated as they are made; the chunk's output,
    if something reads it, within a few bfloat16 roundings."""
    info = load_model(str(ensure_demo_variant("tiny", variant)))
    model = info.model
    blocks = list(model.layers)
    ids = mx.array([prompts(info.tokenizer)[-1]])
    assert ids.shape[1] >= 2 * fast_prefill.DEFAULT_MIN_TOKENS

    def prefill(read: bool) -> tuple[list[mx.array], mx.array | None]:
        cache = make_prompt_cache(model)
        out = model(ids, cache=cache)
        mx.eval([c.state for c in cache])
        logits = out[0, -1] if read else None
        if logits is not None:
            mx.eval(logits)
        return [a for c in cache for a in c.state], logits

    plan = fast_prefill.install(model, decode="stock", decode_kernel=False)
    try:
        per_block = plan.layers // len(blocks)
        runs = {}
        for lazy in (True, False):
            if not lazy:  # every block's products evaluated as they are made
                fast_prefill._unmark_last_block(plan)
            before = plan.converted
            runs[lazy] = prefill(read=False), prefill(read=True)
            assert plan.converted - before == 2 * (plan.layers - (per_block if lazy else 0))
    finally:
        fast_prefill.uninstall(plan)
    for (lazy_cache, lazy_logits), (eager_cache, eager_logits) in zip(runs[True], runs[False],
                                                                     strict=True):
        assert all(mx.array_equal(a, b).item()
                   for a, b in zip(lazy_cache, eager_cache, strict=True))
        assert (lazy_logits is None) == (eager_logits is None)
        if lazy_logits is not None:
            # Read, the last block's attention is MLX's own (not NumPy's): a few bfloat16
            # roundings apart at most (measured: one ulp of the largest logit, 0.0039).
            scale = mx.abs(eager_logits).max().item()
            assert mx.abs(lazy_logits - eager_logits).max().item() <= 2**-6 * scale


def test_numpy_swiglu_matches_mlx_and_saturates_quietly():
    """Gates far below zero overflow exp(-g) to inf: SwiGLU is 0 there, as MLX's, and
    NumPy says nothing about it."""
    plan = fast_prefill.FastPrefill(True, "test", dtype="float32")
    plan.bind_thread()
    try:
        mx.random.seed(3)
        gate = mx.random.normal((1, 32, 64)) * 4
        gate[0, :4, :8] = -200.0
        x = mx.random.normal((1, 32, 64))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ours = fast_prefill._swiglu(gate, x)
        assert plan.in_numpy == 1
        stock = fast_prefill._stock_swiglu(gate, x)
        assert mx.abs(ours - stock).max().item() <= 1e-5
        assert mx.all(ours[0, :4, :8] == 0).item()
    finally:
        fast_prefill._thread.plan = None


@pytest.mark.parametrize("half", [mx.bfloat16, mx.float16])
def test_half_precision_swiglu_is_mlx_s_bit_for_bit(half):
    """A half-precision chunk's SwiGLU (a lookup of silu in a table the stock kernel made,
    times x rounded to nearest even) gives MLX's own bits: gates and inputs over the whole
    range, saturating ones, zeros, infinities and the largest finite values included (a
    NaN, from zero times infinity, may differ in its sign bit); a chunk too short for the fast path keeps the stock kernel."""
    plan = fast_prefill.FastPrefill(True, "test", dtype=str(half))
    plan.bind_thread()
    try:
        mx.random.seed(5)
        big = 65504.0 if half == mx.float16 else 3.0e38
        edges = mx.array([0.0, -0.0, 1e-3, -1e-3, 20.0, -20.0, 200.0, -200.0, big, -big,
                          float("inf"), float("-inf")])
        for scale in (1.0, 8.0, 60.0):
            gate = (mx.random.normal((2, 40, 96)) * scale).astype(half)
            x = (mx.random.normal((2, 40, 96)) * scale).astype(half)
            gate[0, 0, :12] = edges.astype(half)
            x[0, 1, :12] = edges.astype(half)
            before = plan.in_numpy
            ours = fast_prefill._swiglu(gate, x)
            assert plan.in_numpy == before + 1
            stock = fast_prefill._stock_swiglu(gate, x)
            assert ours.dtype == half and ours.shape == stock.shape
            nan = mx.isnan(stock)  # 0 x inf: a NaN either way, its sign bit may differ
            assert mx.array_equal(mx.isnan(ours), nan).item()
            assert mx.array_equal(mx.where(nan, 0, ours.view(mx.uint16)),
                                  mx.where(nan, 0, stock.view(mx.uint16))).item()
        short = (mx.random.normal((1, 8, 96))).astype(half)
        before = plan.in_numpy
        fast_prefill._swiglu(short, short)
        assert plan.in_numpy == before
    finally:
        fast_prefill._thread.plan = None


@pytest.mark.parametrize("shim", [True, False], ids=["shim", "numpy"])
@pytest.mark.parametrize("half", [mx.float32, mx.bfloat16])
def test_numpy_passes_split_over_threads_give_the_same_bits(half, shim, monkeypatch):
    """A chunk's softmax and SwiGLU run in parts on the decode kernels' thread count,
    through the shim's kernels or NumPy's passes: each row is one thread's, so any split
    gives the one-thread result bit for bit."""
    if not shim:
        monkeypatch.setattr(fast_prefill, "_shim_kernels", lambda: (None, None))
    plan = fast_prefill.FastPrefill(True, "test", dtype=str(half))
    plan.bind_thread()
    ran_on: list[str] = []
    parts = fast_prefill._in_parts

    def watched(count, run):
        def part(a, b):
            ran_on.append(threading.current_thread().name)
            run(a, b)
        parts(count, part)

    monkeypatch.setattr(fast_prefill, "_in_parts", watched)
    try:
        mx.random.seed(11)
        q = mx.random.normal((1, 4, 300, 16)) * 0.25
        k, v = mx.random.normal((1, 2, 300, 16)), mx.random.normal((1, 2, 300, 16))
        gate, x = (mx.random.normal((1, 700, 384)).astype(half) for _ in range(2))
        results = {}
        for threads in (1, 2, 3):
            monkeypatch.setattr(fast_prefill.blas, "kernel_threads", lambda t=threads: t)
            ran_on.clear()
            results[threads] = (fast_prefill._attend(q, k, v, "causal", half, 0),
                                fast_prefill._swiglu(gate, x))
            # Each pass in `threads` parts, one on the caller, the others on the pool.
            assert len(ran_on) == 2 * threads, ran_on
            caller = threading.current_thread().name
            assert ran_on.count(caller) == 2, ran_on
        for threads in (2, 3):
            for ours, one in zip(results[threads], results[1], strict=True):
                assert mx.array_equal(ours, one).item()
    finally:
        fast_prefill._thread.plan = None


@pytest.mark.parametrize("half", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("mask", ["causal", "additive", "bool"])
@pytest.mark.parametrize("n, s_len", [(20, 30), (100, 120)])  # all 8 heads a block; 5 + 3
def test_small_heads_softmaxed_together_give_each_heads_own_result(monkeypatch, half, mask,
                                                                   n, s_len):
    """Short prompts in a batch: a block of the NumPy softmax holds several whole heads
    (each batch entry's own mask for all of them), the same bits as one head a block."""
    monkeypatch.setattr(fast_prefill, "_shim_kernels", lambda: (None, None))
    b, h, kv = 3, 8, 2
    assert fast_prefill._BLOCK_ELEMENTS // (100 * 120) == 5  # the second shape's grouping
    mx.random.seed(5)
    q = mx.random.normal((b, h, n, 16)) * 0.25
    k, v = mx.random.normal((b, kv, s_len, 16)), mx.random.normal((b, kv, s_len, 16))
    m = {"causal": "causal",
         "additive": mx.random.normal((b, 1, n, s_len)) * 4,
         "bool": mx.random.uniform(shape=(b, 1, n, s_len)) > 0.3}[mask]
    together = fast_prefill._attend(q, k, v, m, half, s_len - n)
    monkeypatch.setattr(fast_prefill, "_BLOCK_ELEMENTS", n * s_len)  # one head a block
    alone = fast_prefill._attend(q, k, v, m, half, s_len - n)
    assert mx.array_equal(together, alone, equal_nan=True).item()


@pytest.mark.parametrize("half", [mx.float32, mx.bfloat16])
def test_attention_whose_values_have_a_head_size_of_their_own(half):
    """Multi-head latent attention (MiniCPM3, DeepSeek-V2): queries and keys of 24 per
    head, values of 16. The chunk's attention (whole, and a block of queries at a time)
    and a decode step's have the values' head size, as MLX's own attention has."""
    mx.random.seed(3)
    n, cached = 2 * fast_prefill.CAUSAL_ROWS + 5, 20
    q = (mx.random.normal((1, 4, n, 24)) * 0.25).astype(half)
    k = mx.random.normal((1, 2, cached + n, 24)).astype(half)
    v = mx.random.normal((1, 2, cached + n, 16)).astype(half)
    f32 = (q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32))
    tol = 1e-4 if half == mx.float32 else 2 ** -6
    for mask, rows in (("causal", n), (None, 9)):
        got = fast_prefill._attention_f32(f32[0][:, :, :rows], *f32[1:], mask, half)
        want = mx.fast.scaled_dot_product_attention(q[:, :, :rows], k, v, scale=1.0,
                                                    mask=mask if rows == n else None)
        assert got.shape == want.shape == (1, 4, rows, 16)
        assert mx.abs(got - want.astype(mx.float32)).max().item() <= tol
    if half == mx.bfloat16:
        step = shim_decode.decode_attention(q[:, :, -1:], k, v, 0.2, None)
        want = mx.fast.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=0.2, mask=None)
        assert step.shape == want.shape == (1, 4, 1, 16)
        assert mx.abs(step.astype(mx.float32) - want.astype(mx.float32)).max().item() <= tol


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
async def test_a_model_with_latent_attention_serves_the_stock_paths_tokens(tmp_path, dtype,
                                                                           monkeypatch):
    """A small random MiniCPM3 (its values' heads narrower than its queries'): an engine
    with the defaults serves a 40-token and a 150-token prompt (each chunk's attention
    outside MLX: its softmax through the shim's kernel, rounded as the model's dtype
    rounds, where the shim is loaded) and decodes the tokens of an engine with every
    speed-up off."""
    kinds: list[int] = []
    kernels = fast_prefill._shim_kernels

    def watched():
        softmax, swiglu = kernels()
        if softmax is None:
            return softmax, swiglu

        def recorded(kind, *args):
            kinds.append(kind)
            return softmax(kind, *args)

        return recorded, swiglu

    monkeypatch.setattr(fast_prefill, "_shim_kernels", watched)
    path = write_random_model(tmp_path / "minicpm3", MINICPM3, dtype)
    prompts = [[1 + (7 * j) % 1000 for j in range(n)] for n in (40, 150)]
    stock = EngineSettings(fast_prefill=False, prefill_last_token=False, fast_decode="stock",
                           fast_decode_kernel=False, compiled_decode=False)
    got, want = [], []
    for settings, out in ((EngineSettings(), got), (stock, want)):
        engine = ModelEngine("mla", str(path), asyncio.get_running_loop(), settings)
        await asyncio.wait_for(asyncio.wrap_future(engine.start()), 60)
        try:
            for i, ids in enumerate(prompts):
                out.append(await greedy(engine, f"mla-{i}", ids, 8))
        finally:
            await asyncio.wait_for(asyncio.wrap_future(engine.stop()), 60)
    assert got == want and all(len(t) == 8 for t in got), (got, want)
    if blas.softmax_rows() is not None:
        assert set(kinds) == {fast_prefill.SHIM_SOFTMAX_KINDS[dtype]}, kinds


@pytest.mark.parametrize("half", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("cached", [0, 100])
def test_causal_blocks_give_the_whole_chunks_attention(half, cached):
    """A causal chunk longer than CAUSAL_ROWS is attended a block of queries at a time,
    each with only the keys it may see: the same result as the whole chunk at once, with
    keys already in the cache or not."""
    n = 2 * fast_prefill.CAUSAL_ROWS + 37
    mx.random.seed(7)
    q = mx.random.normal((1, 4, n, 16)) * 0.25
    k = mx.random.normal((1, 2, cached + n, 16))
    v = mx.random.normal((1, 2, cached + n, 16))
    blocks = fast_prefill._attention_f32(q, k, v, "causal", half)
    whole = fast_prefill._attend(q, k, v, "causal", half, cached)
    assert blocks.shape == whole.shape == (1, 4, n, 16)
    # float32: summation order only. bfloat16: the scores and weights are rounded, so a
    # last-bit difference in a score may move a weight by one bfloat16 step (2^-8).
    tol = 1e-5 if half == mx.float32 else 2 ** -8
    assert mx.abs(blocks - whole).max().item() <= tol
    # And it is attention: the stock float32 kernel agrees on the unrounded case.
    if half == mx.float32:
        stock = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask="causal")
        assert mx.abs(blocks - stock).max().item() <= 1e-4


async def test_bf16_decode_through_float32_copies_keeps_the_stock_tokens(tiny_bf16):
    """Decode rows of cache-sized dense layers (the LM head too) run on a float32 copy of
    the weight; with the prefill left stock, greedy output is the stock path's."""
    loop = asyncio.get_running_loop()
    settings = EngineSettings(prefill_step_size=STEP, fast_decode="fp32",
                              fast_decode_dense=True, fast_decode_kernel=False,
                              fast_prefill_min_tokens=1 << 30)
    fast = ModelEngine("fast", str(tiny_bf16), loop, settings)
    stock = ModelEngine("stock", str(tiny_bf16), loop,
                        EngineSettings(prefill_step_size=STEP, fast_prefill=False))
    try:
        facts, _ = await asyncio.gather(asyncio.wrap_future(fast.start()),
                                        asyncio.wrap_future(stock.start()))
        plan = fast.fast_prefill
        head = fast.info.model.lm_head
        assert isinstance(head, fast_prefill._FastLinear) and head._decode_only
        assert tuple(head.weight.shape) in plan.decode_shapes
        # Admission counts what a decode step converts: a block's copies at once.
        block = sum(m.weight.size * 4 for _, m in fast.info.model.layers[0].named_modules()
                    if isinstance(m, fast_prefill._FastLinear))
        assert facts.prefill_conversion.weight_bytes == block + head.weight.size * 4
        for i, ids in enumerate(prompts(fast.info.tokenizer)):
            got, want = await asyncio.gather(greedy(fast, f"f{i}", ids),
                                             greedy(stock, f"s{i}", ids))
            assert got == want, f"prompt {i} ({len(ids)} tokens)"
        assert plan.converted == 0  # the prefill stayed stock
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


def test_a_decode_step_holds_no_more_than_admission_counts(tiny_bf16):
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(str(tiny_bf16))
    plan = fast_prefill.install(model, decode="fp32", decode_dense=True, decode_kernel=False)
    try:
        assert plan.decode_shapes
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[5] * 64]), cache=cache), [c.state for c in cache])
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        token = mx.array([[5]])
        for _ in range(4):
            token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1, keepdims=True)
            mx.eval(token)
        held = mx.get_peak_memory() - base
        # The copies, and a step's own activations and logits (a few KiB here).
        assert held <= plan.transient.weight_bytes + (64 << 10), (held, plan.transient)
    finally:
        fast_prefill.uninstall(plan)


def test_dense_decode_is_measured_per_shape_at_load(tiny_bf16):
    import mlx_lm

    model, _ = mlx_lm.load(str(tiny_bf16))
    # Without the kernel (its own test below), dense decode stays stock by default.
    off = fast_prefill.install(model, decode="auto", decode_kernel=False)
    try:
        assert off.decode_shapes == frozenset()
        assert not isinstance(model.lm_head, fast_prefill._FastLinear)
    finally:
        fast_prefill.uninstall(off)
    plan = fast_prefill.install(model, decode="auto", decode_dense=True, decode_kernel=False)
    try:
        assert "dense shapes" in plan.decode_reason
        shapes = {tuple(m.weight.shape) for _, m in model.named_modules()
                  if isinstance(m, fast_prefill._FastLinear)}
        assert plan.decode_shapes <= shapes
    finally:
        fast_prefill.uninstall(plan)
    assert plan.decode_shapes == frozenset()
    stock = fast_prefill.install(model, decode="stock", decode_dense=True)
    try:
        assert stock.decode_shapes == frozenset() and not stock.decode_half
    finally:
        fast_prefill.uninstall(stock)


def test_serve_has_a_flag_that_turns_it_off():
    parser = build_parser()
    assert parser.parse_args(["serve"]).fast_prefill is True
    assert parser.parse_args(["serve", "--no-fast-prefill"]).fast_prefill is False


def _exact_float32(model: nn.Module) -> None:
    """Every quantized layer dequantized exactly (float32 scales) and every parameter
    in float32: the reference both paths approximate."""
    for _, parent in model.named_modules():
        for name, child in list(parent.children().items()):
            if type(child) in (nn.QuantizedLinear, fast_prefill._FastQuantizedLinear):
                w = mx.dequantize(child["weight"], child["scales"].astype(mx.float32),
                                  child["biases"].astype(mx.float32), child.group_size,
                                  child.bits)
                dense = nn.Linear(w.shape[1], w.shape[0], bias=False)
                dense.weight = w
                setattr(parent, name, dense)
    model.update(tree_map(lambda p: p.astype(mx.float32)
                          if mx.issubdtype(p.dtype, mx.floating) else p, model.parameters()))


def _logits(model: nn.Module, seq: list[int]) -> mx.array:
    out = model(mx.array([seq]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    mx.eval(out)
    return out


def test_4bit_logits_stay_within_tolerance_of_the_stock_path(tiny_4bit):
    info = load_model(str(tiny_4bit))
    reference = load_model(str(tiny_4bit)).model
    _exact_float32(reference)
    plan = fast_prefill.install(info.model, kv_bytes_per_token=info.kv_bytes_per_token,
                                decode="fp32")
    try:
        assert plan.enabled and plan.dtype == "4-bit" and plan.decode_fp32
        assert isinstance(info.model.lm_head, fast_prefill._FastQuantizedLinear)
        fast_vs_stock = fast_vs_ref = stock_vs_ref = 0.0
        for ids in prompts(info.tokenizer):
            plan.enabled = plan.decode_fp32 = False
            stock = _logits(info.model, ids)
            plan.enabled = plan.decode_fp32 = True
            before = plan.converted
            fast = _logits(info.model, ids)
            assert plan.converted > before
            ref = _logits(reference, ids)
            fast_vs_stock = max(fast_vs_stock, mx.abs(fast - stock).max().item())
            fast_vs_ref = max(fast_vs_ref, mx.abs(fast - ref).max().item())
            stock_vs_ref = max(stock_vs_ref, mx.abs(stock - ref).max().item())
        assert fast_vs_stock <= LOGIT_TOL_4BIT
        # Closer to the exact float32 result than the stock path.
        assert fast_vs_ref <= stock_vs_ref, (fast_vs_ref, stock_vs_ref)
    finally:
        fast_prefill.uninstall(plan)
    assert type(info.model.layers[0].mlp.up_proj) is nn.QuantizedLinear


CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=4, idle_poll_s=3600,
                      empty_poll_s=3600, active_poll_s=3600)


async def _admit_bytes(path, fast: bool) -> tuple[int, object]:
    """request_bytes of one Admit for a 600-token prompt, readings scripted so that both
    servers see the same usage; and the model's conversion transient."""
    server = PlimsollServer(
        ServerConfig(port=0, models=[str(path)], memory=CONFIG,
                     engine=EngineSettings(fast_prefill=fast),
                     service=ServiceSettings(admission_timeout_s=30.0)),
        reader=ScriptedReader(readings(0.5)))
    await server.start()
    try:
        await server.load_initial_models()
        gov = server.service.governor
        gov.stop()
        await gov.tick()
        (entry,) = server.service.pool.entries()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
            control = control_pb2_grpc.ControlServiceStub(ch)
            r = await control.Admit(control_pb2.AdmitRequest(request=request(LONG_TOKENS, 1)))
        assert r.verdict == control_pb2.ADMIT_VERDICT_ADMIT
        return r.request_bytes, entry.prefill_conversion
    finally:
        await server.drain()


async def test_admission_counts_the_fp32_layer_of_a_bf16_model(tiny_bf16):
    fast_bytes, conversion = await _admit_bytes(tiny_bf16, fast=True)
    stock_bytes, none = await _admit_bytes(tiny_bf16, fast=False)
    assert none is None and conversion is not None
    # The largest layer of the tiny model is its MLP's 384 x 128 projection: in float32,
    # 196,608 bytes, computed from the model once at load.
    assert conversion.weight_bytes == 384 * 128 * 4
    grew = fast_bytes - stock_bytes
    chunk = min(LONG_TOKENS, EngineSettings().prefill_step_size)
    assert grew == conversion.bytes_for(chunk, LONG_TOKENS)
    assert grew >= conversion.weight_bytes


class _RecordingGuard(PrefillGuard):
    """The server's prefill guard, keeping each chunk's measured peak as the engine
    reports it."""

    def __init__(self, figures: PrefillFigures) -> None:
        super().__init__(figures, 16, EngineSettings().prefill_step_size)
        self.update(ceiling_bytes=64 << 30, abort_cap_bytes=64 << 30, non_mlx_bytes=0,
                    tier=Tier.CUSTOM)
        self.chunks: list[tuple[int, int, int]] = []

    def observe(self, tokens: int, bytes_delta: int, prompt_tokens: int = 0) -> None:
        self.chunks.append((tokens, bytes_delta, prompt_tokens))
        super().observe(tokens, bytes_delta, prompt_tokens)


@pytest.mark.parametrize("variant", ["bf16", "4bit"])
async def test_a_fast_prefills_measured_peak_stays_within_what_admission_projects(variant):
    """On a real engine thread with the defaults, each chunk of a 1,500-token prompt
    through the float32 conversions peaks (MLX's own measure, as the server's guard
    learns from it) within the estimate admission and the guard project with: the
    stock figures plus the conversion's layer and activations. Converting more than a
    layer at a time, or a conversion the figures did not count, would fail it."""
    path = ensure_demo_variant("small", variant)
    engine = ModelEngine("m", str(path), asyncio.get_running_loop(), EngineSettings())
    try:
        facts = await asyncio.wrap_future(engine.start())
        assert facts.prefill_conversion is not None  # the conversion runs and is counted
        figures = PrefillFigures(facts.kv_bytes_per_token, facts.attention_heads,
                                 facts.prefill_conversion)
        engine.prefill_planner = guard = _RecordingGuard(figures)
        ids = [5 + (i * 7) % 900 for i in range(1500)]
        converted = engine.fast_prefill.converted
        await greedy(engine, "long", ids, max_tokens=2)
        assert engine.fast_prefill.converted > converted
    finally:
        await asyncio.wrap_future(engine.stop())
    assert [t for t, _, _ in guard.chunks] == [512, 512, 475], guard.chunks
    for tokens, peak, prompt in guard.chunks:
        assert 0 < peak <= figures.chunk_bytes(tokens, max(tokens, prompt)), guard.chunks
    assert guard.cost_factor == 1.0


def test_the_prefill_guard_counts_the_layer_before_every_chunk():
    """The enforcer's prefill guard projects a chunk with the converted layer's float32
    weight already allocated: near the abort line, it stops a chunk the stock path would
    still run."""
    layer = 64 << 20
    stock = PrefillGuard(PrefillFigures(1024), 16, 512)
    fast = PrefillGuard(PrefillFigures(1024, conversion=ConversionTransient(layer)), 16, 512)
    for guard in (stock, fast):
        guard.update(ceiling_bytes=8 << 30, abort_cap_bytes=8 << 30, non_mlx_bytes=0,
                     tier=Tier.CUSTOM)
    line = prefill_abort_line(Tier.CUSTOM, 8 << 30, 8 << 30)
    active = line - layer // 2  # room for a chunk, not for the layer too
    assert stock.plan(active, 16) == (16, False)
    assert fast.plan(active, 16)[1] is True
