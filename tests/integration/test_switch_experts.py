"""Half-precision experts multiplied in float32 on MLX's CPU backend (engine/
switch_experts.py): MLX's CPU `gather_mm` takes float32 only, so without this a bfloat16
mixture-of-experts model fails every step."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from mlx_lm.models.switch_layers import SwitchGLU, SwitchLinear

from engine import switch_experts
from engine.model_engine import EngineSettings, ModelEngine
from tests.integration.test_fast_prefill import greedy
from tests.support.random_models import MIXTRAL, write_random_model

WAIT_S = 60.0


def _reference(layer: SwitchLinear, x: mx.array, indices: mx.array) -> mx.array:
    """Each (token, expert) pair's product on its own, in float32, rounded to x's dtype."""
    w = layer.weight.astype(mx.float32)
    rows = [x[i].astype(mx.float32) @ w[int(e)].T for i, e in enumerate(indices.tolist())]
    return mx.stack(rows).astype(x.dtype)


@pytest.mark.parametrize("pairs", [3, 8])  # half as many pairs as experts, and more
def test_a_half_precision_expert_layer_multiplies_in_float32(pairs):
    """Both ways (the chosen experts, or the layer's experts converted once) give each
    pair's own product in float32, rounded to the activations' dtype; the stock layer
    fails on this backend."""
    mx.random.seed(1)
    layer = SwitchLinear(32, 48, num_experts=6, bias=False)
    layer.set_dtype(mx.bfloat16)
    x = mx.random.normal((pairs, 1, 32)).astype(mx.bfloat16)
    indices = mx.random.randint(0, 6, (pairs,))
    with pytest.raises(RuntimeError, match="float32"):
        mx.eval(layer(x, indices))
    assert switch_experts.install(layer).layers == 1
    got = layer(x, indices)
    assert got.dtype == mx.bfloat16 and got.shape == (pairs, 1, 48)
    assert mx.array_equal(got, _reference(layer, x, indices)).item()


def test_switch_glu_runs_both_ways_and_install_counts_the_largest_layer():
    """A SwitchGLU of a token (two pairs: its chosen experts) and of 40 tokens (80 pairs,
    sorted by mlx-lm: the layer converted): the same rows either way."""
    mx.random.seed(2)
    glu = SwitchGLU(32, 64, num_experts=4)
    glu.set_dtype(mx.bfloat16)
    done = switch_experts.install(glu)
    assert done.layers == 3 and done.weight_bytes == 4 * 64 * 32 * 4
    x = mx.random.normal((1, 40, 32)).astype(mx.bfloat16)
    indices = mx.random.randint(0, 4, (1, 40, 2))
    chunk = glu(x, indices)
    one = mx.concatenate([glu(x[:, i:i + 1], indices[:, i:i + 1]) for i in range(40)], axis=1)
    assert chunk.shape == one.shape == (1, 40, 2, 32)
    assert mx.array_equal(chunk, one).item()


def test_float32_experts_and_other_layers_are_left_as_they_are():
    layer = SwitchLinear(8, 8, num_experts=2)
    assert switch_experts.install(layer).layers == 0
    assert type(layer) is SwitchLinear


async def test_a_bfloat16_mixture_of_experts_model_serves(tmp_path):
    """A small random bfloat16 Mixtral on engine threads: prompts of 5 and 200 tokens are
    served, with the defaults as with every speed-up off, and admission's prefill
    transient counts a layer's experts in float32."""
    path = write_random_model(tmp_path / "mixtral", MIXTRAL, mx.bfloat16)
    prompts = [[1 + (7 * j) % 1000 for j in range(n)] for n in (5, 200)]
    stock = EngineSettings(fast_prefill=False, prefill_last_token=False, fast_decode="stock",
                           fast_decode_kernel=False, compiled_decode=False)
    served = []
    for settings in (EngineSettings(), stock):
        engine = ModelEngine("moe", str(path), asyncio.get_running_loop(), settings)
        await asyncio.wait_for(asyncio.wrap_future(engine.start()), WAIT_S)
        try:
            expert_bytes = 4 * 128 * 64 * 4  # experts x out x in, float32
            assert engine.info.prefill_conversion.weight_bytes >= expert_bytes
            served.append([await greedy(engine, f"moe-{i}", p, 8)
                           for i, p in enumerate(prompts)])
        finally:
            await asyncio.wait_for(asyncio.wrap_future(engine.stop()), WAIT_S)
    assert served[0] == served[1] and all(len(t) == 8 for t in served[0]), served
