"""One prefill chunk in process, one change on and off, alternating on the same model in
the same process (ABBA): `--compare rope-table` (default), a chunk's RoPE from a table
(engine/rope_table.py) against `mx.fast.rope`; `--compare numpy-threads`, the chunk's
NumPy softmax and SwiGLU (engine/fast_prefill.py) in parts on the decode kernels'
threads against one thread; `--compare shim-softmax`, the chunk's softmax and float32
SwiGLU through the CBLAS shim's kernels (engine/cblas_shim.c) against NumPy's passes;
`--compare head-blocks`, the NumPy softmax over several
whole heads a block where they are small against one head a block; `--compare
numpy-output`, the NumPy SwiGLU writing into an MLX buffer against into an array of its
own, copied into MLX after; `--compare idle`, a chunk after the process has been idle
(`--idle` seconds, as a request that comes after a pause) against one right after another
chunk; `--compare kept-cache`, a chunk with MLX's buffer cache kept from the chunk before
against one after emptying it (as the served engine does when its batch drains);
`--compare mlx-pool`, a chunk with MLX's buffer pool at `--mlx-pool-mb` (the server's
default) against MLX's own limit (32 MiB on Linux CPU).

    python -m tools.bench_prefill_step --models small-fp32,medium-fp32,small --tokens 255
    python -m tools.bench_prefill_step --compare numpy-threads --rounds 24
    python -m tools.bench_prefill_step --compare shim-softmax --models small-fp32,medium-fp32,small,medium
    python -m tools.bench_prefill_step --compare head-blocks --batch 8 --tokens 47
    python -m tools.bench_prefill_step --compare numpy-output --clear-cache
    OPENBLAS_THREAD_TIMEOUT=20 python -m tools.bench_prefill_step --compare idle
    python -m tools.bench_prefill_step --compare mlx-pool --clear-cache --batch 8

The model is loaded as the server loads it (the optimized BLAS first, the fast prefill
and the compiled decode ops installed); a chunk is `model(tokens, cache)` on a fresh
batch cache (`--batch` prompts' caches merged as mlx-lm's BatchGenerator merges them:
an offset array, as the server's engine has), then its cache evaluated, as mlx-lm
prefills, with large allocations from mmap as the server makes them (`--clear-cache`:
MLX's buffer cache emptied before each measured chunk, as the engine empties it when its
batch drains). Per model: the median time and page faults of each side, their ratio,
and whether the caches were equal bit for bit."""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from engine import allocator, blas


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small-fp32,medium-fp32,small",
                   help="demo sizes, SIZE-VARIANT for a variant (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=255, help="prompt tokens in the chunk")
    p.add_argument("--batch", type=int, default=1, help="prompts in the chunk")
    p.add_argument("--rounds", type=int, default=8, help="rounds per side, alternating")
    p.add_argument("--compare", default="rope-table",
                   choices=("rope-table", "numpy-threads", "shim-softmax", "head-blocks",
                            "numpy-output",
                            "idle", "kept-cache", "mlx-pool"))
    p.add_argument("--idle", type=float, default=2.0,
                   help="seconds idle before an 'on' chunk of --compare idle")
    p.add_argument("--mlx-pool-mb", type=int, default=allocator.MLX_POOL_BYTES >> 20,
                   help="MLX's buffer pool as the server sets it (default: %(default)s; "
                   "0: MLX's own)")
    p.add_argument("--clear-cache", action="store_true",
                   help="empty MLX's buffer cache before each measured chunk")
    args = p.parse_args(argv)
    print(f"BLAS: {blas.preload().description}", flush=True)
    allocator.release_large_allocations_on_free()  # as the server does
    import mlx.core as mx

    mlx_own = mx.set_cache_limit(0)
    mx.set_cache_limit(mlx_own)
    pool = allocator.raise_mlx_pool(args.mlx_pool_mb << 20) if args.mlx_pool_mb else mlx_own
    print(f"MLX buffer pool: {pool >> 20} MiB (MLX's own: {mlx_own >> 20} MiB)", flush=True)
    from mlx_lm.models.cache import make_prompt_cache

    from engine import fast_prefill, rope_table
    from engine.demo_models import ensure_demo
    from engine.loading import load_model
    from engine.model_engine import EngineSettings, install_model_paths

    if args.compare == "rope-table":
        target, name = rope_table, "rotate"

        def off(module, x, offset, stock, key):
            return stock(x, offset)
    elif args.compare == "numpy-threads":
        target, name = fast_prefill, "_in_parts"

        def off(count, run):
            return run(0, count)
    elif args.compare == "shim-softmax":
        target, name = fast_prefill, "_shim_kernels"

        def off():
            return None, None
    elif args.compare == "head-blocks":
        target, name = fast_prefill, "_heads_per_block"

        def off(n, s_len):
            return 1
    elif args.compare in ("idle", "kept-cache", "mlx-pool"):
        # idle: "on" pauses before the chunk, "off" does not; kept-cache: "on" keeps MLX's
        # buffer cache from the chunk before, "off" empties it (as the served engine
        # does when its batch drains); mlx-pool: "on" the pool above, "off" MLX's own
        target, name, off = None, "", None
    else:
        import numpy as np

        target, name = fast_prefill, "_from_numpy"

        def off(shape, dtype, write):
            out = np.empty(shape, np.uint16 if dtype == mx.uint16 else np.float32)
            write(out)
            return mx.array(out)
    on_fn = getattr(target, name, None)
    print("| model | prompts x tokens | off (ms) | on (ms) | off / on | page faults off | on "
          "| caches equal |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for model_name in args.models.split(","):
        info = load_model(str(ensure_demo(model_name)))
        model = info.model
        plan = install_model_paths(info, EngineSettings(), model_name).fast_prefill
        tokens = mx.array([[5 + (i + 7 * b) % 4000 for i in range(args.tokens)]
                           for b in range(args.batch)])

        def chunk(model=model, tokens=tokens) -> tuple[float, int, list]:
            cache = [c.merge([c] * args.batch) for c in make_prompt_cache(model)]
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            model(tokens, cache=cache)
            mx.eval([c.state for c in cache])
            took = time.perf_counter() - t0
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            return took, faults, [s for c in cache for s in c.state]

        times: dict[bool, list[float]] = {True: [], False: []}
        faults: dict[bool, list[int]] = {True: [], False: []}
        states: dict[bool, list] = {}
        try:
            for r in range(2 * args.rounds):
                on = (r % 4) in (0, 3)
                if target is not None:
                    setattr(target, name, on_fn if on else off)
                if args.compare == "mlx-pool":
                    mx.set_cache_limit(pool if on else mlx_own)
                chunk()  # warm: tables, threads, buffers
                if args.clear_cache or (args.compare == "kept-cache" and not on):
                    mx.clear_cache()
                if args.compare == "idle" and on:
                    time.sleep(args.idle)
                took, n, states[on] = chunk()
                times[on].append(took * 1e3)
                faults[on].append(n)
        finally:
            if target is not None:
                setattr(target, name, on_fn)
            mx.set_cache_limit(pool)
            fast_prefill.uninstall(plan)
        a, b = statistics.median(times[False]), statistics.median(times[True])
        equal = all(mx.array_equal(x, y).item()
                    for x, y in zip(states[True], states[False], strict=True))
        print(f"| {model_name} | {args.batch} x {args.tokens} | {a:.1f} | {b:.1f} | {a / b:.3f} | "
              f"{statistics.median(faults[False]):.0f} | {statistics.median(faults[True]):.0f} | "
              f"{'yes' if equal else 'NO'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
