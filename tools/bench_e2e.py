"""End to end: Plimsoll against stock `mlx_lm.server`, prefill and decode, 1 and 8 streams.

    python -m tools.bench_e2e                    # small + medium, fp32/bf16/4bit (~25-35 min)
    python -m tools.bench_e2e --quick            # small only, short prompts (~7 min, 2 cores)
    python -m tools.bench_e2e --models small --variants bf16,4bit --servers plimsoll,mlx_lm
    python -m tools.bench_e2e --bandwidth --json e2e.json   # + decode against memory bandwidth

Issue 10's end-to-end table. Three servers, each a subprocess on the same model folder:

* plimsoll: `python -m service.cli serve --model PATH` with the optimized BLAS (the
  `[blas]` extra, PLIMSOLL_BLAS=auto) and so the fast prefill path (engine/fast_prefill.py);
* reference: the same with PLIMSOLL_BLAS=reference (MLX's bundled reference BLAS, fast
  prefill off: it needs the optimized BLAS);
* mlx_lm: stock `python -m mlx_lm server --model PATH --port P` (mlx-cpu with its own
  reference BLAS), spoken to over its OpenAI HTTP API: `/v1/completions`, streamed, with
  its prompt cache off (`--prompt-cache-size 0`: every prompt is prefilled).

Both Plimsoll servers run with `--no-session-bank` (no KV reuse between requests either)
and `--memory-guard-gb 8` (the governor stays still). All servers are up at once; each
measurement runs on one while the others are stopped (SIGSTOP), in rounds that alternate
the order (A B C, C B A, ...), so that a slow drift or a neighbour hits every side alike.

A measurement: N concurrent requests (N = 1 or 8), the same prompts for every server in a
round (exactly L tokens each, as the server counted them; fresh prompts each round),
temperature 0, max_tokens D, generation never stopped early (Plimsoll: ignore_eos;
mlx_lm: its special tokens get logit_bias -1e9, which only rules them out).

* prefill tok/s = prompt tokens / time to first token; with N streams, all prompt tokens /
  (last stream's first token - first request sent);
* decode tok/s = (generated - 1) / (last token - first token); with N streams, the tokens
  streamed while all N were decoding / that window (last first token -> first last token).

A random-weight model sometimes emits bytes that end inside a UTF-8 character; both servers
then hold that text back (Plimsoll its ids too), which would read as a late first token.
So each round's prompts are first run once, unmeasured, on Plimsoll, and any whose stream
came bunched are replaced; a Plimsoll stream still held falls back to the start message's
arrival + the server's own time to first token, and the table counts held runs.

Prompt and decode lengths (`--prompt-tokens`, `--decode-tokens`) are the same for every
server of a row. They are cut for a row whose slowest server would take longer than
`--budget-s` per measurement (stock 4-bit prefills at ~1-8 tok/s on 2 cores): a probe on
each server (16-token prompt, 6 tokens) sets the lengths; the table prints them. A server
still estimated over `--skip-above-s` at the minimum lengths is left out of that row.

`--bandwidth` measures the machine's read bandwidth in the same run (NumPy reductions over
a `--bandwidth-gib` buffer, far larger than the last-level cache, split over as many
threads as the server's BLAS uses: engine.blas.usable_cpus()), before and after the
servers run, and divides single-stream Plimsoll decode by it: bytes per token = the
weights a decode step reads (every tensor of the checkpoint but the input embedding, of
which one row; the whole table when it is tied to the head) + the KV cache read at the
mean context of the decode (L + D/2 tokens). Goal: >= 80 %.

Goals over stock mlx_lm.server (reported, not asserted): float32 >= 40x prefill and >= 5.5x
decode; bfloat16 and 4-bit >= 10x prefill and no slower decode. `--quick` rows use short
prompts (the budget cuts them to 32-128 tokens), which lowers every fast-path prefill ratio:
read it as a check of the tool, not of the goals.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata as md
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import zlib
from dataclasses import asdict, dataclass, field
from multiprocessing.pool import ThreadPool
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a file, not with -m
    sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from engine.blas import usable_cpus  # noqa: E402
from engine.demo_models import ensure_demo_variant  # noqa: E402
from tools.bench_blas import machine_line  # noqa: E402
from tools.harness.generate import Prompt, make_prompts  # noqa: E402
from tools.harness.report import log  # noqa: E402
from tools.harness.server import ServerProcess, free_port, start_server  # noqa: E402

SERVERS = ("plimsoll", "reference", "mlx_lm")
SERVER_ENV = {"plimsoll": "auto", "reference": "reference"}
VARIANTS = ("fp32", "bf16", "4bit")
# variant: (prefill x, decode x) over stock mlx_lm.server
GOALS = {"fp32": (40.0, 5.5), "bf16": (10.0, 1.0), "4bit": (10.0, 1.0)}
BANDWIDTH_GOAL = 0.80
DECODE_NOISE = 0.97  # a decode ratio in [0.97, 1.0) is "no slower" within noise
PROBE_PROMPT = 16  # tokens: at the fast path's minimum rows, so it is exercised
PROBE_DECODE = 6
LENGTH_STEP = 16  # prompt lengths are cut to multiples of this


def elapsed(t0: float) -> str:
    s = time.perf_counter() - t0
    return f"{s // 60:.0f} min {s % 60:02.0f} s"


# -- servers -------------------------------------------------------------------------------
@dataclass
class Stream:
    """One request as the client saw it."""

    sent: float
    stamps: list[tuple[float, int]]  # (arrival, tokens) of every chunk that carried tokens
    prompt_tokens: int  # as the server counted them
    completion_tokens: int  # as the server counted them
    # Plimsoll only: the start message's arrival and the server's own time to first token
    # (from admission, which sends the start message): where the first token's text was
    # held back (a random model's bytes that end inside a UTF-8 character), the first
    # chunk comes late with several ids, and start + server TTFT is when it was made.
    start_at: float | None = None
    server_ttft: float | None = None

    @property
    def held(self) -> bool:
        """The first token's text was held back, or most tokens came bunched."""
        return self.stamps[0][1] > 1 or len(self.stamps) < 0.75 * self.completion_tokens

    @property
    def first(self) -> float:
        if self.stamps[0][1] > 1 and self.start_at is not None and self.server_ttft:
            return min(self.stamps[0][0], self.start_at + self.server_ttft)
        return self.stamps[0][0]

    @property
    def last(self) -> float:
        return self.stamps[-1][0]


