"""A Plimsoll service in this process with the session cold tier on, and one greedy turn
through its pipeline: the real engine thread and bank, no gRPC (the cold tier's tests and
benchmarks)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from engine.model_engine import EngineSettings
from engine.pool import ModelPool
from engine.request import Chunk, SamplingParams
from memory.config import MemoryConfig
from service.assembly import Service, ServiceSettings
from service.generate import Admitted, GenerateSpec


async def cold_tier_service(folder: str | Path, model: str | Path, model_id: str, *,
                            kv_bits: int = 0, min_prefix_tokens: int | None = None,
                            engine: EngineSettings | None = None) -> Service:
    """`model` loaded as `model_id` (the default), the disk tier in `folder` with no
    free-space floor, the governor off so that nothing moves but what the caller does."""
    extra = {} if min_prefix_tokens is None else {
        "session_disk_min_prefix_tokens": min_prefix_tokens}
    settings = ServiceSettings(session_disk_dir=str(folder), session_kv_bits=kv_bits,
                               session_disk_min_free_bytes=0, **extra)
    pool = ModelPool(asyncio.get_running_loop(), settings=engine)
    svc = Service(pool, settings, MemoryConfig(enabled=False))
    await pool.load(str(model), model_id, default=True)
    return svc


async def greedy_turn(svc: Service, model_id: str, tokens: list[int], session_id: str,
                      max_tokens: int) -> tuple[Admitted, list[int]]:
    """One request of `session_id` ("" for none), greedy with ignore_eos: its start
    message and the tokens it streamed."""
    spec = GenerateSpec(model=model_id, token_ids=list(tokens), max_tokens=max_tokens,
                        ignore_eos=True, session_id=session_id,
                        sampling=SamplingParams(temperature=0.0))
    start, out = None, []
    async for ev in svc.pipeline.generate(spec):
        if isinstance(ev, Admitted):
            start = ev
        elif isinstance(ev, Chunk):
            out += ev.token_ids
    assert start is not None, "the request ended before its start message"
    return start, out


async def close(svc: Service) -> None:
    """Unload, then spill and finish the tier's writes as a graceful stop does."""
    await svc.pool.close()
    await asyncio.to_thread(svc.close_cold_tier)
