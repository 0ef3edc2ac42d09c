"""Loads that cannot stay, on the real path: LoadModel over gRPC loopback into the real
control plane, pool load guard, governor, load plan and executor, with real engine
threads on the tiny demo model. Readings are scripted (`ScriptedReader`), so the marks
are exact: custom tier, 10 GiB ceiling, soft 8.5 GiB.

- A load that fits under the ceiling but not under soft is refused (RESOURCE_EXHAUSTED)
  with the numbers, and a hopeless one unloads no idle model first.
- A load that fits under soft after evicting idle models evicts only what it needs.
- A just-loaded model survives the ticks of its warm-up, then follows the seed's rules.

The "big" model is a folder whose weight file is sparse: its estimate is its file size,
and a refused load never reads it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from memory.actions import REASON_SOFT_LRU, EvictModel
from memory.config import MemoryConfig
from memory.levels import GIB, MIB, PressureLevel, Tier
from plimsoll.v1 import control_pb2, control_pb2_grpc
from service.server import PlimsollServer, ServerConfig
from tests.support.memory_fakes import ScriptedReader, readings

WARMUP_S = 1.5
CONFIG = MemoryConfig(tier=Tier.CUSTOM, custom_ceiling_gib=10, idle_poll_s=3600,
                      empty_poll_s=3600, active_poll_s=3600, load_warmup_s=WARMUP_S)
SOFT, CEILING = int(8.5 * GIB), 10 * GIB

pytestmark = pytest.mark.timeout(60)


async def start(demo_path: Path, reader: ScriptedReader, extras: int) -> PlimsollServer:
    """The tiny model (the default) plus `extras` copies, loaded "long ago" (past their
    warm-up). The governor's own loop is stopped: the test runs every tick itself."""
    server = PlimsollServer(ServerConfig(port=0, models=[str(demo_path)], memory=CONFIG),
                            reader=reader)
    await server.start()
    await server.load_initial_models()
    pool = server.service.pool
    for i in range(1, extras + 1):
        await pool.load(str(demo_path), f"extra-{i}")
    server.service.governor.stop()
    await server.service.governor.tick()  # after any tick of its loop still in flight
    for e in pool.entries():
        e.loaded_at = (e.loaded_at or 0.0) - 10 * WARMUP_S
    return server


def big_model(folder: Path, size: int) -> Path:
    """A model folder that only looks `size` bytes big (a sparse weight file)."""
    folder.mkdir()
    with open(folder / "model.safetensors", "wb") as fh:
        os.truncate(fh.fileno(), size)
    return folder


def loaded(server: PlimsollServer) -> set[str]:
    return {e.model_id for e in server.service.pool.entries() if e.engine is not None}


async def load(server: PlimsollServer, source: Path, model_id: str
               ) -> control_pb2.LoadModelResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        stub = control_pb2_grpc.ControlServiceStub(ch)
        return await stub.LoadModel(control_pb2.LoadModelRequest(
            source=str(source), model_id=model_id), timeout=60)


def error_info(err: grpc.aio.AioRpcError) -> error_details_pb2.ErrorInfo:
    status = rpc_status.from_call(err)
    assert status is not None, err
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info
    raise AssertionError(f"no ErrorInfo in {err}")


async def test_a_load_that_would_cross_soft_is_refused_with_the_numbers_and_evicts_nothing(
        demo_path, tmp_path):
    # 8.3 + 1.05 GiB = 9.35: under the 10 GiB ceiling (once admitted, after unloading
    # every idle model for nothing), over soft even with the three idle tiny models gone.
    reader = ScriptedReader(readings(8.3))
    server = await start(demo_path, reader, extras=2)
    default = server.service.pool.get("").model_id
    before = loaded(server)
    idle_bytes = sum(e.measured_bytes for e in server.service.pool.entries())
    try:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await load(server, big_model(tmp_path / "big", GIB), "big")
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "soft mark" in err.value.details()
        assert "nothing was evicted" in err.value.details()
        info = error_info(err.value)
        assert info.reason == "LOAD_EXCEEDS_SOFT"
        numbers = {"estimated_bytes": str(int(GIB * 1.05)), "usage_bytes": str(int(8.3 * GIB)),
                   "soft_bytes": str(SOFT), "ceiling_bytes": str(CEILING),
                   "freeable_bytes": str(idle_bytes)}
        assert {k: info.metadata[k] for k in numbers} == numbers
        assert "warming_bytes" not in info.metadata
        assert retry_delay_s(err.value) == 10.0
        assert loaded(server) == before == {default, "extra-1", "extra-2"}
        assert "big" not in {e.model_id for e in server.service.pool.entries()}
    finally:
        await server.drain()


