"""The session cold tier end to end with the real engine and real files: a shed entry
spills to disk, the next turn restores from it with the same greedy output as a cold
run, across a restart too, and the start message says how many tokens came from disk.
Spills, restores and collections each leave an OpenTelemetry span (the session's
in-memory exporter, tests/conftest.py)."""

from __future__ import annotations

import asyncio
import random

import mlx.core as mx
import pytest

from memory.plans import spill
from plimsoll.v1 import control_pb2, inference_pb2
from service.assembly import Service
from service.generate import Admitted
from telemetry import names
from tests.support.random_models import GEMMA3_TEXT, write_random_model
from tools.harness.in_process import close, cold_tier_service, greedy_turn
from tools.harness.server import serving


async def turn(svc: Service, tokens: list[int], sid: str, n: int = 8
               ) -> tuple[Admitted, list[int]]:
    return await greedy_turn(svc, "tiny", tokens, sid, n)


async def service(folder, demo_path, kv_bits: int = 0, min_prefix: int = 8) -> Service:
    return await cold_tier_service(folder, demo_path, "tiny", kv_bits=kv_bits,
                                   min_prefix_tokens=min_prefix)


async def stop(svc: Service) -> None:
    await close(svc)


def random_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


# Turns 2 and 3 generate GEN tokens and must match a cold run token for token. The tiny
# demo model (random weights, flat logits: max |logit| ~0.8, top-2 gaps down to ~4e-3,
# see tools/check_kv_bits.py) degenerates on some prompts: after the "ramp" case's
# appended [7, 8, 9] it repeats one token (9, 9, 9, ...), so a match there proves little.
# The "random" case's cold outputs are varied (checked against MIN_DISTINCT), so a
# restored cache that moved a greedy pick would show.
GEN = 32
MIN_DISTINCT = 16
# (prompt, tokens appended for turn 2, for turn 3, whether the outputs must be varied)
CASES = {
    "ramp": (list(range(5, 300)), [7, 8, 9], [1, 2], False),
    "random": (random_tokens(5, 1200), [123, 456, 789], [321, 654], True),
}


@pytest.mark.parametrize(("kv_bits", "prompt_kind"), [(0, "ramp"), (8, "ramp"), (8, "random")])
def test_shed_spills_then_restores_from_disk_with_the_same_output(tmp_path, demo_path, kv_bits,
                                                                  prompt_kind):
    async def main() -> None:
        svc = await service(tmp_path, demo_path, kv_bits)
        prompt, more, last_more, varied = CASES[prompt_kind]
        first, out1 = await turn(svc, prompt, "s1")
        assert (first.cached_tokens, first.cached_disk_tokens) == (0, 0)
        assert svc.bank.shrink_to_bytes(0) == 1  # what the governor does under pressure
        assert svc.cold.flush(10) and svc.cold.stats().writes == 1
        assert svc.bank.total_bytes() == 0
        nxt = prompt + out1 + more
        warm, out2 = await turn(svc, nxt, "s1", GEN)
        cold, out3 = await turn(svc, nxt, "", GEN)  # no session: a cold prefill
        assert warm.cached_tokens == warm.cached_disk_tokens == len(prompt) + len(out1)
        assert cold.cached_tokens == 0
        assert len(out3) == GEN and (not varied or len(set(out3)) >= MIN_DISTINCT), out3
        assert out2 == out3
        s = svc.cold.stats()
        assert (s.restores, s.hits_disk, s.restore_failures) == (1, 1, 0)
        await stop(svc)
        # A restart: the index is rebuilt from the files; shutdown spilled the bank.
        svc = await service(tmp_path, demo_path, kv_bits)
        assert svc.cold.stats().entries == 1
        last = nxt + out2 + last_more
        warm, out4 = await turn(svc, last, "s1", GEN)
        _, out5 = await turn(svc, last, "", GEN)
        assert warm.cached_disk_tokens == len(nxt) + len(out2) and out4 == out5
        assert not varied or len(set(out5)) >= MIN_DISTINCT, (out5, len(set(out5)))
        await stop(svc)

    asyncio.run(main())


def test_quantized_sessions_of_a_sliding_window_model_are_kept_and_restored(tmp_path):
    """`--session-kv-bits 8` on a small random gemma3_text, whose every other layer keeps
    a sliding window (mlx-lm cannot quantize that cache): the other layers are quantized,
    the window stays full precision, and the next turn reuses the session from RAM and
    from disk with a cold run's tokens."""
    async def main() -> None:
        model = write_random_model(tmp_path / "gemma3", GEMMA3_TEXT, mx.float32)
        svc = await cold_tier_service(tmp_path / "disk", model, "tiny", kv_bits=8,
                                      min_prefix_tokens=8)
        try:
            # An 8-bit cache moves this random model's flat greedy picks on some prompts
            # (random_tokens(11, 40): the third turn's 8th token, from RAM and from disk
            # alike); full precision matches a cold run on every prompt tried.
            prompt = random_tokens(12, 40)
            _, out1 = await turn(svc, prompt, "s1")
            entry = svc.bank.longest_prefix("tiny", prompt + out1 + [7])
            assert entry is not None, "the turn was not stored"
            kinds = {type(c).__name__ for c in entry.payload}
            assert kinds == {"QuantizedKVCache", "RotatingKVCache"}, kinds
            nxt = prompt + out1 + [7, 8, 9]
            warm, out2 = await turn(svc, nxt, "s1")
            _, cold = await turn(svc, nxt, "")
            assert warm.cached_tokens == len(prompt) + len(out1) and out2 == cold
            assert svc.bank.shrink_to_bytes(0) >= 1 and svc.cold.flush(10)
            last = nxt + out2 + [1, 2]
            warm, out3 = await turn(svc, last, "s1")
            _, cold = await turn(svc, last, "")
            assert warm.cached_disk_tokens == len(nxt) + len(out2) and out3 == cold
        finally:
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


