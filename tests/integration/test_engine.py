"""The engine thread directly (real MLX, tiny demo model)."""

from __future__ import annotations

import asyncio
import sys
import threading

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from engine.errors import Internal, Unavailable
from engine.model_engine import EngineSettings, ModelEngine
from engine.request import Chunk, Failed, Finished, FinishReason, GenerationRequest
from tests.support.processes import run_side_by_side
from tools.harness.server import ROOT


async def events_of(engine: ModelEngine, request: GenerationRequest) -> list:
    """Submits the request; its events up to and with its end."""
    sink: asyncio.Queue = asyncio.Queue()
    engine.submit(request, sink)
    events = []
    while not events or not isinstance(events[-1], Finished | Failed):
        events.append(await asyncio.wait_for(sink.get(), 30))
    return events


async def tokens_and_end(engine: ModelEngine, request: GenerationRequest
                         ) -> tuple[list[int], Finished]:
    """The ids a request streamed and its end, which must be a Finished."""
    events = await events_of(engine, request)
    assert isinstance(events[-1], Finished), events[-1]
    return [t for e in events if isinstance(e, Chunk) for t in e.token_ids], events[-1]


async def run(engine: ModelEngine, rid: str) -> list:
    return await events_of(engine, GenerationRequest(rid, "tiny", [5, 6, 7], max_tokens=4,
                                                     ignore_eos=True))


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


async def test_the_first_token_goes_out_before_the_next_decode_step_runs(
        demo_path, monkeypatch):
    """mlx-lm hands back a sequence's first token only from the step after it is
    sampled; the engine sends it at once. The step after is held here until the first
    chunk has arrived, so a first token that waits for that step times out."""
    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop())
    await asyncio.wrap_future(engine.start())
    real_next = BatchGenerator.next
    release = threading.Event()

    def held_next(self):
        if len(self._generation_batch) > 0:  # a sequence is decoding: its token is out
            release.wait(20)
        return real_next(self)

    monkeypatch.setattr(BatchGenerator, "next", held_next)
    sink: asyncio.Queue = asyncio.Queue()
    try:
        engine.submit(GenerationRequest("a", "tiny", [5, 6, 7], max_tokens=4,
                                        ignore_eos=True), sink)
        first = await asyncio.wait_for(sink.get(), 10)
        assert isinstance(first, Chunk) and len(first.token_ids) == 1
        release.set()
        events = [first]
        while not isinstance(events[-1], Finished | Failed):
            events.append(await asyncio.wait_for(sink.get(), 30))
        # Sent once: the step's own response for that token adds nothing.
        ids = [t for e in events if isinstance(e, Chunk) for t in e.token_ids]
        assert len(ids) == 4 and events[-1].completion_tokens == 4
    finally:
        release.set()
        await asyncio.wrap_future(engine.stop())


async def test_an_early_first_token_leaves_the_output_unchanged(demo_path):
    """Greedy output with the first token sent early equals the batch's own sequence:
    compared with mlx-lm's BatchGenerator driven directly."""
    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop())
    info = await asyncio.wrap_future(engine.start())
    prompt = [5, 6, 7, 8, 9]
    try:
        sink: asyncio.Queue = asyncio.Queue()
        engine.submit(GenerationRequest("a", "tiny", prompt, max_tokens=6,
                                        ignore_eos=True), sink)
        events = []
        while not events or not isinstance(events[-1], Finished | Failed):
            events.append(await asyncio.wait_for(sink.get(), 30))
        ours = [t for e in events if isinstance(e, Chunk) for t in e.token_ids]

        def direct() -> list[int]:
            gen = BatchGenerator(engine.info.model)
            gen.insert([prompt], max_tokens=[6])
            out: list[int] = []
            while len(out) < 6:
                out += [r.token for r in gen.next()[1]]
            gen.close()
            return out

        assert ours == await asyncio.wrap_future(engine.call(direct))
    finally:
        await asyncio.wrap_future(engine.stop())
    assert info is not None


@pytest.mark.skipif(mx.default_device() != mx.cpu,
                    reason="on an accelerator mlx-lm's own path is kept")
