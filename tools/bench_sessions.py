"""Warm-session vs cold time to first token for a long prompt, and the SessionBank micro-benchmark.

    python -m tools.bench_sessions                      # 2,048-token prompt, 7 rounds
    python -m tools.bench_sessions --prompt-tokens 3000 --rounds 11 --no-bank

A real server (`python -m service.cli serve`, the tiny demo model: context 4,096) as a
subprocess; the client in this process. Each round, with a fresh session id:

* turn 1: a `--prompt-tokens` (2,048) token prompt of random ids, sent as `token_ids`,
  with `session_id`, `max_tokens` `--max-tokens` (8), ignore_eos, temperature 0. The
  server keeps the turn's KV in its SessionBank when the turn ends.
* turn 2 = turn 1's prompt + its generated tokens + `--new-tokens` (16) new ids, sent
  twice: warm (same `session_id`: the start message must report cached_tokens close to
  2,048 + 8) and cold (no `session_id`: nothing is restored). The two run one after the
  other, never together, in alternating order from round to round.

TTFT = request sent → first chunk with tokens, as this client sees it; the server's own
figure (GenerateEnd.timings) is printed beside it. Medians over the rounds after one
warm-up round. Target: warm at least 10x faster than cold.

Then `tools/bench_bank.py` (lookup and put with 10,000 entries, trie vs linear scan) runs
as a subprocess and its figures are printed as they come (`--no-bank` skips it).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402

from engine.demo_models import DEMO_SIZES, ensure_demo_model  # noqa: E402
from plimsoll.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
from tools.harness.report import Machine, log  # noqa: E402
from tools.harness.server import ServerProcess, serving  # noqa: E402

SPEEDUP_TARGET = 10.0
FIRST_ORDINARY_ID = 5  # ids 0-4 are the demo tokenizer's special tokens


@dataclass
class Turn:
    ttft_s: float
    server_ttft_s: float
    cached: int
    prompt: int
    generated: list[int]
    total_s: float


async def generate(stub, ids: list[int], session: str, max_tokens: int) -> Turn:
    req = inference_pb2.GenerateRequest(
        max_tokens=max_tokens, ignore_eos=True,
        sampling=inference_pb2.SamplingParams(temperature=0.0), session_id=session)
    req.token_ids.ids.extend(ids)
    sent = time.perf_counter()
    first = None
    cached = prompt = -1
    server_ttft = float("nan")
    out: list[int] = []
    async for msg in stub.Generate(req, timeout=600):
        kind = msg.WhichOneof("event")
        if kind == "chunk" and msg.chunk.token_ids:
            if first is None:
                first = time.perf_counter()
            out.extend(msg.chunk.token_ids)
        elif kind == "start":
            cached, prompt = msg.start.cached_tokens, msg.start.prompt_tokens
        elif kind == "end":
            server_ttft = msg.end.timings.time_to_first_token.ToNanoseconds() / 1e9
    done = time.perf_counter()
    if len(out) != max_tokens:
        raise RuntimeError(f"{len(out)} tokens generated, expected {max_tokens}")
    return Turn((first or done) - sent, server_ttft, cached, prompt, out, done - sent)


@dataclass
class RoundResult:
    warm: Turn
    cold: Turn
    turn1: Turn
    order: str
    foreign: float


async def bench(args, server: ServerProcess, vocab: int) -> list[RoundResult]:
    rng = random.Random(args.seed)
    machine = Machine(server.proc.pid)
    results: list[RoundResult] = []
    async with grpc.aio.insecure_channel(server.address) as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        i = -1
        attempts = 0
        while len(results) < args.rounds and attempts < 3 * (args.rounds + 1):
            i += 1  # round 0 is a warm-up
            attempts += 1
            await machine.wait_quiet(args.foreign_limit, args.quiet_wait)
            a = machine.sample()
            sid = f"bench-{uuid.uuid4().hex[:12]}"
            prompt1 = [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(args.prompt_tokens)]
            t1 = await generate(stub, prompt1, sid, args.max_tokens)
            prompt2 = prompt1 + t1.generated + [
                rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(args.new_tokens)]
            await asyncio.sleep(args.settle)
            order = "warm first" if i % 2 == 0 else "cold first"
            if i % 2 == 0:
                warm = await generate(stub, prompt2, sid, args.max_tokens)
                await asyncio.sleep(args.settle)
                cold = await generate(stub, prompt2, "", args.max_tokens)
            else:
                cold = await generate(stub, prompt2, "", args.max_tokens)
                await asyncio.sleep(args.settle)
                warm = await generate(stub, prompt2, sid, args.max_tokens)
            foreign = machine.foreign_cores(a, machine.sample())
            if warm.cached < args.prompt_tokens:
                raise RuntimeError(f"round {i}: the warm turn restored only {warm.cached} of "
                                   f"{warm.prompt} prompt tokens")
            if cold.cached != 0:
                raise RuntimeError(f"round {i}: the cold turn restored {cold.cached} tokens")
            noisy = i > 0 and machine.disturbed(foreign, warm.total_s + cold.total_s,
                                                args.foreign_limit)
            log(f"  round {i}{' (warm-up)' if i == 0 else ''}: {order}; turn 1 TTFT "
                f"{t1.ttft_s * 1e3:.1f} ms; turn 2 ({warm.prompt} tokens) warm TTFT "
                f"{warm.ttft_s * 1e3:.1f} ms (cached {warm.cached}), cold "
                f"{cold.ttft_s * 1e3:.1f} ms; {cold.ttft_s / warm.ttft_s:.1f}x; others "
                f"{foreign:.2f} cores{' — DISCARDED, run again' if noisy else ''}")
            if i > 0 and not noisy:
                results.append(RoundResult(warm, cold, t1, order, foreign))
        if len(results) < args.rounds:
            log(f"  only {len(results)} quiet rounds in {attempts} attempts")
    return results


def report(args, results: list[RoundResult]) -> None:
    med = statistics.median
    warm = med(r.warm.ttft_s for r in results) * 1e3
    cold = med(r.cold.ttft_s for r in results) * 1e3
    warm_srv = med(r.warm.server_ttft_s for r in results) * 1e3
    cold_srv = med(r.cold.server_ttft_s for r in results) * 1e3
    ratio = cold / warm
    ratios = [r.cold.ttft_s / r.warm.ttft_s for r in results]
    r0 = results[0]
    print(f"\nWarm-session vs cold TTFT — demo-tiny, turn 1 {args.prompt_tokens} tokens + "
          f"{args.max_tokens} generated, turn 2 {r0.warm.prompt} tokens "
          f"(+{args.new_tokens} new), max_tokens {args.max_tokens}, token_ids, temperature 0; "
          f"medians of {len(results)} rounds; {os.cpu_count()} CPUs, {platform.system()} "
          f"{platform.machine()}, Python {platform.python_version()}\n")
    print("| turn 2 | cached tokens | TTFT p50, client (ms) | TTFT p50, server (ms) | "
          "min–max, client (ms) |")
    print("|---|---:|---:|---:|---:|")
    print(f"| cold (no session_id) | {r0.cold.cached} | {cold:.1f} | {cold_srv:.1f} | "
          f"{min(r.cold.ttft_s for r in results) * 1e3:.1f}–"
          f"{max(r.cold.ttft_s for r in results) * 1e3:.1f} |")
    print(f"| warm (same session_id) | {med(r.warm.cached for r in results):.0f} | "
          f"{warm:.1f} | {warm_srv:.1f} | "
          f"{min(r.warm.ttft_s for r in results) * 1e3:.1f}–"
          f"{max(r.warm.ttft_s for r in results) * 1e3:.1f} |")
    print(f"\nspeed-up (cold / warm, medians): {ratio:.1f}x (per round "
          f"{min(ratios):.1f}–{max(ratios):.1f}x) — target ≥ {SPEEDUP_TARGET:g}x: "
          f"{'PASS' if ratio >= SPEEDUP_TARGET else 'MISS'}")
    print(f"turn 1 TTFT p50 {med(r.turn1.ttft_s for r in results) * 1e3:.1f} ms; others used "
          f"up to {max(r.foreign for r in results):.2f} cores during a round")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7, help="measured rounds (default 7)")
    p.add_argument("--settle", type=float, default=0.2,
                   help="seconds between requests (default 0.2)")
    p.add_argument("--foreign-limit", type=float, default=0.15)
    p.add_argument("--quiet-wait", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-bank", action="store_true", help="skip tools/bench_bank.py")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for `plimsoll serve` (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = DEMO_SIZES["tiny"]
    if args.prompt_tokens + 2 * args.max_tokens + args.new_tokens > spec.max_position_embeddings:
        raise SystemExit(f"turn 2 must fit the context ({spec.max_position_embeddings})")
    path = ensure_demo_model("tiny")
    with (
        tempfile.TemporaryDirectory(prefix="plimsoll-bench-") as tmp,
        serving(Path(tmp), "--model", str(path), *args.server_arg, timeout=300) as server,
    ):
        results = asyncio.run(bench(args, server, spec.vocab_size))
    report(args, results)
    if not args.no_bank:
        print("\nSessionBank micro-benchmark: python tools/bench_bank.py\n")
        sys.stdout.flush()
        subprocess.run([sys.executable, str(ROOT / "tools" / "bench_bank.py")], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
