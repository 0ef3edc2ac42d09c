"""Where mlx-lm's own model code mishandles a batch of sequences, corrected at load.

- **gemma2.** Its attention groups the query heads as (B, KV heads, repeats, L, S) but
  applies the batch's (B, 1, L, S) mask as it is, so the mask's batch axis lines up with
  the key heads: sequences prefilled or decoded together take each other's masks (other
  tokens than each alone) or do not broadcast at all (the step fails, as for three
  sequences over two key heads). The mask gets the repeats axis, (B, 1, 1, L, S).

Each fix swaps the class of the affected modules for a subclass (parameters and names
unchanged); `install` returns what it fixed, for the load's log line.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2


class Gemma2Attention(gemma2.Attention):
    """gemma2's attention with a batch's mask broadcast over each sequence's heads."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        if isinstance(mask, mx.array) and mask.ndim == 4 and self.repeats > 1:
            mask = mx.expand_dims(mask, 2)
        return super().__call__(x, mask, cache)


def install(model: nn.Module) -> list[str]:
    """Applies every fix `model` needs; the fixes applied, as log text."""
    attention = [m for _, m in model.named_modules()
                 if type(m) is gemma2.Attention and m.repeats > 1]
    for m in attention:
        m.__class__ = Gemma2Attention
    return [f"gemma2's batch mask over grouped heads ({len(attention)} layers)"] \
        if attention else []