@pytest.mark.parametrize("max_tokens", [1, 2, 6])
async def test_the_last_token_and_the_end_go_out_without_a_step_after_them(
        demo_path, monkeypatch, max_tokens):
    """mlx-lm returns a sequence's token from the step after it was sampled, so at its
    max_tokens it runs a step only to throw it away; the engine reads that last token
    at once and ends the request: a lone request runs max_tokens - 1 decode steps, with
    the same tokens as the batch's own sequence. The finish hook gets every token's KV
    but the last's, and those tokens. A turn the session bank keeps takes mlx-lm's path,
    its stored cache holding the last token too."""
    stored: dict[str, tuple[int, list[int]]] = {}

    def on_finish(request: GenerationRequest, cache: list, tokens: list[int]) -> None:
        stored[request.request_id] = (cache[0].offset, list(tokens))

    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop(),
                         on_finish=on_finish)
    await asyncio.wrap_future(engine.start())
    real_next = BatchGenerator.next
    steps: list[int] = []

    def counted_next(self):
        if len(self._generation_batch) > 0:
            steps.append(len(self._generation_batch))
        return real_next(self)

    monkeypatch.setattr(BatchGenerator, "next", counted_next)
    prompt = [5, 6, 7, 8, 9]

    async def generate(rid: str, session: str = "") -> tuple[list[int], Finished]:
        return await tokens_and_end(engine, GenerationRequest(
            rid, "tiny", prompt, max_tokens=max_tokens, ignore_eos=True, session_id=session))

    def direct() -> list[int]:
        gen = BatchGenerator(engine.info.model)
        gen.insert([prompt], max_tokens=[max_tokens])
        out: list[int] = []
        while len(out) < max_tokens:
            out += [r.token for r in gen.next()[1]]
        gen.close()
        return out

    try:
        ours, end = await generate("a")
        assert steps == [1] * (max_tokens - 1)
        assert end.reason == FinishReason.LENGTH and end.completion_tokens == max_tokens
        want = await asyncio.wrap_future(engine.call(direct))
        steps.clear()
        kept, _ = await generate("s", session="chat")
        assert steps == [1] * max_tokens  # mlx-lm's path: the step after the last too
    finally:
        await asyncio.wrap_future(engine.stop())
    assert ours == want == kept
    kv, tokens = stored["a"]
    assert tokens == prompt + ours[:-1] and kv == len(tokens)
    kv, tokens = stored["s"]
    assert tokens == prompt + kept and kv == len(tokens)


@pytest.mark.skipif(mx.default_device() != mx.cpu,
                    reason="on an accelerator mlx-lm's own path is kept")
async def test_sequences_that_end_early_leave_the_rest_of_their_batch_as_it_was(
        demo_path):
    """Three requests decoding together: one ends at 2 tokens and one at 5, read ahead
    and taken out of the batch while the others go on; the third's last token by
    max_tokens is one of its stop ids, read ahead too, which ends it as a stop (the id
    withheld, as mlx-lm ends it). Every token is the batch's own sequence, from mlx-lm's
    BatchGenerator driven directly."""
    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop(),
                         EngineSettings(burst_wait_s=0.5, burst_gap_s=0.05))
    await asyncio.wrap_future(engine.start())
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24, 25, 26, 27]]
    lengths = [2, 5, 7]

    def direct() -> list[list[int]]:
        gen = BatchGenerator(engine.info.model)
        uids = gen.insert(prompts, max_tokens=lengths)
        out: dict[int, list[int]] = {u: [] for u in uids}
        while any(len(out[u]) < n for u, n in zip(uids, lengths, strict=True)):
            for r in gen.next()[1]:
                out[r.uid].append(r.token)
        gen.close()
        return [out[u] for u in uids]

    def generate(i: int, stop: tuple[int, ...]):
        return tokens_and_end(engine, GenerationRequest(
            f"r{i}", "tiny", prompts[i], max_tokens=lengths[i], ignore_eos=True,
            stop_token_ids=stop))

    try:
        want = await asyncio.wrap_future(engine.call(direct))
        last = want[2][-1]
        assert last not in want[2][:-1]  # so that the stop id ends it at its last token
        got = await asyncio.gather(generate(0, ()), generate(1, ()), generate(2, (last,)))
    finally:
        await asyncio.wrap_future(engine.stop())
    (a, end_a), (b, end_b), (c, end_c) = got
    assert (a, b) == (want[0], want[1])
    assert end_a.reason == end_b.reason == FinishReason.LENGTH
    assert (end_a.completion_tokens, end_b.completion_tokens) == (2, 5)
    assert c == want[2][:-1] and end_c.reason == FinishReason.STOP
    assert end_c.matched_stop_token == last and end_c.completion_tokens == 6


