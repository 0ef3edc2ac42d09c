"""A model's last block left lazy in a prefill chunk (engine/fast_prefill.py
`_LastBlock`), against the same fast path computing it at once.

    python -m tools.bench_last_block                       # small-fp32, medium-fp32; 256, 1024
    python -m tools.bench_last_block --models small-bf16,small-4bit,medium-bf16,medium-4bit
    python -m tools.bench_last_block --models small-fp32 --prompts 512 --pairs 20

One process, one load: the fast path is installed once and the last block's marking
switched on and off between runs, in pairs whose order alternates. One run is what
mlx-lm does with a prefill chunk: the model on the prompt, then the cache evaluated.
Prints the median of each side and what the marking saves.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

from engine import fast_prefill  # noqa: E402
from tools.bench_prefill import model_path, prompt_ids  # noqa: E402


def prefill_ms(model, ids) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    began = time.perf_counter()
    model(ids, cache=cache)
    mx.eval([c.state for c in cache])
    return (time.perf_counter() - began) * 1e3


def measure(name: str, lengths: list[int], pairs: int) -> None:
    import mlx.core as mx
    from mlx_lm import load

    model, tokenizer = load(str(model_path(name)))
    plan = fast_prefill.install(model)
    if plan.last_block is None:
        print(f"{name}: not on the fast path ({plan.summary()})")
        return
    blocks = list(model.layers)
    for n in lengths:
        ids = mx.array([prompt_ids(tokenizer, n)])
        times: dict[bool, list[float]] = {True: [], False: []}
        for i in range(pairs):
            for marked in ((True, False) if i % 2 else (False, True)):
                if marked:
                    fast_prefill._mark_last_block(plan, blocks)
                else:
                    fast_prefill._unmark_last_block(plan)
                prefill_ms(model, ids)  # warm this side
                times[marked].append(prefill_ms(model, ids))
        lazy, eager = (statistics.median(times[m]) for m in (True, False))
        print(f"| {name} | {len(blocks)} | {n} | {eager:.1f} | {lazy:.1f} | "
              f"{100 * (1 - lazy / eager):.1f} % |", flush=True)
    fast_prefill._mark_last_block(plan, blocks)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small-fp32,medium-fp32")
    ap.add_argument("--prompts", default="256,1024", help="prompt lengths, comma-separated")
    ap.add_argument("--pairs", type=int, default=12, help="runs of each side (default 12)")
    args = ap.parse_args(argv)
    print("| model | blocks | prompt tokens | last block computed (ms) | left lazy (ms) | saved |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        measure(name, [int(n) for n in args.prompts.split(",")], args.pairs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