class Side:
    name: str
    pid: int
    log_path: Path
    info: dict

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, prompt: Prompt, max_tokens: int) -> Stream:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError


class PlimsollSide(Side):
    def __init__(self, name: str, path: Path, log_dir: Path, extra: list[str]) -> None:
        self.name = name
        self.server: ServerProcess = start_server(
            log_dir, "--model", str(path), "--no-session-bank", "--memory-guard-gb", "8",
            *extra, env={"PLIMSOLL_BLAS": SERVER_ENV[name]}, timeout=600)
        self.pid = self.server.proc.pid
        self.log_path = self.server.log_path
        self.channel = None
        self.stub = None
        import grpc

        from plimsoll.v1 import control_pb2, control_pb2_grpc

        with grpc.insecure_channel(self.server.address) as ch:
            status = control_pb2_grpc.ControlServiceStub(ch).GetMemoryStatus(
                control_pb2.GetMemoryStatusRequest(), timeout=60)
        blas = {f.name: v for f, v in status.blas.ListFields()}
        plan = [line.split(": ", 1)[-1] for line in self.server.log().splitlines()
                if "fast prefill" in line]
        self.info = {"blas": blas, "fast_prefill": plan[-1] if plan else "?"}

    async def open(self) -> None:
        import grpc

        from plimsoll.v1 import inference_pb2_grpc

        self.channel = grpc.aio.insecure_channel(self.server.address)
        self.stub = inference_pb2_grpc.InferenceServiceStub(self.channel)

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()
        self.channel = self.stub = None

    async def generate(self, prompt: Prompt, max_tokens: int) -> Stream:
        from plimsoll.v1 import inference_pb2 as pb

        req = pb.GenerateRequest(max_tokens=max_tokens, ignore_eos=True,
                                 sampling=pb.SamplingParams(temperature=0.0))
        req.token_ids.ids.extend(prompt.ids)
        sent = time.perf_counter()
        stamps: list[tuple[float, int]] = []
        prompt_tokens = completion = -1
        start_at = server_ttft = None
        async for msg in self.stub.Generate(req, timeout=1800):
            kind = msg.WhichOneof("event")
            if kind == "chunk" and msg.chunk.token_ids:
                stamps.append((time.perf_counter(), len(msg.chunk.token_ids)))
            elif kind == "start":
                start_at = time.perf_counter()
                prompt_tokens = msg.start.prompt_tokens
            elif kind == "end":
                completion = msg.end.usage.completion_tokens
                server_ttft = msg.end.timings.time_to_first_token.ToNanoseconds() / 1e9
        return Stream(sent, stamps, prompt_tokens, completion, start_at, server_ttft)

    def stop(self) -> None:
        self.server.stop()


