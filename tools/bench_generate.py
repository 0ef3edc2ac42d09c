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

Targets (reported, not asserted): ratio >= 0.95 with one stream, >= 0.90 with
more; TTFT p50 overhead (gRPC - baseline) <= 3 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from engine.demo_models import ensure_demo_model  # noqa: E402
from plimsoll.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402

RATIO_TARGET_SINGLE = 0.95
RATIO_TARGET_BATCH = 0.90
TTFT_OVERHEAD_TARGET_MS = 3.0

# Matches the server's defaults (service/cli.py, engine/model_engine.py EngineSettings).
COMPLETION_BATCH_SIZE = 32
PREFILL_BATCH_SIZE = 8
PREFILL_STEP_SIZE = 512

WORDS = [
    "river",
    "stone",
    "market",
    "lantern",
    "harbor",
    "meadow",
    "copper",
    "violet",
    "engine",
    "garden",
    "winter",
    "signal",
    "orchard",
    "canyon",
    "ribbon",
    "falcon",
    "tunnel",
    "marble",
    "thunder",
    "velvet",
    "pepper",
    "glacier",
    "compass",
    "saddle",
    "island",
    "mirror",
    "candle",
    "forest",
    "rocket",
    "silver",
    "basket",
    "needle",
    "harvest",
    "bridge",
    "shadow",
    "feather",
    "anchor",
    "desert",
    "kettle",
    "planet",
    "spiral",
    "timber",
    "oyster",
    "quartz",
    "pillow",
    "cactus",
    "ladder",
    "meadowlark",
    "sandal",
    "beacon",
    "walnut",
    "trumpet",
]


# -- prompts ------------------------------------------------------------------------
@dataclass
class Prompt:
    text: str
    ids: list[int]


def make_prompts(tokenizer, n: int, lo: int = 32, hi: int = 64, seed: int = 0) -> list[Prompt]:
    """n distinct prompts of lo..hi tokens each (deterministic for a seed)."""
    rng = random.Random(seed)
    out: list[Prompt] = []
    seen: set[tuple[int, ...]] = set()
    while len(out) < n:
        target = rng.randint(lo, hi)
        words = [f"Request {len(out)}:"]
        ids = list(tokenizer.encode(" ".join(words)))
        while len(ids) < target:
            words.append(rng.choice(WORDS))
            ids = list(tokenizer.encode(" ".join(words)))
        while len(ids) > hi and len(words) > 1:
            words.pop()
            ids = list(tokenizer.encode(" ".join(words)))
        if len(ids) < lo or tuple(ids) in seen:
            continue
        seen.add(tuple(ids))
        out.append(Prompt(" ".join(words), ids))
    return out


# -- statistics -----------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Run:
    side: str  # "baseline" or "grpc"
    streams: int
    tokens: int
    wall_s: float
    ttft_s: list[float]
    # CPU seconds over the run: this process (the baseline, or the gRPC client)
    # and the server process (gRPC side only).
    bench_cpu_s: float = 0.0
    server_cpu_s: float = 0.0
    # Cores kept busy by other processes on the machine during the run.
    foreign_cores: float = 0.0
    # gRPC only: TTFT as the server measured it (its request creation → first token
    # out of BatchGenerator), from GenerateEnd.timings.
    server_ttft_s: list[float] = field(default_factory=list)
    # gRPC only: request sent → start message received (admission round trip).
    start_s: list[float] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def ttft_p50_ms(self) -> float:
        return percentile(self.ttft_s, 50) * 1e3

    @property
    def ttft_p99_ms(self) -> float:
        return percentile(self.ttft_s, 99) * 1e3


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
        ttft_ok=(g50 - b50) <= TTFT_OVERHEAD_TARGET_MS,
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


