"""Time to first token of short prompts, served: Plimsoll with its defaults against
`--no-decode-kernel` (MLX's own half-precision and quantized products for every row) and,
with `--tree`, against another checkout's server (an older commit).

    python -m tools.bench_short_prompts --models small,medium,small-4bit,medium-4bit
    python -m tools.bench_short_prompts --models medium --tree /tmp/before --lengths 4,15

A prompt shorter than a prefill chunk the fast prefill converts (16 tokens) has its
products run on a few rows; since 2026-12-03 the shim's decode kernel takes them
(engine/fast_prefill.py `_kernel_rows`). Per model, every side's server is up at once
and the idle ones SIGSTOPped; for each prompt length, rounds alternate between the sides
(ABBA), each a gRPC `Generate` of `max_tokens=1`, temperature 0, prompt as token ids
(distinct in every round, so no prefix is reused): the time from the call to its first
token, the median of the rounds. Ratios are the other side's time over the defaults'."""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.demo_models import ensure_demo
from plimsoll.v1 import inference_pb2
from tools.harness.server import ServerProcess, start_server, wait_all_serving


def _ttft(server: ServerProcess, model_id: str, ids: list[int]) -> float:
    req = inference_pb2.GenerateRequest(
        model_id=model_id, token_ids=inference_pb2.TokenIds(ids=ids), max_tokens=1,
        ignore_eos=True, sampling=inference_pb2.SamplingParams(temperature=0))
    with server.stubs() as (_, inference):
        t0 = time.perf_counter()
        for m in inference.Generate(req, timeout=300):
            if m.WhichOneof("event") == "chunk" and m.chunk.token_ids:
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="small,medium,small-4bit,medium-4bit",
                   help="demo sizes, SIZE-VARIANT for a variant (default: %(default)s)")
    p.add_argument("--lengths", default="2,4,8,15,32", help="prompt lengths in tokens")
    p.add_argument("--rounds", type=int, default=6, help="requests per side and length")
    p.add_argument("--tree", type=Path, help="another checkout to serve a third side from")
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",")]
    rng = random.Random(7)
    sides = [("defaults", (), None), ("--no-decode-kernel", ("--no-decode-kernel",), None)]
    if args.tree:
        sides.append((f"tree {args.tree.name}", (), args.tree.resolve()))
    print("| model | prompt tokens | " + " | ".join(f"{name} (ms)" for name, _, _ in sides)
          + " | " + " | ".join(f"{name} / defaults" for name, _, _ in sides[1:]) + " |")
    print("|---|---:|" + "---:|" * (2 * len(sides) - 1))
    with tempfile.TemporaryDirectory() as logs:
        for name in args.models.split(","):
            path = ensure_demo(name)
            servers = [start_server(Path(logs), "--model", str(path), *flags, wait=False,
                                    **({"cwd": tree} if tree else {}))
                       for _, flags, tree in sides]
            try:
                wait_all_serving(servers)
                model_id = path.name
                for srv in servers:  # warm: the first request of a server pays its setup
                    _ttft(srv, model_id, [5, 6, 7])
                    srv.freeze()
                for n in lengths:
                    times: list[list[float]] = [[] for _ in sides]
                    for r in range(args.rounds):
                        order = range(len(sides)) if r % 2 == 0 else reversed(range(len(sides)))
                        for i in order:
                            ids = [rng.randrange(5, 4000) for _ in range(n)]
                            servers[i].thaw()
                            try:
                                times[i].append(_ttft(servers[i], model_id, ids))
                            finally:
                                servers[i].freeze()
                    med = [statistics.median(t) * 1e3 for t in times]
                    print(f"| {name} | {n} | " + " | ".join(f"{m:.1f}" for m in med) + " | "
                          + " | ".join(f"{m / med[0]:.2f}x" for m in med[1:]) + " |",
                          flush=True)
            except BaseException:
                for srv in servers:
                    print(f"server log tail:\n{srv.log()[-2000:]}", file=sys.stderr)
                raise
            finally:
                for srv in servers:
                    srv.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
