"""Prompts and concurrent gRPC `Generate` streams, timed (the client side of the benchmarks)."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field

import grpc
import psutil

from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from tools.harness.report import percentile

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
                server_ttft = msg.end.timings.time_to_first_token.ToNanoseconds() / 1e9
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