async def test_a_load_that_fits_after_evictions_evicts_only_what_it_needs(demo_path):
    # 2 MiB under soft: the new tiny copy (~2.6 MiB) needs one idle model gone; the
    # least recently used goes, and the reading follows the unload.
    reader = ScriptedReader(readings(4.0))
    server = await start(demo_path, reader, extras=2)
    reader.current = readings((SOFT - 2 * MIB) / GIB)
    pool = server.service.pool
    default = pool.get("").model_id
    pool.touch(pool.get(default))
    pool.touch(pool.get("extra-2"))  # extra-1 is now the least recently used

    def follow_unloads() -> None:
        gone = sum(e.measured_bytes for e in pool.entries() if e.engine is None)
        reader.current = readings((SOFT - 2 * MIB - gone) / GIB)

    pool.listeners.append(follow_unloads)
    try:
        reply = await load(server, demo_path, "fresh")
        assert reply.model.model_id == "fresh"
        assert reply.model.state == control_pb2.MODEL_STATE_READY
        assert loaded(server) == {default, "extra-2", "fresh"}
    finally:
        pool.listeners.remove(follow_unloads)
        await server.drain()


async def test_a_just_loaded_model_survives_its_warm_up_then_follows_the_seed(demo_path):
    # The default model is busy (a request holds it), so at soft the just-loaded model is
    # the only idle victim while two are loaded: the seed's soft rule unloads it at once.
    reader = ScriptedReader(readings(4.0))
    server = await start(demo_path, reader, extras=0)
    svc = server.service
    held = svc.pool.get("")  # the default model
    svc.pool.acquire(held)
    try:
        await load(server, demo_path, "fresh")
        reader.current = readings(9.0)  # soft
        for _ in range(2):
            tick = await svc.governor.tick()
            assert tick is not None and tick.level is PressureLevel.SOFT
            assert tick.actions_of(EvictModel) == []
            assert loaded(server) == {held.model_id, "fresh"}
        age = time.monotonic() - svc.pool.get("fresh").loaded_at
        await asyncio.sleep(max(0.0, WARMUP_S - age) + 0.05)
        tick = await svc.governor.tick()
        assert tick is not None
        assert [(a.model_id, a.reason) for a in tick.actions_of(EvictModel)] == [
            ("fresh", REASON_SOFT_LRU)]
        assert loaded(server) == {held.model_id}
    finally:
        svc.pool.release(held)
        await server.drain()


def retry_delay_s(err: grpc.aio.AioRpcError) -> float:
    status = rpc_status.from_call(err)
    assert status is not None, err
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return info.retry_delay.ToNanoseconds() / 1e9
    raise AssertionError(f"no RetryInfo in {err}")


async def test_a_load_that_needs_a_warming_model_gone_is_told_when_to_retry(
        demo_path, tmp_path):
    # Back-to-back loads: "fresh" has just loaded; a 100 MiB load (105 with the margin)
    # fits under soft only if both the default model and "fresh" go. "fresh" is spared,
    # so nothing is evicted, and the refusal says when its warm-up ends.
    reader = ScriptedReader(readings(4.0))
    server = await start(demo_path, reader, extras=0)
    pool = server.service.pool
    default = pool.get("").model_id
    try:
        await load(server, demo_path, "fresh")
        reader.current = readings((SOFT - 105 * MIB + 4 * MIB) / GIB)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await load(server, big_model(tmp_path / "big", 100 * MIB), "big")
        assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "once 'fresh'" in err.value.details()
        assert 0 < retry_delay_s(err.value) <= WARMUP_S
        info = error_info(err.value)
        assert info.metadata["warming_bytes"] == str(pool.get("fresh").measured_bytes)
        assert loaded(server) == {default, "fresh"}
    finally:
        await server.drain()
