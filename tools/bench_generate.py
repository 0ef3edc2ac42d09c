"""Generate throughput: gRPC `Generate` against mlx-lm's `BatchGenerator` in process.

    python -m tools.bench_generate                        # tiny demo model, 1/8/32 streams
    python -m tools.bench_generate --size small --max-tokens 32
    python -m tools.bench_generate --model ~/models/Qwen3-0.6B-4bit --json out.json
    python -m tools.bench_generate --profile /tmp/prof    # also py-spy the server

One run measures both sides on the same model and the same prompts:

* baseline: `mlx_lm.load(path)` in this process, a `BatchGenerator` with the
  server's batch settings (completion 32, prefill batch 8, prefill step 512),
  N prompts inserted at once with `max_tokens=M` and stop sequences that never
  match (the in-process twin of `ignore_eos`), stepped with `next()` until all
  finish. tokens/s = N*M / (insert → last token); TTFT per sequence = insert →
  its first generated token.
* gRPC: the server as a subprocess (`python -m service.cli serve`), N
  concurrent `Generate` streams from one grpc.aio channel with
  `ignore_eos=true`, temperature 0, the same prompts and `max_tokens`.
  tokens/s = completion tokens / (first request sent → last end received);
  TTFT = request sent → first chunk, as the client sees it.

The two never run at the same time: the machine this was written on has two
cores. While the baseline runs the server is idle and, by default, stopped
with SIGSTOP so that not even its idle timers compete (`--no-freeze` keeps it
running). Each configuration runs in pairs (baseline, then gRPC) after one
unmeasured warm-up of each, at least `--repeats` times and, for short
configurations, until the baseline has run `--min-seconds` in all; the figures
are medians over the runs (TTFT percentiles are taken per run, then the median
of those).

On a shared machine a neighbour's burst would count against whichever side it
hits, so the script measures the CPU time other processes use (system CPU
time less its own and the server's), waits for the machine to be quiet before
each pair, and discards and repeats a pair during which others used more than
`--foreign-limit` cores. It also prints diagnostics: CPU per token on each
side, TTFT as the server itself measured it (GenerateEnd.timings), and the
request → start-message round trip.

`--profile DIR` then runs the largest configuration again for
`--profile-seconds` under `py-spy record` (pip install py-spy) attached to the
server, and prints where its threads spend their time.

Targets (reported, not asserted; issue 10 item 4): ratio >= 0.97 with one stream,
>= 0.90 with more; TTFT p50 overhead (gRPC - baseline) <= 3 ms at every stream
count; with 32 or more streams TTFT p99 no worse than the baseline's + 10 %.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

from engine.demo_models import ensure_demo_model  # noqa: E402
from tools.harness.generate import GrpcSide, Prompt, Run, make_prompts  # noqa: E402
from tools.harness.profile import analyze_collapsed, find_py_spy, print_profile  # noqa: E402
from tools.harness.report import Machine, log, percentile  # noqa: E402
from tools.harness.server import ServerProcess, serving  # noqa: E402

RATIO_TARGET_SINGLE = 0.97
RATIO_TARGET_BATCH = 0.90
TTFT_OVERHEAD_TARGET_MS = 3.0
TTFT_P99_TARGET_STREAMS = 32  # from this many streams on, p99 is held to the baseline's
TTFT_P99_TARGET_FACTOR = 1.10

# Matches the server's defaults (service/cli.py, engine/model_engine.py EngineSettings).
COMPLETION_BATCH_SIZE = 32
PREFILL_BATCH_SIZE = 8
PREFILL_STEP_SIZE = 512


# -- statistics -----------------------------------------------------------------------
@dataclass
class Row:
    streams: int
    baseline_tok_s: float
    grpc_tok_s: float
    ratio: float
    baseline_ttft_p50_ms: float
    baseline_ttft_p99_ms: float
    grpc_ttft_p50_ms: float
    grpc_ttft_p99_ms: float
    ttft_p50_overhead_ms: float
    ratio_target: float
    ratio_ok: bool
    ttft_ok: bool
    ttft_p99_overhead_ms: float = 0.0
    p99_ok: bool = True
    # Median CPU milliseconds per generated token, and cores kept busy (CPU s / wall s).
    baseline_cpu_ms_per_tok: float = 0.0
    server_cpu_ms_per_tok: float = 0.0
    client_cpu_ms_per_tok: float = 0.0
    baseline_cores: float = 0.0
    server_cores: float = 0.0
    client_cores: float = 0.0
    foreign_cores_max: float = 0.0
    server_ttft_p50_ms: float = 0.0
    start_p50_ms: float = 0.0
    runs: list[dict] = field(default_factory=list)


def summarize(streams: int, baseline: list[Run], grpc_runs: list[Run]) -> Row:
    med = statistics.median
    b_tok = med(r.tok_s for r in baseline)
    g_tok = med(r.tok_s for r in grpc_runs)
    b50 = med(r.ttft_p50_ms for r in baseline)
    b99 = med(r.ttft_p99_ms for r in baseline)
    g50 = med(r.ttft_p50_ms for r in grpc_runs)
    g99 = med(r.ttft_p99_ms for r in grpc_runs)
    ratio = g_tok / b_tok if b_tok > 0 else 0.0
    target = RATIO_TARGET_SINGLE if streams == 1 else RATIO_TARGET_BATCH
    p99_ok = streams < TTFT_P99_TARGET_STREAMS or g99 <= b99 * TTFT_P99_TARGET_FACTOR
    return Row(
        streams=streams,
        baseline_tok_s=b_tok,
        grpc_tok_s=g_tok,
        ratio=ratio,
        baseline_ttft_p50_ms=b50,
        baseline_ttft_p99_ms=b99,
        grpc_ttft_p50_ms=g50,
        grpc_ttft_p99_ms=g99,
        ttft_p50_overhead_ms=g50 - b50,
        ratio_target=target,
        ratio_ok=ratio >= target,
        ttft_ok=(g50 - b50) <= TTFT_OVERHEAD_TARGET_MS and p99_ok,
        ttft_p99_overhead_ms=g99 - b99,
        p99_ok=p99_ok,
        baseline_cpu_ms_per_tok=med(1e3 * r.bench_cpu_s / r.tokens for r in baseline),
        server_cpu_ms_per_tok=med(1e3 * r.server_cpu_s / r.tokens for r in grpc_runs),
        client_cpu_ms_per_tok=med(1e3 * r.bench_cpu_s / r.tokens for r in grpc_runs),
        baseline_cores=med(r.bench_cpu_s / r.wall_s for r in baseline),
        server_cores=med(r.server_cpu_s / r.wall_s for r in grpc_runs),
        client_cores=med(r.bench_cpu_s / r.wall_s for r in grpc_runs),
        server_ttft_p50_ms=med(percentile(r.server_ttft_s, 50) * 1e3 for r in grpc_runs),
        start_p50_ms=med(percentile(r.start_s, 50) * 1e3 for r in grpc_runs),
        foreign_cores_max=max(r.foreign_cores for r in (*baseline, *grpc_runs)),
        runs=[asdict(r) for r in (*baseline, *grpc_runs)],
    )


# -- baseline: BatchGenerator in this process ---------------------------------------------
class Baseline:
    def __init__(self, path: Path) -> None:
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(str(path))

    def run(self, prompts: list[Prompt], max_tokens: int) -> Run:
        from mlx_lm.generate import BatchGenerator, StopSequences

        n = len(prompts)
        gen = BatchGenerator(
            self.model,
            completion_batch_size=COMPLETION_BATCH_SIZE,
            prefill_batch_size=PREFILL_BATCH_SIZE,
            prefill_step_size=PREFILL_STEP_SIZE,
        )
        try:
            first: dict[int, float] = {}
            tokens = 0
            finished: set[int] = set()
            cpu0 = time.process_time()
            t0 = time.perf_counter()
            uids = gen.insert(
                [p.ids for p in prompts],
                max_tokens=[max_tokens] * n,
                stop_sequences=[StopSequences(None)] * n,
            )
            while len(finished) < n:
                _, responses = gen.next()
                now = time.perf_counter()
                for r in responses:
                    tokens += 1
                    first.setdefault(r.uid, now)
                    if r.finish_reason is not None:
                        finished.add(r.uid)
            wall = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
        finally:
            gen.close()
        return Run("baseline", n, tokens, wall, [first[u] - t0 for u in uids], bench_cpu_s=cpu)


# -- profiling the server with py-spy ----------------------------------------------------


async def profile_server(
    server: ServerProcess,
    side: GrpcSide,
    prompts: list[Prompt],
    max_tokens: int,
    seconds: float,
    out_dir: Path,
    mode: str,
) -> dict:
    py_spy = find_py_spy()
    if py_spy is None:
        raise SystemExit("--profile needs py-spy (pip install py-spy)")
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"server-{len(prompts)}streams-{mode}.txt"
    cmd = [
        py_spy,
        "record",
        "--pid",
        str(server.proc.pid),
        "--format",
        "raw",
        "--output",
        str(raw),
        "--rate",
        "250",
        "--threads",
    ]
    # --native must pause the process to unwind C frames; the other modes sample
    # without stopping it, which perturbs the server less.
    cmd += {
        "cpu": ["--nonblocking"],
        "idle": ["--nonblocking", "--idle"],
        "gil": ["--nonblocking", "--gil"],
        "native": ["--native"],
    }[mode]
    spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    await asyncio.sleep(1.0)  # let py-spy attach
    deadline = time.monotonic() + seconds
    rounds = 0
    while time.monotonic() < deadline or rounds == 0:
        await side.run(prompts, max_tokens)
        rounds += 1
    spy.send_signal(signal.SIGINT)
    _, err = spy.communicate(timeout=120)
    if not raw.exists():
        raise RuntimeError(f"py-spy wrote nothing: {err.decode(errors='replace')[-2000:]}")
    report = analyze_collapsed(raw)
    report["file"] = str(raw)
    report["mode"] = mode
    report["rounds"] = rounds
    return report


# -- the run -------------------------------------------------------------------------------
def fmt_table(rows: list[Row]) -> str:
    head = (
        "| streams | runs | baseline tok/s | gRPC tok/s | ratio | target | "
        "TTFT p50 base (ms) | TTFT p99 base (ms) | TTFT p50 gRPC (ms) | "
        "TTFT p99 gRPC (ms) | TTFT p50 overhead (ms) | TTFT p99 overhead (ms) | "
        "throughput | TTFT |"
    )
    sep = "|" + "|".join("---:" for _ in range(14)) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r.streams} | {len(r.runs) // 2} | {r.baseline_tok_s:.0f} | {r.grpc_tok_s:.0f} | {r.ratio:.3f} | "
            f"≥ {r.ratio_target:.2f} | {r.baseline_ttft_p50_ms:.1f} | "
            f"{r.baseline_ttft_p99_ms:.1f} | {r.grpc_ttft_p50_ms:.1f} | "
            f"{r.grpc_ttft_p99_ms:.1f} | {r.ttft_p50_overhead_ms:+.1f} | "
            f"{r.ttft_p99_overhead_ms:+.1f} | "
            f"{'PASS' if r.ratio_ok else 'MISS'} | {'PASS' if r.ttft_ok else 'MISS'} |"
        )
    return "\n".join(lines)


def fmt_cpu_table(rows: list[Row]) -> str:
    lines = [
        "| streams | baseline CPU ms/tok | server CPU ms/tok | client CPU ms/tok | "
        "baseline cores | server cores | client cores | others, max (cores) | "
        "gRPC TTFT p50, server-measured (ms) | gRPC request → start message p50 (ms) |",
        "|" + "|".join("---:" for _ in range(10)) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r.streams} | {r.baseline_cpu_ms_per_tok:.2f} | {r.server_cpu_ms_per_tok:.2f} | "
            f"{r.client_cpu_ms_per_tok:.2f} | {r.baseline_cores:.2f} | {r.server_cores:.2f} | "
            f"{r.client_cores:.2f} | {r.foreign_cores_max:.2f} | {r.server_ttft_p50_ms:.1f} | "
            f"{r.start_p50_ms:.1f} |"
        )
    return "\n".join(lines)


def _grpc_runs(row: Row) -> list[Run]:
    return [Run(**r) for r in row.runs if r["side"] == "grpc"]


def ab_ratio(a: Row, b: Row) -> float:
    """B's tokens/s over A's, round by round (the rounds ran together), the median."""
    return statistics.median(y.tok_s / x.tok_s for x, y in
                             zip(_grpc_runs(a), _grpc_runs(b), strict=True) if x.tok_s > 0)


def ab_ttft_delta(a: Row, b: Row) -> float:
    return statistics.median(y.ttft_p50_ms - x.ttft_p50_ms for x, y in
                             zip(_grpc_runs(a), _grpc_runs(b), strict=True))


def more_runs(kept: list[Run], args) -> bool:
    """At least --repeats pairs; short configurations repeat until the baseline has run
    --min-seconds in all, so that one hiccup cannot move the median."""
    if len(kept) < args.repeats:
        return True
    return sum(r.wall_s for r in kept) < args.min_seconds and len(kept) < args.max_runs


async def bench(args, baseline: Baseline, servers: list[ServerProcess],
                prompts: list[Prompt]) -> dict:
    """Each round: the baseline, then every server in turn (the order alternating), the
    others SIGSTOPped, so that an A/B of two servers is measured in the same rounds."""
    server = servers[0]
    sides = [GrpcSide(s.address, args.send_ids, s.proc.pid) for s in servers]
    side = sides[0]
    machines = [Machine(s.proc.pid) for s in servers]
    machine = machines[0]
    freeze = not args.no_freeze
    rows: list[list[Row]] = [[] for _ in servers]
    profile = None
    discarded: list[dict] = []
    discarded_rounds = 0

    def run_baseline(batch: list[Prompt]) -> Run:
        if freeze:
            for s in servers:
                s.freeze()
        try:
            a = machine.sample()
            run = baseline.run(batch, args.max_tokens)
            run.foreign_cores = machine.foreign_cores(a, machine.sample())
        finally:
            for s in servers:
                s.thaw()
        return run

    async def run_grpc(batch: list[Prompt], i: int = 0) -> Run:
        others = [s for j, s in enumerate(servers) if j != i]
        if freeze:
            for s in others:
                s.freeze()
        try:
            a = machines[i].sample()
            run = await sides[i].run(batch, args.max_tokens)
            run.foreign_cores = machines[i].foreign_cores(a, machines[i].sample())
        finally:
            for s in others:
                s.thaw()
        return run

    try:
        for n in args.streams:
            batch = prompts[:n]
            log(f"[{n} streams] warm-up")
            await machine.wait_quiet(args.foreign_limit, args.quiet_wait)
            run_baseline(batch)
            for i in range(len(servers)):
                await run_grpc(batch, i)
            b_runs: list[Run] = []
            g_runs: list[list[Run]] = [[] for _ in servers]
            attempts = 0

            while more_runs(b_runs, args):
                attempts += 1
                await machine.wait_quiet(args.foreign_limit, args.quiet_wait)
                b = run_baseline(batch)
                order = list(range(len(servers)))
                if len(b_runs) % 2 == 1:  # kept rounds alternate, whatever was discarded
                    order.reverse()
                gs: list[Run | None] = [None] * len(servers)
                for i in order:
                    await asyncio.sleep(args.settle)
                    gs[i] = await run_grpc(batch, i)
                note = ""
                noisy = [
                    r
                    for r in (b, *gs)
                    if machine.disturbed(r.foreign_cores, r.wall_s, args.foreign_limit)
                ]
                if noisy and discarded_rounds < args.repeats * 3:
                    discarded_rounds += 1
                    discarded.extend(asdict(r) for r in (b, *gs))
                    note = " — DISCARDED: " + ", ".join(
                        f"{r.side} shared the CPUs with other processes "
                        f"({r.foreign_cores:.2f} cores)"
                        for r in noisy
                    )
                else:
                    b_runs.append(b)
                    for i, g in enumerate(gs):
                        g_runs[i].append(g)
                log(
                    f"[{n} streams] run {attempts} (kept {len(b_runs)}): "
                    f"baseline {b.tok_s:.0f} tok/s, gRPC "
                    + " / ".join(f"{g.tok_s:.0f}" for g in gs)
                    + " tok/s; TTFT p50 "
                    f"{b.ttft_p50_ms:.1f} / " + " / ".join(f"{g.ttft_p50_ms:.1f}" for g in gs)
                    + f" ms{note}"
                )
            for i in range(len(servers)):
                rows[i].append(summarize(n, b_runs, g_runs[i]))
        if args.profile:
            n = args.profile_streams or max(args.streams)
            log(f"[profile] py-spy on the server during {n}-stream gRPC runs")
            if freeze:
                for s in servers[1:]:
                    s.freeze()  # thawed in the finally below
            try:
                profile = await profile_server(
                    server,
                    side,
                    prompts[:n],
                    args.max_tokens,
                    args.profile_seconds,
                    Path(args.profile),
                    args.profile_mode,
                )
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                log(f"[profile] failed: {exc}")
    finally:
        for s, sd in zip(servers, sides, strict=True):
            s.thaw()
            await sd.close()
    return {"rows": rows, "profile": profile, "discarded": discarded,
            "discarded_rounds": discarded_rounds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", default="tiny", help="demo model size (default: tiny)")
    p.add_argument("--model", default=None, help="a model folder instead of a demo model")
    p.add_argument(
        "--streams", default="1,8,32", help="concurrent streams, comma-separated (default: 1,8,32)"
    )
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="at least this many runs per configuration (default 3); figures are medians",
    )
    p.add_argument(
        "--prompt-tokens", default="32-64", help="prompt length range in tokens (default 32-64)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the prompts")
    p.add_argument(
        "--send-ids", action="store_true", help="send prompts as token_ids rather than text"
    )
    p.add_argument(
        "--no-freeze",
        action="store_true",
        help="leave the idle server running (not SIGSTOPped) during the baseline",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=0.2,
        help="seconds between a baseline run and the gRPC run (default 0.2)",
    )
    p.add_argument(
        "--min-seconds",
        type=float,
        default=2.0,
        help="repeat short configurations beyond --repeats until the baseline has run "
        "this long in all (default 2; 0 to run exactly --repeats)",
    )
    p.add_argument(
        "--max-runs", type=int, default=30, help="cap on repeats per configuration (default 30)"
    )
    p.add_argument(
        "--foreign-limit",
        type=float,
        default=0.15,
        help="cores other processes may use during a run before it is discarded and "
        "run again (default 0.15)",
    )
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="seconds to wait for other processes to go quiet before each run (default 120)",
    )
    p.add_argument(
        "--json",
        metavar="PATH",
        default=None,
        help="also write the raw figures as JSON ('-' for stdout)",
    )
    p.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="after measuring, py-spy the server during the largest gRPC phase (with "
        "--ab-env: server A, B stopped meanwhile)",
    )
    p.add_argument(
        "--profile-seconds",
        type=float,
        default=15.0,
        help="how long to keep the profiled gRPC phase running (default 15)",
    )
    p.add_argument(
        "--profile-streams",
        type=int,
        default=0,
        help="streams in the profiled phase (default: the largest of --streams)",
    )
    p.add_argument(
        "--profile-mode",
        choices=("cpu", "idle", "gil", "native"),
        default="cpu",
        help="py-spy sampling: cpu (active threads, default), idle (every thread, waits "
        "included), gil (only the thread holding the GIL), native (C/C++ frames too)",
    )
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        help="extra argument for `plimsoll serve` (repeatable)",
    )
    p.add_argument(
        "--ab-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also start a second server with this environment variable (repeatable) and "
        "measure both in the same rounds, in alternating order",
    )
    p.add_argument(
        "--ab-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="like --ab-env, with this extra `plimsoll serve` argument for the second "
        "server (repeatable; combines with --ab-env)",
    )
    p.add_argument(
        "--ab-checkout",
        default=None,
        metavar="DIR",
        help="like --ab-env, with the second server running this checkout's code (a "
        "`git worktree` of another commit, say); combines with --ab-env and --ab-arg",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment variable for the server only, not the baseline (repeatable)",
    )
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    lo, _, hi = args.prompt_tokens.partition("-")
    args.prompt_range = (int(lo), int(hi or lo))
    if args.repeats < 1 or args.max_tokens < 1 or not args.streams:
        p.error("--repeats, --max-tokens and --streams must be positive")
    if any("=" not in item for item in (*args.server_env, *args.ab_env)):
        p.error("--server-env and --ab-env take NAME=VALUE")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model:
        path = Path(args.model).expanduser()
        server_args = ["--model", str(path)]
        label = str(path)
    else:
        path = ensure_demo_model(args.size)
        server_args = [] if args.size == "tiny" else ["--demo-size", args.size]
        label = f"demo-{args.size} ({path})"
    server_args += args.server_arg

    log(f"loading {label} for the baseline")
    baseline = Baseline(path)
    prompts = make_prompts(
        baseline.tokenizer,
        max(*args.streams, args.profile_streams),
        *args.prompt_range,
        seed=args.seed,
    )

    with tempfile.TemporaryDirectory(prefix="plimsoll-bench-") as tmp:
        log("starting the server")
        env = dict(item.split("=", 1) for item in args.server_env)
        labels = ["server"]
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(serving(Path(tmp), *server_args, env=env,
                                                   timeout=300))]
            if args.ab_env or args.ab_arg or args.ab_checkout:
                b_env = {**env, **dict(item.split("=", 1) for item in args.ab_env)}
                b_cwd = Path(args.ab_checkout).resolve() if args.ab_checkout else ROOT
                servers.append(stack.enter_context(serving(
                    Path(tmp), *server_args, *args.ab_arg, env=b_env, timeout=300,
                    cwd=b_cwd)))
                b_what = [*args.ab_env, *args.ab_arg,
                          *([f"code of {args.ab_checkout}"] if args.ab_checkout else [])]
                labels = ["A (" + (" ".join(args.server_env) or "as is") + ")",
                          "B (" + " ".join(b_what) + ")"]
            result = asyncio.run(bench(args, baseline, servers, prompts))

    all_rows: list[list[Row]] = result["rows"]
    rows: list[Row] = all_rows[0]
    lens = [len(p.ids) for p in prompts]
    print(f"\nGenerate throughput — model {label}")
    print(
        f"max_tokens {args.max_tokens}, prompts {min(lens)}-{max(lens)} tokens "
        f"(sent as {'token_ids' if args.send_ids else 'text'}), ignore_eos, temperature 0, "
        f"medians over ≥ {args.repeats} runs per row (≥ {args.min_seconds:g} s of baseline); "
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, Python {platform.python_version()}\n"
    )
    for side_label, side_rows in zip(labels, all_rows, strict=True):
        if len(all_rows) > 1:
            print(f"\n{side_label}:")
        print(fmt_table(side_rows))
    if len(all_rows) > 1:
        print("\nB against A, medians of the per-round ratios (same rounds):")
        for a, b in zip(all_rows[0], all_rows[1], strict=True):
            print(f"  {a.streams} streams: tok/s B/A {ab_ratio(a, b):.3f}, TTFT p50 "
                  f"B-A {ab_ttft_delta(a, b):+.1f} ms")
    misses = [r.streams for r in rows if not (r.ratio_ok and r.ttft_ok)]
    print(
        f"\ntargets: ratio ≥ {RATIO_TARGET_SINGLE} (1 stream), ≥ {RATIO_TARGET_BATCH} "
        f"(more); TTFT p50 overhead ≤ {TTFT_OVERHEAD_TARGET_MS:g} ms, and p99 ≤ baseline "
        f"× {TTFT_P99_TARGET_FACTOR:g} from {TTFT_P99_TARGET_STREAMS} streams — "
        + ("all PASS" if not misses else f"MISS at {misses} streams")
    )
    if result["discarded"]:
        worst = max(r["foreign_cores"] for r in result["discarded"])
        print(
            f"\n{result['discarded_rounds']} round(s) discarded and run again: other "
            f"processes used up to {worst:.2f} cores during them"
        )
    print(
        "\nDiagnostics: CPU per generated token (the client shares the machine's cores), "
        "load from other processes, and TTFT as the server itself measured it:\n"
    )
    for side_label, side_rows in zip(labels, all_rows, strict=True):
        if len(all_rows) > 1:
            print(f"\n{side_label}:")
        print(fmt_cpu_table(side_rows))
    if result["profile"]:
        print_profile(result["profile"], f"server profile ({result['profile']['file']})")

    if args.json:
        payload = {
            "model": label,
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "prompt_tokens": lens,
            "send_ids": args.send_ids,
            "freeze": not args.no_freeze,
            "rows": [asdict(r) for r in rows],
            "server_env": args.server_env,
            "ab_env": args.ab_env,
            "ab_arg": args.ab_arg,
            "ab_checkout": args.ab_checkout,
            "ab_rows": [asdict(r) for r in all_rows[1]] if len(all_rows) > 1 else [],
            "ab_tok_s_ratio": {str(a.streams): ab_ratio(a, b)
                               for a, b in zip(all_rows[0], all_rows[-1], strict=True)}
            if len(all_rows) > 1 else {},
            "profile": result["profile"],
            "discarded_runs": result["discarded"],
        }
        text = json.dumps(payload, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
