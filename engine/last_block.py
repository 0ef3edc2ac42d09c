"""The model's last transformer block, marked: two passes of a prefill chunk look at it.

- Of a prefill chunk mlx-lm evaluates only the cache, so in the last block only the keys
  and values are read: the query, the attention and the MLP there are never computed if
  they stay MLX's lazy operations. `inside()` tells engine/fast_prefill.py it is building
  that block, so it leaves its products lazy rather than evaluating them at once.
- A prompt's final chunk may carry the prompt's last token (engine/final_chunk.py): under
  `split_last_row()` the block runs the chunk's other rows for the cache only and the
  last row on its own, so the model's output is that one row and the LM head reads one
  row, not the chunk's.

The block keeps its module, parameters and names; only its class is swapped for a subclass
(`mark`), and `unmark` swaps it back.
"""

from __future__ import annotations

import contextlib
import inspect
import threading
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, make_prompt_cache

_thread = threading.local()

# The block's call as mlx-lm's decoder blocks spell it: the rows, their mask, the cache.
_CALL = ("x", "mask", "cache")


class LastBlock:
    """Mixin for the model's last transformer block (`mark`)."""

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if getattr(_thread, "split", False) and x.ndim == 3 and x.shape[1] > 1:
            call = _mask_and_cache(args, kwargs)
            if call is not None:
                return self._split_last_row(x, *call)
        return self._building(x, *args, **kwargs)

    def _building(self, *args: Any, **kwargs: Any) -> Any:
        _thread.inside = True
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        finally:
            _thread.inside = False

    def _split_last_row(self, x: mx.array, mask: Any, cache: Any) -> mx.array:
        masks = _split_mask(mask, x.shape[1])
        if masks is None:  # a mask this cannot cut: every row, the model's output too
            return self._building(x, mask, cache)
        first, last = masks
        # The other rows' output is never read: only their keys and values are computed.
        self._building(x[:, :-1], first, cache)
        return super().__call__(x[:, -1:], last, cache)  # type: ignore[misc]


def _mask_and_cache(args: tuple, kwargs: dict[str, Any]) -> tuple[Any, Any] | None:
    """(mask, cache) when the block was called with nothing else; None otherwise (an
    argument sized to the whole chunk could not follow its rows apart)."""
    if len(args) > 2 or not kwargs.keys() <= {"mask", "cache"}:
        return None
    named = dict(zip(("mask", "cache"), args, strict=False))  # args may be fewer
    if named.keys() & kwargs.keys():
        return None
    named.update(kwargs)
    return named.get("mask"), named.get("cache")


def _split_mask(mask: Any, rows: int) -> tuple[Any, Any] | None:
    """The masks of a chunk's first rows and of its last row, cut from the chunk's mask
    (rows x keys, the last key the last row's own), or None when it is not such a mask."""
    if mask is None:
        return None, None
    if isinstance(mask, str):
        return (mask, None) if mask == "causal" else None
    if isinstance(mask, mx.array) and mask.ndim >= 2 and mask.shape[-2] == rows:
        return mask[..., :-1, :-1], mask[..., -1:, :]
    return None


_CLASSES: dict[type, type] = {}  # block class -> its LastBlock subclass


def last_of(model: nn.Module) -> nn.Module | None:
    """The model's last transformer block (mlx-lm models list them as `layers`)."""
    found = [b for b in getattr(model, "layers", None) or () if isinstance(b, nn.Module)]
    return found[-1] if found else None


def _own_class(block: nn.Module) -> type:
    return type(block).__mro__[2] if isinstance(block, LastBlock) else type(block)


def mark(block: nn.Module) -> bool:
    """Marks the block; False when it was marked already."""
    if isinstance(block, LastBlock):
        return False
    cls = type(block)
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(f"Last{cls.__name__}", (LastBlock, cls), {})
    block.__class__ = sub
    return True


def unmark(block: nn.Module) -> None:
    block.__class__ = _own_class(block)


def inside() -> bool:
    """The calling thread is building the last block's rows for the cache only."""
    return getattr(_thread, "inside", False)


@contextlib.contextmanager
def split_last_row() -> Iterator[None]:
    """Model calls on this thread return the last row only, its other rows cached."""
    _thread.split = True
    try:
        yield
    finally:
        _thread.split = False


def split_reason(model: nn.Module) -> str | None:
    """Why the last block cannot run a chunk's last row apart, or None when it can: its
    call must take (x, mask, cache) and nothing else (another argument may be sized to
    the whole chunk), and every layer's cache must be a plain `KVCache` (a rotating or
    state-space cache does not keep a chunk's rows as decode rows)."""
    block = last_of(model)
    if block is None:
        return "the model lists no `layers`"
    params = tuple(inspect.signature(_own_class(block).__call__).parameters)[1:]
    if params != _CALL:
        return f"its last block is called with ({', '.join(params)}), not (x, mask, cache)"
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    if kinds != {KVCache.__name__}:
        return f"its caches are {', '.join(sorted(kinds))}, not KVCache only"
    return None
