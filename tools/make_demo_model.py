"""Make a deterministic demo model (random weights, real BPE tokenizer) in mlx-lm's format.

    python -m tools.make_demo_model                      # the tiny default model
    python -m tools.make_demo_model --size medium        # ~300 MB, for memory tests
    python -m tools.make_demo_model --size small --check # also load it and measure it
    python -m tools.make_demo_model --list               # the sizes and what is made

The model is made once per cache folder: a second run returns at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from engine.demo_models import (
    CACHE_ENV,
    DEMO_SIZES,
    demo_model_bytes,
    demo_model_path,
    dir_size,
    ensure_demo_model,
    is_complete,
    kv_bytes_per_token,
)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tools.make_demo_model",
        description=(
            "Make (once, deterministically) a Llama-architecture demo model with random "
            "weights and a byte-level BPE tokenizer, in mlx-lm's format, and print where it "
            "is and its size on disk."
        ),
    )
    parser.add_argument(
        "--size",
        choices=list(DEMO_SIZES),
        default="tiny",
        help="which demo model to make (default: tiny, the model `plimsoll serve` serves "
        "without --model); see --list for their shapes and sizes",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help=f"cache root; the model goes to DIR/demo-models/<size>-v<N> "
        f"(default: ${CACHE_ENV}, else ~/.cache/plimsoll)",
    )
    parser.add_argument(
        "--list",
        action="store_true",
        help="list the sizes (shape, parameters, estimated bytes, KV bytes per token) and "
        "whether each is already made in the cache, then exit without making anything",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="after making, load the model with mlx_lm.load and report MLX active memory "
        "after load and greedy decode speed (slow for the big sizes on a CPU)",
    )
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=32,
        metavar="N",
        help="tokens to decode greedily for --check, EOS ignored (default: 32)",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="print only the model's path (for scripts: MODEL=$(python -m ... --quiet))",
    )
    return parser.parse_args(argv)


def list_sizes(cache_dir: Path | None) -> None:
    print(f"{'size':<7} {'dtype':<9} {'layers':>6} {'hidden':>6} {'heads/kv':>8} "
          f"{'vocab':>6} {'params':>14} {'weights':>10} {'KV/token':>9}  made")
    for name, spec in DEMO_SIZES.items():
        made = "yes" if is_complete(demo_model_path(name, cache_dir)) else "no"
        print(
            f"{name:<7} {spec.dtype:<9} {spec.num_hidden_layers:>6} {spec.hidden_size:>6} "
            f"{spec.num_attention_heads:>4}/{spec.num_key_value_heads:<3} "
            f"{spec.vocab_size:>6} {spec.param_count():>14,} "
            f"{human(demo_model_bytes(name)):>10} {human(kv_bytes_per_token(spec.config())):>9}"
            f"  {made}"
        )
    print(f"cache: {demo_model_path('tiny', cache_dir).parent}")


def check(path: Path, tokens: int) -> None:
    """Load with mlx-lm as the server does, then time prefill and a greedy decode."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    before = mx.get_active_memory()
    start = time.perf_counter()
    model, tokenizer = mlx_lm.load(str(path))
    load_s = time.perf_counter() - start
    print(f"loaded in {load_s:.2f} s; MLX active memory after load: "
          f"{mx.get_active_memory() - before:,} bytes "
          f"({human(mx.get_active_memory() - before)})")

    prompt = mx.array(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about the Plimsoll line."}],
        add_generation_prompt=True,
    ))
    # generate_step never stops at EOS, so every run decodes the same number of tokens.
    steps = generate_step(prompt, model, max_tokens=tokens)
    start = time.perf_counter()
    first, _ = next(steps)
    first_s = time.perf_counter() - start
    out = [int(first)]
    start = time.perf_counter()
    out += [int(tok) for tok, _ in steps]
    decode_s = time.perf_counter() - start
    rate = (len(out) - 1) / decode_s if decode_s > 0 else float("inf")
    print(f"prompt {prompt.size} tokens, first token in {first_s * 1000:.0f} ms; "
          f"decode {len(out) - 1} tokens at {rate:.1f} tokens/s; "
          f"peak MLX memory {human(mx.get_peak_memory())}")
    print(f"text: {tokenizer.decode(out)!r}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.list:
        list_sizes(args.cache_dir)
        return 0
    path = demo_model_path(args.size, args.cache_dir)
    already = is_complete(path)
    start = time.perf_counter()
    path = ensure_demo_model(args.size, args.cache_dir)
    elapsed = time.perf_counter() - start
    if args.quiet:
        print(path)
    else:
        how = "already made" if already else f"made (or waited for) in {elapsed:.1f} s"
        size = dir_size(path)
        print(f"{args.size}: {path} ({how})")
        print(f"size on disk: {size:,} bytes ({human(size)}); "
              f"estimated weights {human(demo_model_bytes(args.size))}")
    if args.check:
        check(path, args.check_tokens)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
