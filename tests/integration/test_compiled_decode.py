"""A decode step's RoPE and RMSNorm as compiled kernels (engine/compiled_decode.py), on
real MLX and real engines: the same tokens and the same logits, bit for bit."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import BatchGenerator

from engine import compiled_decode
from engine.demo_models import ensure_demo_variant
from engine.loading import load_model
from engine.model_engine import EngineSettings, ModelEngine
from service.cli import build_parser
from tests.integration.test_fast_prefill import TEXTS, greedy

pytestmark = pytest.mark.skipif(
    compiled_decode.environment_reason() is not None,
    reason=f"compiled decode ops are not used here: {compiled_decode.environment_reason()}")

COMPILED = (compiled_decode._CompiledRMSNorm, compiled_decode._CompiledRoPE,
            compiled_decode._CompiledLlama3RoPE)


@pytest.fixture(scope="module", params=["fp32", "bf16"])
def model_path(request, demo_path):
    return demo_path if request.param == "fp32" else ensure_demo_variant("tiny", "bf16")


def _counting(monkeypatch) -> dict[tuple, int]:
    """Counts the calls of each compiled function from now on."""
    calls: dict[tuple, int] = {}
    for key, fn in list(compiled_decode._functions.items()):
        def counted(*args, _fn=fn, _key=key):
            calls[_key] = calls.get(_key, 0) + 1
            return _fn(*args)
        monkeypatch.setitem(compiled_decode._functions, key, counted)
    return calls


async def test_engines_decode_the_stock_tokens_and_the_flag_turns_it_off(model_path, monkeypatch):
    loop = asyncio.get_running_loop()
    # The half-precision decode kernel sums in another order than MLX: off on both, so
    # that only the compiled ops differ.
    fast = ModelEngine("compiled", str(model_path), loop,
                       EngineSettings(fast_decode_kernel=False))
    stock = ModelEngine("stock", str(model_path), loop,
                        EngineSettings(compiled_decode=False, fast_decode_kernel=False))
    try:
        await asyncio.gather(asyncio.wrap_future(fast.start()),
                             asyncio.wrap_future(stock.start()))
        plan = fast.compiled_decode
        assert plan is not None and plan.enabled, plan.summary()
        blocks = len(fast.info.model.layers)
        # Two norms per block and the final one; a RoPE per block's attention.
        assert f"{2 * blocks + 1} RMSNorm and {blocks} RoPE" in plan.reason
        assert not stock.compiled_decode.enabled
        assert "turned off" in stock.compiled_decode.reason
        assert not any(isinstance(m, COMPILED) for _, m in stock.info.model.named_modules())
        calls = _counting(monkeypatch)
        ids = [fast.info.tokenizer.encode(t) for t in TEXTS]
        # All prompts at once on each engine: one batch, an offset per sequence.
        got, want = await asyncio.gather(
            asyncio.gather(*(greedy(fast, f"f{i}", p) for i, p in enumerate(ids))),
            asyncio.gather(*(greedy(stock, f"s{i}", p) for i, p in enumerate(ids))))
        assert got == want
        assert sum(v for k, v in calls.items() if k[0] == "rms_norm") >= 2 * blocks * 20
        assert sum(v for k, v in calls.items() if k[0] == "rope") >= 2 * blocks * 20
    finally:
        await asyncio.gather(asyncio.wrap_future(fast.stop()),
                             asyncio.wrap_future(stock.stop()))


def _batch_logprobs(model: nn.Module, prompts: list[list[int]], n: int) -> list[mx.array]:
    gen = BatchGenerator(model, max_tokens=n, stop_tokens=set())
    uids = gen.insert(prompts, max_tokens=[n] * len(prompts))
    out: dict[int, list[mx.array]] = {u: [] for u in uids}
    try:
        while any(len(v) < n for v in out.values()):
            _, responses = gen.next()
            for r in responses:
                out[r.uid].append(r.logprobs)
    finally:
        gen.close()
    return [mx.stack(out[u]) for u in uids]


@pytest.mark.parametrize("batch", [1, 3])
def test_decode_logits_are_the_stock_paths_bit_for_bit(model_path, batch):
    """One sequence (an int offset) and a left-padded batch (an offset per sequence)."""
    model = load_model(str(model_path)).model
    tok_prompts = [list(range(5, 40)), list(range(7, 90)), list(range(3, 20))][:batch]
    plan = compiled_decode.install(model)
    assert plan.enabled, plan.summary()
    try:
        fast = _batch_logprobs(model, tok_prompts, 16)
    finally:
        compiled_decode.uninstall(plan)
    assert not any(isinstance(m, COMPILED) for _, m in model.named_modules())
    stock = _batch_logprobs(model, tok_prompts, 16)
    for a, b in zip(fast, stock, strict=True):
        assert mx.array_equal(a, b).item()


def test_only_decode_sized_calls_are_compiled():
    assert compiled_decode.decode_sized(mx.zeros((1, 1, 64)))  # a norm, one sequence
    assert compiled_decode.decode_sized(mx.zeros((32, 1, 64)))  # a norm, 32 sequences
    assert compiled_decode.decode_sized(mx.zeros((32, 16, 1, 64)))  # a RoPE
    assert not compiled_decode.decode_sized(mx.zeros((1, 16, 64)))  # a prefill chunk
    assert not compiled_decode.decode_sized(mx.zeros((1, 16, 8, 64)))
    assert not compiled_decode.decode_sized(mx.zeros((1, 1, 4, 64)))  # a per-head norm
    assert not compiled_decode.decode_sized(mx.zeros((1, 64)))


def test_a_failed_compile_leaves_the_model_stock(demo_path, monkeypatch):
    model = load_model(str(demo_path)).model

    def fail(modules, dtype):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(compiled_decode, "_warm", fail)
    plan = compiled_decode.install(model)
    assert not plan.enabled and "no C++ compiler" in plan.reason
    assert not any(isinstance(m, COMPILED) for _, m in model.named_modules())


def test_serve_has_a_flag_that_turns_it_off():
    parser = build_parser()
    assert parser.parse_args(["serve"]).compiled_decode is True
    assert parser.parse_args(["serve", "--no-compiled-decode"]).compiled_decode is False
