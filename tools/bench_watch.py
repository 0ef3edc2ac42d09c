"""WatchPressure fan-out: 1,000 subscribers, transition latency, and what they cost Generate.

    python -m tools.bench_watch                               # fan-out, then throughput
    python -m tools.bench_watch --skip-throughput --transitions 40
    python -m tools.bench_watch --profile /tmp/prof           # py-spy the server's fan-out

One server (`python -m service.cli serve`, demo-tiny, `--memory-guard-gb 4`) runs as a
subprocess inside a child memory cgroup of this process's own (root; cgroup v1 or v2;
`tools.harness.cgroup`, as in `tools.bench_enforcer`); the clients run in this process.

(1) Fan-out. `--subscribers` (1,000) `WatchPressure` streams over `--channels` (10)
grpc.aio channels, each channel its own TCP connection (a local subchannel pool), 100
streams per channel, transitions only (`--samples` also subscribes to every tick's
sample). Transitions come from the ceiling, not from loads (a load/unload cycle does not
give memory back to the OS here, so usage would creep; see the reaction notes in
docs/benchmarks.md): the child cgroup's limit is lowered so that the container term of
the ceiling puts usage at 90 % of it (soft is 85 %, hard 95 %: ok -> soft), then lifted
(soft -> ok), `--transitions` times. The server polls every 0.25 s while idle
(`--poll-idle 0.25`) only so that a toggle is seen quickly; the cadence plays no part
in the figure. For every subscriber and transition: delay = time this client received
the message - `WatchPressureResponse.time`, the server's wall clock when the broker
published it (same machine, same clock). p50 / p99 / max over all of them; the first
transition is a warm-up. Target: p99 <= 100 ms.

(2) Generate throughput with the subscribers connected vs not, same server, same run:
8 concurrent `Generate` streams (ignore_eos, temperature 0, 256 tokens each, prompts of
32-64 tokens) timed with `tools.harness.generate.GrpcSide`; runs alternate without / with
1,000 idle subscribers (connected before the run, closed after), `--repeats` pairs,
medians. A third row has the 1,000 subscribers also taking every tick's sample (1,000
messages per tick, a tick a second while Generate runs). Target: ratio (connected /
without) >= 0.95. Server and clients share the machine's cores (2 here).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
import psutil  # noqa: E402

from engine.demo_models import ensure_demo_model  # noqa: E402
from plimsoll.v1 import control_pb2, control_pb2_grpc, types_pb2  # noqa: E402
from tools.harness.cgroup import CgroupUnavailable, ChildCgroup, limit_for_ceiling  # noqa: E402
from tools.harness.generate import GrpcSide, make_prompts  # noqa: E402
from tools.harness.profile import analyze_collapsed, find_py_spy, print_profile  # noqa: E402
from tools.harness.report import Machine, log, percentile, ts  # noqa: E402
from tools.harness.server import serving  # noqa: E402

FANOUT_P99_TARGET_MS = 100.0
THROUGHPUT_RATIO_TARGET = 0.95
SOFT_SHARE = 0.90  # usage / ceiling after a step: between soft (0.85) and hard (0.95)


# -- subscribers -------------------------------------------------------------------------
@dataclass
class Subscribers:
    """n WatchPressure streams over `channels` connections; transitions are recorded as
    (received wall time, server event time, to_level) per subscriber."""

    address: str
    n: int
    channels: int
    samples: bool = False
    received: list[list[tuple[float, float, int]]] = field(default_factory=list)
    sample_count: int = 0
    errors: list[str] = field(default_factory=list)

    async def start(self, timeout: float = 60.0) -> float:
        """Connects every stream; returns when each has its snapshot (seconds taken)."""
        t0 = time.perf_counter()
        opts = [("grpc.use_local_subchannel_pool", 1)]
        self._channels = [grpc.aio.insecure_channel(self.address, options=opts)
                          for _ in range(self.channels)]
        stubs = [control_pb2_grpc.ControlServiceStub(ch) for ch in self._channels]
        self.received = [[] for _ in range(self.n)]
        self._snapshots = 0
        self._transitions = 0
        self._want = 0
        self._changed = asyncio.Event()
        req = control_pb2.WatchPressureRequest(include_samples=self.samples)
        self._tasks = [asyncio.create_task(self._run(i, stubs[i % self.channels], req))
                       for i in range(self.n)]
        await self._until(lambda: self._snapshots >= self.n, timeout, "snapshots")
        return time.perf_counter() - t0

    async def _run(self, i: int, stub, req) -> None:
        mine = self.received[i]
        try:
            async for msg in stub.WatchPressure(req):
                now = time.time()
                kind = msg.WhichOneof("event")
                if kind == "transition":
                    mine.append((now, ts(msg.event_time), msg.transition.to_level))
                    self._transitions += 1
                    if self._transitions >= self._want:
                        self._changed.set()
                elif kind == "snapshot":
                    self._snapshots += 1
                    if self._snapshots >= self.n:
                        self._changed.set()
                else:
                    self.sample_count += 1
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.CANCELLED:
                self.errors.append(f"{err.code().name}: {err.details()}")

    async def _until(self, done, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what}: waited {timeout:.0f} s ({self._snapshots} "
                                   f"snapshots, {self._transitions} transitions, errors "
                                   f"{self.errors[:3]})")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))

    async def wait_transitions(self, k: int, timeout: float) -> None:
        """Until every subscriber has received k transitions."""
        self._want = self.n * k
        await self._until(lambda: self._transitions >= self._want, timeout, f"transition {k}")

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for ch in self._channels:
            await ch.close()


# -- fan-out -----------------------------------------------------------------------------
@dataclass
class FanoutResult:
    delays_ms: list[float]  # every subscriber x measured transition
    per_transition: list[dict]
    connect_s: float
    samples_received: int


async def fanout(args, server, cgroup: ChildCgroup) -> FanoutResult:
    total = psutil.virtual_memory().total
    proc = psutil.Process(server.proc.pid)
    subs = Subscribers(server.address, args.subscribers, args.channels, args.samples)
    log(f"connecting {args.subscribers} subscribers over {args.channels} channels")
    connect_s = await subs.start()
    log(f"  connected in {connect_s:.1f} s")
    rng = random.Random(args.seed)
    per: list[dict] = []
    delays: list[float] = []
    spy = None
    machine = Machine(server.proc.pid)
    async with grpc.aio.insecure_channel(server.address) as ch:
        control = control_pb2_grpc.ControlServiceStub(ch)
        try:
            k = 0  # transition 1 is a warm-up
            discarded = 0
            while len(per) < args.transitions and k < 3 * args.transitions + 1:
                k += 1
                if k == 2 and args.profile:
                    spy = start_spy(server, Path(args.profile), "fanout")
                down = k % 2 == 1
                await machine.wait_quiet(args.foreign_limit, args.quiet_wait)
                m0 = machine.sample()
                cpu0 = time.process_time()
                srv0 = sum(proc.cpu_times()[:2])
                if down:
                    status = await control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest())
                    usage = max(proc.memory_info().rss, status.readings.process_bytes)
                    # (RSS and the last tick agree here: nothing loads or generates.)
                    limit = limit_for_ceiling(int(usage / SOFT_SHARE), total)
                    cgroup.set_limit(limit)
                else:
                    cgroup.set_limit(None)
                await subs.wait_transitions(k, args.timeout)
                foreign = machine.foreign_cores(m0, machine.sample())
                client_cpu = (time.process_time() - cpu0) * 1e3
                server_cpu = (sum(proc.cpu_times()[:2]) - srv0) * 1e3
                rows = [r[k - 1] for r in subs.received]
                d = [(recv - event) * 1e3 for recv, event, _ in rows]
                levels = {lvl for _, _, lvl in rows}
                expect = types_pb2.PRESSURE_LEVEL_SOFT if down else types_pb2.PRESSURE_LEVEL_OK
                if levels != {expect}:
                    raise RuntimeError(f"transition {k}: subscribers saw levels {levels}, "
                                       f"expected {expect}")
                first = min(recv for recv, _, _ in rows)
                last = max(recv for recv, _, _ in rows)
                info = {"k": k, "to": "soft" if down else "ok",
                        "p50_ms": statistics.median(d), "p99_ms": percentile(d, 99),
                        "max_ms": max(d), "min_ms": min(d),
                        "spread_ms": (last - first) * 1e3,
                        "client_cpu_ms": client_cpu, "server_cpu_ms": server_cpu,
                        "foreign": foreign}
                # Wall time of the window: the step, the tick, the fan-out.
                noisy = machine.disturbed(foreign, max(d) / 1e3 + 0.3, args.foreign_limit)
                note = ""
                if k == 1:
                    note = " (warm-up)"
                elif noisy and discarded < 2 * args.transitions:
                    discarded += 1
                    note = " — DISCARDED: other processes were busy"
                else:
                    per.append(info)
                    delays.extend(d)
                log(f"  transition {k} ({info['to']}): p50 {info['p50_ms']:.1f} ms, p99 "
                    f"{info['p99_ms']:.1f} ms, max {info['max_ms']:.1f} ms, first→last "
                    f"receipt {info['spread_ms']:.1f} ms; CPU client {client_cpu:.0f} ms, "
                    f"server {server_cpu:.0f} ms; others {foreign:.2f} cores{note}")
                await asyncio.sleep(0.3 + 0.3 * rng.random())
        finally:
            with contextlib.suppress(OSError):
                cgroup.set_limit(None)
            if spy is not None:
                report = stop_spy(spy)
                if report:
                    print_profile(report, f"server during the fan-out ({report['file']})")
            await subs.close()
    return FanoutResult(delays, per, connect_s, subs.sample_count)


# -- throughput --------------------------------------------------------------------------
@dataclass
class TputRun:
    mode: str
    tok_s: float
    ttft_p50_ms: float
    foreign: float
    server_cpu_ms_per_tok: float
    samples_received: int = 0


async def throughput(args, server, path: Path) -> list[TputRun]:
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(path))
    prompts = make_prompts(tokenizer, args.streams, 32, 64, seed=args.seed)
    side = GrpcSide(server.address, False, server.proc.pid)
    machine = Machine(server.proc.pid)
    runs: list[TputRun] = []
    modes = ["without", "connected"] + (["samples"] if not args.no_samples_row else [])
    try:
        for m in modes:  # warm-up
            await one_run(side, machine, server, prompts, args, m, warm=True)
        for rep in range(args.repeats):
            order = modes if rep % 2 == 0 else list(reversed(modes))
            for m in order:
                runs.append(await one_run(side, machine, server, prompts, args, m))
                r = runs[-1]
                log(f"  [{rep + 1}/{args.repeats}] {m:9s}: {r.tok_s:.0f} tok/s, TTFT p50 "
                    f"{r.ttft_p50_ms:.1f} ms, others {r.foreign:.2f} cores")
    finally:
        await side.close()
    return runs


async def one_run(side: GrpcSide, machine: Machine, server, prompts, args, mode: str,
                  warm: bool = False) -> TputRun:
    """One Generate run; a run during which other processes used more than
    --foreign-limit cores is run again (at most --retries times)."""
    for attempt in range(args.retries + 1):
        subs = None
        if mode != "without":
            subs = Subscribers(server.address, args.subscribers, args.channels,
                               samples=mode == "samples")
            await subs.start()
            await asyncio.sleep(0.5)
        try:
            await machine.wait_quiet(args.foreign_limit, args.quiet_wait)
            before = subs.sample_count if subs else 0
            a = machine.sample()
            run = await side.run(prompts, args.max_tokens)
            foreign = machine.foreign_cores(a, machine.sample())
            samples = (subs.sample_count - before) if subs else 0
        finally:
            if subs is not None:
                await subs.close()
        result = TputRun(mode, run.tok_s, run.ttft_p50_ms, foreign,
                         run.server_cpu_s / run.tokens * 1e3, samples)
        if warm or not machine.disturbed(foreign, run.wall_s, args.foreign_limit):
            return result
        log(f"  {mode}: {run.tok_s:.0f} tok/s — DISCARDED, other processes used "
            f"{foreign:.2f} cores (attempt {attempt + 1})")
    return result


# -- py-spy -------------------------------------------------------------------------------
def start_spy(server, out_dir: Path, label: str):
    py_spy = find_py_spy()
    if py_spy is None:
        log("--profile needs py-spy (pip install py-spy)")
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    raw = out_dir / f"server-{label}.txt"
    cmd = [py_spy, "record", "--pid", str(server.proc.pid), "--format", "raw", "--output",
           str(raw), "--rate", "500", "--threads", "--nonblocking"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)
    return proc, raw


def stop_spy(spy) -> dict | None:
    proc, raw = spy
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    if not raw.exists():
        return None
    report = analyze_collapsed(raw)
    report["file"] = str(raw)
    report["mode"] = "cpu"
    return report


# -- report ---------------------------------------------------------------------------------
def summarize_tput(runs: list[TputRun]) -> list[dict]:
    base = statistics.median(r.tok_s for r in runs if r.mode == "without")
    rows = []
    for mode, label in (("without", "no subscribers"),
                        ("connected", "1,000 subscribers connected (transitions only)"),
                        ("samples", "1,000 subscribers taking every tick's sample")):
        rs = [r for r in runs if r.mode == mode]
        if not rs:
            continue
        tok = statistics.median(r.tok_s for r in rs)
        rows.append({
            "mode": mode, "label": label, "runs": len(rs), "tok_s": tok,
            "ratio": tok / base, "ttft_ms": statistics.median(r.ttft_p50_ms for r in rs),
            "cpu_ms_tok": statistics.median(r.server_cpu_ms_per_tok for r in rs),
            "foreign": max(r.foreign for r in rs),
            "samples": max(r.samples_received for r in rs),
        })
    return rows


def print_report(args, fan: FanoutResult | None, skipped: str | None,
                 tput: list[dict] | None) -> None:
    print(f"\nWatchPressure fan-out — demo-tiny, {args.subscribers} subscribers over "
          f"{args.channels} channels ({args.subscribers // args.channels} streams each), "
          f"{'transitions and samples' if args.samples else 'transitions only'}; "
          f"{os.cpu_count()} CPUs, {platform.system()} {platform.machine()}, "
          f"Python {platform.python_version()}\n")
    if fan is None:
        print(f"fan-out: {skipped or 'skipped (--skip-fanout)'}")
    else:
        d = fan.delays_ms
        p99 = percentile(d, 99)
        print("| transitions | deliveries | p50 (ms) | p99 (ms) | max (ms) | "
              "first→last receipt, median (ms) | target p99 | verdict |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {len(fan.per_transition)} | {len(d)} | {statistics.median(d):.1f} | "
              f"{p99:.1f} | {max(d):.1f} | "
              f"{statistics.median(t['spread_ms'] for t in fan.per_transition):.1f} | "
              f"≤ {FANOUT_P99_TARGET_MS:g} | "
              f"{'PASS' if p99 <= FANOUT_P99_TARGET_MS else 'MISS'} |")
        print(f"\nconnecting {args.subscribers} streams took {fan.connect_s:.1f} s")
        print(f"CPU per transition, medians: this client (all {args.subscribers} "
              f"subscribers) {statistics.median(t['client_cpu_ms'] for t in fan.per_transition):.0f}"
              f" ms, server {statistics.median(t['server_cpu_ms'] for t in fan.per_transition):.0f}"
              " ms (from the step to the last receipt, the tick included); other processes "
              f"used up to {max(t['foreign'] for t in fan.per_transition):.2f} cores")
        print("\nper transition (p50 / p99 / max ms, first→last receipt ms, CPU client / "
              "server ms):")
        for t in fan.per_transition:
            print(f"  {t['k']:3d} → {t['to']:4s}  {t['p50_ms']:6.1f} / {t['p99_ms']:6.1f} / "
                  f"{t['max_ms']:6.1f}   {t['spread_ms']:6.1f}   {t['client_cpu_ms']:4.0f} / "
                  f"{t['server_cpu_ms']:4.0f}")
    if tput:
        print(f"\nGenerate throughput with and without the subscribers — {args.streams} "
              f"streams × {args.max_tokens} tokens, ignore_eos, medians of {args.repeats} "
              "alternating runs\n")
        print("| subscribers | runs | tok/s | ratio | target | verdict | TTFT p50 (ms) | "
              "server CPU ms/tok | others, max (cores) | samples received during a run |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in tput:
            target = verdict = ""
            if r["mode"] == "connected":
                target = f"≥ {THROUGHPUT_RATIO_TARGET}"
                verdict = "PASS" if r["ratio"] >= THROUGHPUT_RATIO_TARGET else "MISS"
            print(f"| {r['label']} | {r['runs']} | {r['tok_s']:.0f} | {r['ratio']:.3f} | "
                  f"{target} | {verdict} | {r['ttft_ms']:.1f} | {r['cpu_ms_tok']:.2f} | "
                  f"{r['foreign']:.2f} | {r['samples']} |")


# -- main -----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--subscribers", type=int, default=1000)
    p.add_argument("--channels", type=int, default=10)
    p.add_argument("--transitions", type=int, default=20,
                   help="measured transitions (default 20, after one warm-up)")
    p.add_argument("--samples", action="store_true",
                   help="fan-out subscribers also take every tick's sample")
    p.add_argument("--timeout", type=float, default=20.0,
                   help="seconds to wait for a transition to reach everyone (default 20)")
    p.add_argument("--skip-fanout", action="store_true")
    p.add_argument("--skip-throughput", action="store_true")
    p.add_argument("--no-samples-row", action="store_true",
                   help="throughput: skip the row with subscribers taking samples")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--foreign-limit", type=float, default=0.15,
                   help="wait until other processes use at most this many cores")
    p.add_argument("--quiet-wait", type=float, default=60.0)
    p.add_argument("--retries", type=int, default=3,
                   help="runs again a throughput run disturbed by other processes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", metavar="DIR", default=None,
                   help="py-spy the server during the measured fan-out transitions")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = ensure_demo_model("tiny")
    fan = None
    skipped = None
    tput = None
    try:
        cgroup = ChildCgroup.create()
    except CgroupUnavailable as exc:
        cgroup = None
        skipped = f"SKIPPED: {exc}"
    with tempfile.TemporaryDirectory(prefix="plimsoll-bench-") as tmp:
        server_args = ["--model", str(path), "--memory-guard-gb", "4", "--poll-idle", "0.25",
                       "--poll-empty", "0.25"]
        prefix = cgroup.prefix() if cgroup is not None else None
        try:
            with serving(Path(tmp), *server_args, prefix=prefix, timeout=300) as server:
                if cgroup is not None and not args.skip_fanout:
                    fan = asyncio.run(fanout(args, server, cgroup))
                if not args.skip_throughput:
                    log("throughput: without / with subscribers")
                    tput = summarize_tput(asyncio.run(throughput(args, server, path)))
        finally:
            if cgroup is not None:
                cgroup.destroy()
    print_report(args, fan, skipped, tput)
    return 0


if __name__ == "__main__":
    sys.exit(main())
