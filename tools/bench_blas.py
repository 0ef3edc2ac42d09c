"""The optimized BLAS against MLX's bundled reference BLAS, on Linux CPU (`mlx[cpu]`).

    python -m tools.bench_blas                      # kernels, then end to end (~5 min, 2 cores)
    python -m tools.bench_blas --part kernels       # matmul / matvec only (~1 min)
    python -m tools.bench_blas --part e2e --models small-float32,medium-float32
    python -m tools.bench_blas --json out.json      # raw figures too

The BLAS is chosen once per process, before `mlx.core` loads (engine/blas.py), so every
figure for one side comes from its own subprocess: `PLIMSOLL_BLAS=reference` for the
reference side, the default (`auto`: the `[blas]` extra) for the optimized one.

* kernels: `x @ w.T` as the model's linear layers run it, with `w` of shape (out, in):
  4096x4096 and each demo model's projections, for m = 1 (decode, one stream),
  8 (decode, 8 streams) and 64 (a prefill chunk), in float32, bfloat16 and float16;
  the median of repeated, evaluated calls after a warm-up. float16 and bfloat16 go to
  MLX's own kernels, not to the BLAS: they show the BLAS threads cost them nothing.
* end to end: Plimsoll itself (`python -m service.cli serve --model PATH` as a subprocess,
  gRPC `Generate`, temperature 0, ignore_eos): prefill tok/s = prompt tokens / time to
  first token (max_tokens 1), decode tok/s = (tokens - 1) / (last token - first token),
  summed over the streams, for 1 and 8 concurrent streams. Models: the demo models in
  their own dtypes and float32 copies of them (`<size>-float32`, made once under
  $PLIMSOLL_CACHE_DIR/bench-models: the same weights, cast).
* same results: `--worker greedy` runs greedy decoding in process and saves the tokens
  and every step's logits; the report compares both sides (tests/integration/test_blas.py
  uses the same worker).

Ratios are optimized / reference, both measured in the same run on the same machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

from engine.demo_models import DEMO_SIZES, ensure_demo_model  # noqa: E402

SIDES = ("reference", "optimized")
SIDE_ENV = {"reference": "reference", "optimized": "auto"}
KERNEL_ROWS = (1, 8, 64)
KERNEL_DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_MODELS = ("tiny", "small", "small-float32", "medium-float32")
# Compared token for token; the logits within LOGITS_ATOL (see docs/benchmarks.md).
GREEDY_PROMPTS = (
    "Once upon a time, in a small village by the sea,",
    "The Plimsoll line is the mark on a ship's hull",
    "def fibonacci(n: int) -> int:",
)
LOGITS_ATOL = 1e-4


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- models ------------------------------------------------------------------------------
def model_path(name: str) -> Path:
    """A demo model ("small"), or a copy of one cast to another dtype ("small-float32")."""
    size, _, dtype = name.partition("-")
    if size not in DEMO_SIZES:
        raise SystemExit(f"unknown model {name!r}: a demo size, optionally -float32 "
                         "or -bfloat16")
    src = ensure_demo_model(size)
    if not dtype or dtype == DEMO_SIZES[size].dtype:
        return src
    if dtype not in ("float32", "bfloat16"):
        raise SystemExit(f"unknown model {name!r}: only -float32 and -bfloat16 copies")
    return cast_copy(src, dtype)


def cast_copy(src: Path, dtype: str) -> Path:
    """The demo model at `src` with every weight cast to `dtype`, made once (atomically)
    under <cache>/bench-models beside <cache>/demo-models."""
    dest = src.parent.parent / "bench-models" / f"{src.name}-{dtype}"
    if (dest / "config.json").is_file():
        return dest
    import mlx.core as mx

    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "config.json":
                shutil.copy2(f, tmp / f.name)
        weights = mx.load(str(src / "model.safetensors"))
        weights = {k: v.astype(getattr(mx, dtype)) for k, v in weights.items()}
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        config = json.loads((src / "config.json").read_text())
        config["torch_dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=2))  # last: the marker
        tmp.chmod(0o755)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process made it first
            if not (dest / "config.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def kernel_shapes() -> list[tuple[str, int, int]]:
    """(label, out, in) of the weights benchmarked: 4096x4096 and the demo models' own."""
    shapes = [("4096x4096", 4096, 4096)]
    for size in ("tiny", "small", "medium"):
        s = DEMO_SIZES[size]
        shapes += [
            (f"{size} q/o {s.hidden_size}x{s.hidden_size}", s.hidden_size, s.hidden_size),
            (f"{size} up {s.intermediate_size}x{s.hidden_size}", s.intermediate_size,
             s.hidden_size),
            (f"{size} lm_head {s.vocab_size}x{s.hidden_size}", s.vocab_size, s.hidden_size),
        ]
    return shapes


