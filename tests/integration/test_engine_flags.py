"""Engine flags and figures on real engine threads (real MLX, the demo models).

Each test drives a real `ModelEngine` thread in-process: reclaims consumed at step
boundaries, pending unloads, load aborts, the pre-chunk prefill abort, the store
gate and timestamped MLX samples.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine import model_engine
from engine.demo_models import ensure_demo_model
from engine.errors import Aborted, FailedPrecondition, Unavailable
from engine.model_engine import (
    EngineSettings,
    FinishHook,
    MlxSample,
    ModelEngine,
    PrefillAbortReport,
)
from engine.pool import ModelPool, ModelState
from engine.request import Chunk, Event, Failed, Finished, GenerationRequest
from memory.levels import PressureLevel

pytestmark = pytest.mark.timeout(60)

WAIT_S = 10.0  # the most any single wait may take; each test ends well within a few
LONG_DECODE = 20_000  # tokens: the tiny model is still decoding when a test checks
MIB = 1 << 20


@pytest.fixture(scope="module")
def tiny() -> Path:
    return ensure_demo_model("tiny")


@asynccontextmanager
async def running_engine(path: Path, model_id: str = "tiny", max_num_seqs: int = 4,
                         on_finish: FinishHook | None = None) -> AsyncIterator[ModelEngine]:
    engine = ModelEngine(model_id, str(path), asyncio.get_running_loop(),
                         EngineSettings(max_num_seqs=max_num_seqs), on_finish)
    await asyncio.wait_for(asyncio.wrap_future(engine.start()), WAIT_S)
    try:
        yield engine
    finally:
        await asyncio.wait_for(asyncio.wrap_future(engine.stop()), WAIT_S)


def submit(engine: ModelEngine, rid: str, max_tokens: int,
           prompt: list[int] | None = None) -> asyncio.Queue[Event]:
    sink: asyncio.Queue[Event] = asyncio.Queue()
    request = GenerationRequest(rid, engine.model_id, prompt or [5, 6, 7, 8],
                                max_tokens=max_tokens, ignore_eos=True)
    engine.submit(request, sink)
    return sink


def long_prompt(tokens: int) -> list[int]:
    # Inside the tiny model's vocabulary of 1024.
    return [1 + i % 1000 for i in range(tokens)]


async def first_chunk(sink: asyncio.Queue[Event]) -> Chunk:
    event = await asyncio.wait_for(sink.get(), WAIT_S)
    assert isinstance(event, Chunk), event
    return event


async def last_event(sink: asyncio.Queue[Event]) -> Event:
    while True:
        event = await asyncio.wait_for(sink.get(), WAIT_S)
        if not isinstance(event, Chunk):
            return event


async def wait(future: concurrent.futures.Future, timeout: float = WAIT_S) -> Any:
    return await asyncio.wait_for(asyncio.wrap_future(future), timeout)


async def fresh(engine: ModelEngine) -> MlxSample:
    return await wait(engine.fresh_sample(), 1.0)


async def until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


class FixedPlanner:
    """A prefill planner with a fixed answer (the real one sizes against the ceiling)."""

    def __init__(self, chunk: int, abort: bool) -> None:
        self.chunk = chunk
        self.abort = abort

    def plan(self, mlx_bytes: int, remaining_tokens: int,
             prompt_tokens: int = 0) -> tuple[int, bool]:
        return self.chunk, self.abort

    def observe(self, tokens: int, bytes_delta: int, prompt_tokens: int = 0) -> None:
        pass


async def test_pressure_reclaim_drains_the_pool_at_the_next_boundary_while_decoding(tiny):
    async with running_engine(tiny) as engine:
        decoding = submit(engine, "decoding", LONG_DECODE)
        await first_chunk(decoding)
        # A long prompt's KV goes back to the MLX pool when it finishes; the batch
        # is still busy, so nothing else clears the pool.
        finished = await last_event(submit(engine, "prompt", 2, long_prompt(1500)))
        assert isinstance(finished, Finished)
        before = await fresh(engine)
        assert before.pool_bytes > 0
        reclaims = engine.stats.pressure_reclaims

        assert engine.request_pressure_reclaim()
        after = await fresh(engine)

        assert engine.stats.active_requests > 0
        assert engine.stats.pressure_reclaims == reclaims + 1
        assert after.at > before.at
        assert after.pool_bytes == 0 or after.pool_bytes < before.pool_bytes / 4, (
            before, after)


async def test_idle_reclaim_waits_until_the_batch_is_idle(tiny):
    async with running_engine(tiny) as engine:
        decoding = submit(engine, "decoding", LONG_DECODE)
        await first_chunk(decoding)
        reclaims = engine.stats.idle_reclaims

        engine.request_idle_reclaim()
        for _ in range(3):  # three step boundaries pass, each one busy
            await fresh(engine)
        assert engine.stats.active_requests == 1
        assert engine.stats.idle_reclaims == reclaims

        assert await wait(engine.abort(Aborted("test over"), ["decoding"])) == ["decoding"]
        await until(lambda: engine.stats.idle_reclaims == reclaims + 1, 2.0)
        assert engine.stats.active_requests == 0


async def test_a_pending_unload_refuses_new_work_and_unloads_once_idle(tiny):
    pool = ModelPool(asyncio.get_running_loop())
    try:
        entry = await asyncio.wait_for(pool.load(str(tiny), "m"), WAIT_S)
        pool.acquire(entry)
        sink = submit(entry.engine, "r", 64)
        entry.pending_unload_reason = "test"
        with pytest.raises(Unavailable) as refused:
            pool.ready("m")
        assert refused.value.reason == "MODEL_UNLOADING"

        assert isinstance(await last_event(sink), Finished)
        assert entry.state == ModelState.READY  # still held by its request
        pool.release(entry)

        await until(lambda: entry.state == ModelState.UNLOADED)
        assert entry.engine is None and not entry.pending_unload_reason
    finally:
        await pool.close()


async def test_an_engine_that_fails_outside_a_step_ends_its_requests_and_is_unloaded(
        tiny, monkeypatch):
    """An unforeseen exception on the engine thread outside a step (injected here as the
    thread hands a finished request's events to the loop) strands no client and leaves
    no dead model READY: the request still gets its end, the pool unloads the model, and
    a load serves it again."""
    pool = ModelPool(asyncio.get_running_loop())
    try:
        entry = await asyncio.wait_for(pool.load(str(tiny), "m"), WAIT_S)
        real = ModelEngine._deliver
        failed: list[bool] = []

        def deliver_failing_once(self, outbox, flush) -> None:
            if not failed and any(isinstance(e, Finished) for _, e in outbox):
                failed.append(True)
                raise RuntimeError("injected")
            real(self, outbox, flush)

        monkeypatch.setattr(ModelEngine, "_deliver", deliver_failing_once)
        assert isinstance(await last_event(submit(entry.engine, "r", 3)), Finished)
        assert failed
        await until(lambda: entry.state == ModelState.UNLOADED)
        assert entry.engine is None
        with pytest.raises(FailedPrecondition):
            pool.ready("m")
        monkeypatch.undo()

        entry = await asyncio.wait_for(pool.load(str(tiny), "m"), WAIT_S)
        assert isinstance(await last_event(submit(entry.engine, "r2", 3)), Finished)
    finally:
        await pool.close()


async def test_a_request_whose_insert_fails_ends_alone_and_the_model_keeps_serving(
        tiny, monkeypatch):
    """A request whose parts cannot be made on the engine thread (injected: its stop
    sequences) ends ENGINE_ERROR before the batch is touched; the request beside it and
    the next one finish."""
    real = model_engine._stop_sequences

    def stop_sequences(req, *args):
        if req.request_id == "bad":
            raise RuntimeError("injected")
        return real(req, *args)

    monkeypatch.setattr(model_engine, "_stop_sequences", stop_sequences)
    async with running_engine(tiny) as engine:
        ok, bad = submit(engine, "ok", 4), submit(engine, "bad", 4)
        failed = await last_event(bad)
        assert isinstance(failed, Failed) and failed.error.reason == "ENGINE_ERROR"
        assert isinstance(await last_event(ok), Finished)
        assert isinstance(await last_event(submit(engine, "next", 4)), Finished)
        assert engine.thread.is_alive()


async def test_a_pending_unload_waits_for_sequences_nobody_holds(tiny):
    pool = ModelPool(asyncio.get_running_loop())
    try:
        entry = await asyncio.wait_for(pool.load(str(tiny), "m"), WAIT_S)
        engine = entry.engine
        pool.acquire(entry)
        sink = submit(engine, "r", 1000)
        await first_chunk(sink)
        entry.pending_unload_reason = "test"
        # The holder leaves while the engine is still decoding its sequence.
        pool.release(entry)
        assert entry.busy and entry.state == ModelState.READY

        # The sequence ends on its own (not aborted by the unload), then the model goes.
        assert isinstance(await last_event(sink), Finished)
        await until(lambda: entry.state == ModelState.UNLOADED)
    finally:
        await pool.close()


async def test_a_load_flagged_to_abort_frees_its_memory():
    small = ensure_demo_model("small")  # about 67 MB of weights
    tolerance = 8 * MIB
    baseline = mx.get_active_memory()  # no engine thread is running yet
    engine = ModelEngine("small-abort", str(small), asyncio.get_running_loop())
    loaded = engine.start()
    engine.flag_load_abort()

    with pytest.raises(Aborted):
        await wait(loaded, 60.0)
    assert await wait(engine.stopped) == 0
    for thread in threading.enumerate():
        if thread.name == "engine-small-abort":
            thread.join(WAIT_S)
            assert not thread.is_alive()

    last = engine.mlx_sample()  # the engine thread's own reading after it freed the load
    assert last is not None and last.active_bytes < baseline + tolerance, (baseline, last)
    assert mx.get_active_memory() < baseline + tolerance, baseline
    with pytest.raises(Unavailable):
        engine.fresh_sample().result(timeout=0)


async def test_a_pre_chunk_abort_ends_the_request_typed_and_the_engine_keeps_serving(tiny):
    reports: list[PrefillAbortReport] = []
    async with running_engine(tiny) as engine:
        engine.on_prefill_abort = reports.append
        engine.prefill_planner = FixedPlanner(chunk=16, abort=True)

        event = await last_event(submit(engine, "too-big", 4, long_prompt(64)))

        assert isinstance(event, Failed) and isinstance(event.error, Aborted)
        assert event.error.reason == "PREFILL_ABORT"
        # Every token is still to prefill, the last with the final chunk (final_chunk.py).
        assert event.error.metadata["remaining_tokens"] == "64"
        assert event.error.metadata["chunk_tokens"] == "16"
        assert [r.request_id for r in reports] == ["too-big"]
        assert (reports[0].prompt_tokens, reports[0].remaining_tokens,
                reports[0].chunk_tokens) == (64, 64, 16)
        assert reports[0].model_id == "tiny" and reports[0].mlx_active_bytes > 0

        engine.prefill_planner = FixedPlanner(chunk=16, abort=False)
        done = await last_event(submit(engine, "fits", 4, long_prompt(64)))
        assert isinstance(done, Finished) and done.completion_tokens == 4
        assert len(reports) == 1


class RecordingPlanner(FixedPlanner):
    """A fixed answer, and every question asked of it."""

    def __init__(self, chunk: int) -> None:
        super().__init__(chunk, abort=False)
        self.planned: list[int] = []
        self.observed: list[int] = []

    def plan(self, mlx_bytes: int, remaining_tokens: int,
             prompt_tokens: int = 0) -> tuple[int, bool]:
        self.planned.append(remaining_tokens)
        return super().plan(mlx_bytes, remaining_tokens, prompt_tokens)

    def observe(self, tokens: int, bytes_delta: int, prompt_tokens: int = 0) -> None:
        self.observed.append(tokens)


async def test_a_last_token_left_alone_is_no_prefill_for_the_planner(tiny):
    """With the defaults a prompt's last token goes with its final chunk, but one left
    alone runs as the sequence's first decode step: a one-token prompt, or the 17th
    token after a 16-token chunk. The planner is asked about neither, and no decode step
    is taught to it as a one-token chunk's memory."""
    async with running_engine(tiny) as engine:
        assert engine.prefill_last_token
        engine.prefill_planner = planner = RecordingPlanner(chunk=16)
        done = await last_event(submit(engine, "one", 4, long_prompt(1)))
        assert isinstance(done, Finished) and done.completion_tokens == 4
        assert planner.planned == [] and planner.observed == []

        done = await last_event(submit(engine, "seventeen", 4, long_prompt(17)))
        assert isinstance(done, Finished) and done.completion_tokens == 4
        # 17 with the last token; the chunk of 16 cannot carry it, so it runs apart.
        assert planner.planned == [17] and planner.observed == [16], planner.__dict__

        planner.planned.clear()
        planner.observed.clear()
        done = await last_event(submit(engine, "sixteen", 4, long_prompt(16)))
        assert isinstance(done, Finished) and done.completion_tokens == 4
        assert planner.planned == [16] and len(planner.observed) == 1, planner.__dict__


async def test_the_store_gate_brackets_the_finish_hook(tiny):
    stored: list[tuple[str, str]] = []

    def on_finish(request: GenerationRequest, cache: list, tokens: list[int]) -> None:
        stored.append((request.request_id, threading.current_thread().name))

    async with running_engine(tiny, max_num_seqs=4, on_finish=on_finish) as engine:
        assert isinstance(await last_event(submit(engine, "first", 4)), Finished)
        assert stored == [("first", "engine-tiny")]
        assert engine.store_gate.in_flight == 0

        caps = [engine.adjust_store_cache_cap(PressureLevel.HARD) for _ in range(4)]
        assert caps == [3, 2, 1, 1] and engine.store_gate.cap == 1
        assert engine.batch_cap == 4  # the decode batch cap walks on its own
        assert engine.store_gate.try_acquire()  # one store in flight fills the gate
        try:
            assert isinstance(await last_event(submit(engine, "second", 4)), Finished)
        finally:
            engine.store_gate.release()
        assert [rid for rid, _ in stored] == ["first"]
        assert engine.stats.stores_skipped == 1

        assert engine.adjust_store_cache_cap(PressureLevel.OK) == 2
        assert engine.adjust_batch_cap(PressureLevel.SOFT) == 3 == engine.batch_cap
        assert engine.adjust_batch_cap(PressureLevel.OK) == 4
        assert engine.store_gate.cap == 2


async def test_fresh_sample_answers_within_a_second_on_an_idle_engine(tiny):
    unstarted = ModelEngine("never", str(tiny), asyncio.get_running_loop())
    assert unstarted.mlx_sample() is None
    with pytest.raises(Unavailable):
        unstarted.fresh_sample().result(timeout=0)

    async with running_engine(tiny) as engine:
        asked_at = time.monotonic()
        sample = await wait(engine.fresh_sample(), 1.0)
        assert sample.at > asked_at and sample.active_bytes > 0
        latest = engine.mlx_sample()
        assert latest is not None and latest.at >= sample.at
        assert engine.stats.sampled_at >= sample.at
    with pytest.raises(Unavailable):
        engine.fresh_sample().result(timeout=0)


async def test_abort_ends_held_and_undrained_inserts_and_reports_them(tiny):
    async with running_engine(tiny) as engine:
        engine.batch_cap = 1
        decoding = submit(engine, "decoding", LONG_DECODE)
        await first_chunk(decoding)
        held = submit(engine, "held", 8)
        await until(lambda: engine.stats.waiting_requests == 1, 2.0)
        assert engine.busy and engine.stats.active_requests == 1

        late = submit(engine, "late", 8)  # still in the inbox when the abort is sent
        ended = await wait(engine.abort(Aborted("test over"),
                                        ["held", "late", "decoding", "unknown"]))

        assert sorted(ended) == ["decoding", "held", "late"]
        for sink in (decoding, held, late):
            event = await last_event(sink)
            assert isinstance(event, Failed) and isinstance(event.error, Aborted)
        assert (engine.stats.active_requests, engine.stats.waiting_requests) == (0, 0)
        assert not engine.busy
