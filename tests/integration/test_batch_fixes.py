"""mlx-lm's own model code corrected where it mishandles a batch (engine/batch_fixes.py),
on engine threads with the defaults."""

from __future__ import annotations

import mlx.core as mx

from engine import batch_fixes
from engine.loading import load_model
from tests.integration.test_final_chunk import engine_on, greedy_all
from tests.support.random_models import GEMMA2, write_random_model


async def test_gemma2_prompts_served_together_decode_what_each_does_alone(tmp_path):
    """A small random gemma2 (four query heads over two key heads): two and three prompts
    arriving together, prefilled and decoded in one batch, get the tokens each gets
    alone. mlx-lm's own attention gave two of them each other's masks, and failed three."""
    path = write_random_model(tmp_path / "gemma2", GEMMA2, mx.float32)
    prompts = [[1 + (13 * i + 7 * j) % 1000 for j in range(n)]
               for i, n in enumerate((30, 9, 17))]
    async with engine_on(path, "gemma2") as engine:
        alone = [(await greedy_all(engine, [p], 6))[0] for p in prompts]
        two = await greedy_all(engine, prompts[:2], 6)
        three = await greedy_all(engine, prompts, 6)
    assert two == alone[:2] and three == alone, (alone, two, three)


def test_only_grouped_gemma2_attention_is_changed(tmp_path, demo_path):
    fixed = load_model(str(write_random_model(tmp_path / "g", GEMMA2, mx.float32))).model
    assert batch_fixes.install(fixed) == ["gemma2's batch mask over grouped heads (3 layers)"]
    assert all(type(layer.self_attn) is batch_fixes.Gemma2Attention for layer in fixed.layers)
    assert batch_fixes.install(load_model(str(demo_path)).model) == []  # llama: nothing
