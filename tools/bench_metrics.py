"""Prometheus /metrics latency, idle and while 32 Generate streams decode.

    python -m tools.bench_metrics                        # 20 s idle, then 20 s under load
    python -m tools.bench_metrics --seconds 60 --streams 64

A real server (`python -m service.cli serve --metrics-port P`, the tiny demo model) as
a subprocess. This process scrapes `http://127.0.0.1:P/metrics` every `--interval-ms`
(50 ms: how often the Gateway API inference extension's endpoint picker polls) for
`--seconds`, on a fixed schedule (a late scrape goes at once, the next keeps the
schedule). Latency = connect → last byte of the body, one new connection per scrape (the
listener speaks HTTP/1.0), as a picker sees it. Each body is parsed: a scrape must offer
`vllm:num_requests_running`, and under load its value is recorded.

1. idle: the server with its model loaded and nothing running (the baseline, same run),
   after 4 short requests so that every family has its series (the TTFT buckets too).
2. load: a child process (its own interpreter: its client work must not share this
   process's GIL with the scraper) keeps `--streams` (32) Generate streams in flight on
   one grpc.aio channel (ignore_eos, temperature 0, `--max-tokens` 3072: longer than the
   phase; a stream that ends is replaced at once). Scraping starts once the server
   reports all of them running.

Each phase starts once other processes have used under `--foreign-limit` (0.15) cores
for a second (waiting up to `--quiet-wait`): the machine may be shared. Printed:
p50 / p99 / max per phase, the load/idle ratios, tokens/s during the load phase, the
server's and the client's cores and what other processes used meanwhile. Target:
p99 <= 50 ms under load.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing as mp
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from engine.demo_models import ensure_demo_model  # noqa: E402
from telemetry import names  # noqa: E402
from tools.harness.generate import WORDS  # noqa: E402
from tools.harness.report import log, percentile  # noqa: E402
from tools.harness.server import free_port, serving  # noqa: E402

P99_TARGET_MS = 50.0


@dataclass
class Phase:
    name: str
    latencies_s: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)  # vllm:num_requests_running seen
    body_bytes: list[int] = field(default_factory=list)
    errors: int = 0
    late: int = 0  # scrapes that started after their slot (the previous one overran)
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    client_cpu_s: float = 0.0
    foreign_cores: float = 0.0
    tokens: int = 0

    def ms(self, q: float) -> float:
        return percentile(self.latencies_s, q) * 1e3


# -- scraping -----------------------------------------------------------------------------
def scrape(port: int, timeout_s: float = 5.0) -> tuple[float, bytes]:
    """(seconds from connect to the body's last byte, body)."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"/metrics answered {resp.status}")
    finally:
        conn.close()
    return time.perf_counter() - t0, body


def gauge_value(body: bytes, name: str) -> float | None:
    prefix = name.encode() + b" "
    for line in body.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    return None


def scrape_for(port: int, seconds: float, interval_s: float, phase: Phase) -> None:
    start = time.perf_counter()
    k = 0
    while True:
        slot = start + k * interval_s
        if slot - start >= seconds:
            break
        now = time.perf_counter()
        if now < slot:
            time.sleep(slot - now)
        elif now - slot > interval_s:
            phase.late += 1
        k += 1
        try:
            latency, body = scrape(port)
        except (OSError, RuntimeError) as err:
            phase.errors += 1
            log(f"  scrape failed: {err}")
            continue
        running = gauge_value(body, names.VLLM_REQUESTS_RUNNING)
        if running is None:
            phase.errors += 1
            continue
        phase.latencies_s.append(latency)
        phase.running.append(running)
        phase.body_bytes.append(len(body))


def wait_running(port: int, streams: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, body = scrape(port)
        if (gauge_value(body, names.VLLM_REQUESTS_RUNNING) or 0) >= streams:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the server never reported {streams} requests running")


# -- the load child -----------------------------------------------------------------------
def prompt(i: int, rng: random.Random) -> str:
    return f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(24))


async def _streams(address: str, streams: int, max_tokens: int, stop, tokens) -> None:
    import grpc

    from plimsoll.v1 import inference_pb2, inference_pb2_grpc

    rng = random.Random(0)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)

        async def slot(i: int) -> None:
            n = 0
            while True:  # a stream that ends is replaced at once
                req = inference_pb2.GenerateRequest(
                    text=prompt(i * 1000 + n, rng), max_tokens=max_tokens, ignore_eos=True,
                    sampling=inference_pb2.SamplingParams(temperature=0.0))
                n += 1
                async for msg in stub.Generate(req, timeout=600):
                    if msg.WhichOneof("event") == "chunk":
                        with tokens.get_lock():
                            tokens.value += len(msg.chunk.token_ids)

        tasks = [asyncio.create_task(slot(i)) for i in range(streams)]
        while not stop.is_set():
            await asyncio.sleep(0.1)
            failed = [t for t in tasks if t.done()]
            if failed:
                failed[0].result()  # a stream error ends the benchmark, loudly
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def load_main(address: str, streams: int, max_tokens: int, stop, tokens) -> None:
    asyncio.run(_streams(address, streams, max_tokens, stop, tokens))


