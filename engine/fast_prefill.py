"""Prefill through the optimized BLAS for bfloat16, float16 and quantized models on a CPU.

MLX's CPU kernels for half-precision matrix products and for `quantized_matmul` do not
call BLAS: on the `mlx[cpu]` wheel they run ~10x (bfloat16) to ~50x (4-bit, bfloat16
activations) slower than a float32 product through the optimized BLAS engine/blas.py
loads. This module keeps the weights in their stored format and, for prefill chunks only,
converts ONE LAYER AT A TIME into float32:

- a `Linear` (bf16/fp16 weight) is cast, a `QuantizedLinear` (affine) dequantized with
  float32 scales (twice as fast as dequantizing to bf16 and casting, and exact), then
  `x.astype(f32) @ W32.T` runs through `cblas_sgemm`; the result goes back in the model's
  dtype and is evaluated at once, so the layer's float32 weight is freed before the next
  layer converts its own (the transient is the largest layer, never the model);
- attention of a prefill chunk (`mlx_lm.models.base.scaled_dot_product_attention`, as the
  model's module calls it) runs on float32 queries, keys and values: its two products
  through BLAS, its softmax in the CBLAS shim's kernel (engine/cblas_shim.c; NumPy where
  the shim is not loaded or the mask is not one window of keys a row: MLX's CPU exp is
  scalar), rounding the scores and weights to the model's dtype where MLX's own
  half-precision attention rounds them.

- the MLP's SwiGLU of a prefill chunk runs in NumPy: MLX's half-precision result bit for
  bit, from a table of silu over all 65,536 values that the stock kernel fills once.

These passes run in parts of independent rows on as many threads as the decode kernels
use (`_in_parts`): between MLX's evaluations the other cores are idle.

What stays on MLX's kernels: RMSNorm and RoPE (elementwise, a small part of a prefill).

A float32 model's products already run through BLAS, so none of its layers is wrapped;
its prefill chunks of at least `FLOAT32_MIN_TOKENS` rows take the same attention, and
SwiGLU outside MLX too (the shim's kernel, else NumPy: MLX's CPU sigmoid is as slow as its
exp): 1.2-2x faster prefill on the demo models.

In the model's last block a prefill chunk's products, attention and SwiGLU stay MLX's lazy
operations (engine/last_block.py): mlx-lm evaluates only a chunk's cache, so there they would
compute a query, an attention and an MLP that nobody reads (5-16 % of a float32 prefill,
4-27 % of a bfloat16 or 4-bit one on the demo models).

Decode rows of a dense bfloat16 or float16 layer, or of an affine 4/8-bit one (the LM
head too), go through the CBLAS shim's kernels (engine/shim_decode.py) where that measures
faster on the model's largest layer at load: they read the weight as stored (no copy, no
transient) and sum in float32, inside MLX's lazy graph. MLX's own half-precision product
streams the weight at ~1.6-2.5 GB/s here, the kernel at 20-28 GB/s on one core for one
row; a 4-bit layer's kernel is 4-5x MLX's float32 quantized product at one row, 12-17x at
four. Such a step's attention runs its two products in float32 through the BLAS too
(`shim_decode.decode_attention`; MLX's half-precision product costs ~1 ms a layer for
them), rounded where MLX's rounds; a bfloat16 cache is converted as its whole buffers,
one vectorized pass, not its strided prefix (`_cache_buffers`). The kernels also take
every chunk with fewer rows than a prefill conversion (`_kernel_rows`: a short prompt, a
prompt's last tokens): MLX's products of 2-15 rows take 10-200x as long; and longer
chunks while the kernels measure faster than the conversion at load (`choose_kernel_rows`:
MLX's CPU dequantize is slow, so a 4-bit model's chunks of up to 24-64 rows), evaluated a
layer at a time as a conversion is and never holding more than the largest conversion
admission counts. The float32 sums part from MLX's products only at near-tied greedy
choices (docs/benchmarks.md). `decode_kernel=False`
(`--no-decode-kernel`) keeps MLX's products and attention.

Otherwise decode steps (one token per sequence) take the stock path, except that a quantized model
may decode through `quantized_matmul` on float32 activations and scales (MLX's float32
quantized kernel is ~10x faster than its bfloat16 one), its LM head too, when that
measures faster on the model's own largest layer at load (`DECODE_MARGIN`); that is lazy
and converts only scales (1/8 byte per weight, a layer at a time as MLX evaluates).
With `decode_dense` (`serve --fast-decode-dense`, off by default), a dense
half-precision model decodes its cache-sized layers (and a dense LM head) through a
float32 copy of the weight, lazily, where that measures faster per shape at load: MLX's own bfloat16 product reads ~2.5 GB/s of weights here, the cast and sgemv
of a layer whose copy stays in the CPU's caches 3x that (512x1536: 0.17 ms against
0.51); beyond `DENSE_DECODE_MAX_BYTES` the stock kernel wins (4096x4096: 13 ms stock
against 33 ms cast + sgemv) and such layers are never converted. A step's copies are
bounded by `decode_copy_bytes` and counted with the prefill's. It is off by default:
those copies (a block's layers at once: 28 MiB on the small demo model) then weigh on
every prefill's projection, and its float32 sums flip more near-tied greedy choices of
the stock bfloat16 kernels (docs/benchmarks.md).

It applies only where it wins: Linux, MLX on the CPU, an optimized BLAS loaded ahead of
MLX, half-precision, quantized or float32 layers, and a chunk of at least `min_tokens`
rows. The
memory it adds is described by `memory.chunking.ConversionTransient`, computed once from
the model's layers, and counted by admission's projection and the prefill guard.

The wrapped layers are the model's own modules with their class swapped for a subclass
(`_FastLinear`, `_FastQuantizedLinear`, `_FastQuantizedEmbedding` for a tied head):
parameters, names and `isinstance` stay as they were; `uninstall` swaps them back, and
`FastPrefill.enabled` turns the prefill path off at any step boundary. Greedy output is
the stock path's except where the stock path's own two best logits are tied or one
half-precision step apart (the products' summation order differs: measured on the demo
models, docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import activations as _mlx_activations
from mlx_lm.models import base as _mlx_base
from mlx_lm.models.cache import BatchKVCache, KVCache

from engine import blas, last_block, shim_decode
from memory.chunking import ConversionTransient

HALF = (mx.bfloat16, mx.float16)
# The dtypes whose prefill chunks take this module's attention (and, float32 only, its
# activation): a float32 model's products already run through BLAS, its elementwise
# kernels do not.
PREFILL_DTYPES = (*HALF, mx.float32)
F32_BYTES = 4
# Rows (tokens x sequences) from which a prefill chunk converts its layers. At 16 rows the
# float32 path wins on every shape measured (512x1536 to 4096x4096, bf16 and 4-bit).
DEFAULT_MIN_TOKENS = 16
# A float32 model's chunks take the NumPy attention and SwiGLU from this many rows: below
# it the evaluations they need cost more than MLX's own kernels save (the tiny demo model,
# 32 tokens: 8.5 ms against 2.2-3.5 stock; from 128 tokens 1.5x faster).
FLOAT32_MIN_TOKENS = 128
# The float32 decode of a quantized model is chosen when it takes under this fraction of
# the stock time on the model's largest layer.
DECODE_MARGIN = 0.8
DECODE_REPEATS = 3

# A dense half-precision layer decodes through a float32 copy of its weight (cast, then
# BLAS) only while that copy stays within the CPU's caches: measured here, 512x1536 bf16
# decodes in 0.17 ms that way against 0.51 stock and an 8192x512 LM head in 1.4 against
# 3.0, but a 4096x4096 layer takes 32.5 ms against 13.3. Larger layers are never measured
# (the copy would be their transient) nor converted.
DENSE_DECODE_MAX_BYTES = 32 << 20


DecodeMode = str  # "auto" | "stock" | "fp32"
DECODE_MODES = ("auto", "stock", "fp32")

_thread = threading.local()


@dataclass
class FastPrefill:
    """One model's fast path: what was wrapped, what it costs, and the switch.

    Holds no reference to the model (its layers hold this)."""

    enabled: bool  # the prefill fast path
    reason: str  # why it is on or off, one line for the log
    min_tokens: int = DEFAULT_MIN_TOKENS
    decode_fp32: bool = False  # quantized layers decode on float32 activations
    # (out, in) of the dense half-precision layers whose decode rows run through a float32
    # copy of the weight (lazy: one asynchronous graph per step, a layer's copy at a time).
    decode_shapes: frozenset[tuple[int, int]] = frozenset()
    decode_reason: str = "stock"
    # Dense half-precision layers, and quantized ones, decode through the shim's kernels
    # (engine/shim_decode.py), those shown to it.
    decode_half: bool = False
    decode_quant: bool = False
    # Chunks of fewer rows run through those kernels too, not converted: min_tokens unless
    # the kernel measured faster at more rows at load (`measure_kernel_rows`).
    kernel_below: int = DEFAULT_MIN_TOKENS
    layers: int = 0  # wrapped Linear / QuantizedLinear modules
    dtype: str = ""  # "bfloat16", "float16", "4-bit", ... (what was found)
    transient: ConversionTransient = field(default_factory=ConversionTransient)
    decode_ms: tuple[float, float] | None = None  # (stock, fp32) on the largest layer
    converted: int = 0  # layer products run in float32 (the engine thread counts them)
    through_kernel: int = 0  # prefill chunks' layer products run through the kernels
    in_numpy: int = 0  # attention and SwiGLU passes run in NumPy (likewise)
    # The last block, while its products of a prefill chunk stay lazy (`_mark_last_block`).
    last_block: weakref.ref | None = field(default=None, repr=False)
    owns_last_mark: bool = False  # this plan marked it (and unmarks it at uninstall)
    # The wrapped layers, weakly: a plan kept after its model went never keeps it alive.
    wrapped: list[weakref.ref] = field(default_factory=list, repr=False)

    @property
    def prefill_transient(self) -> ConversionTransient | None:
        """The transient admission counts; None while the fast path is off."""
        return self.transient if self.enabled else None

    def bind_thread(self) -> None:
        """Attention of prefill chunks on this thread runs in float32 (the engine thread
        that owns the model; `install` binds the calling thread)."""
        _thread.plan = self

    def summary(self) -> str:
        if self.dtype == "float32":
            state = "on" if self.enabled else "off"
            return (f"fast prefill {state} ({self.reason}): float32 model, attention and "
                    f"activation of chunks from {self.min_tokens} tokens in NumPy; "
                    f"decode {self.decode_reason}")
        if not self.layers:
            return f"fast prefill off ({self.reason})"
        state = "on" if self.enabled else "off"
        return (f"fast prefill {state} ({self.reason}): {self.layers} {self.dtype} layers, "
                f"largest conversion {self.transient.weight_bytes / (1 << 20):.1f} MiB, "
                f"from {self.min_tokens} tokens; decode {self.decode_reason}")


# -- the wrapped layers ---------------------------------------------------------------


def _prefill_rows(x: mx.array, plan: FastPrefill) -> bool:
    """A prefill chunk: (batch, tokens > 1, features) with enough rows."""
    if not plan.enabled or x.ndim < 3 or x.shape[-2] < 2:
        return False
    return _row_count(x) >= plan.min_tokens


def _kernel_rows(x: mx.array, plan: FastPrefill) -> bool:
    """Rows the shim's kernels take where the plan decodes through them: a decode step's
    (one token per sequence) and any chunk too short for a prefill's conversion (a short
    prompt, a prompt's last few tokens), which MLX's half-precision and quantized
    products take 10-200x as long over."""
    if x.ndim < 2:
        return False
    return x.shape[-2] == 1 or _row_count(x) < max(plan.min_tokens, plan.kernel_below)


def _kernel_product(m: nn.Module, view: mx.array, x: mx.array, plan: FastPrefill
                    ) -> mx.array:
    """A layer's rows through the shim's kernel: lazy for a decode step or a short prompt;
    a prefill chunk's (min_tokens rows or more) evaluated now, as a conversion is, so what
    it holds is one layer's (`shim_decode.product_bytes`), never several layers' ahead."""
    y = shim_decode.product(m, view, x)
    if not m._decode_only and _row_count(x) >= plan.min_tokens and not _in_last_block(plan):
        plan.through_kernel += 1
        mx.eval(y)
    return y


def _in_last_block(plan: FastPrefill) -> bool:
    """The calling thread is building the model's last block for the cache only
    (engine/last_block.py): of a prefill chunk there mlx-lm evaluates only the keys and
    values, so its products stay lazy."""
    return plan.last_block is not None and last_block.inside()


def _row_count(x: mx.array) -> int:
    return x.size // max(1, x.shape[-1])


def _float32_product(x: mx.array, w32: mx.array, bias: mx.array | None) -> mx.array:
    """x @ w32.T (+ bias) in float32 through BLAS, back in x's dtype; lazy (MLX makes
    `w32` just before its product and frees it after)."""
    x32 = x.astype(mx.float32)
    y = x32 @ w32.T if bias is None else mx.addmm(bias.astype(mx.float32), x32, w32.T)
    return y.astype(x.dtype)


def _product(x: mx.array, w32: mx.array, bias: mx.array | None, plan: FastPrefill
             ) -> mx.array:
    """A prefill chunk's converted product, evaluated now so `w32` is freed before the
    next layer converts its weight; in the last block left lazy (`_in_last_block`)."""
    y = _float32_product(x, w32, bias)
    if not _in_last_block(plan):
        plan.converted += 1
        mx.eval(y)
    return y


def _dense_decode_product(x: mx.array, w: mx.array, bias: mx.array | None) -> mx.array:
    """A decode row through a float32 copy of a cache-sized weight, left lazy."""
    return _float32_product(x, w.astype(mx.float32), bias)


class _FastLinear(nn.Linear):
    _fast_prefill: FastPrefill
    _decode_only = False  # a dense LM head: its prefill logits are never evaluated

    def __call__(self, x: mx.array) -> mx.array:
        plan = self._fast_prefill
        w = self["weight"]
        if x.dtype == w.dtype:
            kernel = _kernel_rows(x, plan)
            view = shim_decode.shown_view(self) if kernel and plan.decode_half else None
            if view is not None:
                return _kernel_product(self, view, x, plan)
            if not self._decode_only and _prefill_rows(x, plan):
                return _product(x, w.astype(mx.float32), self.get("bias"), plan)
            if kernel and tuple(w.shape) in plan.decode_shapes:
                return _dense_decode_product(x, w, self.get("bias"))
        return nn.Linear.__call__(self, x)


def _decode_product(m: nn.Module, x: mx.array) -> mx.array:
    """A quantized layer's product on float32 activations and scales (MLX's float32
    quantized kernel), left lazy: a decode step stays one asynchronous graph. The only
    conversion is the layer's scales and biases (1/8 byte per weight at group size 64)."""
    y = mx.quantized_matmul(x.astype(mx.float32), m["weight"], m["scales"].astype(mx.float32),
                            m["biases"].astype(mx.float32), transpose=True,
                            group_size=m.group_size, bits=m.bits)
    if "bias" in m:
        y = y + m["bias"].astype(mx.float32)
    return y.astype(x.dtype)


