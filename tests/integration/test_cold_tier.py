"""The session cold tier end to end with the real engine and real files: a shed entry
spills to disk, the next turn restores from it with the same greedy output as a cold
run, across a restart too, and the start message says how many tokens came from disk."""

from __future__ import annotations

import asyncio

import pytest

from engine.pool import ModelPool
from engine.request import Chunk, SamplingParams
from memory.config import MemoryConfig
from plimsoll.v1 import control_pb2, inference_pb2
from service.assembly import Service, ServiceSettings
from service.generate import Admitted, GenerateSpec
from tools.harness.server import serving


async def turn(svc: Service, tokens: list[int], sid: str) -> tuple[Admitted, list[int]]:
    spec = GenerateSpec(model="tiny", token_ids=list(tokens), max_tokens=8, ignore_eos=True,
                        session_id=sid, sampling=SamplingParams(temperature=0.0))
    start, out = None, []
    async for ev in svc.pipeline.generate(spec):
        if isinstance(ev, Admitted):
            start = ev
        elif isinstance(ev, Chunk):
            out += ev.token_ids
    return start, out


async def service(folder, demo_path, kv_bits: int = 0) -> Service:
    pool = ModelPool(asyncio.get_running_loop())
    svc = Service(pool, ServiceSettings(session_disk_dir=str(folder), session_kv_bits=kv_bits,
                                        session_disk_min_free_bytes=0,
                                        session_disk_min_prefix_tokens=8),
                  MemoryConfig(enabled=False))
    await pool.load(str(demo_path), "tiny", default=True)
    return svc


async def stop(svc: Service) -> None:
    await svc.pool.close()
    await asyncio.to_thread(svc.close_cold_tier)


@pytest.mark.parametrize("kv_bits", [0, 8])
def test_shed_spills_then_restores_from_disk_with_the_same_output(tmp_path, demo_path, kv_bits):
    async def main() -> None:
        svc = await service(tmp_path, demo_path, kv_bits)
        prompt = list(range(5, 300))
        first, out1 = await turn(svc, prompt, "s1")
        assert (first.cached_tokens, first.cached_disk_tokens) == (0, 0)
        assert svc.bank.shrink_to_bytes(0) == 1  # what the governor does under pressure
        assert svc.cold.flush(10) and svc.cold.stats().writes == 1
        assert svc.bank.total_bytes() == 0
        nxt = prompt + out1 + [7, 8, 9]
        warm, out2 = await turn(svc, nxt, "s1")
        cold, out3 = await turn(svc, nxt, "")  # no session: a cold prefill
        assert warm.cached_tokens == warm.cached_disk_tokens == len(prompt) + len(out1)
        assert cold.cached_tokens == 0
        assert out2 == out3
        s = svc.cold.stats()
        assert (s.restores, s.hits_disk, s.restore_failures) == (1, 1, 0)
        await stop(svc)
        # A restart: the index is rebuilt from the files; shutdown spilled the bank.
        svc = await service(tmp_path, demo_path, kv_bits)
        assert svc.cold.stats().entries == 1
        last = nxt + out2 + [1, 2]
        warm, out4 = await turn(svc, last, "s1")
        _, out5 = await turn(svc, last, "")
        assert warm.cached_disk_tokens == len(nxt) + len(out2) and out4 == out5
        await stop(svc)

    asyncio.run(main())


def test_a_failed_restore_falls_back_to_a_cold_prefill(tmp_path, demo_path):
    async def main() -> None:
        svc = await service(tmp_path, demo_path)
        prompt = list(range(5, 200))
        _, out1 = await turn(svc, prompt, "s1")
        svc.bank.shrink_to_bytes(0)
        assert svc.cold.flush(10)
        for p in tmp_path.glob("*.safetensors"):  # corrupted after it was indexed
            p.write_bytes(p.read_bytes()[:-1] + b"\0")
        nxt = prompt + out1 + [3]
        warm, out2 = await turn(svc, nxt, "s1")
        _, out3 = await turn(svc, nxt, "")
        assert warm.cached_tokens == 0 and out2 == out3
        s = svc.cold.stats()
        assert s.restore_failures == 1 and s.collected == {"corrupt": 1} and s.entries == 0
        await stop(svc)

    asyncio.run(main())


def test_server_restart_restores_from_disk_and_status_shows_the_tier(tmp_path, demo_path):
    disk = tmp_path / "disk"
    args = ("--session-disk-dir", str(disk), "--session-disk-min-free-gb", "0",
            "--memory-guard-gb", "8")

    def generate(inference, tokens, sid):
        req = inference_pb2.GenerateRequest(
            model_id="demo-tiny", token_ids=inference_pb2.TokenIds(ids=tokens), session_id=sid,
            sampling=inference_pb2.SamplingParams(temperature=0.0), max_tokens=8,
            ignore_eos=True)
        start, out = None, []
        for r in inference.Generate(req, timeout=60):
            if r.HasField("start"):
                start = r.start
            elif r.HasField("chunk"):
                out += list(r.chunk.token_ids)
        return start, out

    prompt = list(range(5, 300))
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with serving(tmp_path / "a", *args) as srv, srv.stubs() as (control, inference):
        _, out1 = generate(inference, prompt, "s1")
    # The graceful stop spilled the bank; a new server finds it.
    nxt = prompt + out1 + [9]
    with serving(tmp_path / "b", *args) as srv, srv.stubs() as (control, inference):
        start, out2 = generate(inference, nxt, "s1")
        _, out3 = generate(inference, nxt, "")
        assert start.cached_disk_tokens == start.cached_tokens == len(prompt) + len(out1)
        assert out2 == out3
        status = control.GetMemoryStatus(control_pb2.GetMemoryStatusRequest(), timeout=10)
        tier = status.session_disk
        assert tier.directory == str(disk) and tier.restores == 1 and tier.hits_disk == 1
        listed = control.ListSessions(control_pb2.ListSessionsRequest(), timeout=10)
        tiers = {e.tier for s in listed.sessions for e in s.entries}
        assert control_pb2.SESSION_TIER_RAM in tiers or control_pb2.SESSION_TIER_DISK in tiers
        assert listed.session_disk.entries >= 1