class MlxLmSide(Side):
    """Stock `mlx_lm server`: its OpenAI-style HTTP API, streamed (server-sent events)."""

    def __init__(self, path: Path, log_dir: Path, banned: list[int]) -> None:
        self.name = "mlx_lm"
        self.port = free_port()
        self.log_path = log_dir / f"mlx_lm-{self.port}.log"
        self.banned = banned
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(path),
               "--port", str(self.port), "--prompt-cache-size", "0", "--log-level", "WARNING"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PLIMSOLL_")}
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         env=env)
        self.pid = self.proc.pid
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mlx_lm server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health",
                                            timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError("mlx_lm server not healthy after 600 s")
            time.sleep(0.3)
        self.info = {"command": " ".join(["python", *cmd[1:4], "--model", "PATH", "--port", "P",
                                          *cmd[8:]]),
                     "blas": "MLX's bundled reference BLAS (mlx[cpu], not preloaded)"}

    async def generate(self, prompt: Prompt, max_tokens: int) -> Stream:
        body = json.dumps({
            "prompt": prompt.text, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
            "logit_bias": {str(t): -1e9 for t in self.banned},
        }).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port,
                                                       limit=1 << 22)
        stamps: list[tuple[float, int]] = []
        usage: dict = {}
        try:
            sent = time.perf_counter()
            writer.write(head + body)
            await writer.drain()
            status = await reader.readline()
            if b" 200 " not in status:
                rest = await reader.read()
                raise RuntimeError(f"mlx_lm server: {status!r} {rest[-500:]!r}")
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # headers
            while True:
                line = await reader.readline()
                if not line:
                    break
                if not line.startswith(b"data: "):
                    continue  # blank separators and ": keepalive" comments
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                msg = json.loads(payload)
                now = time.perf_counter()
                if msg.get("usage"):
                    usage = msg["usage"]
                for choice in msg.get("choices") or []:
                    if choice.get("text"):
                        stamps.append((now, 1))  # one token's text per event
                    elif choice.get("finish_reason") and not stamps:
                        stamps.append((now, 1))  # no text at all: the end stands for it
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if cached:
            raise RuntimeError(f"mlx_lm server reused {cached} cached prompt tokens")
        return Stream(sent, stamps, usage.get("prompt_tokens", -1),
                      usage.get("completion_tokens", -1))

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGCONT)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- how busy the rest of the machine is -----------------------------------------------------
class Load:
    """CPU other processes use: system busy time less this process's and the servers'."""

    def __init__(self, pids: list[int]) -> None:
        self.procs = [psutil.Process(p) for p in pids]

    def sample(self) -> tuple[float, float]:
        t = psutil.cpu_times()
        busy = sum(t) - t.idle - getattr(t, "iowait", 0.0)
        busy -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
        ours = time.process_time()
        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                c = p.cpu_times()
                ours += c.user + c.system
        return time.perf_counter(), busy - ours

    @staticmethod
    def cores(a, b) -> float:
        return max(0.0, b[1] - a[1]) / (b[0] - a[0]) if b[0] > a[0] else 0.0

    async def wait_quiet(self, limit: float, max_wait: float) -> float:
        deadline = time.monotonic() + max_wait
        while True:
            a = self.sample()
            await asyncio.sleep(0.5)
            foreign = self.cores(a, self.sample())
            if foreign <= limit or time.monotonic() >= deadline:
                return foreign
            log(f"    others use {foreign:.2f} cores: waiting")


# -- one measurement -------------------------------------------------------------------------
@dataclass
class Measurement:
    server: str
    streams: int
    prompt_tokens: int
    decode_tokens: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_method: str  # "single", "window" (all streams decoding) or "sum" (fallback)
    ttft_ms: list[float]
    wall_s: float
    foreign_cores: float
    text_events_short: int = 0  # tokens whose text came in another token's event
    held: int = 0  # streams whose text was held back (Stream.held)


def summarize_streams(server: str, streams: list[Stream], plen: int, dlen: int,
                      wall: float, foreign: float) -> Measurement:
    n = len(streams)
    t0 = min(s.sent for s in streams)
    prefill = n * plen / (max(s.first for s in streams) - t0)
    if n == 1:
        s = streams[0]
        span = s.last - s.first
        decode = (s.completion_tokens - s.stamps[0][1]) / span if span > 0 else 0.0
        method = "single"
    else:
        ta = max(s.first for s in streams)
        tb = min(s.last for s in streams)
        spans = statistics.mean(s.last - s.first for s in streams)
        if tb - ta > 0.25 * spans:
            tokens = sum(k for s in streams for t, k in s.stamps if ta < t <= tb)
            decode = tokens / (tb - ta)
            method = "window"
        else:  # the streams hardly decoded together: each stream's own rate, summed
            decode = sum((s.completion_tokens - s.stamps[0][1]) / (s.last - s.first)
                         for s in streams if s.last > s.first)
            method = "sum"
    short = sum(s.completion_tokens - len(s.stamps) for s in streams)
    return Measurement(server, n, plen, dlen, prefill, decode, method,
                       [(s.first - s.sent) * 1e3 for s in streams], wall, foreign, short,
                       sum(s.held for s in streams))