# -- workers (one BLAS per process) ------------------------------------------------------
def kernel_rows(dtypes=KERNEL_DTYPES) -> list[dict]:
    return [{"shape": label, "out": n_out, "in": n_in, "m": m, "dtype": dtype}
            for label, n_out, n_in in kernel_shapes() for dtype in dtypes
            for m in KERNEL_ROWS]


def worker_kernels(args) -> None:
    """Serves timing requests in lockstep with the other side's worker: reads "ROW SECONDS"
    lines, answers each with the median milliseconds of one `x @ w.T` for that row."""
    from engine import blas

    state = blas.state()
    import mlx.core as mx

    rows = kernel_rows(args.dtypes.split(","))
    print(json.dumps({"blas": asdict(state) | {"path": None}, "rows": len(rows)}), flush=True)
    arrays: dict[tuple, object] = {}
    for line in sys.stdin:
        i, budget = line.split()
        r = rows[int(i)]
        dt = getattr(mx, r["dtype"])
        key = (r["out"], r["in"], r["dtype"])
        if key not in arrays:
            arrays.clear()  # rows come grouped by weight: keep one at a time
            w = (mx.random.normal((r["out"], r["in"]), key=mx.random.key(1)) * 0.02).astype(dt)
            mx.eval(w)
            arrays[key] = w
        w = arrays[key]
        x = mx.random.normal((r["m"], r["in"]), key=mx.random.key(2)).astype(dt)
        mx.eval(x)
        print(json.dumps({"ms": _time_call(mx, w, x, float(budget))}), flush=True)


def _time_call(mx, w, x, budget_s: float) -> float:
    for _ in range(2):
        mx.eval(x @ w.T)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 200):
        t = time.perf_counter()
        mx.eval(x @ w.T)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


