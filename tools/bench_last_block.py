"""One change to the fast prefill (engine/fast_prefill.py) switched on and off in one
process: `--change last-block`, the model's last block left lazy in a prefill chunk
(engine/last_block.py) against computing it at once; `--change half-swiglu`, a half-precision
chunk's SwiGLU through the table of silu (`_half_swiglu`) against MLX's own kernel.

    python -m tools.bench_last_block                       # small-fp32, medium-fp32; 256, 1024
    python -m tools.bench_last_block --models small-bf16,small-4bit,medium-bf16,medium-4bit
    python -m tools.bench_last_block --models small-fp32 --prompts 512 --pairs 20
    python -m tools.bench_last_block --change half-swiglu --models small-bf16,medium-4bit

One load: the fast path is installed once and the change switched on and off between
runs, in pairs whose order alternates. One run is what mlx-lm does with a prefill chunk:
the model on the prompt, then the cache evaluated. Prints the median of each side and
what the change saves.
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


def _switch_last_block(plan, blocks, on: bool) -> None:
    if on:
        fast_prefill._mark_last_block(plan, blocks)
    else:
        fast_prefill._unmark_last_block(plan)


_OWN_HALF_SWIGLU = fast_prefill._half_swiglu


def _switch_half_swiglu(plan, blocks, on: bool) -> None:
    fast_prefill._half_swiglu = _OWN_HALF_SWIGLU if on else fast_prefill._stock_swiglu


SWITCHES = {"last-block": _switch_last_block, "half-swiglu": _switch_half_swiglu}
HEADERS = {"last-block": ("last block computed (ms)", "left lazy (ms)"),
           "half-swiglu": ("MLX's SwiGLU (ms)", "table SwiGLU (ms)")}


def measure(name: str, lengths: list[int], pairs: int, change: str) -> None:
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
            for on in ((True, False) if i % 2 else (False, True)):
                SWITCHES[change](plan, blocks, on)
                prefill_ms(model, ids)  # warm this side
                times[on].append(prefill_ms(model, ids))
        with_it, without = (statistics.median(times[m]) for m in (True, False))
        print(f"| {name} | {len(blocks)} | {n} | {without:.1f} | {with_it:.1f} | "
              f"{100 * (1 - with_it / without):.1f} % |", flush=True)
    SWITCHES[change](plan, blocks, True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="small-fp32,medium-fp32")
    ap.add_argument("--prompts", default="256,1024", help="prompt lengths, comma-separated")
    ap.add_argument("--pairs", type=int, default=12, help="runs of each side (default 12)")
    ap.add_argument("--change", choices=sorted(SWITCHES), default="last-block")
    args = ap.parse_args(argv)
    off, on = HEADERS[args.change]
    print(f"| model | blocks | prompt tokens | {off} | {on} | saved |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        measure(name, [int(n) for n in args.prompts.split(",")], args.pairs, args.change)
    return 0


if __name__ == "__main__":
    sys.exit(main())
