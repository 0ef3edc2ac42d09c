"""Decode rows through the CBLAS shim's kernels, inside MLX's lazy graph (Linux CPU).

MLX's CPU products for a bfloat16/float16 weight (~1.6-2.5 GB/s of weights here) and for
an affine-quantized one (~4 GB/s with float32 activations, ~0.4 with half-precision ones)
are far from what a decode step, bound by reading each weight once, could reach. The
shim (engine/cblas_shim.c) has kernels that read such weights as stored and sum in
float32: `plimsoll_half_gemv` and `plimsoll_quant_gemv`. MLX calls them itself: a layer's
weight is registered with the shim (`show`) and MLX multiplies by a float32 view of its
bits, with the activations laid out as the kernel reads them; the shim's cblas_sgemm
recognises the registered pointer and runs the kernel. So a decode step stays one lazy
graph, with no evaluation, copy or NumPy per layer.

A registration holds the layer's weight (and a quantized layer's scales and biases), so
that no other array can be at a registered address; it ends with `hide`, when the
layer is collected, or when the layer's weight is replaced (a weight update: the layer
then keeps MLX's own product). `show_layers` checks one product per distinct shape
against the kernel called directly before a layer is used.

engine/fast_prefill.py decides per model whether its layers decode this way (measured
at load) and wraps them; `decode_attention` is its decode steps' attention."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from engine import blas

HALF_KINDS = {mx.bfloat16: blas.HALF_BF16, mx.float16: blas.HALF_F16}
SCALE_KINDS = {mx.bfloat16: blas.SCALE_BF16, mx.float16: blas.SCALE_F16,
               mx.float32: blas.SCALE_F32}
QUANT_BITS = (4, 8)
# What one product's MLX output may hold (it is `spread` times the real y, below).
PRODUCT_OUTPUT_BYTES = 8 << 20


@dataclass
class _Shown:
    """A layer's weight registered with the shim, the float32 view of its bits that MLX
    multiplies by, and what the registration keeps alive (the weight; a quantized layer's
    scales and biases)."""

    held: tuple[mx.array, ...]  # the layer's arrays when registered (a rebinding shows)
    # The registered buffers themselves (NumPy views keep them alive even if the layer's
    # arrays are later updated in place: the kernel then reads stale, never freed, bytes).
    buffers: tuple
    view: mx.array  # MLX's own buffer, seen as float32
    view_t: mx.array  # the same, transposed once (not a transpose in every product's graph)
    release: weakref.finalize  # unregisters once: here, or when the layer is collected


def _quantized(m: nn.Module) -> bool:
    return "scales" in m and hasattr(m, "bits")


def _parts(m: nn.Module) -> tuple[mx.array, ...]:
    if _quantized(m):
        return m["weight"], m["scales"], m["biases"]
    return (m["weight"],)


def _own_buffer(*arrays: mx.array) -> list[np.ndarray] | None:
    """Zero-copy NumPy views of evaluated, contiguous MLX arrays (half-precision ones as
    their uint16 bits: NumPy has no bfloat16), or None."""
    arrays = tuple(a.view(mx.uint16) if a.dtype in HALF_KINDS else a for a in arrays)
    mx.eval(*arrays)
    views = [np.asarray(a) for a in arrays]
    return views if all(v.flags.c_contiguous for v in views) else None


def show(m: nn.Module) -> mx.array | None:
    """Registers a dense bfloat16/float16 layer's weight, or an affine 4/8-bit one's
    (group sizes of multiples of 16), and returns the float32 view of its bits MLX
    multiplies by: n x k/2 for half precision, the packed words (n x k*bits/32) for a
    quantized weight. Made once per weight; None where it cannot be (a shape or format
    the kernels do not take, a weight MLX would copy, no free slot): the layer then keeps
    MLX's own product."""
    view = shown_view(m)
    if view is not None:
        return view
    w = m["weight"]
    if w.ndim != 2:
        return None
    if _quantized(m):
        if (getattr(m, "mode", "affine") != "affine" or "biases" not in m
                or m.bits not in QUANT_BITS or m.group_size % 16
                or m["scales"].dtype not in SCALE_KINDS
                or m["biases"].dtype != m["scales"].dtype or w.dtype != mx.uint32):
            return None
        view = w.view(mx.float32)
        arrays = _own_buffer(view, w, m["scales"], m["biases"])
        if arrays is None or arrays[0].ctypes.data != arrays[1].ctypes.data:
            return None
        n, k = int(w.shape[0]), int(m["scales"].shape[1]) * m.group_size
        slot = blas.quant_register(arrays[0].ctypes.data, n, k, m.bits, m.group_size,
                                   arrays[2].ctypes.data, arrays[3].ctypes.data,
                                   SCALE_KINDS[m["scales"].dtype])
    else:
        if w.dtype not in HALF_KINDS or int(w.shape[1]) % 2:
            return None
        view = w.view(mx.float32)
        arrays = _own_buffer(view, w)
        # Not the weight's own buffer: MLX would multiply a copy.
        if arrays is None or arrays[0].ctypes.data != arrays[1].ctypes.data:
            return None
        slot = blas.half_register(arrays[0].ctypes.data, int(w.shape[0]), int(w.shape[1]),
                                  HALF_KINDS[w.dtype])
    if slot is None:
        return None
    view_t = view.T
    mx.eval(view_t)
    object.__setattr__(m, "_shim_shown", _Shown(_parts(m), tuple(arrays), view, view_t,
                                                weakref.finalize(m, blas.half_unregister,
                                                                 slot)))
    return view