def cold_spans(exporter, name: str) -> list[dict]:
    return [dict(sp.attributes or {}) for sp in exporter.get_finished_spans() if sp.name == name]


def test_spills_restores_and_collections_leave_spans(tmp_path, demo_path, captured):
    """A spill written (file bytes), a spill dropped (its reason), a restore (seconds,
    outcome), a failed restore whose corrupt file is collected, and the start-up
    collection of a damaged file: each its own span with its figures."""
    exporter = captured.spans

    async def main() -> None:
        exporter.clear()
        svc = await service(tmp_path, demo_path, min_prefix=64)
        prompt = list(range(5, 300))
        _, out1 = await turn(svc, prompt, "s1")
        await turn(svc, list(range(5, 25)), "short")  # 28 tokens: under the 64 minimum
        assert svc.bank.shrink_to_bytes(0) == 2
        assert svc.cold.flush(10)
        s = svc.cold.stats()
        assert (s.writes, s.drops) == (1, {spill.DROP_TOO_SHORT: 1})
        spills = cold_spans(exporter, names.SPAN_COLD_SPILL)
        written = [a for a in spills if a.get(names.ATTR_COLD_OUTCOME) == "written"]
        dropped = [a for a in spills if a.get(names.ATTR_COLD_OUTCOME) == "dropped"]
        assert len(written) == 1 and len(dropped) == 1, spills
        w, d = written[0], dropped[0]
        assert w[names.ATTR_MODEL] == "tiny" and w[names.ATTR_REASON] == "memory_pressure"
        assert w[names.ATTR_PROMPT_TOKENS] == len(prompt) + len(out1)
        assert w[names.ATTR_COLD_FILE_BYTES] == s.written_bytes > 0
        assert w[names.ATTR_COLD_BYTES] > 0
        assert d[names.ATTR_COLD_DROP_REASON] == spill.DROP_TOO_SHORT
        assert d[names.ATTR_REASON] == "memory_pressure" and d[names.ATTR_PROMPT_TOKENS] == 28
        assert names.ATTR_COLD_FILE_BYTES not in d

        nxt = prompt + out1 + [7, 8, 9]
        warm, out2 = await turn(svc, nxt, "s1")
        assert warm.cached_disk_tokens == len(prompt) + len(out1)
        (r,) = cold_spans(exporter, names.SPAN_COLD_RESTORE)
        assert r[names.ATTR_COLD_OUTCOME] == "restored" and r[names.ATTR_MODEL] == "tiny"
        assert r[names.ATTR_CACHED_TOKENS] == len(prompt) + len(out1)
        assert r[names.ATTR_COLD_FILE_BYTES] == s.written_bytes
        assert 0 < r[names.ATTR_COLD_SECONDS] < 10

        # A file damaged after it was indexed: the restore fails, the file is collected.
        svc.bank.shrink_to_bytes(0)  # s1's longer snapshot goes to disk (s1's older one
        assert svc.cold.flush(10)  # is collected as superseded)
        collects = cold_spans(exporter, names.SPAN_COLD_COLLECT)
        assert {a[names.ATTR_REASON] for a in collects} >= {spill.COLLECT_SUPERSEDED}, collects
        (data,) = tmp_path.glob("*.safetensors")
        data.write_bytes(data.read_bytes()[:-1] + b"\0")
        exporter.clear()
        last = nxt + out2 + [1, 2]
        warm, _ = await turn(svc, last, "s1")
        assert warm.cached_tokens == 0
        (r,) = cold_spans(exporter, names.SPAN_COLD_RESTORE)
        assert r[names.ATTR_COLD_OUTCOME] == "failed" and "checksum" in r[names.ATTR_ERROR]
        (c,) = cold_spans(exporter, names.SPAN_COLD_COLLECT)
        assert c[names.ATTR_REASON] == spill.COLLECT_CORRUPT and c[names.ATTR_MODEL] == "tiny"
        assert c[names.ATTR_ENTRIES_EVICTED] == 1 and "checksum" in c[names.ATTR_ERROR]
        await stop(svc)  # the shutdown spills the bank (s1's last turn)
        shutdown = [a for a in cold_spans(exporter, names.SPAN_COLD_SPILL)
                    if a[names.ATTR_REASON] == "shutdown"]
        assert [a[names.ATTR_COLD_OUTCOME] for a in shutdown] == ["written"], shutdown

        # At start-up, a data file that does not match its record is collected.
        (data,) = tmp_path.glob("*.safetensors")
        data.write_bytes(data.read_bytes()[:100])
        exporter.clear()
        svc = await service(tmp_path, demo_path, min_prefix=64)
        s = svc.cold.stats()
        assert s.entries == 0 and s.collected == {spill.COLLECT_CORRUPT: 1}, s
        (c,) = cold_spans(exporter, names.SPAN_COLD_COLLECT)
        assert c[names.ATTR_REASON] == "startup" and c[names.ATTR_ENTRIES_EVICTED] == 1
        assert c[names.ATTR_COLD_ENTRIES] == 0
        await stop(svc)

    asyncio.run(main())