async def run_streams(side: Side, load: Load, prompts: list[Prompt], max_tokens: int
                      ) -> tuple[list[Stream], float, float]:
    """The prompts as concurrent requests on a thawed `side`: (streams, wall s, cores
    other processes used meanwhile); the side is frozen again afterwards."""
    side.thaw()
    try:
        await side.open()
        a = load.sample()
        t = time.perf_counter()
        streams = await asyncio.gather(*(side.generate(p, max_tokens) for p in prompts))
        wall = time.perf_counter() - t
        foreign = load.cores(a, load.sample())
    finally:
        await side.close()
        side.freeze()
    for p, s in zip(prompts, streams, strict=True):
        if s.prompt_tokens != len(p.ids):
            raise RuntimeError(f"{side.name} counted {s.prompt_tokens} prompt tokens, the "
                               f"client sent {len(p.ids)}: the prompts differ")
        if s.completion_tokens != max_tokens or not s.stamps:
            raise RuntimeError(f"{side.name} generated {s.completion_tokens} tokens "
                               f"({len(s.stamps)} events), {max_tokens} asked for")
    return list(streams), wall, foreign


async def measure(side: Side, load: Load, prompts: list[Prompt], max_tokens: int) -> Measurement:
    streams, wall, foreign = await run_streams(side, load, prompts, max_tokens)
    return summarize_streams(side.name, streams, len(prompts[0].ids), max_tokens, wall,
                             foreign)


async def screened_prompts(side: Side, load: Load, tokenizer, n: int, plen: int, dlen: int,
                           seed: int, tries: int = 4) -> tuple[list[Prompt], int]:
    """n prompts of plen tokens whose greedy continuation streams token by token on `side`
    (an unmeasured run): a random model sometimes emits bytes that end inside a UTF-8
    character, whose text (and, on Plimsoll, ids) then wait, which would read as a late
    first token. Held prompts are replaced, up to `tries` runs; (prompts, replaced)."""
    prompts = make_prompts(tokenizer, n, plen, plen, seed=seed)
    replaced = 0
    for attempt in range(tries):
        streams, _, _ = await run_streams(side, load, prompts, dlen)
        bad = [i for i, st in enumerate(streams) if st.held]
        if not bad:
            break
        if attempt == tries - 1:
            log(f"    {len(bad)} prompt(s) still held back after {tries} tries: kept")
            break
        taken = {tuple(p.ids) for p in prompts}
        for i in bad:
            k = 1
            while True:
                cand = make_prompts(tokenizer, i + 1, plen, plen,
                                    seed=seed + 7919 * (attempt + 1) + k)[i]
                if tuple(cand.ids) not in taken:
                    break
                k += 1
            taken.add(tuple(cand.ids))
            prompts[i] = cand
            replaced += 1
    return prompts, replaced


# -- one model -------------------------------------------------------------------------------
@dataclass
class Probe:
    prefill_tok_s: float
    decode_tok_s: float


