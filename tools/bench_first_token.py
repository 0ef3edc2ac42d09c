"""From prompts to their first tokens in process: mlx-lm's `BatchGenerator` (the prompt's
last token run as a decode step of its own) against engine/final_chunk.py's
`FinalChunkGenerator` (the last token prefilled with the final chunk), alternating on the
same model in the same process (ABBA).

    python -m tools.bench_first_token
    python -m tools.bench_first_token --models small-bf16,small-4bit,medium-bf16 --tokens 255
    python -m tools.bench_first_token --models small-fp32 --batch 8 --tokens 128
    python -m tools.bench_first_token --models tiny,small-fp32 --batch 8 --tokens 62 --shortest 32
    python -m tools.bench_first_token --models small-fp32 --batch 8 --tokens 512 --shortest 64 --step 256

The model is loaded as the server loads it (the optimized BLAS first, its last block
marked, the fast prefill and the compiled decode ops installed) and prefilled in one chunk
(`--step`: in chunks of that many tokens), as the engine does when memory allows. A round
inserts `--batch` prompts (of `--tokens` tokens, or `--shortest` to `--tokens`) and steps
the generator until every sequence's first token is sampled and read, as the engine reads
it early (engine/model_engine.py `_publish_first_tokens`). Per model: the median time of
each side, their ratio and whether the first tokens were equal."""

from __future__ import annotations

import argparse
import statistics
import time

from engine import allocator, blas


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small-fp32,medium-fp32,small",
                   help="demo sizes, SIZE-VARIANT for a variant (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=256, help="tokens of the longest prompt")
    p.add_argument("--shortest", type=int, default=None,
                   help="tokens of the shortest prompt, the others spread evenly between "
                   "(default: all of --tokens)")
    p.add_argument("--batch", type=int, default=1, help="prompts inserted together")
    p.add_argument("--step", type=int, default=None,
                   help="prefill step size (default: the longest prompt in one chunk)")
    p.add_argument("--rounds", type=int, default=8, help="rounds per side, alternating")
    args = p.parse_args(argv)
    print(f"BLAS: {blas.preload().description}", flush=True)
    allocator.release_large_allocations_on_free()  # as the server does
    allocator.raise_mlx_pool(allocator.MLX_POOL_BYTES)
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    from engine.demo_models import ensure_demo
    from engine.final_chunk import FinalChunkGenerator
    from engine.loading import load_model
    from engine.model_engine import EngineSettings, install_model_paths

    print("| model | prompts x tokens | last token apart (ms) | with the chunk (ms) | "
          "apart / with | first tokens equal |")
    print("|---|---:|---:|---:|---:|---|")
    for model_name in args.models.split(","):
        info = load_model(str(ensure_demo(model_name)))
        model = info.model
        if not install_model_paths(info, EngineSettings(), model_name).prefill_last_token:
            print(f"| {model_name} | the last token keeps mlx-lm's path here |")
            continue
        shortest = args.tokens if args.shortest is None else args.shortest
        lengths = [args.tokens - (args.tokens - shortest) * b // max(1, args.batch - 1)
                   for b in range(args.batch)]
        prompts = [[5 + (i + 7 * b) % 4000 for i in range(n)] for b, n in enumerate(lengths)]

        def first_tokens(make: type, model=model, prompts=prompts) -> tuple[float, list[int]]:
            gen = make(model, completion_batch_size=max(8, args.batch),
                       prefill_batch_size=max(8, args.batch),
                       prefill_step_size=args.step or args.tokens + 1)
            mx.clear_cache()
            t0 = time.perf_counter()
            gen.insert(prompts, max_tokens=[2] * len(prompts))
            while len(gen._generation_batch) < len(prompts):
                gen.next()
            tokens = gen._generation_batch._next_tokens.tolist()
            took = time.perf_counter() - t0
            gen.close()
            return took, tokens

        sides = {False: BatchGenerator, True: FinalChunkGenerator}
        times: dict[bool, list[float]] = {True: [], False: []}
        tokens: dict[bool, list[int]] = {}
        for r in range(2 * args.rounds):
            merged = (r % 4) in (0, 3)
            first_tokens(sides[merged])  # warm this side
            took, tokens[merged] = first_tokens(sides[merged])
            times[merged].append(took)
        apart, merged_ms = (statistics.median(times[k]) * 1e3 for k in (False, True))
        shape = (f"{args.batch} x {args.tokens}" if shortest == args.tokens
                 else f"{args.batch} x {shortest}-{args.tokens}")
        print(f"| {model_name} | {shape} | {apart:.2f} | {merged_ms:.2f} "
              f"| {apart / merged_ms:.3f} | {'yes' if tokens[True] == tokens[False] else 'no'} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
