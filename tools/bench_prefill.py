"""Prefill and decode with the fast path (engine/fast_prefill.py) against the stock path.

    python -m tools.bench_prefill                              # 4 models, 512 and 2048 tokens
    python -m tools.bench_prefill --models small-bf16 --prompts 512
    python -m tools.bench_prefill --stock-budget-s 20 --json out.json

Models are the demo models' variants made with mlx-lm's own convert
(`engine.demo_models.ensure_demo_variant`: `<size>-bf16`, `<size>-4bit`, `<size>-8bit`),
or a model folder given with `--model PATH`. Each is loaded once, in this process, and its
layers wrapped once; the two sides are the same model with the fast path switched on and
off between runs (`FastPrefill.enabled`, and its float32 decode: quantized layers, dense shapes), so
every ratio comes from one process, one load and one run.

- prefill: mlx-lm's `BatchGenerator` as the engine drives it (completion batch 32, prefill
  batch 8, step 512), one prompt, `max_tokens=1`: tok/s = prompt tokens / (insert → first
  token). The stock path of a quantized model runs at a few tokens per second, so each
  stock figure is measured on at most the prompt tokens that fit `--stock-budget-s`
  (estimated from a 64-token run): the first N tokens of the same prompt, N in the table.
  Stock cost per token grows with the prompt (attention), so a shortened stock run only
  flatters the stock path: the ratio is then a lower bound.
- peak: MLX peak memory during the prefill above the model's own, each side; the part of
  the transient admission adds for the fast path (`ConversionTransient.bytes_for`), and
  all admission projects for the prompt (KV, the stock transient and that part).
- decode: one stream, a 32-token prompt then `--decode-tokens` greedy tokens:
  tok/s = (tokens - 1) / (first token → last token); the MLX peak of the decode steps
  above the memory held at the first token; whether both sides produced the same tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

import engine  # noqa: E402, F401, I001 - loads the optimized BLAS before mlx.core

# isort: split
import mlx.core as mx  # noqa: E402
from mlx_lm.generate import BatchGenerator, StopSequences  # noqa: E402

from engine import blas, fast_prefill  # noqa: E402
from engine.demo_models import DEMO_CORPUS, DEMO_VARIANTS, ensure_demo_variant  # noqa: E402
from engine.loading import load_model  # noqa: E402
from memory.plans.admission import AdmissionRequest, prefill_transient_bytes  # noqa: E402
from tools.bench_blas import machine_line  # noqa: E402

DEFAULT_MODELS = ("small-bf16", "small-4bit", "medium-bf16", "medium-4bit")
DEFAULT_PROMPTS = (512, 2048)
STEP = 512
MiB = 1 << 20


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_path(name: str) -> Path:
    size, _, variant = name.partition("-")
    if variant not in DEMO_VARIANTS:
        raise SystemExit(f"unknown model {name!r}: <size>-<{'|'.join(DEMO_VARIANTS)}>")
    return ensure_demo_variant(size, variant)


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(DEMO_CORPUS)
    return (ids * (n // len(ids) + 1))[:n]


class Sides:
    """Switches one loaded model between its stock and fast paths."""

    def __init__(self, plan: fast_prefill.FastPrefill) -> None:
        self.plan = plan
        self.fast_decode = plan.decode_fp32
        self.decode_shapes = plan.decode_shapes

    def set(self, fast: bool) -> None:
        self.plan.enabled = fast
        self.plan.decode_fp32 = fast and self.fast_decode
        self.plan.decode_shapes = self.decode_shapes if fast else frozenset()


def run_once(model, ids: list[int], max_tokens: int
             ) -> tuple[float, float, list[int], int, int]:
    """(insert → first token s, first → last token s, tokens, MLX peak above the start
    until the first token, MLX peak above the first token's after it)."""
    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=8,
                         prefill_step_size=STEP)
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    gen.insert([ids], max_tokens=[max_tokens], stop_sequences=[StopSequences(None)])
    tokens: list[int] = []
    first = last = t0
    peak = decode_base = 0
    done = False
    while not done:
        _, responses = gen.next()
        for r in responses:
            tokens.append(r.token)
            last = time.perf_counter()
            if len(tokens) == 1:
                first = last
                peak = mx.get_peak_memory() - base
                decode_base = mx.get_active_memory()
                mx.reset_peak_memory()
            done = done or r.finish_reason is not None
    decode_peak = max(0, mx.get_peak_memory() - decode_base) if len(tokens) > 1 else 0
    gen.close()
    return first - t0, last - first, tokens, peak, decode_peak


def admission_projection(info, plan: fast_prefill.FastPrefill, n: int) -> int:
    """What admission projects a prompt of `n` tokens adds (KV + prefill transient, the
    conversion included), as Admit's request_bytes would say with max_tokens 1."""
    req = AdmissionRequest(model="m", prompt_tokens=tuple(range(n)), max_tokens=1,
                           kv_bytes_per_token=info.kv_bytes_per_token,
                           attention_heads=info.attention_heads, prefill_step_size=STEP,
                           prefill_conversion=plan.transient)
    return (n + 1) * info.kv_bytes_per_token + prefill_transient_bytes(req, n)