# -- the server and the gRPC side --------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args: list[str], log_dir: Path) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"server-{self.port}.log"
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port), *args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        self.frozen = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_serving(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"server exited early:\n{self.log()[-3000:]}")
                with contextlib.suppress(grpc.RpcError):
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                time.sleep(0.2)
        raise TimeoutError(f"server not SERVING after {timeout}s:\n{self.log()[-3000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def freeze(self) -> None:
        if not self.frozen:
            os.kill(self.proc.pid, signal.SIGSTOP)
            self.frozen = True

    def thaw(self) -> None:
        if self.frozen:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.frozen = False

    def stop(self) -> None:
        self.thaw()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class GrpcSide:
    def __init__(self, address: str, send_ids: bool, server_pid: int) -> None:
        self.server = psutil.Process(server_pid)
        self.address = address
        self.send_ids = send_ids
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    def request(self, prompt: Prompt, max_tokens: int) -> inference_pb2.GenerateRequest:
        req = inference_pb2.GenerateRequest(
            max_tokens=max_tokens,
            ignore_eos=True,
            sampling=inference_pb2.SamplingParams(temperature=0.0),
        )
        if self.send_ids:
            req.token_ids.ids.extend(prompt.ids)
        else:
            req.text = prompt.text
        return req

    async def one(self, req: inference_pb2.GenerateRequest, expect_prompt: int):
        sent = time.perf_counter()
        first = None
        streamed = 0
        completion = -1
        server_ttft = float("nan")
        started = float("nan")
        async for msg in self.stub.Generate(req, timeout=600):
            kind = msg.WhichOneof("event")
            if kind == "chunk":
                if first is None and msg.chunk.token_ids:
                    first = time.perf_counter()
                streamed += len(msg.chunk.token_ids)
            elif kind == "start":
                started = time.perf_counter() - sent
                if msg.start.prompt_tokens != expect_prompt:
                    raise RuntimeError(
                        f"server saw {msg.start.prompt_tokens} prompt tokens, the "
                        f"baseline {expect_prompt}: the prompts differ"
                    )
            elif kind == "end":
                completion = msg.end.usage.completion_tokens
                server_ttft = msg.end.timings.time_to_first_token_seconds
        done = time.perf_counter()
        if completion != streamed:
            raise RuntimeError(f"usage says {completion} tokens, {streamed} were streamed")
        first = first if first is not None else done
        return sent, first, done, completion, server_ttft, started

    async def run(self, prompts: list[Prompt], max_tokens: int) -> Run:
        reqs = [self.request(p, max_tokens) for p in prompts]
        cpu0 = time.process_time()
        server0 = self.server.cpu_times()
        results = await asyncio.gather(
            *(self.one(r, len(p.ids)) for r, p in zip(reqs, prompts, strict=True))
        )
        cpu = time.process_time() - cpu0
        server1 = self.server.cpu_times()
        server_cpu = (server1.user - server0.user) + (server1.system - server0.system)
        start = min(r[0] for r in results)
        end = max(r[2] for r in results)
        tokens = sum(r[3] for r in results)
        expected = len(prompts) * max_tokens
        if tokens != expected:
            raise RuntimeError(f"{tokens} tokens generated, expected {expected}")
        return Run(
            "grpc",
            len(prompts),
            tokens,
            end - start,
            [r[1] - r[0] for r in results],
            server_ttft_s=[r[4] for r in results],
            start_s=[r[5] for r in results],
            bench_cpu_s=cpu,
            server_cpu_s=server_cpu,
        )

    async def close(self) -> None:
        await self.channel.close()


# -- other processes on the machine ---------------------------------------------------
class Machine:
    """How busy the rest of the machine is: system CPU time less this process's and the
    server's. A benchmark on a shared box must not count a neighbour's burst against
    either side, so disturbed runs are measured, reported and run again."""

    # /proc/stat and /proc/PID/stat tick at 100 Hz: allow a few ticks of rounding.
    TICK_SLACK_S = 0.03

    def __init__(self, server_pid: int) -> None:
        self.server = psutil.Process(server_pid)

    def sample(self) -> tuple[float, float, float, float]:
        t = psutil.cpu_times()
        busy = sum(t) - t.idle
        for name in ("iowait", "guest", "guest_nice"):
            busy -= getattr(t, name, 0.0)
        srv = self.server.cpu_times()
        return time.perf_counter(), busy, time.process_time(), srv.user + srv.system

    @staticmethod
    def foreign_cores(a, b) -> float:
        wall = b[0] - a[0]
        other = (b[1] - a[1]) - (b[2] - a[2]) - (b[3] - a[3])
        return max(0.0, other) / wall if wall > 0 else 0.0

    def disturbed(self, foreign: float, wall_s: float, limit: float) -> bool:
        return foreign > limit + self.TICK_SLACK_S / max(wall_s, 1e-3)

    async def wait_quiet(self, limit: float, max_wait_s: float) -> float:
        """Waits until other processes use at most `limit` cores (over 0.5 s windows)."""
        deadline = time.monotonic() + max_wait_s
        announced = False
        while True:
            a = self.sample()
            await asyncio.sleep(0.5)
            foreign = self.foreign_cores(a, self.sample())
            if foreign <= limit + self.TICK_SLACK_S / 0.5 or time.monotonic() >= deadline:
                if announced:
                    log(f"  ...machine quiet enough ({foreign:.2f} cores used by others)")
                return foreign
            if not announced:
                log(
                    f"  other processes are using {foreign:.2f} cores; waiting "
                    f"(up to {max_wait_s:.0f} s)"
                )
                announced = True


# -- profiling the server with py-spy ----------------------------------------------------
def find_py_spy() -> str | None:
    return shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")


_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    """'func (path/to/file.py:123)' -> 'func (file.py)' so lines of one function merge."""
    m = _FRAME.match(frame.strip())
    if not m:
        return frame.strip()
    file = m.group("file")
    parts = Path(file).parts
    if "site-packages" in parts:
        file = "/".join(parts[parts.index("site-packages") + 1 :])
    elif str(ROOT) in file:
        file = os.path.relpath(file, ROOT)
    else:
        file = "/".join(parts[-2:])
    return f"{m.group('func')} ({file})"


def analyze_collapsed(path: Path, top: int = 25) -> dict:
    """Self and inclusive shares of py-spy's collapsed stacks (raw format, --threads)."""
    total = 0
    by_thread: Counter[str] = Counter()
    self_t: Counter[str] = Counter()
    incl_t: Counter[str] = Counter()
    self_by_thread: dict[str, Counter[str]] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0]
        m = re.search(r'"([^"]*)"', thread)
        thread = m.group(1) if m else thread
        body = [_short(f) for f in frames[1:]] or ["<thread>"]
        total += n
        by_thread[thread] += n
        self_t[body[-1]] += n
        self_by_thread[thread][body[-1]] += n
        for f in set(body):
            incl_t[f] += n

    def pct(c: Counter[str]) -> list[tuple[str, float]]:
        return [(k, 100.0 * v / total) for k, v in c.most_common(top)] if total else []

    return {
        "samples": total,
        "threads": pct(by_thread),
        "self": pct(self_t),
        "inclusive": pct(incl_t),
        "self_by_thread": {
            t: [(k, 100.0 * v / total) for k, v in c.most_common(12)]
            for t, c in self_by_thread.items()
        },
    }