@pytest.mark.parametrize("wait_s,together", [(0.5, True), (0.0, False)])
async def test_an_idle_engine_takes_a_burst_that_arrives_over_a_few_ms_as_one_batch(
        demo_path, monkeypatch, wait_s, together):
    """Requests an event loop hands over one at a time, a few ms apart: an idle engine
    inserts them all before its first step (one prefill), or, with the wait off, starts
    on the first at once. (A wider gap than the default's 1 ms keeps a busy machine's
    scheduling out of the test.)"""
    settings = EngineSettings(burst_wait_s=wait_s, burst_gap_s=0.05)
    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop(), settings)
    await asyncio.wrap_future(engine.start())
    seen: list[str] = []
    real_insert, real_next = BatchGenerator.insert, BatchGenerator.next

    def insert(self, *a, **kw):
        seen.append("insert")
        return real_insert(self, *a, **kw)

    def step(self):
        if not seen or seen[-1] != "step":
            seen.append("step")
        return real_next(self)

    monkeypatch.setattr(BatchGenerator, "insert", insert)
    monkeypatch.setattr(BatchGenerator, "next", step)
    sinks = [asyncio.Queue() for _ in range(4)]
    try:
        for i, sink in enumerate(sinks):
            engine.submit(GenerationRequest(f"r{i}", "tiny", [5, 6, 7 + i], max_tokens=2,
                                            ignore_eos=True), sink)
            await asyncio.sleep(0.005)
        for sink in sinks:
            events = [await asyncio.wait_for(sink.get(), 30)]
            while not isinstance(events[-1], Finished | Failed):
                events.append(await asyncio.wait_for(sink.get(), 30))
            assert isinstance(events[-1], Finished)
    finally:
        await asyncio.wrap_future(engine.stop())
    first_step = seen.index("step")
    assert (seen[:first_step] == ["insert"] * 4) is together, seen


async def test_lone_requests_in_a_row_stop_the_burst_wait_until_a_burst_comes(demo_path):
    """With the defaults: an idle engine waits for company at its first
    burst_lone_starts lone starts, then starts lone requests at once; two requests
    submitted together (within the default 1 ms) make the next idle start wait again."""
    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop())
    lone = engine.settings.burst_lone_starts
    await asyncio.wrap_future(engine.start())

    async def run(*names: str) -> None:
        sinks = [asyncio.Queue() for _ in names]
        for name, sink in zip(names, sinks, strict=True):
            engine.submit(GenerationRequest(name, "tiny", [5, 6, 7], max_tokens=2,
                                            ignore_eos=True), sink)
        for sink in sinks:
            event = await asyncio.wait_for(sink.get(), 30)
            while not isinstance(event, Finished | Failed):
                event = await asyncio.wait_for(sink.get(), 30)
            assert isinstance(event, Finished)
        await asyncio.sleep(0.02)  # apart by far more than burst_gap_s

    try:
        for i in range(lone + 3):
            await run(f"lone-{i}")
        assert engine.stats.burst_waits == lone
        await run("pair-0", "pair-1")
        assert engine.stats.burst_waits == lone  # lone starts still: no wait for the pair
        await run("after-pair")
        assert engine.stats.burst_waits == lone + 1
    finally:
        await asyncio.wrap_future(engine.stop())



# A script that runs an engine directly, awaits its stop and returns at once. The
# engine thread's C++ thread-local destructors (MLX's compile cache, which holds Python
# objects) run after its Python part ended; without the engine's exit hook the
# interpreter finalized under them and aborted in about two runs of three.
_STOP_AND_EXIT = """
import asyncio, sys
from engine.model_engine import ModelEngine
from engine.request import Finished, GenerationRequest

async def main():
    engine = ModelEngine("tiny", sys.argv[1], asyncio.get_running_loop())
    await asyncio.wrap_future(engine.start())
    sink = asyncio.Queue()
    engine.submit(GenerationRequest("r", "tiny", [5, 6, 7], max_tokens=4, ignore_eos=True),
                  sink)
    while not isinstance(await sink.get(), Finished):
        pass
    await asyncio.wrap_future(engine.stop())

asyncio.run(main())
"""


def test_a_script_that_returns_right_after_stop_exits_cleanly(demo_path):
    # Four interpreters side by side (the race shows in some runs only), twice.
    command = [sys.executable, "-c", _STOP_AND_EXIT, str(demo_path)]
    for _ in range(2):
        for r in run_side_by_side([command] * 4, cwd=ROOT):
            assert r.returncode == 0, f"exit {r.returncode}: {r.stderr[-2000:]}"
            assert "terminate called" not in r.stderr
