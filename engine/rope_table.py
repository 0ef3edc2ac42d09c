"""A prefill chunk's RoPE from a table of cosines and sines, on a Linux CPU.

MLX's CPU backend has no RoPE kernel: `mx.fast.rope` computes every position's angles,
their cosines and their sines on each call, one value at a time, and on a prefill chunk
that is most of its cost (a 255-token chunk of the small demo model: ~0.6-0.75 ms a call,
two calls a block). The angles depend only on the position and the module's settings,
so a table per setting holds them for the chunk's positions, built by the chunk's
first RoPE call and read by every other layer's.

The table is made by the stock op itself, on an input whose rotated halves are 1 and 0
(its output there is the cosine and the sine MLX would use), and a chunk is rotated with
the stock op's own products and sums in the same order: the result is `mx.fast.rope`'s
bit for bit (tests/integration/test_rope_table.py). A table is shared by every layer with
the same settings and dtype and replaced when a chunk needs other positions; it holds one
chunk's rows (at most `MAX_TABLE_BYTES`, past that the stock op): 64-128 KiB for a 512-token
chunk of the demo models. Short chunks (`MIN_ANGLES`) keep the stock op.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

MAX_TABLE_BYTES = 16 << 20  # cosines and sines together, per setting
# Angles per sequence (tokens x dims / 2) from which a chunk takes the table: below it the
# stock op's trigonometry costs less than the table's few extra operations (measured
# through mlx-lm's BatchGenerator: the tiny demo model's 48-token prompt 0.97x with the
# table, the small one's 64-token prompt 1.05x, 256 tokens 1.03x and 1.11x).
MIN_ANGLES = 2048


@dataclass(frozen=True)
class _Table:
    lo: int  # the position of row 0
    cos: mx.array  # (rows, dims / 2), in the input's dtype
    sin: mx.array

    @property
    def hi(self) -> int:
        return self.lo + self.cos.shape[0]


_tables: dict[tuple, _Table] = {}
_lock = threading.Lock()  # engines of different models may build a table at once


def rotate(module: Any, x: mx.array, offset: Any, stock: Callable[[mx.array, Any], mx.array],
           key: tuple) -> mx.array:
    """`stock(x, offset)` (the module's `mx.fast.rope`) for a (batch, heads, tokens, dim)
    chunk, from the table of the setting `key`; the stock op itself where no table
    serves (another shape, an offset of another kind, positions past the bound)."""
    if (x.ndim != 4 or module.dims % 2 or module.dims > x.shape[-1]
            or x.shape[-2] * module.dims // 2 < MIN_ANGLES):
        return stock(x, offset)
    tokens = x.shape[-2]
    if isinstance(offset, mx.array) and offset.ndim == 1 and offset.shape[0] == x.shape[0]:
        # A batch's offsets (mlx-lm's BatchKVCache: negative under left padding); one
        # start for every sequence (one prompt, or no padding) takes rows as an int does.
        starts = offset.tolist()
        lo, hi = min(starts), max(starts) + tokens
        if lo + tokens == hi:
            offset = lo
    elif isinstance(offset, int):
        lo, hi = offset, offset + tokens
    else:
        return stock(x, offset)
    table = _table(module, stock, (*key, x.dtype), lo, hi, x.dtype)
    if table is None:
        return stock(x, offset)
    if isinstance(offset, int):
        cos = table.cos[lo - table.lo:hi - table.lo]
        sin = table.sin[lo - table.lo:hi - table.lo]
    else:
        rows = offset[:, None] + (mx.arange(tokens, dtype=offset.dtype) - table.lo)
        cos, sin = table.cos[rows][:, None], table.sin[rows][:, None]
    return _apply(x, module.dims, module.traditional, cos, sin)


def _apply(x: mx.array, dims: int, traditional: bool, cos: mx.array,
           sin: mx.array) -> mx.array:
    # The stock op's arithmetic: x1 * cos - x2 * sin, x1 * sin + x2 * cos.
    if traditional:  # pairs of neighbours
        x1, x2 = x[..., 0:dims:2], x[..., 1:dims:2]
        pairs = [(x1 * cos - x2 * sin)[..., None], (x1 * sin + x2 * cos)[..., None]]
        parts = [mx.concatenate(pairs, axis=-1).reshape(*x.shape[:-1], dims)]
    else:  # the two halves
        half = dims // 2
        x1, x2 = x[..., :half], x[..., half:dims]
        parts = [x1 * cos - x2 * sin, x1 * sin + x2 * cos]
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return mx.concatenate(parts, axis=-1)


def _table(module: Any, stock: Callable[[mx.array, Any], mx.array], key: tuple, lo: int,
           hi: int, dtype: mx.Dtype) -> _Table | None:
    table = _tables.get(key)
    if table is not None and table.lo <= lo and hi <= table.hi:
        return table
    with _lock:
        table = _tables.get(key)
        if table is not None and table.lo <= lo and hi <= table.hi:
            return table
        # Exactly the positions this chunk needs: every layer of the chunk reads them
        # (one build serves 2 x blocks calls), and what a build holds at once stays a
        # chunk's worth (a table grown ahead for longer prompts was a transient of
        # several MiB that admission does not count).
        rows = hi - lo
        if rows * module.dims * dtype.size > MAX_TABLE_BYTES:
            return None
        table = _build(module, stock, lo, rows, dtype)
        _tables[key] = table
        return table


def _build(module: Any, stock: Callable[[mx.array, Any], mx.array], lo: int, rows: int,
           dtype: mx.Dtype) -> _Table:
    """cos and sin of `rows` positions from `lo`, as the stock op computes them: it turns
    (1, 0) into (cos, sin) exactly."""
    dims, half = module.dims, module.dims // 2
    if module.traditional:
        unit = mx.tile(mx.array([1, 0], dtype=dtype), (half,))
    else:
        unit = mx.concatenate([mx.ones((half,), dtype), mx.zeros((half,), dtype)])
    out = stock(mx.broadcast_to(unit, (1, 1, rows, dims)), lo)[0, 0]
    if module.traditional:
        cos, sin = out[:, 0::2], out[:, 1::2]
    else:
        cos, sin = out[:, :half], out[:, half:]
    cos, sin = mx.contiguous(cos), mx.contiguous(sin)
    mx.eval(cos, sin)
    return _Table(lo, cos, sin)


def clear() -> None:
    """Drops every table (tests)."""
    with _lock:
        _tables.clear()