def _decode_ok(m: nn.Module, x: mx.array, plan: FastPrefill) -> bool:
    return (plan.decode_fp32 and m.mode == "affine" and "biases" in m
            and x.dtype == m["scales"].dtype)


class _FastQuantizedLinear(nn.QuantizedLinear):
    _fast_prefill: FastPrefill
    _decode_only = False  # the LM head: its prefill logits are never evaluated

    def __call__(self, x: mx.array) -> mx.array:
        plan = self._fast_prefill
        scales = self["scales"]
        if x.dtype != scales.dtype or self.mode != "affine":
            return nn.QuantizedLinear.__call__(self, x)
        if plan.decode_quant and _kernel_rows(x, plan):
            view = shim_decode.shown_view(self)
            if view is not None:
                return _kernel_product(self, view, x, plan)
        if not self._decode_only and _prefill_rows(x, plan):
            w32 = mx.dequantize(self["weight"], scales.astype(mx.float32),
                                self["biases"].astype(mx.float32), self.group_size,
                                self.bits)
            return _product(x, w32, self.get("bias"), plan)
        if _decode_ok(self, x, plan):
            return _decode_product(self, x)
        return nn.QuantizedLinear.__call__(self, x)


class _FastQuantizedEmbedding(nn.QuantizedEmbedding):
    """A tied LM head (`as_linear`) decodes on float32 activations too; lookups are
    untouched."""

    _fast_prefill: FastPrefill

    def as_linear(self, x: mx.array) -> mx.array:
        plan = self._fast_prefill
        if plan.decode_quant and _kernel_rows(x, plan):
            view = shim_decode.shown_view(self)
            if view is not None and x.dtype == self["scales"].dtype:
                return shim_decode.product(self, view, x)
        if x.ndim >= 2 and x.shape[-2] == 1 and _decode_ok(self, x, plan):
            return _decode_product(self, x)
        return nn.QuantizedEmbedding.as_linear(self, x)


class _FastEmbedding(nn.Embedding):
    """A tied dense half-precision LM head (`as_linear`) decodes through the shim's
    kernel; lookups are untouched."""

    _fast_prefill: FastPrefill

    def as_linear(self, x: mx.array) -> mx.array:
        plan = self._fast_prefill
        if (plan.decode_half and x.dtype == self["weight"].dtype
                and _kernel_rows(x, plan)):
            view = shim_decode.shown_view(self)
            if view is not None:
                return shim_decode.product(self, view, x)
        return nn.Embedding.as_linear(self, x)


_FAST_CLASSES: dict[type, type] = {nn.Linear: _FastLinear, nn.QuantizedLinear: _FastQuantizedLinear,
                                   nn.QuantizedEmbedding: _FastQuantizedEmbedding,
                                   nn.Embedding: _FastEmbedding}
_STOCK_CLASSES = {v: k for k, v in _FAST_CLASSES.items()}


# -- attention ------------------------------------------------------------------------
#
# Once the products go through BLAS, a prefill chunk's time goes to MLX's CPU elementwise
# kernels, which are scalar on x86: exp at ~90 M elements/s, so the softmax over
# (heads x chunk x prompt) attention scores takes most of it. NumPy's SIMD exp is ~20x
# faster, the shim's fused rows (`plimsoll_softmax_rows`) ~4x NumPy's passes again, and an
# evaluated MLX array is a zero-copy NumPy view (buffer protocol), so for a prefill chunk
# the softmax runs outside MLX, in place on the float32 scores this module just made
# (never on an array anyone else holds): the same float32 maths as MLX's precise softmax
# (max |difference| ~5e-7 without the half-precision rounding).