@dataclass
class Row:
    model: str
    variant: str
    streams: int
    prompt_tokens: int
    decode_tokens: int
    runs: dict[str, list[dict]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    replaced_prompts: int = 0  # held back on the screening server, replaced

    def median(self, server: str, key: str) -> float | None:
        got = [r[key] for r in self.runs.get(server, [])]
        return statistics.median(got) if got else None


def plan_lengths(args, probes: dict[str, Probe], streams: int) -> tuple[int, int, dict]:
    """(prompt tokens, decode tokens, {server: why skipped}) for one row."""
    def est(p: Probe, plen: int, dlen: int) -> float:
        # Prefill rows cost what they cost; decode assumes no gain from batching (stock
        # kernels on 2 cores are mostly compute-bound): an overestimate, never under.
        return streams * plen / p.prefill_tok_s + streams * (dlen - 1) / p.decode_tok_s

    skipped = {}
    for name, p in probes.items():
        low = est(p, args.min_prompt_tokens, args.min_decode_tokens)
        if name != "plimsoll" and low > args.skip_above_s:
            skipped[name] = f"estimated {low:.0f} s at the shortest lengths"
    kept = [p for n, p in probes.items() if n not in skipped]
    rp = min(p.prefill_tok_s for p in kept)
    rd = min(p.decode_tok_s for p in kept)
    half = args.budget_s / 2
    plen = int(half * rp / streams) // LENGTH_STEP * LENGTH_STEP
    plen = max(args.min_prompt_tokens, min(args.prompt_tokens, plen))
    dlen = int(half * rd / streams) + 1
    dlen = max(args.min_decode_tokens, min(args.decode_tokens, dlen))
    return plen, dlen, skipped


async def probe(side: Side, load: Load, tokenizer, seed: int) -> Probe:
    """Warm-up (a short prompt, 1 token: loads the weights), then a 16-token prompt with 6
    tokens: the rates that size the row."""
    await measure(side, load, make_prompts(tokenizer, 1, 4, 8, seed=seed), 1)
    for k in range(3):  # a held-back first token would read as a slow prefill
        m = await measure(side, load, make_prompts(tokenizer, 1, PROBE_PROMPT, PROBE_PROMPT,
                                                   seed=seed + 1 + k), PROBE_DECODE)
        if not m.held:
            break
    return Probe(m.prefill_tok_s, m.decode_tok_s)


def start_sides(args, path: Path, log_dir: Path, banned: list[int]) -> dict[str, Side]:
    sides: dict[str, Side] = {}
    try:
        for name in args.servers:
            log(f"  starting {name}")
            if name == "mlx_lm":
                sides[name] = MlxLmSide(path, log_dir, banned)
            else:
                sides[name] = PlimsollSide(name, path, log_dir, args.server_arg)
            sides[name].freeze()
    except BaseException:
        for s in sides.values():
            s.stop()
        raise
    return sides


async def bench_model(args, size: str, variant: str, log_dir: Path, out: dict) -> list[Row]:
    import mlx_lm.tokenizer_utils

    path = ensure_demo_variant(size, variant)
    tokenizer = mlx_lm.tokenizer_utils.load(path)
    banned = sorted(set(getattr(tokenizer, "all_special_ids", []) or [])
                    | set(tokenizer.eos_token_ids))
    rows: list[Row] = []
    label = f"{size}-{variant}"
    began = time.perf_counter()
    sides = start_sides(args, path, log_dir, banned)
    out["servers"][label] = {n: s.info for n, s in sides.items()}
    load = Load([s.pid for s in sides.values()])
    try:
        probes = {}
        for i, (name, side) in enumerate(sides.items()):
            probes[name] = await probe(side, load, tokenizer, seed=1000 + 10 * i)
            log(f"  {label} {name} probe: prefill {probes[name].prefill_tok_s:.1f} tok/s, "
                f"decode {probes[name].decode_tok_s:.1f} tok/s")
        out["probes"][label] = {n: asdict(p) for n, p in probes.items()}
        for streams in args.streams:
            plen, dlen, skipped = plan_lengths(args, probes, streams)
            row = Row(size, variant, streams, plen, dlen, skipped=skipped)
            order = [n for n in sides if n not in skipped]
            screen = "plimsoll" if "plimsoll" in order else order[0]
            for n, why in skipped.items():
                log(f"  {label} {streams} streams: {n} skipped ({why})")
            t_row = time.perf_counter()
            rnd = 0
            while rnd < args.repeats and (rnd == 0 or time.perf_counter() - t_row
                                          < args.row_seconds):
                await load.wait_quiet(args.foreign_limit, args.quiet_wait)
                prompts, replaced = await screened_prompts(
                    sides[screen], load, tokenizer, streams, plen, dlen,
                    seed=zlib.crc32(f"{label}/{streams}/{rnd}".encode()))
                row.replaced_prompts += replaced
                for name in order if rnd % 2 == 0 else order[::-1]:
                    m = await measure(sides[name], load, prompts, dlen)
                    row.runs.setdefault(name, []).append(asdict(m))
                    log(f"  {label} {streams} stream(s) L={plen} D={dlen} round {rnd + 1} "
                        f"{name:9s}: prefill {m.prefill_tok_s:8.1f} tok/s, decode "
                        f"{m.decode_tok_s:7.1f} tok/s ({m.decode_method}; {m.wall_s:.1f} s, "
                        f"others {m.foreign_cores:.2f} cores"
                        + (f"; {m.held} stream(s) held back" if m.held else "") + ")")
                rnd += 1
            rows.append(row)
    finally:
        for s in sides.values():
            s.stop()
    log(f"  {label} done in {elapsed(began)}")
    return rows


# -- memory bandwidth ------------------------------------------------------------------------
def read_bandwidth(threads: int, gib: float, repeats: int = 8) -> dict:
    """Best read bandwidth (GB/s) of a few NumPy reductions over a buffer of `gib` GiB,
    split into one slice per thread (NumPy releases the GIL in them)."""
    import numpy as np

    buf = np.full(int(gib * (1 << 30)) // 4, 1.5, dtype=np.float32)  # touched: resident
    kernels = {
        "uint64 bitwise_or.reduce": lambda p: np.bitwise_or.reduce(p.view(np.uint64)),
        "float32 max": lambda p: p.max(),
        "uint8 max": lambda p: p.view(np.uint8).max(),
        "float32 sum": lambda p: p.sum(),
    }
    out: dict = {"threads": threads, "buffer_gib": gib, "kernels": {}}
    for n in sorted({1, threads}):
        cut = [len(buf) * i // n // 64 * 64 for i in range(n)] + [len(buf)]
        parts = [buf[a:b] for a, b in zip(cut, cut[1:], strict=False)]
        with ThreadPool(n) as pool:
            for name, fn in kernels.items():
                best = 0.0
                for _ in range(repeats):
                    t = time.perf_counter()
                    pool.map(fn, parts)
                    best = max(best, buf.nbytes / (time.perf_counter() - t))
                out["kernels"][f"{name}, {n} thread{'s' if n > 1 else ''}"] = best / 1e9
    mine = {k: v for k, v in out["kernels"].items()
            if k.endswith(f"{threads} thread{'s' if threads > 1 else ''}")}
    out["kernel"], out["gb_s"] = max(mine.items(), key=lambda kv: kv[1])
    out["one_thread_gb_s"] = max(v for k, v in out["kernels"].items()
                                 if k.endswith(", 1 thread"))
    del buf
    return out


_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "U8": 1, "I8": 1,
             "I64": 8, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "I16": 2, "BOOL": 1}


def model_bytes(path: Path) -> dict:
    """Bytes of the checkpoint's tensors (safetensors headers), and what a decode step
    reads: all of them but the input embedding, of which one row (all of it when tied)."""
    config = json.loads((path / "config.json").read_text())
    total = embed = 0
    act = 2
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            b = t["data_offsets"][1] - t["data_offsets"][0]
            total += b
            if name.startswith("model.embed_tokens."):
                embed += b
            if name == "model.norm.weight":
                act = _ST_BYTES.get(t["dtype"], 2)  # the activations' (and KV's) dtype
    tied = bool(config.get("tie_word_embeddings"))
    vocab = int(config["vocab_size"])
    read = total if tied else total - embed + embed // vocab
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    kv = (2 * int(config["num_hidden_layers"]) * int(config.get("num_key_value_heads") or heads)
          * head_dim * act)
    return {"total_bytes": total, "embedding_bytes": embed, "read_per_step_bytes": read,
            "kv_bytes_per_token": kv, "activation_bytes": act, "tied": tied}


def l3_bytes() -> int:
    try:
        for d in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
            if (d / "level").read_text().strip() == "3":
                text = (d / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
                return int(text.rstrip("KMG")) * mult
    except (OSError, ValueError):
        pass
    return 0


def bandwidth_rows(rows: list[Row], bw: float) -> list[dict]:
    out = []
    for r in rows:
        dec = r.median("plimsoll", "decode_tok_s")
        if r.streams != 1 or dec is None:
            continue
        mb = model_bytes(ensure_demo_variant(r.model, r.variant))
        context = r.prompt_tokens + r.decode_tokens / 2
        per_token = mb["read_per_step_bytes"] + context * mb["kv_bytes_per_token"]
        achieved = dec * per_token / 1e9
        out.append({"model": r.model, "variant": r.variant, "context": context,
                    **mb, "bytes_per_token": per_token, "decode_tok_s": dec,
                    "achieved_gb_s": achieved, "bandwidth_gb_s": bw,
                    "fraction": achieved / bw, "limit_tok_s": bw * 1e9 / per_token})
    return out


# -- report ----------------------------------------------------------------------------------
def _x(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


def fmt_table(rows: list[Row]) -> str:
    lines = ["| model | variant | streams | prompt / decode tokens | server | runs | "
             "prefill tok/s | decode tok/s | prefill vs mlx_lm | decode vs mlx_lm | "
             "prefill vs reference | decode vs reference | others' cores, max |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        base = {k: r.median("mlx_lm", k) for k in ("prefill_tok_s", "decode_tok_s")}
        ref = {k: r.median("reference", k) for k in ("prefill_tok_s", "decode_tok_s")}
        for server in SERVERS:
            if server in r.skipped:
                lines.append(f"| {r.model} | {r.variant} | {r.streams} | {r.prompt_tokens} / "
                             f"{r.decode_tokens} | {server} | 0 | skipped: "
                             f"{r.skipped[server]} | | | | | | |")
                continue
            runs = r.runs.get(server)
            if not runs:
                continue
            p, d = r.median(server, "prefill_tok_s"), r.median(server, "decode_tok_s")
            foreign = max(x["foreign_cores"] for x in runs)
            held = sum(x["held"] > 0 for x in runs)
            nruns = f"{len(runs)}" + (f" ({held} held)" if held else "")
            vs_base = ("-", "-") if server == "mlx_lm" else (
                _x(p, base["prefill_tok_s"]), _x(d, base["decode_tok_s"]))
            vs_ref = ("-", "-") if server == "reference" else (
                _x(p, ref["prefill_tok_s"]), _x(d, ref["decode_tok_s"]))
            lines.append(f"| {r.model} | {r.variant} | {r.streams} | {r.prompt_tokens} / "
                         f"{r.decode_tokens} | {server} | {nruns} | {p:.1f} | {d:.1f} | "
                         f"{vs_base[0]} | {vs_base[1]} | {vs_ref[0]} | {vs_ref[1]} | "
                         f"{foreign:.2f} |")
    return "\n".join(lines)


def goal_rows(rows: list[Row]) -> list[dict]:
    out = []
    for r in rows:
        pl = {k: r.median("plimsoll", k) for k in ("prefill_tok_s", "decode_tok_s")}
        base = {k: r.median("mlx_lm", k) for k in ("prefill_tok_s", "decode_tok_s")}
        if None in (*pl.values(), *base.values()) or r.variant not in GOALS:
            continue
        gp, gd = GOALS[r.variant]
        px = pl["prefill_tok_s"] / base["prefill_tok_s"]
        dx = pl["decode_tok_s"] / base["decode_tok_s"]
        dok = "PASS" if dx >= gd else ("PASS (within 3 %)" if gd == 1.0 and dx >= DECODE_NOISE
                                       else "MISS")
        out.append({"model": r.model, "variant": r.variant, "streams": r.streams,
                    "prefill_x": px, "prefill_goal": gp,
                    "prefill": "PASS" if px >= gp else "MISS",
                    "decode_x": dx, "decode_goal": gd, "decode": dok})
    return out


def fmt_goals(goals: list[dict]) -> str:
    lines = ["| model | variant | streams | prefill vs mlx_lm | goal | | decode vs mlx_lm "
             "| goal | |", "|---|---|---:|---:|---:|---|---:|---:|---|"]
    for g in goals:
        lines.append(f"| {g['model']} | {g['variant']} | {g['streams']} | "
                     f"{g['prefill_x']:.2f}x | ≥ {g['prefill_goal']:g}x | {g['prefill']} | "
                     f"{g['decode_x']:.2f}x | ≥ {g['decode_goal']:g}x | {g['decode']} |")
    return "\n".join(lines)


def fmt_bandwidth(brows: list[dict], l3: int) -> str:
    lines = ["| model | variant | weights read / step (MB) | KV read / step (MB) | "
             "bytes / token (MB) | decode tok/s | achieved GB/s | bandwidth GB/s | "
             "limit tok/s | fraction | goal ≥ 80 % |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for b in brows:
        kv = b["context"] * b["kv_bytes_per_token"]
        verdict = "PASS" if b["fraction"] >= BANDWIDTH_GOAL else "MISS"
        if l3 and b["bytes_per_token"] <= l3:
            verdict += " (fits in L3)"
        lines.append(f"| {b['model']} | {b['variant']} | {b['read_per_step_bytes'] / 1e6:.1f} | "
                     f"{kv / 1e6:.2f} | {b['bytes_per_token'] / 1e6:.1f} | "
                     f"{b['decode_tok_s']:.1f} | {b['achieved_gb_s']:.1f} | "
                     f"{b['bandwidth_gb_s']:.1f} | {b['limit_tok_s']:.0f} | "
                     f"{100 * b['fraction']:.0f} % | {verdict} |")
    return "\n".join(lines)


def versions() -> dict:
    out = {}
    for dist in ("mlx", "mlx-cpu", "mlx-lm", "scipy-openblas32", "mkl", "intel-openmp", "numpy", "grpcio"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            out[dist] = "-"
    return out


# -- the run ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.bench_e2e",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a few minutes: --models small, 128/32 tokens, --budget-s 12, "
                   "--skip-above-s 90, --repeats 1 (explicit flags win)")
    p.add_argument("--models", default=None, help="demo sizes (default: small,medium; "
                   "quick: small)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help="demo variants (default: %(default)s)")
    p.add_argument("--streams", default="1,8", help="concurrent streams (default: %(default)s)")
    p.add_argument("--servers", default=",".join(SERVERS),
                   help="of plimsoll, reference, mlx_lm (default: %(default)s)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length, the longest (default 256; quick 128)")
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="tokens generated per stream, the most (default 64; quick 32)")
    p.add_argument("--min-prompt-tokens", type=int, default=32)
    p.add_argument("--min-decode-tokens", type=int, default=16)
    p.add_argument("--budget-s", type=float, default=None,
                   help="longest one measurement of the slowest server should take; longer "
                   "rows get shorter prompts and decodes (default 60; quick 12)")
    p.add_argument("--skip-above-s", type=float, default=None,
                   help="leave a reference or mlx_lm server out of a row it would take "
                   "longer than this on even at the minimum lengths (default 150; quick 90)")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds per row, at most (default 3; quick 1)")
    p.add_argument("--row-seconds", type=float, default=None,
                   help="further rounds only while the row has run less than this "
                   "(default 90)")
    p.add_argument("--foreign-limit", type=float, default=0.3,
                   help="wait before a round until other processes use at most this many "
                   "cores (default %(default)s)")
    p.add_argument("--quiet-wait", type=float, default=10.0,
                   help="but at most this many seconds (default %(default)s)")
    p.add_argument("--bandwidth", action="store_true",
                   help="measure read bandwidth and report single-stream decode against it")
    p.add_argument("--bandwidth-gib", type=float, default=1.0)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra argument for both Plimsoll servers (repeatable)")
    p.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                   help="write the servers' logs here (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {"models": "small" if quick else "small,medium",
                "prompt_tokens": 128 if quick else 256, "decode_tokens": 32 if quick else 64,
                "budget_s": 12.0 if quick else 60.0, "skip_above_s": 90.0 if quick else 150.0,
                "repeats": 1 if quick else 3, "row_seconds": 0.0 if quick else 90.0}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.models = [m for m in args.models.split(",") if m]
    args.variants = [v for v in args.variants.split(",") if v]
    args.streams = [int(s) for s in args.streams.split(",") if s]
    args.servers = [s for s in args.servers.split(",") if s]
    bad = set(args.servers) - set(SERVERS)
    if bad:
        p.error(f"unknown servers {sorted(bad)}: of {', '.join(SERVERS)}")
    if args.min_prompt_tokens < PROBE_PROMPT or args.min_decode_tokens < 2:
        p.error(f"--min-prompt-tokens >= {PROBE_PROMPT} and --min-decode-tokens >= 2")
    args.prompt_tokens = max(args.prompt_tokens, args.min_prompt_tokens)
    args.decode_tokens = max(args.decode_tokens, args.min_decode_tokens)
    return args


async def run(args, log_dir: Path) -> dict:
    out: dict = {"servers": {}, "probes": {}}
    rows: list[Row] = []
    for size in args.models:
        for variant in args.variants:
            log(f"{size}-{variant}")
            rows += await bench_model(args, size, variant, log_dir, out)
    out["rows"] = rows
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    began = time.perf_counter()
    threads = usable_cpus()
    report: dict = {"command": "python -m tools.bench_e2e " + " ".join(
        sys.argv[1:] if argv is None else argv), "machine": machine_line(),
        "versions": versions(), "nproc": os.cpu_count(), "usable_cpus": threads}
    bw: list[dict] = []
    if args.bandwidth:
        log(f"read bandwidth, {threads} threads, {args.bandwidth_gib:g} GiB ...")
        bw.append(read_bandwidth(threads, args.bandwidth_gib))
        log(f"  {bw[-1]['gb_s']:.1f} GB/s ({bw[-1]['kernel']})")
    with contextlib.ExitStack() as stack:
        if args.keep_logs:
            args.keep_logs.mkdir(parents=True, exist_ok=True)
            log_dir = args.keep_logs
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(
                prefix="plimsoll-e2e-")))
        result = asyncio.run(run(args, log_dir))
    if args.bandwidth:
        log("read bandwidth again ...")
        bw.append(read_bandwidth(threads, args.bandwidth_gib))
        log(f"  {bw[-1]['gb_s']:.1f} GB/s ({bw[-1]['kernel']})")
    rows: list[Row] = result["rows"]
    wall = time.perf_counter() - began

    v = report["versions"]
    print(f"End to end — {report['machine']}")
    print(f"nproc {report['nproc']}, usable CPUs {threads}; mlx {v['mlx']}, mlx-lm "
          f"{v['mlx-lm']}, scipy-openblas32 {v['scipy-openblas32']}, mkl {v['mkl']}")
    seen: set[str] = set()
    for label, servers in result["servers"].items():
        for name, info in servers.items():
            if name == "mlx_lm":
                line = f"mlx_lm: `{info['command']}`, {info['blas']}"
            else:
                b = info["blas"]
                line = (f"{name}: BLAS {b.get('description', '?')}, "
                        f"{b.get('threads', 0)} thread(s) ({b.get('reason', '')})")
            if line not in seen:
                seen.add(line)
                print(line)
        for name, info in servers.items():
            if name != "mlx_lm":
                print(f"  {label} {name}: {info['fast_prefill']}")
    print(f"prompts of L tokens (table), D generated tokens per stream, temperature 0, medians "
          f"over the runs; budget {args.budget_s:g} s per measurement; whole run "
          f"{elapsed(began)}\n")
    print(fmt_table(rows) + "\n")
    goals = goal_rows(rows)
    print("Goals (Plimsoll over stock mlx_lm.server):\n")
    print(fmt_goals(goals) + "\n")
    brows: list[dict] = []
    if bw:
        best = max(b["gb_s"] for b in bw)
        brows = bandwidth_rows(rows, best)
        l3 = l3_bytes()
        print(f"Single-stream Plimsoll decode against read bandwidth: {best:.1f} GB/s, "
              f"{threads} threads (before the servers {bw[0]['gb_s']:.1f}, after "
              f"{bw[-1]['gb_s']:.1f} GB/s; best kernel {bw[0]['kernel']}; one thread "
              f"{max(b['one_thread_gb_s'] for b in bw):.1f} GB/s); L3 {l3 >> 20} MiB. "
              f"KV at the mean decode context (L + D/2).\n")
        print(fmt_bandwidth(brows, l3) + "\n")
    print(f"({wall:.0f} s)")
    if args.json:
        report |= {"args": {k: (str(x) if isinstance(x, Path) else x)
                            for k, x in vars(args).items()},
                   "servers": result["servers"], "probes": result["probes"],
                   "rows": [asdict(r) for r in rows], "goals": goals, "bandwidth": bw,
                   "bandwidth_rows": brows, "wall_s": wall}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
