"""A decode step in process, one change on and off, alternating on the same model in the
same process: `--compare compiled` (default), the compiled RoPE and RMSNorm
(engine/compiled_decode.py) against MLX's stock ops; `--compare kernel`, the shim's
decode kernels for half-precision and quantized layers (engine/shim_decode.py) against
what the model decodes with otherwise (MLX's own product; for a quantized model the
float32 quantized product where that was measured faster); `--compare skinny`, a float32
model's products of a few rows through the shim's kernel (engine/cblas_shim.c, "a float32
weight through the same kernel") against OpenBLAS, with the server's other decode paths on;
`--compare isa`, the decode kernels on AVX-512 against AVX2 (engine/blas.py
`limit_kernel_isa`), with the server's decode paths on; `--compare long-softmax`, a
decode step's attention over a long cache with the shim's softmax on evaluated scores (a
half-precision model's products through the shim's kernels too; engine/fast_prefill.py
`DECODE_SOFTMAX_MIN_KEYS`) against the attention the step takes otherwise, after a
`--context`-token prompt; `--compare cache-buffers`, a bfloat16 decode step's attention
converting the cache's whole buffers to float32 (engine/fast_prefill.py `_cache_buffers`)
against converting the keys' and values' strided prefix; `--compare one-row-share`, one
row of a half-precision weight whose rows are short on MLX's thread alone
(engine/blas.py `HALF_ONE_ROW_SHARED_MIN_ROW_BYTES`) against shared with the helper
threads like any large product.

    python -m tools.bench_decode_step --models small-fp32,medium-fp32,small --batch 1,4
    python -m tools.bench_decode_step --compare kernel --models small,medium,small-4bit --batch 1,4
    python -m tools.bench_decode_step --compare skinny --models tiny,small-fp32,medium-fp32 --batch 1,4,8
    python -m tools.bench_decode_step --compare isa --models small,medium,small-4bit --batch 1,4
    python -m tools.bench_decode_step --compare long-softmax --models small-fp32 --batch 1 --context 2000
    python -m tools.bench_decode_step --compare cache-buffers --models small,small-4bit --batch 1,2 --context 300
    python -m tools.bench_decode_step --compare one-row-share --models small,medium-bf16,medium --batch 1 --rounds 12

Per model and batch size: the median step time of each side over the rounds, their ratio,
and whether every step's logits were equal bit for bit (for the kernel: the largest
difference of the log-probabilities and whether the greedy tokens were the same). The
optimized BLAS is loaded as the server loads it (engine/blas.py)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from engine import blas


def _steps(model, prompts: list[list[int]], steps: int) -> tuple[list[float], list]:
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=steps + 1, stop_tokens=set())
    uids = gen.insert(prompts, max_tokens=[steps + 1] * len(prompts))
    times: list[float] = []
    logits: dict[int, list] = {u: [] for u in uids}
    try:
        gen.next()  # the prefill and the first token
        for _ in range(steps):
            t0 = time.perf_counter()
            _, responses = gen.next()
            mx.eval([r.logprobs for r in responses])
            times.append(time.perf_counter() - t0)
            for r in responses:
                logits[r.uid].append(r.logprobs)
    finally:
        gen.close()
    return times, [mx.stack(logits[u]) for u in uids]


def _keep(_plan: object) -> None:
    """Nothing to undo between rounds."""


def _never(*_args: object) -> bool:
    """A path's check that always declines."""
    return False


# Per comparison, the table's labels: the side off, the side on, and both for the ratio.
_SIDES = {
    "compiled": ("stock step", "compiled step", "stock", "compiled"),
    "kernel": ("stock step", "kernel step", "stock", "kernel"),
    "skinny": ("OpenBLAS step", "skinny step", "OpenBLAS", "skinny"),
    "isa": ("AVX2 step", "AVX-512 step", "AVX2", "AVX-512"),
    "long-softmax": ("MLX's softmax step", "shim's softmax step", "MLX", "shim"),
    "cache-buffers": ("prefix converted", "buffers converted", "prefix", "buffers"),
    "one-row-share": ("shared step", "one-thread step", "shared", "one thread"),
}