_stock_sdpa: Callable[..., mx.array] = _mlx_base.scaled_dot_product_attention


def _prefill_plan(x: mx.array, rows_axis: int) -> FastPrefill | None:
    """The bound thread's plan when `x` belongs to a prefill chunk, else None."""
    plan: FastPrefill | None = getattr(_thread, "plan", None)
    if plan is None or not plan.enabled or x.dtype not in PREFILL_DTYPES or x.ndim < 3:
        return None
    if _in_last_block(plan):
        return None
    tokens = x.shape[rows_axis]
    if tokens < 2 or x.shape[0] * tokens < plan.min_tokens:
        return None
    return plan


# Rows of scores per NumPy pass: every pass of the softmax runs on a block that stays in
# the CPU's cache (~256 KiB of float32), which makes it ~3x faster than whole-array passes.
_BLOCK_ELEMENTS = 1 << 16
# Queries per block of a causal chunk's attention (`_attention_f32`).
CAUSAL_ROWS = 256

# The NumPy passes (softmax, SwiGLU) run between MLX's evaluations, when the BLAS and MLX
# threads are idle: they are split over the threads the decode kernels use (NumPy
# releases the GIL in its loops), in contiguous parts of independent rows.
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _in_parts(count: int, run: Callable[[int, int], None]) -> None:
    """`run(start, stop)` over [0, count), one contiguous part per thread, this thread
    taking the first; returns when every part is done."""
    global _pool
    n = min(blas.kernel_threads(), count)
    if n <= 1:
        run(0, count)
        return
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(blas.KERNEL_MAX_THREADS - 1,
                                       thread_name_prefix="plimsoll-numpy")
        pool = _pool
    cuts = [count * i // n for i in range(n + 1)]
    rest = [pool.submit(run, a, b) for a, b in zip(cuts[1:-1], cuts[2:], strict=True)]
    try:
        run(cuts[0], cuts[1])
    finally:
        for f in rest:
            f.result()


# The shim's softmax and SwiGLU (engine/cblas_shim.c): one to three passes where NumPy
# makes six to nine, ~4x (softmax) and ~3x (SwiGLU) faster, and a causal chunk's hidden
# keys are never exponentiated. Additive masks, masks whose rows are not one window of
# keys, and half-precision SwiGLU (a table of MLX's own bits) stay in NumPy.
SHIM_SOFTMAX_KINDS = {mx.float32: blas.SOFTMAX_F32, mx.bfloat16: blas.SOFTMAX_BF16,
                      mx.float16: blas.SOFTMAX_F16}


def _shim_kernels() -> tuple[Callable[..., int] | None, Callable[..., int] | None]:
    """The shim's softmax and float32 SwiGLU, each None without the shim (MKL, the
    reference BLAS, macOS, a compiler without vector extensions)."""
    return blas.softmax_rows(), blas.swiglu()


def _round_half(a: np.ndarray, dtype: mx.Dtype, tmp: np.ndarray) -> None:
    """Rounds a contiguous float32 array, in place, to the nearest `dtype` (bf16/fp16)
    value: where the stock path holds a half-precision intermediate, so does this one.
    `tmp`: uint32 scratch of at least `a.size` elements. A float32 model: nothing."""
    if dtype == mx.float32:
        return
    if dtype == mx.float16:
        np.copyto(a, a.astype(np.float16))
        return
    bits = a.view(np.uint32)  # bfloat16: round to nearest even on the top 16 bits
    t = tmp[:bits.size].reshape(bits.shape)
    np.right_shift(bits, 16, out=t)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    bits += t
    bits &= np.uint32(0xFFFF0000)


def _softmax_block(s: np.ndarray, mask: np.ndarray | None, additive: bool,
                   half: mx.Dtype, tmp: np.ndarray) -> None:
    """softmax over the last axis of one contiguous (heads, rows, S) block, in place,
    rounded to `half` before and after as MLX's half-precision attention rounds its scores
    and weights. `mask`: (rows | 1, S), the same for every head, True (bool) where a key
    is hidden, or values to add."""
    _round_half(s, half, tmp)
    if mask is not None:
        if additive:
            s += mask
            _round_half(s, half, tmp)
        else:
            np.copyto(s, np.float32(-np.inf), where=mask)
    top = s.max(axis=-1, keepdims=True)
    np.copyto(top, np.float32(0), where=~np.isfinite(top))  # a row with every key masked
    s -= top
    np.exp(s, out=s)
    total = s.sum(axis=-1, keepdims=True)
    np.copyto(total, np.float32(1), where=total == 0)
    s /= total
    _round_half(s, half, tmp)


def _attention_f32(q: mx.array, k: mx.array, v: mx.array, mask: Any,
                   half: mx.Dtype) -> mx.array:
    """softmax(q k^T + mask) v for scaled float32 (B, H, L, D) queries and (B, KV, S, D)
    keys and values: the products through BLAS, the softmax through the shim's kernel or
    in NumPy, in place. The scores and the weights are rounded to `half` where MLX's own
    half-precision attention rounds them, so the two differ only by the products'
    summation order (and the exp against MLX's).

    A causal chunk is taken `CAUSAL_ROWS` queries at a time, each block with only the
    keys up to its last query: the hidden upper triangle is neither multiplied nor
    exponentiated (half the work of a long chunk), and each block's scores are freed
    before the next block's are made."""
    n, s_len = q.shape[2], k.shape[2]
    if not (isinstance(mask, str) and n > CAUSAL_ROWS):
        return _attend(q, k, v, mask, half, s_len - n)
    b, h, _, d = q.shape
    kv = k.shape[1]
    offset = s_len - n  # keys already in the cache: every query sees them all
    groups = q.reshape(b, kv, h // kv, n, d)
    outs = []
    for r0 in range(0, n, CAUSAL_ROWS):
        r1 = min(n, r0 + CAUSAL_ROWS)
        end = offset + r1
        block = groups[:, :, :, r0:r1].reshape(b, h, r1 - r0, d)
        out = _attend(block, k[:, :, :end], v[:, :, :end], mask, half, offset + r0)
        mx.eval(out)
        outs.append(out)
    return mx.concatenate(outs, axis=2)


def _heads_per_block(n: int, s_len: int) -> int:
    """Whole heads one block of the softmax holds: several where a head's scores are small
    (short prompts in a batch), since NumPy's cost per call, not per element, would
    otherwise dominate (8 x 47-token prompts: 128 blocks of 47 x 47 a layer); else one,
    a few of its rows a block."""
    return max(1, _BLOCK_ELEMENTS // (n * s_len))


def _attend(q: mx.array, k: mx.array, v: mx.array, mask: Any, half: mx.Dtype,
            first: int) -> mx.array:
    """`_attention_f32` over all of `k` for queries at positions `first`.. of the keys
    (a causal mask hides key j from query i when j > first + i)."""
    b, h, n, d = q.shape
    kv, s_len = k.shape[1], k.shape[2]
    rep = h // kv
    # Heads h = g * rep + r share key head g (MLX's own grouping).
    scores = q.reshape(b, kv, rep * n, d) @ k.swapaxes(-1, -2)
    mx.eval(scores, *([mask] if isinstance(mask, mx.array) else []))
    s = np.array(scores, copy=False).reshape(b, h, n, s_len)
    if not _shim_softmax(s, mask, half, first):
        _numpy_softmax(s, mask, half, first)
    # The values' head size, which may differ from the queries' (MLA models).
    return (scores @ v).reshape(b, h, n, v.shape[-1])


def _shim_softmax(s: np.ndarray, mask: Any, half: mx.Dtype, first: int) -> bool:
    """The softmax of (B, H, L, S) scores, in place, through the shim's kernel, in parts
    on the kernels' threads; False (nothing done) where the kernel does not take them."""
    softmax_rows = _shim_kernels()[0]
    b, h, n, s_len = s.shape
    if softmax_rows is None or half not in SHIM_SOFTMAX_KINDS or not s.flags.c_contiguous:
        return False
    windows = _visible_windows(mask, n, s_len, first)
    if windows is None:
        return False
    lo, hi = windows
    kind, at = SHIM_SOFTMAX_KINDS[half], s.ctypes.data

    def rows(start: int, stop: int) -> None:
        if softmax_rows(kind, at, start, stop, s_len, lo.ctypes.data, hi.ctypes.data,
                        n, h * n, lo.shape[0]):
            raise RuntimeError(f"the shim's softmax refused scores of {s.shape}")

    _in_parts(b * h * n, rows)
    return True


def _numpy_softmax(s: np.ndarray, mask: Any, half: mx.Dtype, first: int) -> None:
    """The softmax of (B, H, L, S) scores, in place, in NumPy passes over blocks that stay
    in the CPU's cache, in parts on the kernels' threads."""
    b, h, n, s_len = s.shape
    hidden: np.ndarray | None = None  # (B | 1, L, S): True where a key is hidden
    additive = False
    if isinstance(mask, str):  # "causal"
        hidden = (np.arange(s_len)[None, :] > np.arange(first, first + n)[:, None])[None]
    elif mask is not None:
        m = np.array(mask, copy=False)
        # (L, S), (1, L, S) or (B | 1, 1, L, S) (`_numpy_mask_ok`).
        m = m.reshape(-1, n, s_len)
        additive = m.dtype != np.bool_
        hidden = m.astype(np.float32, copy=False) if additive else ~m
    heads = _heads_per_block(n, s_len)
    rows = n if heads > 1 else max(1, _BLOCK_ELEMENTS // s_len)
    blocks = [(bi, h0, i) for bi in range(b) for h0 in range(0, h, heads)
              for i in range(0, n, rows)]

    def softmax(start: int, stop: int) -> None:
        tmp = np.empty(heads * rows * s_len, dtype=np.uint32)
        for bi, h0, i in blocks[start:stop]:
            mrows = None if hidden is None else hidden[bi if hidden.shape[0] > 1 else 0]
            _softmax_block(s[bi, h0:h0 + heads, i:i + rows], None if mrows is None
                           else mrows[i:i + rows], additive, half, tmp)

    _in_parts(len(blocks), softmax)


def _visible_windows(mask: Any, n: int, s_len: int,
                     first: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Each query row's visible keys as one interval [lo, hi): int64 arrays (B | 1, n),
    for no mask, a causal one (queries at positions `first`..) or a boolean array whose
    rows are each one interval (causal with left padding, a sliding window); None for
    anything else (additive masks, rows with gaps), which stays in NumPy."""
    if mask is None:
        return np.zeros((1, n), np.int64), np.full((1, n), s_len, np.int64)
    if isinstance(mask, str):
        hi = np.minimum(np.arange(first + 1, first + n + 1, dtype=np.int64), s_len)
        return np.zeros((1, n), np.int64), hi[None]
    m = np.array(mask, copy=False)
    if m.dtype != np.bool_:
        return None
    m = m.reshape(-1, n, s_len)
    # A mask is the same array for every layer of a chunk: its windows are found once
    # (held beside a weak reference, so a chunk's mask is not kept past its chunk).
    seen = getattr(_thread, "windows", None)
    if seen is not None and seen[0]() is mask:
        return seen[1]
    count = m.sum(axis=-1, dtype=np.int64)
    lo = np.argmax(m, axis=-1).astype(np.int64)
    hi = lo + count
    ends = s_len - np.argmax(m[..., ::-1], axis=-1)  # past each row's last visible key
    if not np.array_equal(np.where(count > 0, ends, lo), hi):
        return None  # a row with a gap
    windows = lo, hi
    _thread.windows = (weakref.ref(mask), windows)
    return windows


def _numpy_mask_ok(mask: Any, q: mx.array, s_len: int) -> bool:
    if mask is None or (isinstance(mask, str) and mask == "causal"):
        return True
    if not isinstance(mask, mx.array) or mask.shape[-2:] != (q.shape[2], s_len):
        return False
    if mask.ndim == 4:
        return mask.shape[1] == 1 and mask.shape[0] in (1, q.shape[0])
    return mask.ndim == 2 or mask.ndim == 3 and mask.shape[0] == 1


# A float32 model's decode step attends each sequence's one query over its whole cache
# with MLX's softmax, whose exp is scalar and calls libm's fmaf out of line: from ~1,000
# keys that is a large part of the step (small demo model, 4,000 keys: 2.7 ms of 13.7).
# From DECODE_SOFTMAX_MIN_KEYS keys the step evaluates a layer's scores, runs the shim's
# softmax on them in place and leaves the values' product lazy: one evaluation a layer,
# which measured no slower at 256 keys and 1.17x / 1.37x faster at 2,048 / 4,000
# (docs/benchmarks.md). A half-precision (or quantized) model decoding through the
# shim's kernels does the same from HALF_DECODE_KERNELS_MIN_KEYS keys, with the two
# products over the cache as stored (the half-precision kernel for the scores,
# `plimsoll_half_rows_sum` for the values), and also from where the cache is too long
# for `shim_decode.decode_attention`'s float32 copies (`decode_attention_bytes`: 768
# tokens on the small demo model, 2,560 on the medium), which took MLX's half-precision
# attention before: small bfloat16 2.1x a step at 2,000 keys, 3.1x at 4,000; medium
# float16 1.6x at 1,500 against `decode_attention`. Below, the lazy `decode_attention`
# wins (small bfloat16 at 300 / 600 keys: the kernels' path 0.73x / 0.88x; medium at
# 600: 1.04x).
DECODE_SOFTMAX_MIN_KEYS = 512
HALF_DECODE_KERNELS_MIN_KEYS = 1024


def _boolean_mask_ok(mask: Any, queries: mx.array, keys: mx.array) -> bool:
    """No mask, a named one, or a boolean array the NumPy path reads too (a decode step's
    softmax outside MLX takes no additive mask)."""
    return (mask is None or isinstance(mask, str)
            or (isinstance(mask, mx.array) and mask.dtype == mx.bool_
                and _numpy_mask_ok(mask, queries, keys.shape[2])))


def _long_decode_ok(queries: mx.array, keys: mx.array, mask: Any, sinks: Any, cache: Any,
                    kwargs: dict) -> bool:
    """A float32 decode step over at least DECODE_SOFTMAX_MIN_KEYS keys on a bound
    thread, with a mask (if any) that the NumPy path reads too."""
    return (getattr(_thread, "plan", None) is not None and queries.ndim == 4
            and queries.shape[2] == 1 and keys.shape[2] >= DECODE_SOFTMAX_MIN_KEYS
            and queries.dtype == mx.float32 and keys.dtype == mx.float32
            and queries.shape[1] % keys.shape[1] == 0 and sinks is None and not kwargs
            and not hasattr(cache, "bits") and _shim_kernels()[0] is not None
            and _boolean_mask_ok(mask, queries, keys))


def _long_half_decode_ok(queries: mx.array, keys: mx.array, values: mx.array, mask: Any,
                         sinks: Any, cache: Any, kwargs: dict) -> bool:
    """A half-precision decode step on a thread whose plan decodes through the shim's
    kernels (the caller asks from HALF_DECODE_KERNELS_MIN_KEYS keys, or past
    `decode_attention_bytes`), in shapes the kernels take."""
    plan: FastPrefill | None = getattr(_thread, "plan", None)
    heads, length = queries.shape[1:3] if queries.ndim == 4 else (0, 0)
    return (plan is not None and (plan.decode_half or plan.decode_quant) and length == 1
            and queries.dtype in shim_decode.HALF_KINDS and keys.dtype == queries.dtype
            and values.dtype == queries.dtype and heads % keys.shape[1] == 0
            and heads // keys.shape[1] <= blas.HALF_ROWS
            and values.shape[-1] % 8 == 0 and sinks is None and not kwargs
            and not hasattr(cache, "bits") and _shim_kernels()[0] is not None
            and blas.half_gemv() is not None and blas.half_rows_sum() is not None
            and _boolean_mask_ok(mask, queries, keys))


def _stored_rows(a: mx.array) -> tuple[np.ndarray, int] | None:
    """A half-precision (B, KV, S, D) cache as a NumPy view of its stored bits (no copy)
    and its rows' stride in elements; None where a row is not contiguous."""
    bits = a.view(mx.uint16)
    mx.eval(bits)
    view = np.array(bits, copy=False)
    if view.strides[3] != 2 or view.strides[2] % 2:
        return None
    return view, view.strides[2] // 2


def _long_half_decode_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                scale: float, mask: Any) -> mx.array | None:
    """`shim_decode.decode_attention` (the scaling in the queries' dtype, the scores and
    weights rounded to it where MLX rounds them) with both products over the cache as
    stored, through the shim's kernels, and the softmax through the shim's; None where a
    cache's rows are not contiguous (the caller keeps its path)."""
    b, h, _, d = queries.shape
    kv, s_len, dv = keys.shape[1], keys.shape[2], values.shape[-1]
    rep, dtype = h // kv, queries.dtype
    kind = shim_decode.HALF_KINDS[dtype]
    stored_keys, stored_values = _stored_rows(keys), _stored_rows(values)
    if stored_keys is None or stored_values is None:
        return None
    (kn, k_stride), (vn, v_stride) = stored_keys, stored_values
    q = (queries * mx.array(scale, dtype=dtype)).astype(mx.float32)
    mx.eval(q, *([mask] if isinstance(mask, mx.array) else []))
    qn = np.ascontiguousarray(np.array(q, copy=False).reshape(b, kv, rep, d))
    scores = np.empty((b, h, 1, s_len), np.float32)
    out = np.empty((b, h, dv), np.float32)
    gemv, rows_sum = blas.half_gemv(), blas.half_rows_sum()
    pairs = [(bi, g) for bi in range(b) for g in range(kv)]

    def refused(done: int) -> None:
        if done:
            raise RuntimeError(f"the shim refused a decode attention over {s_len} keys")

    def score(start: int, stop: int) -> None:  # each key head's queries against its keys
        for bi, g in pairs[start:stop]:
            refused(gemv(kind, rep, d, qn[bi, g].ctypes.data, d, kn[bi, g].ctypes.data,
                         k_stride, scores[bi, g * rep].ctypes.data, s_len, 0, s_len))

    def weigh(start: int, stop: int) -> None:  # their weights times its value rows
        for bi, g in pairs[start:stop]:
            refused(rows_sum(kind, rep, s_len, dv, scores[bi, g * rep].ctypes.data, s_len,
                             vn[bi, g].ctypes.data, v_stride, out[bi, g * rep].ctypes.data,
                             dv))

    _in_parts(len(pairs), score)
    if not _shim_softmax(scores, mask, dtype, s_len - 1):
        _numpy_softmax(scores, mask, dtype, s_len - 1)
    _in_parts(len(pairs), weigh)
    return mx.array(out).astype(dtype).reshape(b, h, 1, dv)


def _long_decode_attention(queries: mx.array, keys: mx.array, values: mx.array,
                           scale: float, mask: Any) -> mx.array:
    """softmax(q k^T * scale + mask) v for one float32 query per sequence: the scores
    evaluated, their softmax in place through the shim (NumPy's passes for a mask that is
    not one window of keys a row), the values' product lazy."""
    b, h, _, d = queries.shape
    kv, s_len = keys.shape[1], keys.shape[2]
    q = (queries * scale).reshape(b, kv, h // kv, d)  # heads g * rep + r share key head g
    scores = q @ keys.swapaxes(-1, -2)  # (B, KV, rep, S)
    mx.eval(scores, *([mask] if isinstance(mask, mx.array) else []))
    s = np.array(scores, copy=False).reshape(b, h, 1, s_len)
    if not _shim_softmax(s, mask, mx.float32, s_len - 1):
        _numpy_softmax(s, mask, mx.float32, s_len - 1)
    return (scores @ values).reshape(b, h, 1, values.shape[-1])


def _decode_attention_ok(queries: mx.array, keys: mx.array, mask: Any, sinks: Any,
                         cache: Any, kwargs: dict) -> bool:
    """A decode step's attention in a half-precision or quantized model on a thread
    whose plan decodes through the shim's kernels (`shim_decode.decode_attention`)."""
    plan: FastPrefill | None = getattr(_thread, "plan", None)
    if (plan is None or not (plan.decode_half or plan.decode_quant) or queries.ndim != 4
            or queries.shape[2] != 1
            or queries.dtype not in HALF or keys.dtype != queries.dtype or sinks is not None
            or kwargs or hasattr(cache, "bits") or queries.shape[1] % keys.shape[1]
            or 2 * keys.size * F32_BYTES > decode_attention_bytes(plan)):
        return False
    if mask is None:
        return True
    return (isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] == 1
            and mask.shape[0] in (1, queries.shape[0]) and mask.shape[2] == 1
            and mask.shape[3] == keys.shape[2]
            and (mask.dtype == mx.bool_ or mask.dtype == queries.dtype))


def decode_attention_bytes(plan: FastPrefill) -> int:
    """How much a decode step's attention may copy to float32 (one layer's keys and
    values of the whole batch): half the transient admission already counts for a prefill
    chunk's converted layer (a decode step never runs beside one, and a lazy step may cast
    the next layer's before freeing one's). A batch with more stays on MLX's attention:
    on the medium demo model one sequence of 2,560 tokens, on the small one 768."""
    return plan.transient.weight_bytes // 2


# mlx-lm's KVCache and BatchKVCache give attention the first S rows of their buffers
# (B, KV heads, capacity, head size). MLX converts that bfloat16 prefix to float32 element
# by element (a strided copy: 13 % of the small bfloat16 demo model's decode thread at
# ~400 keys), the contiguous buffer in one vectorized pass, several times faster with its
# unused rows. So `shim_decode.decode_attention` converts a bfloat16 cache's buffers when
# the keys and values it is given are the very arrays the cache handed out on the bound
# thread (`_fetching` records them, weakly) and the buffers fit `decode_attention_bytes`.
# A decode step, in process (docs/benchmarks.md): small bfloat16 1.05x at 316 keys, 1.13x
# at 716; small 4-bit 1.05x and 1.10x; medium bfloat16 1.01x and 1.07x. A float16 buffer
# converts no faster whole (medium float16 0.96-0.98x): it keeps the prefix's conversion.
_FETCHING_CACHES = (KVCache, BatchKVCache)


def _fetching(stock: Callable) -> Callable:
    """A cache class's `update_and_fetch` that also records, on a bound thread, which
    arrays it returned."""

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        fetched = stock(self, keys, values)
        if getattr(_thread, "plan", None) is not None and len(fetched) == 2:
            _thread.fetched = tuple(weakref.ref(a) for a in (self, *fetched))
        return fetched

    update_and_fetch.stock = stock
    return update_and_fetch


def _track_fetches() -> None:
    """Wraps the caches' `update_and_fetch` once per process (idempotent)."""
    for cls in _FETCHING_CACHES:
        if not hasattr(cls.update_and_fetch, "stock"):
            cls.update_and_fetch = _fetching(cls.update_and_fetch)


def _cache_buffers(cache: Any, keys: mx.array, values: mx.array
                   ) -> tuple[mx.array, mx.array] | None:
    """The bfloat16 buffers whose first rows are `keys` and `values`, when the cache
    just handed those out on this thread and both fit the plan's bound; else None."""
    fetched, _thread.fetched = getattr(_thread, "fetched", None), None
    if (fetched is None or keys.dtype != mx.bfloat16 or type(cache) not in _FETCHING_CACHES
            or any(r() is not a for r, a in zip(fetched, (cache, keys, values), strict=True))):
        return None
    buffers = cache.keys, cache.values
    if any(b is None or b.shape[:2] != a.shape[:2] or b.shape[3:] != a.shape[3:]
           or b.shape[2] < a.shape[2] for b, a in zip(buffers, (keys, values), strict=True)):
        return None
    if (buffers[0].size + buffers[1].size) * F32_BYTES > decode_attention_bytes(_thread.plan):
        return None
    return buffers


def _sdpa(queries, keys, values, cache, scale, mask, sinks=None, **kwargs):
    """mlx-lm's attention; a prefill chunk on a bound thread runs it in float32, and so
    do a decode step's products where the plan decodes through the shim; a float32
    decode step over a long cache takes the shim's softmax."""
    short = _decode_attention_ok(queries, keys, mask, sinks, cache, kwargs)
    if short and keys.shape[2] < HALF_DECODE_KERNELS_MIN_KEYS:
        return shim_decode.decode_attention(queries, keys, values, scale, mask,
                                            _cache_buffers(cache, keys, values))
    if (_long_half_decode_ok(queries, keys, values, mask, sinks, cache, kwargs)
            and (out := _long_half_decode_attention(queries, keys, values, scale,
                                                    mask)) is not None):
        return out
    if short:
        return shim_decode.decode_attention(queries, keys, values, scale, mask,
                                            _cache_buffers(cache, keys, values))
    if _long_decode_ok(queries, keys, mask, sinks, cache, kwargs):
        return _long_decode_attention(queries, keys, values, scale, mask)
    if (queries.ndim != 4 or hasattr(cache, "bits") or kwargs
            or (plan := _prefill_plan(queries, 2)) is None):
        return _stock_sdpa(queries, keys, values, cache, scale, mask, sinks, **kwargs)
    f32 = mx.float32
    k, v = keys.astype(f32), values.astype(f32)
    if isinstance(mask, mx.array) and mask.dtype in HALF:
        mask = mask.astype(f32)  # additive, and NumPy has no bfloat16
    if (sinks is None and queries.shape[1] % keys.shape[1] == 0
            and _numpy_mask_ok(mask, queries, keys.shape[2])):
        # The scaling in the queries' dtype, as MLX's own attention does it.
        q = (queries * mx.array(scale, dtype=queries.dtype)).astype(f32)
        plan.in_numpy += 1
        out = _attention_f32(q, k, v, mask, queries.dtype)
    else:
        q = queries.astype(f32)
        out = _stock_sdpa(q, k, v, cache, scale, mask,
                          sinks.astype(f32) if sinks is not None else None)
    return out.astype(queries.dtype)


# -- the MLP's activation -----------------------------------------------------------------
#
# MLX's CPU sigmoid runs at ~60 M elements/s, so in a prefill chunk SwiGLU over (chunk x
# intermediate) takes as long as a product. A float32 chunk runs it in NumPy, whose exp is
# ~20x faster. A half-precision chunk must keep MLX's roundings (its bfloat16 exp is a
# polynomial, rounded to bfloat16 before the division; a NumPy sigmoid differs in ~12 %
# of elements by one step), but silu(gate) depends on the gate's 16 bits alone: the stock
# kernel itself fills a table of all 65,536 values once, and a chunk's SwiGLU is a lookup
# and one product rounded as MLX rounds it (bit for bit the stock result; 6x faster on
# (127, 1536) bfloat16).

_stock_swiglu: Callable[[mx.array, mx.array], mx.array] = _mlx_activations.swiglu


def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `silu(gate) * x`; a prefill chunk on a bound thread runs it outside MLX:
    float32 as the same maths through the shim's kernel, else in NumPy a block of rows at
    a time (either exp against MLX's: max relative difference ~1e-6), half precision
    through `_half_silu` (MLX's bits)."""
    if (gate.dtype != x.dtype or gate.shape != x.shape
            or (plan := _prefill_plan(gate, -2)) is None):
        return _stock_swiglu(gate, x)
    if gate.dtype in HALF:
        plan.in_numpy += 1
        return _half_swiglu(gate, x)
    plan.in_numpy += 1
    mx.eval(gate, x)
    width = gate.shape[-1]
    g = np.asarray(gate).reshape(-1, width)
    u = np.asarray(x).reshape(-1, width)
    shim_swiglu = _shim_kernels()[1]
    if shim_swiglu is not None and g.flags.c_contiguous and u.flags.c_contiguous:

        def shim_parts(out: np.ndarray) -> None:
            def part(start: int, stop: int) -> None:
                at = start * F32_BYTES
                shim_swiglu(out.ctypes.data + at, g.ctypes.data + at, u.ctypes.data + at,
                            stop - start)

            _in_parts(g.size, part)

        return _from_numpy(gate.shape, gate.dtype, shim_parts)
    rows = max(1, _BLOCK_ELEMENTS // width)

    def swiglu(out: np.ndarray) -> None:
        out = out.reshape(-1, width)

        def part(start: int, stop: int) -> None:
            with np.errstate(over="ignore"):  # exp(-g) = inf for g < -88: sigmoid 0, as MLX's
                for i in range(start * rows, min(stop * rows, g.shape[0]), rows):
                    t, gb = out[i:i + rows], g[i:i + rows]
                    np.negative(gb, out=t)
                    np.exp(t, out=t)
                    t += 1
                    np.reciprocal(t, out=t)  # sigmoid(g)
                    t *= gb
                    t *= u[i:i + rows]

        _in_parts(-(-g.shape[0] // rows), part)

    return _from_numpy(gate.shape, gate.dtype, swiglu)


_HALF_SILU: dict[mx.Dtype, np.ndarray] = {}


def _half_silu(dtype: mx.Dtype) -> np.ndarray:
    """silu(g) for every `dtype` (bfloat16 or float16) value g, as float32 (exact),
    indexed by g's 16 bits: made by mlx-lm's own compiled SwiGLU on all of them (times
    one, which is exact), so a lookup is the stock kernel's result."""
    table = _HALF_SILU.get(dtype)
    if table is None:
        every = mx.arange(1 << 16, dtype=mx.uint32).astype(mx.uint16).view(dtype)
        silu = _stock_swiglu(every, mx.ones_like(every)).astype(mx.float32)
        table = _HALF_SILU[dtype] = np.array(silu)
    return table


def _half_swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """`silu(gate) * x` for half-precision arrays, as MLX's kernel computes it: silu from
    the table, the product of two half-precision values in float32 (exact), rounded to
    nearest even."""
    table = _half_silu(gate.dtype)
    mx.eval(gate, x)
    g = np.asarray(gate.view(mx.uint16)).reshape(-1)
    u = np.asarray(x.view(mx.uint16)).reshape(-1)
    block = min(g.size, _BLOCK_ELEMENTS)

    def swiglu(out: np.ndarray) -> None:
        out = out.reshape(-1)

        def part(start: int, stop: int) -> None:
            a, b = start * block, min(stop * block, g.size)
            with np.errstate(over="ignore", invalid="ignore"):  # to inf or NaN, as MLX's
                _half_products(table, g[a:b], u[a:b], out[a:b], block, gate.dtype)

        _in_parts(-(-g.size // block), part)

    return _from_numpy(gate.shape, mx.uint16, swiglu).view(gate.dtype)


def _from_numpy(shape: tuple[int, ...], dtype: mx.Dtype,
                write: Callable[[np.ndarray], None]) -> mx.array:
    """A new MLX array whose values `write` puts into a NumPy view of its buffer. The
    buffer comes from MLX's cache, reused layer after layer; a NumPy array of its own
    would be fresh pages each time (first touches are page faults, ~0.3 ms a MiB on this
    machine's virtual CPUs) and then copied into MLX."""
    result = mx.zeros(shape, dtype)
    mx.eval(result)
    write(np.array(result, copy=False))
    return result


def _half_products(table: np.ndarray, g: np.ndarray, u: np.ndarray, out: np.ndarray,
                   block: int, dtype: mx.Dtype) -> None:
    """out = silu(g) * u, a block at a time; g, u and out hold `dtype`'s 16 bits."""
    prod, other, tmp = (np.empty(block, t) for t in (np.float32, np.uint32, np.uint32))
    for i in range(0, g.size, block):
        n = min(block, g.size - i)
        p, o = prod[:n], other[:n]
        np.take(table, g[i:i + n], out=p)
        if dtype == mx.bfloat16:  # a bfloat16 value is the top half of its float32
            np.left_shift(u[i:i + n], 16, out=o, dtype=np.uint32)
            p *= o.view(np.float32)
            _round_half(p, dtype, tmp)
            np.right_shift(p.view(np.uint32), 16, out=out[i:i + n], casting="unsafe")
        else:
            p *= u[i:i + n].view(np.float16)
            np.copyto(out[i:i + n].view(np.float16), p, casting="unsafe")


_PATCHES = (("scaled_dot_product_attention", _stock_sdpa, _sdpa),
            ("swiglu", _stock_swiglu, _swiglu))


def _patch_modules(model: nn.Module) -> int:
    """Points the model's modules' `scaled_dot_product_attention` at `_sdpa` and their
    `swiglu` at `_swiglu`; idempotent. Outside a bound thread's prefill chunk each is
    mlx-lm's own."""
    names = {type(model).__module__}
    names.update(type(m).__module__ for _, m in model.named_modules())
    patched = 0
    for name in names:
        mod = sys.modules.get(name)
        if mod is None:
            continue
        for attr, stock, ours in _PATCHES:
            current = getattr(mod, attr, None)
            if current is stock:
                setattr(mod, attr, ours)
                patched += 1
            elif current is ours:
                patched += 1
    return patched


# -- the last block ------------------------------------------------------------------------
#
# mlx-lm evaluates a prefill chunk's cache, never its output: of the last block only the
# keys and values are ever computed, lazily. The NumPy attention and SwiGLU above, and a
# chunk's converted or kernel products, run as soon as they are called, so there they
# would compute a query, an attention and an MLP nobody reads (about one block in N of
# the chunk). In the last block they stay MLX's lazy operations: the products as float32
# conversions or kernel calls MLX runs only if read (a layer's float32 weight made just
# before its product and freed after it), attention and SwiGLU as the stock path's.
# Measured in process (256-token prompt, cache bit for bit the same): small bfloat16
# prefill 1.19x faster, small 4-bit 1.13x, medium 4-bit 1.14x, medium bfloat16 1.04x.


def _mark_last_block(plan: FastPrefill, blocks: list[nn.Module]) -> None:
    """Leaves the last block's products of a prefill chunk lazy (engine/last_block.py)."""
    if not blocks:
        return
    plan.owns_last_mark = last_block.mark(blocks[-1]) or plan.owns_last_mark
    plan.last_block = weakref.ref(blocks[-1])


def _unmark_last_block(plan: FastPrefill) -> None:
    """The last block's products evaluated as every other block's; its class given back
    when this plan marked it (the engine marks it at load for engine/final_chunk.py)."""
    block = plan.last_block() if plan.last_block is not None else None
    if block is not None and plan.owns_last_mark:
        last_block.unmark(block)
    plan.owns_last_mark = False
    plan.last_block = None


# -- deciding and installing ------------------------------------------------------------


def environment_reason() -> str | None:
    """Why this process cannot use the fast path, or None when it can."""
    if sys.platform != "linux":
        return f"not Linux ({sys.platform})"
    try:
        if mx.default_device().type != mx.DeviceType.cpu:
            return "MLX runs on an accelerator"
    except Exception:  # noqa: BLE001 - no device query: treat as not a CPU
        return "MLX's device is unknown"
    state = blas.state()
    if not state.optimized:
        return f"no optimized BLAS ({state.reason})"
    return None


def _candidates(model: nn.Module) -> list[nn.Module]:
    """Linear and affine QuantizedLinear layers of the transformer blocks (never the
    embedding or the LM head: a prefill never evaluates the head's logits, and a
    per-layer evaluation would make it)."""
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, (list, tuple)) or not blocks:
        return []
    found = []
    for block in blocks:
        if not isinstance(block, nn.Module):
            continue
        for _, m in block.named_modules():
            kind = _STOCK_CLASSES.get(type(m), type(m))
            dense = kind is nn.Linear and m["weight"].dtype in HALF
            quantized = (kind is nn.QuantizedLinear and m.mode == "affine"
                         and m["scales"].dtype in HALF and "biases" in m)
            if dense or quantized:
                found.append(m)
    return found


def _decode_heads(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """Layers outside the blocks that may decode on float32 and are never converted for
    a prefill: affine quantized ones (the LM head, a tied embedding) and a dense
    half-precision LM head, or the embedding of a model without one (a tied head: its
    `as_linear`)."""
    inside = {id(m) for b in blocks for _, m in b.named_modules()}
    outside = [(m, _STOCK_CLASSES.get(type(m), type(m))) for _, m in model.named_modules()
               if id(m) not in inside]
    tied = not any(kind in (nn.Linear, nn.QuantizedLinear) for _, kind in outside)
    found = []
    for m, kind in outside:
        quantized = (kind in (nn.QuantizedLinear, nn.QuantizedEmbedding)
                     and m.mode == "affine" and "biases" in m and m["scales"].dtype in HALF)
        dense = ((kind is nn.Linear or (kind is nn.Embedding and tied))
                 and m["weight"].dtype in HALF)
        if quantized or dense:
            found.append(m)
    return found


def _is_dense(m: nn.Module) -> bool:
    return _STOCK_CLASSES.get(type(m), type(m)) is nn.Linear


def _is_embedding(m: nn.Module) -> bool:
    """A dense embedding (a tied dense model's LM head)."""
    return _STOCK_CLASSES.get(type(m), type(m)) is nn.Embedding


def _shape(m: nn.Module) -> tuple[int, int]:
    """(out, in) of a layer, unpacked for a quantized one."""
    if _STOCK_CLASSES.get(type(m), type(m)) is nn.QuantizedLinear:
        return m["scales"].shape[0], m["scales"].shape[-1] * m.group_size
    return m["weight"].shape[0], m["weight"].shape[-1]


def _weight_fp32_bytes(m: nn.Module) -> int:
    """A layer's conversion at its peak: the float32 weight; for a quantized layer twice
    that (MLX's CPU dequantize holds a temporary as large as its output: measured 20.3 MiB
    for a 10 MiB result) plus the float32 scales and biases."""
    out, inp = _shape(m)
    weight = out * inp * F32_BYTES
    if _STOCK_CLASSES.get(type(m), type(m)) is nn.QuantizedLinear:
        return 2 * weight + 2 * m["scales"].size * F32_BYTES
    return weight


def transient_for(layers: list[nn.Module], kv_bytes_per_token: int, num_layers: int,
                  kv_dtype_bytes: int) -> ConversionTransient:
    """The prefill transient of converting these layers, from their shapes."""
    if not layers:
        return ConversionTransient()
    shapes = [_shape(m) for m in layers]
    weight = max(_weight_fp32_bytes(m) for m in layers)
    # A layer's float32 input and output, and as much again for attention's queries and
    # output (never wider than the widest layer's sides).
    chunk = 2 * max(o + i for o, i in shapes) * F32_BYTES
    per_layer_kv = kv_bytes_per_token // max(1, num_layers)
    prompt = per_layer_kv * F32_BYTES // max(1, kv_dtype_bytes)
    return ConversionTransient(weight, chunk, prompt)


def _dtype_name(layers: list[nn.Module]) -> str:
    kinds = set()
    for m in layers:
        if _STOCK_CLASSES.get(type(m), type(m)) is nn.QuantizedLinear:
            kinds.add(f"{m.bits}-bit")
        else:
            kinds.add(str(m["weight"].dtype).removeprefix("mlx.core."))
    return "/".join(sorted(kinds))


def _time_ms(fn: Callable[[], mx.array], repeats: int) -> float:
    mx.eval(fn())  # warm
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
    return best * 1000


def measure_decode(layers: list[nn.Module], plan: FastPrefill,
                   repeats: int = DECODE_REPEATS) -> tuple[float, float] | None:
    """(stock ms, float32 ms) of one decode row through the largest quantized layer, or
    None when the model has none (dense half layers always decode stock)."""
    quantized = [m for m in layers
                 if _STOCK_CLASSES.get(type(m), type(m)) is nn.QuantizedLinear]
    if not quantized:
        return None
    m = max(quantized, key=lambda q: _shape(q)[0] * _shape(q)[1])
    x = mx.ones((1, 1, _shape(m)[1]), dtype=m["scales"].dtype)
    saved = plan.decode_fp32
    try:
        plan.decode_fp32 = False
        stock = _time_ms(lambda: m(x), repeats)
        plan.decode_fp32 = True
        fp32 = _time_ms(lambda: m(x), repeats)
    finally:
        plan.decode_fp32 = saved
        mx.clear_cache()
    return stock, fp32


def measure_shim_decode(layers: list[nn.Module], repeats: int = DECODE_REPEATS
                        ) -> tuple[float, float] | None:
    """(ms the layer takes now, kernel ms) of one decode row through the largest layer
    shown to the shim (`shim_decode.show_layers`), or None without one."""
    shown = [(m, v) for m in layers if (v := shim_decode.shown_view(m)) is not None]
    if not shown:
        return None
    m, view = max(shown, key=lambda p: p[0]["weight"].shape[0] * shim_decode.in_features(p[0]))
    dtype = m["scales"].dtype if "scales" in m else m["weight"].dtype
    x = mx.ones((1, 1, shim_decode.in_features(m)), dtype=dtype)
    now = m.as_linear if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)) else m
    try:
        return (_time_ms(lambda: now(x), repeats),
                _time_ms(lambda: shim_decode.product(m, view, x), repeats))
    finally:
        mx.clear_cache()


def _choose_shim_decode(layers: list[nn.Module], decode: DecodeMode, what: str,
                        now: str) -> tuple[bool, str]:
    """Whether these layers (dense half-precision ones, or quantized ones) decode through
    the shim's kernels, measured against what they run `now` ("stock", "float32"), and
    the log's words for it ("" when there is nothing to choose). The layers it takes are
    left shown to the shim; none when it says no."""
    if not layers or decode == "stock":
        return False, ""
    if blas.half_gemv() is None:
        return False, f"{what} {now} (the BLAS in use has no decode kernels)"
    shown = shim_decode.show_layers(layers)
    if not shown:
        return False, f"{what} {now} (the shim could not take their weights)"
    isa = blas.half_kernel_isa()
    some = "" if len(shown) == len(layers) else f" ({len(shown)} of {len(layers)})"
    helpers = blas.kernel_helpers()
    shared = (f"; products of {blas.KERNEL_PARALLEL_MIN_BYTES >> 20} MiB of weight or more "
              f"on {helpers + 1} threads (one row of a half-precision weight from rows of "
              f"{blas.HALF_ONE_ROW_SHARED_MIN_ROW_BYTES} bytes)" if helpers else "")
    if decode == "fp32":
        return True, f"{what}{some} through the {isa} kernel (set){shared}"
    timing = measure_shim_decode(shown)
    if timing is None:
        return False, ""
    before, kernel = timing
    chosen = kernel < DECODE_MARGIN * before
    if not chosen:
        for m in shown:
            shim_decode.hide(m)
    return chosen, (f"{what}{some} {'through the ' + isa + ' kernel' if chosen else now} "
                    f"(measured {before:.2f} ms {now}, {kernel:.2f} ms kernel)"
                    f"{shared if chosen else ''}")


# Chunk sizes at which the kernels are measured against a conversion at load, in order;
# none larger (what a kernel product holds grows with its rows, a conversion's does not).
KERNEL_ROW_STEPS = (16, 24, 32, 48, 64)
KERNEL_ROW_REPEATS = 5


def measure_kernel_rows(plan: FastPrefill, m: nn.Module, rows: int,
                        repeats: int = DECODE_REPEATS) -> tuple[float, float]:
    """(kernel ms, conversion ms) of one prefill chunk of `rows` rows through layer `m`,
    each through the layer's own call as a prefill runs it."""
    x = mx.ones((1, rows, _shape(m)[1]), dtype=m["scales"].dtype if "scales" in m
                else m["weight"].dtype)
    saved = plan.kernel_below, plan.converted, plan.through_kernel
    try:
        plan.kernel_below = rows + 1
        kernel = _time_ms(lambda: m(x), repeats)
        plan.kernel_below = plan.min_tokens
        converted = _time_ms(lambda: m(x), repeats)
    finally:
        plan.kernel_below, plan.converted, plan.through_kernel = saved
        mx.clear_cache()
    return kernel, converted


def choose_kernel_rows(plan: FastPrefill, layers: list[nn.Module]) -> str:
    """Raises plan.kernel_below while the kernels measure faster than a conversion on the
    largest layer they take (MLX's CPU dequantize is slow: on the medium 4-bit model a
    64-row chunk's largest product took 6.7 ms through the kernel, 9.3 converted), by
    DECODE_MARGIN, and no layer's product holds more than the largest conversion
    admission counts (`ConversionTransient.weight_bytes`); the log's words ("" when
    it stays)."""
    kinds = (() if not plan.decode_half else (nn.Linear,)) + \
        (() if not plan.decode_quant else (nn.QuantizedLinear,))
    shown = [(m, v) for m in layers if not m._decode_only
             and _STOCK_CLASSES.get(type(m), type(m)) in kinds
             and (v := shim_decode.shown_view(m)) is not None]
    if not shown:
        return ""
    m, _ = max(shown, key=lambda p: _shape(p[0])[0] * _shape(p[0])[1])
    measured = []
    for rows in KERNEL_ROW_STEPS:
        if rows < plan.min_tokens:
            continue
        # Within what admission counts for a conversion (the largest layer's, one at a time).
        if any(shim_decode.product_bytes(q, v, rows) > plan.transient.weight_bytes
               for q, v in shown):
            break
        kernel, converted = measure_kernel_rows(plan, m, rows, KERNEL_ROW_REPEATS)
        measured.append(f"{rows}: {kernel:.2f}/{converted:.2f}")
        if kernel >= DECODE_MARGIN * converted:  # a clear win only: the timings are noisy
            break
        plan.kernel_below = rows + 1
    if plan.kernel_below <= plan.min_tokens:
        return ""
    return (f"prefill chunks of up to {plan.kernel_below - 1} rows through the kernel "
            f"(measured ms kernel/converted at rows {', '.join(measured)})")


def measure_dense_decode(layers: list[nn.Module], repeats: int = DECODE_REPEATS
                         ) -> dict[tuple[int, int], tuple[float, float]]:
    """(stock ms, float32 ms) of one decode row per distinct dense half-precision shape
    whose float32 copy fits DENSE_DECODE_MAX_BYTES."""
    out: dict[tuple[int, int], tuple[float, float]] = {}
    try:
        for m in layers:
            if not _is_dense(m):
                continue
            w = m["weight"]
            shape = (int(w.shape[0]), int(w.shape[1]))
            if shape in out or w.size * F32_BYTES > DENSE_DECODE_MAX_BYTES:
                continue
            x = mx.ones((1, 1, shape[1]), dtype=w.dtype)
            bias = m.get("bias")
            out[shape] = (_time_ms(lambda m=m, x=x: nn.Linear.__call__(m, x), repeats),
                          _time_ms(lambda w=w, x=x, b=bias: _dense_decode_product(x, w, b),
                                   repeats))
    finally:
        mx.clear_cache()
    return out


def _choose_dense_decode(plan: FastPrefill, layers: list[nn.Module], decode: DecodeMode) -> str:
    """Sets plan.decode_shapes; the log's words for it."""
    dense = [m for m in layers if _is_dense(m)]
    if not dense or decode == "stock":
        return ""
    if decode == "fp32":
        plan.decode_shapes = frozenset(
            (int(m["weight"].shape[0]), int(m["weight"].shape[1])) for m in dense
            if m["weight"].size * F32_BYTES <= DENSE_DECODE_MAX_BYTES)
        return f"{len(plan.decode_shapes)} dense shapes float32 (set)"
    timing = measure_dense_decode(dense)
    plan.decode_shapes = frozenset(
        k for k, (stock, fp32) in timing.items() if fp32 < DECODE_MARGIN * stock)
    stock_ms = sum(t[0] for t in timing.values())
    fp32_ms = sum(t[1] if k in plan.decode_shapes else t[0] for k, t in timing.items())
    return (f"{len(plan.decode_shapes)} of {len(timing)} dense shapes float32 (measured "
            f"{stock_ms:.2f} -> {fp32_ms:.2f} ms over one layer of each)")


def decode_copy_bytes(plan: FastPrefill, blocks: list[nn.Module],
                      heads: list[nn.Module]) -> int:
    """The float32 copies a decode step holds at once, at most: a lazy step may run a
    block's casts before their products, and the head's while the last block's are
    still held (measured: 35.1 MiB at peak on the medium demo model, whose blocks copy
    40 MiB each; 26.1 MiB on the small one, whose last block and head copy 28.6)."""
    def copy(m: nn.Module) -> int:
        converted = _is_dense(m) and tuple(m["weight"].shape) in plan.decode_shapes
        return m["weight"].size * F32_BYTES if converted else 0

    per_block = [sum(copy(m) for _, m in b.named_modules() if isinstance(m, _FastLinear))
                 for b in blocks if isinstance(b, nn.Module)]
    return max([0, *per_block]) + max([0, *(copy(m) for m in heads)])


def _with_decode_weight(plan: FastPrefill, blocks: list[nn.Module],
                        heads: list[nn.Module]) -> None:
    """The transient's weight term covers what a decode step converts (the larger of a
    prefill's one layer and a decode step's copies)."""
    held = decode_copy_bytes(plan, blocks, heads)
    if held > plan.transient.weight_bytes:
        plan.transient = dataclasses.replace(plan.transient, weight_bytes=held)


def install(model: nn.Module, *, enabled: bool = True, min_tokens: int = DEFAULT_MIN_TOKENS,
            decode: DecodeMode = "auto", decode_dense: bool = False,
            decode_kernel: bool = True,
            kv_bytes_per_token: int = 0, kv_dtype_bytes: int = 2) -> FastPrefill:
    """Decide for this model and wrap its layers; binds the calling thread (the one that
    will run the model). Nothing is wrapped when the environment or the model do not
    qualify, or when `enabled` is False (the stock path, exactly)."""
    if decode not in DECODE_MODES:
        raise ValueError(f"decode must be one of {', '.join(DECODE_MODES)}, got {decode!r}")
    if not enabled:
        return FastPrefill(False, "turned off by the settings")
    why = environment_reason()
    if why is not None:
        return FastPrefill(False, why)
    layers = _candidates(model)
    if not layers:
        dense32 = _float32_layers(model)
        if not dense32:
            return FastPrefill(False, "no bfloat16, float16, float32 or quantized layers "
                               "in model.layers")
        return _install_float32(model, dense32, max(FLOAT32_MIN_TOKENS, min_tokens))
    blocks = list(getattr(model, "layers", ()))
    plan = FastPrefill(
        True, f"{blas.state().name} BLAS on a Linux CPU", min_tokens=max(2, min_tokens),
        kernel_below=max(2, min_tokens), layers=len(layers), dtype=_dtype_name(layers),
        transient=transient_for(layers, kv_bytes_per_token, len(blocks), kv_dtype_bytes))
    quantized = any(_STOCK_CLASSES.get(type(m), type(m)) is nn.QuantizedLinear
                    for m in layers)
    kernel_mode = decode if decode_kernel else "stock"
    half, half_reason = _choose_shim_decode(
        [m for m in layers if _is_dense(m)], kernel_mode, "dense layers", "stock")
    heads = [m for m in _decode_heads(model, blocks)
             if ((decode_dense or half) and _is_dense(m)) or (half and _is_embedding(m))
             or (quantized and not _is_dense(m) and not _is_embedding(m))]
    for m in layers + heads:
        m._fast_prefill = plan
        m.__class__ = _FAST_CLASSES[_STOCK_CLASSES.get(type(m), type(m))]
    for m in heads:
        if isinstance(m, (_FastQuantizedLinear, _FastLinear)):
            m._decode_only = True
    if half:
        shim_decode.show_layers([m for m in heads if _is_dense(m) or _is_embedding(m)])

    plan.wrapped = [weakref.ref(m) for m in layers + heads]
    _patch_modules(model)
    _track_fetches()
    _mark_last_block(plan, [b for b in blocks if isinstance(b, nn.Module)])
    plan.bind_thread()
    if decode == "fp32":
        plan.decode_fp32 = quantized
        plan.decode_reason = "float32 (set)" if plan.decode_fp32 else "stock (no quantized layers)"
    elif decode == "auto":
        timing = measure_decode(layers, plan)
        plan.decode_ms = timing
        if timing is None:
            plan.decode_reason = "stock (dense layers)"
        else:
            stock, fp32 = timing
            plan.decode_fp32 = fp32 < DECODE_MARGIN * stock
            plan.decode_reason = (f"{'float32' if plan.decode_fp32 else 'stock'} "
                                  f"(measured {stock:.2f} ms stock, {fp32:.2f} ms float32)")
    else:
        plan.decode_reason = "stock (set)"
    if half:
        plan.decode_half = True
        plan.decode_reason = (half_reason if plan.decode_reason.startswith("stock (dense")
                              else f"{plan.decode_reason}; {half_reason}")
    elif half_reason:
        plan.decode_reason = f"{plan.decode_reason}; {half_reason}"
    if quantized:
        plan.decode_quant, quant_reason = _choose_shim_decode(
            [m for m in layers + heads if not _is_dense(m) and not _is_embedding(m)],
            kernel_mode, "quantized layers",
            "float32" if plan.decode_fp32 else "stock")
        if quant_reason:
            plan.decode_reason = f"{plan.decode_reason}; {quant_reason}"
    if plan.decode_half or plan.decode_quant:
        rows_reason = choose_kernel_rows(plan, layers)
        if rows_reason:
            plan.decode_reason = f"{plan.decode_reason}; {rows_reason}"
    dense = (_choose_dense_decode(plan, layers + heads, decode)
             if decode_dense and not half else "")
    if dense:
        plan.decode_reason = (dense if plan.decode_reason.startswith("stock (dense")
                              else f"{plan.decode_reason}; {dense}")
        _with_decode_weight(plan, blocks, heads)
    return plan


def _float32_layers(model: nn.Module) -> list[nn.Module]:
    """The float32 Linear layers of the transformer blocks (a float32 model)."""
    found = []
    for block in getattr(model, "layers", None) or ():
        if isinstance(block, nn.Module):
            found += [m for _, m in block.named_modules()
                      if type(m) is nn.Linear and m["weight"].dtype == mx.float32]
    return found


def _install_float32(model: nn.Module, dense: list[nn.Module], min_tokens: int
                     ) -> FastPrefill:
    """A float32 model: its products already run through BLAS, so no layer is wrapped
    or converted; only attention and SwiGLU of prefill chunks run in NumPy. What that
    adds over the stock path is one activation-sized float32 array per chunk token."""
    widest = max(o + i for o, i in (_shape(m) for m in dense))
    plan = FastPrefill(
        True, f"{blas.state().name} BLAS on a Linux CPU", min_tokens=min_tokens,
        dtype="float32", decode_reason="stock (float32 products use BLAS already)",
        transient=ConversionTransient(0, 2 * widest * F32_BYTES, 0))
    _patch_modules(model)
    _mark_last_block(plan, [b for b in getattr(model, "layers", None) or ()
                            if isinstance(b, nn.Module)])
    plan.bind_thread()
    return plan


def uninstall(plan: FastPrefill) -> None:
    """Gives the wrapped layers (and the last block) their stock classes back."""
    for ref in plan.wrapped:
        m = ref()
        stock = _STOCK_CLASSES.get(type(m))
        if stock is not None:
            m.__class__ = stock
            m.__dict__.pop("_fast_prefill", None)
            m.__dict__.pop("_decode_only", None)
            shim_decode.hide(m)
    plan.wrapped = []
    _unmark_last_block(plan)
    plan.enabled = False
    plan.decode_fp32 = False
    plan.decode_half = plan.decode_quant = False
    plan.kernel_below = plan.min_tokens
    plan.decode_shapes = frozenset()
    if getattr(_thread, "plan", None) is plan:
        _thread.plan = None
