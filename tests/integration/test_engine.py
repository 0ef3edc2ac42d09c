"""The engine thread directly (real MLX, tiny demo model)."""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm.generate import BatchGenerator

from engine.errors import Internal, Unavailable
from engine.model_engine import ModelEngine
from engine.request import Failed, Finished, GenerationRequest


async def run(engine: ModelEngine, rid: str) -> list:
    sink: asyncio.Queue = asyncio.Queue()
    engine.submit(GenerationRequest(rid, "tiny", [5, 6, 7], max_tokens=4, ignore_eos=True),
                  sink)
    events = []
    while not events or not isinstance(events[-1], Finished | Failed):
        events.append(await asyncio.wait_for(sink.get(), 30))
    return events


async def test_a_failed_step_ends_its_requests_and_the_engine_keeps_serving(
        demo_path, monkeypatch):
    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop())
    await asyncio.wrap_future(engine.start())
    real_next = BatchGenerator.next
    calls = {"n": 0}

    def flaky_next(self):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real_next(self)

    monkeypatch.setattr(BatchGenerator, "next", flaky_next)
    try:
        first = await run(engine, "a")
        assert isinstance(first[-1], Failed)
        assert isinstance(first[-1].error, Internal)
        assert first[-1].error.reason == "ENGINE_ERROR"
        assert "injected step failure" not in str(first[-1].error)  # the log has it
        second = await run(engine, "b")
        assert isinstance(second[-1], Finished) and second[-1].completion_tokens == 4
        assert engine.stats.active_requests == 0
    finally:
        await asyncio.wrap_future(engine.stop())
    with pytest.raises(Unavailable):
        engine.submit(GenerationRequest("c", "tiny", [1]), asyncio.Queue())