# -- phases -------------------------------------------------------------------------------
def cpu_s(p: psutil.Process) -> float:
    t = p.cpu_times()
    return t.user + t.system


def busy_s() -> float:
    t = psutil.cpu_times()
    busy = sum(t) - t.idle
    for name in ("iowait", "guest", "guest_nice"):
        busy -= getattr(t, name, 0.0)
    return busy


def measured(phase: Phase, server: psutil.Process, client: psutil.Process | None,
             run) -> None:
    """Runs `run()`, recording wall time, CPU of the server, the client and the rest."""
    me = psutil.Process()
    t0, b0, m0, s0 = time.perf_counter(), busy_s(), cpu_s(me), cpu_s(server)
    c0 = cpu_s(client) if client else 0.0
    run()
    t1, b1, m1, s1 = time.perf_counter(), busy_s(), cpu_s(me), cpu_s(server)
    c1 = cpu_s(client) if client else 0.0
    phase.wall_s = t1 - t0
    phase.server_cpu_s, phase.client_cpu_s = s1 - s0, c1 - c0
    other = (b1 - b0) - (m1 - m0) - phase.server_cpu_s - phase.client_cpu_s
    phase.foreign_cores = max(0.0, other) / phase.wall_s


def prime(address: str, n: int) -> None:
    """n short requests, so that both phases scrape a full body: the TTFT histogram's
    buckets and the request counters have series from here on."""
    import grpc

    from plimsoll.v1 import inference_pb2, inference_pb2_grpc

    rng = random.Random(1)
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        for i in range(n):
            req = inference_pb2.GenerateRequest(text=prompt(i, rng), max_tokens=8,
                                                ignore_eos=True)
            for _ in stub.Generate(req, timeout=60):
                pass


def wait_quiet(server: psutil.Process, limit: float, timeout_s: float) -> float:
    """Waits (up to timeout_s) for a second in which other processes use under `limit`
    cores; the shared machine's neighbours would otherwise be measured. Returns the
    last second's figure."""
    me = psutil.Process()
    deadline = time.monotonic() + timeout_s
    while True:
        b0, m0, s0 = busy_s(), cpu_s(me), cpu_s(server)
        time.sleep(1.0)
        other = (busy_s() - b0) - (cpu_s(me) - m0) - (cpu_s(server) - s0)
        if other < limit or time.monotonic() >= deadline:
            return max(0.0, other)