def _no_buffers(*_args: object) -> None:
    """No cache buffers: the keys' and values' prefix is converted."""
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small-fp32,medium-fp32,small",
                   help="demo sizes, SIZE-VARIANT for a variant (default: %(default)s)")
    p.add_argument("--batch", default="1,4", help="sequences decoded together")
    p.add_argument("--steps", type=int, default=32, help="decode steps per round")
    p.add_argument("--rounds", type=int, default=6, help="rounds per side, alternating")
    p.add_argument("--compare", choices=tuple(_SIDES), default="compiled")
    p.add_argument("--context", type=int, default=None,
                   help="prompt tokens before the measured steps (default: 64 + 7 per "
                   "sequence)")
    args = p.parse_args(argv)
    print(f"BLAS: {blas.preload().description}", flush=True)
    import mlx.core as mx

    from engine import compiled_decode, fast_prefill
    from engine.demo_models import ensure_demo
    from engine.loading import load_model

    long_min, long_half = fast_prefill.DECODE_SOFTMAX_MIN_KEYS, fast_prefill._long_half_decode_ok
    cache_buffers = fast_prefill._cache_buffers
    buffers_taken = [0]

    def counted_buffers(*args):
        found = cache_buffers(*args)
        buffers_taken[0] += found is not None
        return found

    served = ("skinny", "isa", "long-softmax", "cache-buffers", "one-row-share")
    kernel = args.compare == "kernel" or args.compare in served
    if args.compare == "isa" and blas.limit_kernel_isa("avx512") != "avx512":
        print("no AVX-512 decode kernel here (no shim, or a CPU without AVX-512)",
              file=sys.stderr)
        return 1
    off, on, short_off, short_on = _SIDES[args.compare]
    keys_column = "keys | " if args.compare in ("long-softmax", "cache-buffers") else ""
    outputs = ("max logprob difference | tokens equal" if kernel else "logits equal")
    print(f"| model | batch | {keys_column}{off} (ms) | {on} (ms) | {short_off} / {short_on} | "
          f"{outputs} |")
    print("|---|---:|" + "---:|" * (3 + bool(keys_column) + kernel) + "---|")
    for name in args.models.split(","):
        path = ensure_demo(name)
        model = load_model(str(path)).model
        # The server's decode paths.
        if args.compare in served:
            fast_prefill.install(model).bind_thread()
            compiled_decode.install(model)
        for batch in (int(b) for b in args.batch.split(",")):
            prompts = ([list(range(5 + i, 69 + 7 * i)) for i in range(batch)]
                       if args.context is None else
                       [[5 + (i + 7 * b) % 4000 for i in range(args.context)]
                        for b in range(batch)])
            buffers_taken[0] = 0
            med: dict[bool, list[float]] = {True: [], False: []}
            logits_of: dict[bool, list] = {}
            equal = True
            for r in range(2 * args.rounds):
                on = (r % 4) in (0, 3)  # ABBA
                if args.compare == "skinny":
                    if not blas.set_skinny_rows(blas.skinny_rows() if on else 0) and on:
                        print("no skinny kernel in this process (not the OpenBLAS shim, or "
                              "PLIMSOLL_BLAS_SKINNY_ROWS=0)", file=sys.stderr)
                        return 1
                    plan, undo = None, _keep
                elif args.compare == "isa":
                    blas.limit_kernel_isa("avx512" if on else "avx2")
                    plan, undo = None, _keep
                elif args.compare == "long-softmax":
                    fast_prefill.DECODE_SOFTMAX_MIN_KEYS = long_min if on else 1 << 62
                    fast_prefill._long_half_decode_ok = long_half if on else _never
                    plan, undo = None, _keep
                elif args.compare == "cache-buffers":
                    fast_prefill._cache_buffers = counted_buffers if on else _no_buffers
                    plan, undo = None, _keep
                elif args.compare == "one-row-share":
                    if not blas.share_products(blas.HALF_ONE_ROW_SHARED_MIN_ROW_BYTES
                                               if on else 0):
                        print("no helper threads in this process (one usable CPU, no "
                              "shim, or PLIMSOLL_KERNEL_THREADS=1)", file=sys.stderr)
                        return 1
                    plan, undo = None, _keep
                elif kernel:
                    plan = fast_prefill.install(model, decode_kernel=on)
                    if on and not (plan.decode_half or plan.decode_quant):
                        print(f"kernel not chosen: {plan.decode_reason}", file=sys.stderr)
                        return 1
                    undo = fast_prefill.uninstall
                else:
                    plan = compiled_decode.install(model, enabled=on)
                    if on and not plan.enabled:
                        print(f"compiled decode ops unavailable: {plan.reason}",
                              file=sys.stderr)
                        return 1
                    undo = compiled_decode.uninstall
                try:
                    times, logits = _steps(model, prompts, args.steps)
                finally:
                    undo(plan)
                med[on].append(statistics.median(times[2:]) * 1e3)
                if on not in logits_of:
                    logits_of[on] = logits
                elif not kernel:
                    equal &= all(mx.array_equal(a, b).item()
                                 for a, b in zip(logits_of[on], logits, strict=True))
            s, c = statistics.median(med[False]), statistics.median(med[True])
            if kernel:
                pairs = list(zip(logits_of[True], logits_of[False], strict=True))
                diff = max(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item()
                           for a, b in pairs)
                same = all(mx.array_equal(mx.argmax(a, axis=-1), mx.argmax(b, axis=-1)).item()
                           for a, b in pairs)
                keys = (f"{len(prompts[0]) + args.steps // 2} | "
                        if args.compare in ("long-softmax", "cache-buffers") else "")
                if args.compare == "cache-buffers" and not buffers_taken[0]:
                    keys += "(buffers never taken) "
                print(f"| {name} | {batch} | {keys}{s:.2f} | {c:.2f} | {s / c:.3f} | "
                      f"{diff:.4f} | {'yes' if same else 'no'} |", flush=True)
            else:
                equal &= all(mx.array_equal(a, b).item()
                             for a, b in zip(logits_of[True], logits_of[False], strict=True))
                print(f"| {name} | {batch} | {s:.2f} | {c:.2f} | {s / c:.3f} | "
                      f"{'yes' if equal else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
