"""The CBLAS shim's decode kernels (engine/shim_decode.py) against MLX's own products, one
layer at a time, in process (Linux CPU with the optimized BLAS).

    python -m tools.bench_decode_kernels                       # ~1-2 min on 2 cores
    python -m tools.bench_decode_kernels --formats 4bit --rows 1,8

Per weight shape (4096x4096 and the small and medium demo models' projections), format
(bfloat16, float16, affine 4- and 8-bit with group size 64 and bfloat16 scales) and rows
of x (decode sequences): the best time of `x @ w.T` as the model's layer runs it, through
MLX's own product (for a quantized weight with bfloat16 activations, as mlx-lm runs it,
and with float32 ones, what Plimsoll's decode used before the kernel) and through the
kernel inside MLX's graph, and the kernel's rate in GB/s of weights as stored. Each
weight is one of enough copies (at least 256 MB together) that it comes from memory,
not the CPU's caches, as a model's layers do in a decode step."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

from engine import blas  # noqa: E402

FORMATS = ("bf16", "fp16", "4bit", "8bit")


def shapes() -> list[tuple[str, int, int]]:
    from engine.demo_models import DEMO_SIZES

    out = [("4096x4096", 4096, 4096)]
    for size in ("small", "medium"):
        s = DEMO_SIZES[size]
        out += [(f"{size} up {s.intermediate_size}x{s.hidden_size}", s.intermediate_size,
                 s.hidden_size),
                (f"{size} down {s.hidden_size}x{s.intermediate_size}", s.hidden_size,
                 s.intermediate_size),
                (f"{size} lm_head {s.vocab_size}x{s.hidden_size}", s.vocab_size,
                 s.hidden_size)]
    return out


def _layers(fmt: str, n: int, k: int, total_bytes: float):
    import mlx.core as mx
    import mlx.nn as nn

    per = n * k * {"bf16": 2, "fp16": 2, "4bit": 0.5, "8bit": 1}[fmt]
    layers = []
    for i in range(max(3, int(total_bytes // per) + 1)):
        dense = nn.Linear(k, n, bias=False)
        dense.weight = mx.random.normal((n, k), key=mx.random.key(i)) * 0.02
        dense.set_dtype(mx.float16 if fmt == "fp16" else mx.bfloat16)
        layer = (nn.QuantizedLinear.from_linear(dense, group_size=64, bits=int(fmt[0]))
                 if fmt.endswith("bit") else dense)
        mx.eval(layer.parameters())
        layers.append(layer)
    return layers, per


def _best_ms(fn, seconds: float) -> float:
    import mlx.core as mx

    mx.eval(fn())
    best, end = float("inf"), time.perf_counter() + seconds
    while True:
        t = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t)
        if time.perf_counter() > end:
            return best * 1e3


def _times(layers, views, x, seconds: float) -> tuple[float, float | None, float]:
    """ms per layer: MLX's product as the layer runs it, MLX's quantized product on
    float32 activations (None for a dense weight), the kernel."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine import shim_decode

    quantized = isinstance(layers[0], nn.QuantizedLinear)
    call = nn.QuantizedLinear.__call__ if quantized else nn.Linear.__call__
    stock = _best_ms(lambda: [call(m, x) for m in layers], seconds)
    f32 = None
    if quantized:
        x32 = x.astype(mx.float32)
        f32 = _best_ms(lambda: [mx.quantized_matmul(
            x32, m["weight"], m["scales"].astype(mx.float32), m["biases"].astype(mx.float32),
            transpose=True, group_size=m.group_size, bits=m.bits) for m in layers], seconds)
    kernel = _best_ms(lambda: [shim_decode.product(m, v, x)
                               for m, v in zip(layers, views, strict=True)], seconds)
    n = len(layers)
    return stock / n, None if f32 is None else f32 / n, kernel / n


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--formats", default=",".join(FORMATS), help="%(default)s")
    p.add_argument("--rows", default="1,4", help="rows of x, decode sequences (%(default)s)")
    p.add_argument("--seconds", type=float, default=1.0, help="per timing (%(default)s)")
    p.add_argument("--copies-mb", type=float, default=256.0,
                   help="weights of one shape and format, all copies (%(default)s)")
    args = p.parse_args(argv)
    state = blas.preload()
    import mlx.core as mx

    from engine import shim_decode

    if blas.half_gemv() is None:
        print(f"no decode kernels with this BLAS: {state.description}", file=sys.stderr)
        return 1
    print(f"BLAS: {state.description}; kernels: {blas.half_kernel_isa()}; "
          f"mlx {mx.__version__}")
    print("| weight | format | rows | MLX (ms) | MLX, float32 activations (ms) | kernel (ms) "
          "| best MLX / kernel | kernel GB/s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, n, k in shapes():
        for fmt in args.formats.split(","):
            layers, per = _layers(fmt, n, k, args.copies_mb * 1e6)
            for layer in layers:
                if shim_decode.show(layer) is None:
                    print(f"{label} {fmt}: the shim did not take the weight", file=sys.stderr)
                    return 1
            views = [shim_decode.shown_view(m) for m in layers]
            for rows in (int(r) for r in args.rows.split(",")):
                x = mx.random.normal((rows, 1, k), key=mx.random.key(rows)).astype(
                    mx.bfloat16 if fmt != "fp16" else mx.float16)
                stock, f32, kernel = _times(layers, views, x, args.seconds)
                best = min(stock, f32 or stock)
                print(f"| {label} | {fmt} | {rows} | {stock:.3f} | "
                      f"{'-' if f32 is None else f'{f32:.3f}'} | {kernel:.3f} | "
                      f"{best / kernel:.2f}x | {per / kernel / 1e6:.1f} |", flush=True)
            for layer in layers:
                shim_decode.hide(layer)
            mx.clear_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