def print_profile(report: dict, title: str) -> None:
    print(f"\n### {title}: {report['samples']} samples, py-spy mode {report['mode']}")
    for heading, key in (
        ("threads", "threads"),
        ("self time", "self"),
        ("inclusive time", "inclusive"),
    ):
        print(f"\n{heading}:")
        for name, share in report[key]:
            print(f"  {share:6.1f}%  {name}")
    for thread, rows in report["self_by_thread"].items():
        print(f"\nself time in thread {thread}:")
        for name, share in rows:
            print(f"  {share:6.1f}%  {name}")


async def profile_server(
    server: Server,
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
        "TTFT p99 gRPC (ms) | TTFT p50 overhead (ms) | throughput | TTFT |"
    )
    sep = "|" + "|".join("---:" for _ in range(13)) + "|"
    lines = [head, sep]
    for r in rows:
        lines.append(
            f"| {r.streams} | {len(r.runs) // 2} | {r.baseline_tok_s:.0f} | {r.grpc_tok_s:.0f} | {r.ratio:.3f} | "
            f"≥ {r.ratio_target:.2f} | {r.baseline_ttft_p50_ms:.1f} | "
            f"{r.baseline_ttft_p99_ms:.1f} | {r.grpc_ttft_p50_ms:.1f} | "
            f"{r.grpc_ttft_p99_ms:.1f} | {r.ttft_p50_overhead_ms:+.1f} | "
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


def more_runs(kept: list[Run], args) -> bool:
    """At least --repeats pairs; short configurations repeat until the baseline has run
    --min-seconds in all, so that one hiccup cannot move the median."""
    if len(kept) < args.repeats:
        return True
    return sum(r.wall_s for r in kept) < args.min_seconds and len(kept) < args.max_runs


async def bench(args, baseline: Baseline, server: Server, prompts: list[Prompt]) -> dict:
    side = GrpcSide(server.address, args.send_ids, server.proc.pid)
    machine = Machine(server.proc.pid)
    freeze = not args.no_freeze
    rows: list[Row] = []
    profile = None
    discarded: list[dict] = []

    def run_baseline(batch: list[Prompt]) -> Run:
        if freeze:
            server.freeze()
        try:
            a = machine.sample()
            run = baseline.run(batch, args.max_tokens)
            run.foreign_cores = machine.foreign_cores(a, machine.sample())
        finally:
            server.thaw()
        return run

    async def run_grpc(batch: list[Prompt]) -> Run:
        a = machine.sample()
        run = await side.run(batch, args.max_tokens)
        run.foreign_cores = machine.foreign_cores(a, machine.sample())
        return run

    try:
        for n in args.streams:
            batch = prompts[:n]
            log(f"[{n} streams] warm-up")
            await machine.wait_quiet(args.foreign_limit, args.quiet_wait)
            run_baseline(batch)
            await run_grpc(batch)
            b_runs: list[Run] = []
            g_runs: list[Run] = []
            attempts = 0

            while more_runs(b_runs, args):
                attempts += 1
                await machine.wait_quiet(args.foreign_limit, args.quiet_wait)
                b = run_baseline(batch)
                await asyncio.sleep(args.settle)
                g = await run_grpc(batch)
                note = ""
                noisy = [
                    r
                    for r in (b, g)
                    if machine.disturbed(r.foreign_cores, r.wall_s, args.foreign_limit)
                ]
                if noisy and len(discarded) // 2 < args.repeats * 3:
                    discarded.extend(asdict(r) for r in (b, g))
                    note = " — DISCARDED: " + ", ".join(
                        f"{r.side} shared the CPUs with other processes "
                        f"({r.foreign_cores:.2f} cores)"
                        for r in noisy
                    )
                else:
                    b_runs.append(b)
                    g_runs.append(g)
                log(
                    f"[{n} streams] run {attempts} (kept {len(b_runs)}): "
                    f"baseline {b.tok_s:.0f} tok/s, gRPC {g.tok_s:.0f} tok/s; TTFT p50 "
                    f"{b.ttft_p50_ms:.1f} / {g.ttft_p50_ms:.1f} ms{note}"
                )
            rows.append(summarize(n, b_runs, g_runs))
        if args.profile:
            n = args.profile_streams or max(args.streams)
            log(f"[profile] py-spy on the server during {n}-stream gRPC runs")
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
        server.thaw()
        await side.close()
    return {"rows": rows, "profile": profile, "discarded": discarded}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


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
        help="after measuring, py-spy the server during the largest gRPC phase",
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
    args = p.parse_args(argv)
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    lo, _, hi = args.prompt_tokens.partition("-")
    args.prompt_range = (int(lo), int(hi or lo))
    if args.repeats < 1 or args.max_tokens < 1 or not args.streams:
        p.error("--repeats, --max-tokens and --streams must be positive")
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
        server = Server(server_args, Path(tmp))
        try:
            server.wait_serving()
            result = asyncio.run(bench(args, baseline, server, prompts))
        except BaseException:
            with contextlib.suppress(Exception):
                log(f"server log tail:\n{server.log()[-3000:]}")
            raise
        finally:
            server.stop()

    rows: list[Row] = result["rows"]
    lens = [len(p.ids) for p in prompts]
    print(f"\nGenerate throughput — model {label}")
    print(
        f"max_tokens {args.max_tokens}, prompts {min(lens)}-{max(lens)} tokens "
        f"(sent as {'token_ids' if args.send_ids else 'text'}), ignore_eos, temperature 0, "
        f"medians over ≥ {args.repeats} runs per row (≥ {args.min_seconds:g} s of baseline); "
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, Python {platform.python_version()}\n"
    )
    print(fmt_table(rows))
    misses = [r.streams for r in rows if not (r.ratio_ok and r.ttft_ok)]
    print(
        f"\ntargets: ratio ≥ {RATIO_TARGET_SINGLE} (1 stream), ≥ {RATIO_TARGET_BATCH} "
        f"(more); TTFT p50 overhead ≤ {TTFT_OVERHEAD_TARGET_MS:g} ms — "
        + ("all PASS" if not misses else f"MISS at {misses} streams")
    )
    if result["discarded"]:
        worst = max(r["foreign_cores"] for r in result["discarded"])
        print(
            f"\n{len(result['discarded']) // 2} run pair(s) discarded and run again: other "
            f"processes used up to {worst:.2f} cores during them"
        )
    print(
        "\nDiagnostics: CPU per generated token (the client shares the machine's cores), "
        "load from other processes, and TTFT as the server itself measured it:\n"
    )
    print(fmt_cpu_table(rows))
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