def bench_model(name: str, path: Path, prompts: list[int], decode_tokens: int,
                budget_s: float, decode_dense: bool = False) -> dict:
    info = load_model(str(path))
    plan = fast_prefill.install(info.model, kv_bytes_per_token=info.kv_bytes_per_token,
                                decode_dense=decode_dense)
    log(f"{name}: {plan.summary()}")
    out: dict = {"model": name, "plan": plan.summary(), "prefill": [], "decode": None}
    if not plan.enabled:
        return out
    sides = Sides(plan)
    model = info.model
    for fast in (True, False):  # warm both
        sides.set(fast)
        run_once(model, prompt_ids(info.tokenizer, 32), 2)
    stock_runs: dict[int, tuple[float, int]] = {}  # prompts share their first tokens

    def stock_run(ids: list[int]) -> tuple[float, int]:
        if len(ids) not in stock_runs:
            sides.set(False)
            ttft, _, _, peak, _ = run_once(model, ids, 1)
            stock_runs[len(ids)] = (ttft, peak)
        return stock_runs[len(ids)]

    for n in prompts:
        ids = prompt_ids(info.tokenizer, n)
        sides.set(True)
        f_ttft, _, _, f_peak, _ = run_once(model, ids, 1)
        probe = min(n, 64)
        rate = probe / stock_run(ids[:probe])[0]
        stock_n = n if n / rate <= budget_s else max(probe, int(budget_s * rate) // 64 * 64)
        s_ttft, s_peak = stock_run(ids[:stock_n])
        row = {
            "prompt_tokens": n, "stock_tokens": stock_n,
            "stock_tok_s": stock_n / s_ttft, "fast_tok_s": n / f_ttft,
            "stock_peak_mib": s_peak / MiB if stock_n == n else None,
            "fast_peak_mib": f_peak / MiB,
            "projected_transient_mib": plan.transient.bytes_for(min(n, STEP), n) / MiB,
            "admission_mib": admission_projection(info, plan, n) / MiB,
        }
        row["ratio"] = row["fast_tok_s"] / row["stock_tok_s"]
        out["prefill"].append(row)
        log(f"  prefill {n}: {row}")
    ids = prompt_ids(info.tokenizer, 32)
    dec = {}
    for fast in (True, False):
        sides.set(fast)
        _, span, tokens, _, peak = run_once(model, ids, decode_tokens + 1)
        dec["fast" if fast else "stock"] = {"tok_s": decode_tokens / span, "tokens": tokens,
                                            "peak_mib": peak / MiB}
    out["decode"] = {
        "path": plan.decode_reason,
        "stock_tok_s": dec["stock"]["tok_s"], "fast_tok_s": dec["fast"]["tok_s"],
        "ratio": dec["fast"]["tok_s"] / dec["stock"]["tok_s"],
        "stock_peak_mib": dec["stock"]["peak_mib"], "fast_peak_mib": dec["fast"]["peak_mib"],
        "same_tokens": dec["fast"]["tokens"] == dec["stock"]["tokens"],
    }
    log(f"  decode: {out['decode']}")
    fast_prefill.uninstall(plan)
    mx.clear_cache()
    return out


def fmt(results: list[dict]) -> str:
    lines = ["| model | prompt tokens | stock tok/s | stock measured on | fast tok/s | ratio "
             "| peak stock (MiB) | peak fast (MiB) | conversion projected (MiB) "
             "| admission projects (MiB) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for p in r["prefill"]:
            sp = "-" if p["stock_peak_mib"] is None else f"{p['stock_peak_mib']:.1f}"
            lines.append(
                f"| {r['model']} | {p['prompt_tokens']} | {p['stock_tok_s']:.1f} | "
                f"{p['stock_tokens']} | {p['fast_tok_s']:.1f} | {p['ratio']:.1f}x | {sp} | "
                f"{p['fast_peak_mib']:.1f} | {p['projected_transient_mib']:.1f} | "
                f"{p['admission_mib']:.1f} |")
    lines += ["", "| model | decode path | stock tok/s | fast tok/s | ratio | peak stock (MiB) "
              "| peak fast (MiB) | same greedy tokens |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in results:
        d = r["decode"]
        if d is None:
            continue
        lines.append(f"| {r['model']} | {d['path']} | {d['stock_tok_s']:.1f} | "
                     f"{d['fast_tok_s']:.1f} | {d['ratio']:.2f}x | {d['stock_peak_mib']:.1f} "
                     f"| {d['fast_peak_mib']:.1f} | {'yes' if d['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_prefill",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS),
                    help="comma-separated <size>-<variant> (default: %(default)s)")
    ap.add_argument("--model", action="append", default=[], metavar="PATH",
                    help="a model folder instead (repeatable)")
    ap.add_argument("--prompts", default=",".join(map(str, DEFAULT_PROMPTS)),
                    help="prompt lengths in tokens (default: %(default)s)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--stock-budget-s", type=float, default=30.0,
                    help="longest stock prefill run; longer prompts are measured on their "
                    "first tokens (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    ap.add_argument("--fast-decode-dense", action="store_true",
                    help="as `serve --fast-decode-dense`: dense layers may decode in float32")
    args = ap.parse_args(argv)
    if fast_prefill.environment_reason() is not None:
        log(f"the fast path cannot run here: {fast_prefill.environment_reason()}")
        return 2
    prompts = [int(p) for p in args.prompts.split(",") if p]
    targets = [(m, model_path(m)) for m in args.models.split(",") if m and not args.model]
    targets += [(Path(p).name, Path(p)) for p in args.model]
    header = (f"Fast prefill vs stock — {machine_line()}; BLAS: {blas.state().summary()}; "
              f"step {STEP}, one stream")
    print(header)
    results = [bench_model(name, path, prompts, args.decode_tokens, args.stock_budget_s,
                           args.fast_decode_dense)
               for name, path in targets]
    print()
    print(fmt(results))
    if args.json:
        args.json.write_text(json.dumps({"header": header, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