def shown_view(m: nn.Module) -> mx.array | None:
    """The layer's registered view while its weight is still the one registered."""
    held: _Shown | None = m.__dict__.get("_shim_shown")
    if held is None:
        return None
    if any(a is not b for a, b in zip(held.held, _parts(m), strict=True)):
        hide(m)  # replaced (a weight update): MLX's product from now on
        return None
    return held.view


def hide(m: nn.Module) -> None:
    held = m.__dict__.pop("_shim_shown", None)
    if held is not None:
        held.release()


def product(m: nn.Module, view: mx.array, x: mx.array) -> mx.array:
    """Decode rows of a shown layer through the shim's kernel, lazily like any MLX
    product: x's rows in float32, each spread over as many rows of the view's width as
    it holds (2 for half precision, 32 / bits for a quantized weight, whose group sums
    the kernel takes itself), and the real y in the first rows of MLX's output. What it
    adds is x and y in float32 (rows x the layer's sides, y a few times over), freed with
    the step. The result is in x's dtype.

    A decode step runs this for every layer, and on MLX's CPU backend each operation in
    its graph costs a few microseconds whatever its size: the common case (every row in
    one product) is six of them, no slice, copy or transpose that changes nothing."""
    n, width = int(view.shape[0]), int(view.shape[1])
    k = int(x.shape[-1])
    rows = x.size // k
    a = x.astype(mx.float32)
    spread = k // width
    held: _Shown | None = m.__dict__.get("_shim_shown")
    view_t = held.view_t if held is not None and held.view is view else view.T
    # MLX's output is `spread` times the real one: a few rows at a time past a bound, so
    # a wide LM head over many sequences never holds more than that at once.
    step = max(1, min(blas.HALF_ROWS, PRODUCT_OUTPUT_BYTES // (spread * n * 4)))
    if rows <= step:
        y = (a.reshape(-1, width) @ view_t)[:rows]
    else:
        a = a.reshape(rows, spread * width)
        y = mx.concatenate([(mx.contiguous(a[r:r + step]).reshape(-1, width) @ view_t)
                            [:min(step, rows - r)] for r in range(0, rows, step)], axis=0)
    if "bias" in m:
        y = y + m["bias"].astype(mx.float32)
    return y.reshape(*x.shape[:-1], n).astype(x.dtype)


def product_bytes(m: nn.Module, view: mx.array, rows: int) -> int:
    """What `product` holds at most for `rows` rows, evaluated at once: x in float32 (as
    the kernel reads it), MLX's output (`spread` times the real one, every part) and y."""
    n, width, k = int(view.shape[0]), int(view.shape[1]), in_features(m)
    spread = k // width
    return rows * 4 * (k + spread * n + n)


def kernel_reference(m: nn.Module, x: mx.array) -> mx.array:
    """The same product with the kernel called directly on NumPy arrays: what
    `show_layers` checks the shown path against."""
    n = int(m["weight"].shape[0])
    x32 = x.astype(mx.float32).reshape(-1, x.shape[-1])
    if _quantized(m):
        arrays = _own_buffer(x32, m["weight"], m["scales"], m["biases"])
        kernel = blas.quant_gemv()
    else:
        arrays = _own_buffer(x32, m["weight"])
        kernel = blas.half_gemv()
    if arrays is None or kernel is None:
        raise RuntimeError("the shim's kernel is not there or the arrays are not contiguous")
    xs = arrays[0]
    k = int(x32.shape[1])
    y = np.empty((xs.shape[0], n), dtype=np.float32)
    for r0 in range(0, xs.shape[0], blas.HALF_ROWS):
        r = min(blas.HALF_ROWS, xs.shape[0] - r0)
        if _quantized(m):
            done = kernel(m.bits, m.group_size, SCALE_KINDS[m["scales"].dtype], r, k,
                          xs[r0:].ctypes.data, xs.shape[1], arrays[1].ctypes.data,
                          arrays[2].ctypes.data, arrays[3].ctypes.data, y[r0:].ctypes.data,
                          n, 0, n)
        else:
            done = kernel(HALF_KINDS[m["weight"].dtype], r, k, xs[r0:].ctypes.data, k,
                          arrays[1].ctypes.data, k, y[r0:].ctypes.data, n, 0, n)
        if done != 0:
            raise RuntimeError(f"the shim's kernel refused a {r} x {k} product")
    out = mx.array(y)
    if "bias" in m:
        out = out + m["bias"].astype(mx.float32)
    return out.reshape(*x.shape[:-1], n).astype(x.dtype)


def in_features(m: nn.Module) -> int:
    if _quantized(m):
        return int(m["scales"].shape[1]) * m.group_size
    return int(m["weight"].shape[1])


def _checks(m: nn.Module, view: mx.array) -> bool:
    """One product through the shown path ran the kernel (the shim counted it) and gave
    the direct call's result bit for bit: MLX handed the shim the registered weight."""
    dtype = m["scales"].dtype if _quantized(m) else m["weight"].dtype
    x = mx.random.normal((1, 1, in_features(m)), key=mx.random.key(7)).astype(dtype)
    before = blas.half_calls()
    got = product(m, view, x)
    mx.eval(got)
    if blas.half_calls() <= before:
        return False
    return bool(mx.array_equal(got, kernel_reference(m, x)).item())


def show_layers(layers: list[nn.Module]) -> list[nn.Module]:
    """Shows every layer it can (one product checked per distinct shape and format, and
    every layer of one whose check fails hidden again); the layers shown."""
    checked: dict[tuple, bool] = {}
    shown = []
    for m in layers:
        view = show(m)
        if view is None:
            continue
        key = (tuple(m["weight"].shape), m["weight"].dtype, in_features(m),
               getattr(m, "bits", 16), getattr(m, "group_size", 0),
               m["scales"].dtype if "scales" in m else None, "bias" in m)
        if key not in checked:
            checked[key] = _checks(m, view)
        if checked[key]:
            shown.append(m)
        else:
            hide(m)
    mx.clear_cache()
    return shown


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                     mask: mx.array | None,
                     buffers: tuple[mx.array, mx.array] | None = None) -> mx.array:
    """MLX's own half-precision attention for one query per sequence, with its two
    products in float32 through the BLAS (MLX's half-precision product costs ~1 ms a
    layer for them at any context here): the scaling in the queries' dtype, the scores
    and the output rounded to it where MLX rounds them, MLX's precise softmax. Lazy.
    Differs from the stock path only by the products' summation order.

    `buffers`: the cache's whole key and value buffers, whose first S rows along axis 2
    are `keys` and `values`. They are converted whole and then sliced: MLX converts a
    contiguous bfloat16 array to float32 in one vectorized pass, and the strided prefix
    element by element, several times slower even with the buffer's unused rows."""
    b, h, _, d = queries.shape
    kv, s_len, dtype, f32 = keys.shape[1], keys.shape[2], queries.dtype, mx.float32
    if buffers is not None:
        keys32, values32 = (a.astype(f32)[..., :s_len, :] for a in buffers)
    else:
        keys32, values32 = keys.astype(f32), values.astype(f32)
    q = (queries * mx.array(scale, dtype=dtype)).astype(f32).reshape(b, kv, h // kv, d)
    scores = (q @ keys32.swapaxes(-1, -2)).astype(dtype)  # (B, KV, rep, S)
    if mask is not None:
        # The dtype's lowest value, as MLX fills: a row with every key hidden averages.
        scores = (mx.where(mask, scores, mx.array(mx.finfo(dtype).min, dtype=dtype))
                  if mask.dtype == mx.bool_ else scores + mask)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = (weights.astype(f32) @ values32).astype(dtype)
    return out.reshape(b, h, 1, values.shape[-1])  # the values' head size (MLA: not d)