class KernelWorker:
    """A `--worker kernels` subprocess with one side's BLAS."""

    def __init__(self, env: dict[str, str], dtypes: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.bench_blas", "--worker", "kernels",
             "--dtypes", dtypes],
            cwd=ROOT, env={**os.environ, **env}, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.hello = json.loads(self.proc.stdout.readline())

    def time(self, row: int, budget_s: float) -> float:
        self.proc.stdin.write(f"{row} {budget_s}\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["ms"]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


def bench_kernels(sides: dict[str, dict[str, str]], dtypes: str, budget_s: float) -> dict:
    """Every row timed on every side in lockstep, twice in mirrored order (A B ... B A),
    so that a neighbour's burst or a slow drift hits both sides alike; medians of the two."""
    workers = {name: KernelWorker(env, dtypes) for name, env in sides.items()}
    try:
        rows = kernel_rows(dtypes.split(","))
        out = {name: {"blas": w.hello["blas"], "results": []} for name, w in workers.items()}
        names = list(workers)
        for i, row in enumerate(rows):
            got: dict[str, list[float]] = {n: [] for n in names}
            for order in (names, names[::-1]):
                for n in order:
                    got[n].append(workers[n].time(i, budget_s / 2))
            for n in names:
                out[n]["results"].append(row | {"ms": statistics.median(got[n])})
            log(f"  {row['shape']:28s} m={row['m']:<3d} {row['dtype']:9s} "
                + " ".join(f"{n}={statistics.median(got[n]):9.3f}" for n in names))
        return out
    finally:
        for w in workers.values():
            w.close()


def worker_greedy(args) -> dict:
    """Greedy decoding of GREEDY_PROMPTS on each model; tokens in the answer, every step's
    logits (float32) saved to args.out/<model>.npy."""
    from engine import blas

    state = blas.state()
    import mlx.core as mx
    import mlx_lm
    import numpy as np

    out = Path(args.out)
    models = {}
    for name in args.models.split(","):
        model, tokenizer = mlx_lm.load(str(model_path(name)))
        tokens, logits = [], []
        for prompt in GREEDY_PROMPTS:
            ids = tokenizer.encode(prompt)
            seq, steps = _greedy(mx, model, ids, args.max_tokens)
            tokens.append(seq)
            logits.append(steps)
        np.save(out / f"{name}.npy", np.stack(logits))
        models[name] = tokens
    return {"blas": asdict(state) | {"path": None}, "models": models}


def _greedy(mx, model, ids: list[int], n: int):
    import numpy as np
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    x = mx.array([ids])
    seq, steps = [], []
    for _ in range(n):
        logits = model(x, cache=cache)[0, -1].astype(mx.float32)
        tok = mx.argmax(logits)
        mx.eval(tok, logits)
        steps.append(np.array(logits))
        seq.append(int(tok.item()))
        x = tok.reshape(1, 1)
    return seq, np.stack(steps)


def run_worker(kind: str, side: str, *extra: str, timeout: float = 600) -> dict:
    """One worker subprocess with the BLAS of `side`; its JSON answer."""
    env = {**os.environ, "PLIMSOLL_BLAS": SIDE_ENV[side]}
    cmd = [sys.executable, "-m", "tools.bench_blas", "--worker", kind, *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} worker ({side}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout)


def compare_greedy(models: list[str], max_tokens: int) -> dict:
    """Both sides' greedy runs: tokens equal?, max |logits difference| per model."""
    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        answers = {}
        for side in SIDES:
            d = Path(tmp) / side
            d.mkdir()
            answers[side] = run_worker("greedy", side, "--models", ",".join(models),
                                       "--max-tokens", str(max_tokens), "--out", str(d))
        out = {"blas": {s: answers[s]["blas"] for s in SIDES}, "models": {}}
        for name in models:
            ref, opt = (np.load(Path(tmp) / s / f"{name}.npy") for s in SIDES)
            same = answers["reference"]["models"][name] == answers["optimized"]["models"][name]
            diff = np.abs(ref - opt)
            out["models"][name] = {
                "tokens_identical": same,
                "tokens": sum(len(t) for t in answers["reference"]["models"][name]),
                "max_abs_diff": float(diff.max()),
                "max_abs_logit": float(np.abs(ref).max()),
            }
        return out


# -- end to end: Plimsoll over gRPC --------------------------------------------------------
@dataclass
class E2E:
    model: str
    side: str
    streams: int
    prefill_tok_s: float
    decode_tok_s: float
    ttft_ms: float
    foreign_cores: float  # CPU other processes used meanwhile (the machine is shared)


async def _generate(stub, pb, ids: list[int], max_tokens: int):
    req = pb.GenerateRequest(max_tokens=max_tokens, ignore_eos=True,
                             sampling=pb.SamplingParams(temperature=0.0))
    req.token_ids.ids.extend(ids)
    sent = time.perf_counter()
    stamps: list[tuple[float, int]] = []
    async for msg in stub.Generate(req, timeout=900):
        if msg.WhichOneof("event") == "chunk" and msg.chunk.token_ids:
            stamps.append((time.perf_counter(), len(msg.chunk.token_ids)))
    n = sum(k for _, k in stamps)
    if n != max_tokens:
        raise RuntimeError(f"{n} tokens streamed, {max_tokens} asked for")
    return sent, stamps


async def _measure(stub, pb, machine, model: str, side: str, batch, args) -> E2E:
    a = machine.sample()
    # Prefill: max_tokens 1, so the first token ends the request.
    pre = await asyncio.gather(*(_generate(stub, pb, p.ids, 1) for p in batch))
    t0 = min(s for s, _ in pre)
    t1 = max(st[-1][0] for _, st in pre)
    prefill = sum(len(p.ids) for p in batch) / (t1 - t0)
    dec = await asyncio.gather(*(_generate(stub, pb, p.ids, args.decode_tokens)
                                 for p in batch))
    # Decode: the tokens after each stream's first, over its own first → last token.
    decode = sum((args.decode_tokens - st[0][1]) / (st[-1][0] - st[0][0]) for _, st in dec)
    ttft = statistics.median(st[0][0] - s for s, st in dec) * 1e3
    foreign = machine.foreign_cores(a, machine.sample())
    row = E2E(model, side, len(batch), prefill, decode, ttft, foreign)
    log(f"  {model:16s} {side:9s} {len(batch)} stream(s): prefill {prefill:8.1f} tok/s, "
        f"decode {decode:7.1f} tok/s (others used {foreign:.2f} cores)")
    return row


async def e2e_model(model: str, args) -> tuple[list[E2E], dict]:
    """Both sides' servers up at once on the same model; each measurement runs on one
    while the other is stopped (SIGSTOP), alternating sides, so drift hits both alike."""
    import grpc
    import mlx_lm.tokenizer_utils

    from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
    from tools.harness.generate import make_prompts
    from tools.harness.report import Machine
    from tools.harness.server import serving

    path = model_path(model)
    tokenizer = mlx_lm.tokenizer_utils.load(path)
    prompts = make_prompts(tokenizer, max(args.streams), args.prompt_tokens,
                           args.prompt_tokens, seed=7)
    warm = make_prompts(tokenizer, 1, 16, 16, seed=8)[0]
    rows: list[E2E] = []
    infos: dict[str, dict] = {}
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        servers = {side: stack.enter_context(serving(
            logs, "--model", str(path), "--no-session-bank",
            env={"PLIMSOLL_BLAS": SIDE_ENV[side]})) for side in SIDES}
        for side, srv in servers.items():
            ch = stack.enter_context(grpc.insecure_channel(srv.address))
            status = control_pb2_grpc.ControlServiceStub(ch).GetMemoryStatus(
                control_pb2.GetMemoryStatusRequest(), timeout=30)
            infos[side] = {f.name: v for f, v in status.blas.ListFields()}
            srv.freeze()
        for i, streams in enumerate(args.streams):
            for side in SIDES if i % 2 == 0 else SIDES[::-1]:
                srv = servers[side]
                srv.thaw()
                try:
                    async with grpc.aio.insecure_channel(srv.address) as ch:
                        stub = inference_pb2_grpc.InferenceServiceStub(ch)
                        await _generate(stub, inference_pb2, warm.ids, 4)  # warm-up
                        rows.append(await _measure(stub, inference_pb2,
                                                   Machine(srv.proc.pid), model, side,
                                                   prompts[:streams], args))
                finally:
                    srv.freeze()
    return rows, infos


# -- report --------------------------------------------------------------------------------
def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for dist in ("mlx", "mlx-cpu", "mlx-lm", "scipy-openblas32", "mkl", "intel-openmp"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "-"
    return out


def machine_line() -> str:
    from engine.blas import usable_cpus

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    v = versions()
    return (f"{cpu}, {usable_cpus()} usable CPUs, {platform.system()} {platform.machine()}, "
            f"Python {v['python']}, mlx {v['mlx']} (mlx-cpu {v['mlx-cpu']}), "
            f"mlx-lm {v['mlx-lm']}, scipy-openblas32 {v['scipy-openblas32']}, mkl {v['mkl']}, "
            f"intel-openmp {v['intel-openmp']}")


def fmt_kernels(kern: dict) -> str:
    """One row per kernel: each side's milliseconds, and reference / side ratios."""
    names = list(kern)
    others = names[1:]
    head = ("| weight (out x in) | m | dtype | " + " | ".join(f"{n} (ms)" for n in names)
            + " | " + " | ".join(f"speed-up {n}" for n in others) + " |")
    lines = [head, "|---|---:|---|" + "---:|" * (len(names) + len(others))]
    for i, a in enumerate(kern[names[0]]["results"]):
        ms = [kern[n]["results"][i]["ms"] for n in names]
        lines.append(f"| {a['shape']} | {a['m']} | {a['dtype']} | "
                     + " | ".join(f"{v:.3f}" for v in ms) + " | "
                     + " | ".join(f"{ms[0] / v:.2f}x" for v in ms[1:]) + " |")
    return "\n".join(lines)


def fmt_e2e(rows: list[E2E]) -> str:
    lines = ["| model | streams | prefill tok/s ref | prefill tok/s opt | prefill ratio | "
             "decode tok/s ref | decode tok/s opt | decode ratio | TTFT ms ref | TTFT ms opt | "
             "others' cores, max |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r.model, r.side, r.streams): r for r in rows}
    for (model, side, streams), ref in by.items():
        if side != "reference" or (model, "optimized", streams) not in by:
            continue
        opt = by[(model, "optimized", streams)]
        lines.append(
            f"| {model} | {streams} | {ref.prefill_tok_s:.1f} | {opt.prefill_tok_s:.1f} | "
            f"{opt.prefill_tok_s / ref.prefill_tok_s:.2f}x | {ref.decode_tok_s:.1f} | "
            f"{opt.decode_tok_s:.1f} | {opt.decode_tok_s / ref.decode_tok_s:.2f}x | "
            f"{ref.ttft_ms:.0f} | {opt.ttft_ms:.0f} | "
            f"{max(ref.foreign_cores, opt.foreign_cores):.2f} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("all", "kernels", "e2e", "same"), default="all")
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help="end-to-end models: demo sizes, or SIZE-float32 (default: %(default)s)")
    p.add_argument("--streams", default="1,8",
                   type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--seconds", type=float, default=0.25,
                   help="time budget per kernel row and side (default: %(default)s)")
    p.add_argument("--dtypes", default=",".join(KERNEL_DTYPES), help="kernel dtypes")
    p.add_argument("--side", action="append", default=[], metavar="NAME:VAR=VALUE,...",
                   help="another kernel side with these environment variables (experiments)")
    p.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    p.add_argument("--json", type=Path, default=None)
    # internal: one side's figures, in this process
    p.add_argument("--worker", choices=("kernels", "greedy"), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker == "kernels":
        worker_kernels(args)
        return 0
    if args.worker == "greedy":
        print(json.dumps(worker_greedy(args)))
        return 0

    from engine.blas import find_mkl, find_openblas

    if sys.platform != "linux" or (find_mkl() is None and find_openblas() is None):
        log("no optimized BLAS here (Linux with the [blas] extra only): nothing to compare")
        return 1
    began = time.perf_counter()
    report: dict = {"machine": machine_line(), "versions": versions(),
                    "command": "python -m tools.bench_blas " + " ".join(argv or sys.argv[1:])}
    print(f"BLAS benchmark — {report['machine']}\n")
    models = [m for m in args.models.split(",") if m]
    if args.part in ("all", "kernels"):
        log("kernels: both sides in lockstep ...")
        sides = {s: {"PLIMSOLL_BLAS": SIDE_ENV[s]} for s in SIDES}
        for spec in args.side:  # extra sides for experiments: NAME:VAR=VALUE,VAR=VALUE
            name, _, assigns = spec.partition(":")
            sides[name] = dict(a.split("=", 1) for a in assigns.split(",") if a)
        kern = bench_kernels(sides, args.dtypes, args.seconds)
        ref, opt = kern["reference"], kern["optimized"]
        report["kernels"] = kern
        for name in list(sides)[2:]:
            print(f"{name}: {_describe(kern[name]['blas'])}")
        print(f"reference: {_describe(ref['blas'])}\noptimized: {_describe(opt['blas'])}\n")
        print(fmt_kernels(kern) + "\n")
    if args.part in ("all", "same"):
        log("same results: greedy decoding on both sides ...")
        same = compare_greedy(models, args.max_tokens)
        report["same"] = same
        print("| model | greedy tokens | identical | max abs logit diff | max abs logit |")
        print("|---|---:|---|---:|---:|")
        for name, r in same["models"].items():
            print(f"| {name} | {r['tokens']} | {'yes' if r['tokens_identical'] else 'NO'} | "
                  f"{r['max_abs_diff']:.2e} | {r['max_abs_logit']:.2f} |")
        print()
    if args.part in ("all", "e2e"):
        rows: list[E2E] = []
        report["e2e_blas"] = {}
        for model in models:
            got, infos = asyncio.run(e2e_model(model, args))
            rows += got
            report["e2e_blas"] = infos
        report["e2e"] = [asdict(r) for r in rows]
        print(f"end to end: prompts of {args.prompt_tokens} tokens, {args.decode_tokens} "
              f"decoded tokens per stream, temperature 0; servers reported "
              + "; ".join(f"{s}: {_describe(report['e2e_blas'].get(s, {}))}" for s in SIDES)
              + "\n")
        print(fmt_e2e(rows) + "\n")
    print(f"({time.perf_counter() - began:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


def _describe(info: dict) -> str:
    if not info:
        return "?"
    threads = info.get("threads", 0)
    return f"{info.get('description', '?')}, {threads} thread(s)"


if __name__ == "__main__":
    sys.exit(main())
