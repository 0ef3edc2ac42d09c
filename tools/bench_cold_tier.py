"""Session cold tier benchmark: time to first token restored from RAM, from disk (after
the RAM entry was shed), from disk after a restart, and cold; bytes written per turn;
sessions per GiB with and without quantized snapshots. Ratios within one run.

    .venv/bin/python -m tools.bench_cold_tier --model small --variant 16k --tokens 2048 8192

(the `16k` variant is the small demo model with a 16,384-token context: its own is 4,096.)
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time

from engine.demo_models import DEMO_VARIANTS, ensure_demo_model, ensure_demo_variant
from engine.model_engine import EngineSettings
from engine.request import Chunk, SamplingParams
from service.assembly import Service
from service.generate import Admitted, GenerateSpec
from tools.harness.in_process import close, cold_tier_service

GiB = 1 << 30


async def ttft(svc: Service, model: str, tokens: list[int], sid: str) -> tuple[float, Admitted]:
    spec = GenerateSpec(model=model, token_ids=tokens, max_tokens=1, ignore_eos=True,
                        session_id=sid, sampling=SamplingParams(temperature=0.0))
    t0 = time.perf_counter()
    start, first = None, None
    # Read to the end: a request the client leaves early is cancelled, and a cancelled
    # turn stores no snapshot.
    async for ev in svc.pipeline.generate(spec):
        if isinstance(ev, Admitted):
            start = ev
        elif isinstance(ev, Chunk) and first is None:
            first = time.perf_counter() - t0
    return (first if first is not None else time.perf_counter() - t0), start


async def service(folder: str, path, bits: int, dense: bool = False) -> Service:
    return await cold_tier_service(folder, path, "m", kv_bits=bits,
                                   engine=EngineSettings(fast_decode_dense=dense))


async def run(size: str, variant: str, lengths: list[int], bits: int, dense: bool) -> None:
    path = ensure_demo_variant(size, variant) if variant else ensure_demo_model(size)
    folder = tempfile.mkdtemp(prefix="bench-cold-")
    svc = await service(folder, path, bits, dense)
    print(f"model {path.name}, kv_bits {bits}, folder {folder}")
    for n in lengths:
        base = [(i * 7919) % 900 + 10 for i in range(n)]
        sid = f"s{n}"
        await ttft(svc, "m", base[:64], "")  # warm up
        cold, _ = await ttft(svc, "m", base + [1], "")
        await ttft(svc, "m", base, sid)  # turn 1 stores the snapshot
        entry_bytes = svc.bank.total_bytes()
        stored = list(svc.bank.entries()[-1].tokens)  # the prompt and its token
        ram, s1 = await ttft(svc, "m", stored + [2], sid)
        svc.bank.drop_session(sid)  # turn 2's own snapshot: not part of the disk figure
        await ttft(svc, "m", base, sid)
        written0 = svc.cold.stats().written_bytes
        svc.bank.shrink_to_bytes(0)
        svc.cold.flush(60)
        written = svc.cold.stats().written_bytes - written0
        disk, s2 = await ttft(svc, "m", stored + [3], sid)
        # Turn 3's own snapshot would supersede the disk entry at shutdown: not kept.
        svc.bank.drop_session(sid)
        await close(svc)
        svc = await service(folder, path, bits, dense)
        restart, s3 = await ttft(svc, "m", stored + [4], sid)
        print(f"{n:>6} tokens: cold {cold*1e3:8.1f} ms | RAM {ram*1e3:7.1f} ms "
              f"({cold/ram:5.1f}x, cached {s1.cached_tokens}) | disk {disk*1e3:7.1f} ms "
              f"({cold/disk:5.1f}x, disk {s2.cached_disk_tokens}) | after restart "
              f"{restart*1e3:7.1f} ms ({cold/restart:5.1f}x, disk {s3.cached_disk_tokens})")
        print(f"        snapshot {entry_bytes/2**20:.1f} MiB in RAM, {written/2**20:.1f} MiB "
              f"written per shed turn; {GiB/max(1, entry_bytes):.1f} sessions/GiB at this length")
    await close(svc)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small")
    ap.add_argument("--variant", default="16k", choices=["", *DEMO_VARIANTS],
                    help="a demo variant of the model ('' for the model itself)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--kv-bits", type=int, nargs="+", default=[0, 8, 4])
    ap.add_argument("--fast-decode-dense", action="store_true",
                    help="as `serve --fast-decode-dense`")
    args = ap.parse_args()
    for bits in args.kv_bits:
        asyncio.run(run(args.model, args.variant, args.tokens, bits, args.fast_decode_dense))


if __name__ == "__main__":
    main()