def bench(args: argparse.Namespace, port: int, address: str, pid: int) -> list[Phase]:
    server = psutil.Process(pid)
    interval = args.interval_ms / 1000
    prime(address, 4)
    log(f"warm-up: {args.warmup} scrapes")
    for _ in range(args.warmup):
        scrape(port)
    idle = Phase("idle")
    log(f"others use {wait_quiet(server, args.foreign_limit, args.quiet_wait):.2f} cores")
    log(f"idle: scraping every {args.interval_ms:g} ms for {args.seconds:g} s")
    measured(idle, server, None, lambda: scrape_for(port, args.seconds, interval, idle))

    ctx = mp.get_context("spawn")  # a fresh interpreter: no gRPC state forked
    stop, tokens = ctx.Event(), ctx.Value("q", 0)
    child = ctx.Process(target=load_main,
                        args=(address, args.streams, args.max_tokens, stop, tokens))
    loaded = Phase(f"{args.streams} streams")
    log(f"others use {wait_quiet(server, args.foreign_limit, args.quiet_wait):.2f} cores")
    child.start()
    try:
        wait_running(port, args.streams)
        log(f"{args.streams} streams running: scraping for {args.seconds:g} s")
        t0 = tokens.value
        measured(loaded, server, psutil.Process(child.pid),
                 lambda: scrape_for(port, args.seconds, interval, loaded))
        loaded.tokens = tokens.value - t0
    finally:
        stop.set()
        child.join(30)
        if child.is_alive():
            child.kill()
    if child.exitcode not in (0, None):
        raise RuntimeError(f"the load process failed (exit {child.exitcode})")
    return [idle, loaded]


def report(args: argparse.Namespace, phases: list[Phase]) -> None:
    idle, loaded = phases
    print(f"\nPrometheus /metrics latency — demo-tiny, a scrape every {args.interval_ms:g} ms "
          f"for {args.seconds:g} s per phase, one connection per scrape; "
          f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
          f"Python {platform.python_version()}\n")
    print("| phase | scrapes | errors | late | p50 (ms) | p99 (ms) | max (ms) | body (KiB) | "
          "running, median | tokens/s | server cores | client cores | others (cores) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for p in phases:
        tok_s = p.tokens / p.wall_s if p.tokens else 0.0
        print(f"| {p.name} | {len(p.latencies_s)} | {p.errors} | {p.late} | {p.ms(50):.2f} | "
              f"{p.ms(99):.2f} | {max(p.latencies_s, default=0) * 1e3:.2f} | "
              f"{statistics.mean(p.body_bytes or [0]) / 1024:.1f} | "
              f"{statistics.median(p.running or [0]):.0f} | {tok_s:.0f} | "
              f"{p.server_cpu_s / p.wall_s:.2f} | {p.client_cpu_s / p.wall_s:.2f} | "
              f"{p.foreign_cores:.2f} |")
    p99 = loaded.ms(99)
    print(f"\nload / idle: p50 {loaded.ms(50) / idle.ms(50):.2f}x, p99 {p99 / idle.ms(99):.2f}x; "
          f"p99 under load {p99:.2f} ms — target ≤ {P99_TARGET_MS:g} ms: "
          f"{'PASS' if p99 <= P99_TARGET_MS else 'MISS'}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=20.0, help="per phase (default 20)")
    p.add_argument("--interval-ms", type=float, default=50.0,
                   help="between scrapes (default 50)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=3072)
    p.add_argument("--warmup", type=int, default=10, help="scrapes before timing")
    p.add_argument("--foreign-limit", type=float, default=0.15,
                   help="start a phase once other processes use fewer cores (default 0.15)")
    p.add_argument("--quiet-wait", type=float, default=120.0,
                   help="longest wait for that, in seconds (default 120)")
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for `plimsoll serve` (repeatable)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = ensure_demo_model("tiny")
    port = free_port()
    with (
        tempfile.TemporaryDirectory(prefix="plimsoll-bench-") as tmp,
        serving(Path(tmp), "--model", str(path), "--metrics-port", str(port),
                *args.server_arg, timeout=300) as server,
    ):
        phases = bench(args, port, server.address, server.proc.pid)
    report(args, phases)
    return 0


if __name__ == "__main__":
    sys.exit(main())
