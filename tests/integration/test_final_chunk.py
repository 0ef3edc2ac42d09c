"""A prompt's last token prefilled with its final chunk (engine/final_chunk.py), on real
demo models and real engine threads: one model pass fewer before the first token, and
the tokens of mlx-lm's own path, where the last token runs as a decode step of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from engine import last_block
from engine.final_chunk import FinalChunkGenerator
from engine.loading import load_model
from engine.model_engine import EngineSettings, ModelEngine
from engine.request import Chunk, Failed, Finished, GenerationRequest
from plimsoll.v1 import inference_pb2
from service.cli import build_parser
from tools.harness.server import start_server

WAIT_S = 60.0


@asynccontextmanager
async def engine_on(path: Any, model_id: str, **settings: Any) -> AsyncIterator[ModelEngine]:
    engine = ModelEngine(model_id, str(path), asyncio.get_running_loop(),
                         EngineSettings(**settings))
    await asyncio.wait_for(asyncio.wrap_future(engine.start()), WAIT_S)
    try:
        yield engine
    finally:
        await asyncio.wait_for(asyncio.wrap_future(engine.stop()), WAIT_S)


async def greedy_all(engine: ModelEngine, prompts: list[list[int]], max_tokens: int
                     ) -> list[list[int]]:
    """Every prompt submitted at once (one burst); each one's tokens."""
    sinks: list[asyncio.Queue] = []
    for i, prompt in enumerate(prompts):
        sink: asyncio.Queue = asyncio.Queue()
        engine.submit(GenerationRequest(f"{engine.model_id}-{i}", engine.model_id, prompt,
                                        max_tokens=max_tokens, ignore_eos=True), sink)
        sinks.append(sink)
    out = []
    for sink in sinks:
        events: list = []
        while not events or not isinstance(events[-1], Finished | Failed):
            events.append(await asyncio.wait_for(sink.get(), WAIT_S))
        assert isinstance(events[-1], Finished), events[-1]
        out.append([t for e in events if isinstance(e, Chunk) for t in e.token_ids])
    return out


@pytest.fixture
def model_calls(monkeypatch, demo_path) -> dict[str, list[tuple[int, ...]]]:
    """The input shape of every call of the demo model's forward pass, by thread name."""
    model_class = type(load_model(str(demo_path)).model)
    own = model_class.__call__
    calls: dict[str, list[tuple[int, ...]]] = {}

    def counted(self, inputs, *args, **kwargs):
        calls.setdefault(threading.current_thread().name, []).append(tuple(inputs.shape))
        return own(self, inputs, *args, **kwargs)

    monkeypatch.setattr(model_class, "__call__", counted)
    return calls


async def test_the_first_token_comes_from_the_final_chunk_one_model_pass_sooner(
        demo_path, model_calls):
    """With the defaults the engine runs a 40-token prompt as one 40-row pass and samples
    the first token from it; with `prefill_last_token=False` it runs 39 rows and then the
    last token alone, as mlx-lm does. The same greedy tokens either way."""
    prompt = [1 + (7 * i) % 1000 for i in range(40)]
    async with engine_on(demo_path, "merged") as merged, \
            engine_on(demo_path, "apart", prefill_last_token=False) as apart:
        assert merged.prefill_last_token and not apart.prefill_last_token
        got = await greedy_all(merged, [prompt], 6)
        want = await greedy_all(apart, [prompt], 6)
    assert got == want and len(got[0]) == 6
    merged_calls, apart_calls = model_calls["engine-merged"], model_calls["engine-apart"]
    assert merged_calls[0] == (1, 40) and (1, 39) not in merged_calls, merged_calls
    assert apart_calls[:2] == [(1, 39), (1, 1)], apart_calls
    # Every later pass is a decode step: the merged run made one pass fewer in all.
    assert len(merged_calls) == len(apart_calls) - 1, (merged_calls, apart_calls)


async def test_prompts_that_end_together_share_one_final_chunk(demo_path, model_calls):
    """Three prompts of one length that arrive together end in one 3 x 24 pass (a batch
    cache, its mask cut for the last rows); three of 9, 17 and 30 tokens in one 3 x 30
    pass, the shorter ones padded on the left (mlx-lm pads a chunk on the right: 3 x 29,
    then the last tokens). Greedy tokens as with the last tokens run apart."""
    same = [[1 + (11 * i + j) % 1000 for j in range(24)] for i in range(3)]
    mixed = [[1 + (13 * i + j) % 1000 for j in range(n)] for i, n in enumerate((9, 17, 30))]
    async with engine_on(demo_path, "merged") as merged, \
            engine_on(demo_path, "apart", prefill_last_token=False) as apart:
        got = [await greedy_all(merged, same, 5), await greedy_all(merged, mixed, 5)]
        want = [await greedy_all(apart, same, 5), await greedy_all(apart, mixed, 5)]
    assert got == want
    calls = model_calls["engine-merged"]
    assert (3, 24) in calls and (3, 30) in calls, calls
    assert (3, 23) not in calls and (3, 29) not in calls, calls
    assert (3, 29) in model_calls["engine-apart"]


async def test_a_prompt_that_ends_beside_one_that_goes_on(demo_path, model_calls):
    """With 16-token steps, a 10-token prompt beside a 40-token one: the first chunk is
    2 x 16, the short prompt's 10 rows (its last token among them) padded on the left of
    the long one's first 16, and the long one goes on to a final chunk of its last 8.
    Greedy tokens as with the last tokens run apart."""
    prompts = [[1 + (29 * j) % 1000 for j in range(40)], [1 + (31 * j) % 1000 for j in range(10)]]
    async with engine_on(demo_path, "merged", prefill_step_size=16) as merged, \
            engine_on(demo_path, "apart", prefill_step_size=16, prefill_last_token=False) as apart:
        got = await greedy_all(merged, prompts, 5)
        want = await greedy_all(apart, prompts, 5)
    assert got == want
    calls = [c for c in model_calls["engine-merged"] if c[1] > 1]
    assert calls == [(2, 16), (1, 16), (1, 8)], calls
    # Each prompt's last token ran in a chunk: two passes fewer in all.
    assert len(model_calls["engine-merged"]) == len(model_calls["engine-apart"]) - 2


async def test_prompts_of_several_lengths_after_a_cached_prefix_keep_mlx_lm_s_path(demo_path):
    """A batch cache that holds a prompt's cached prefix takes no left padding: prompts of
    two lengths there run their last tokens apart, and decode what mlx-lm decodes."""
    prefix = [1 + (19 * j) % 1000 for j in range(12)]
    rest, other = [[1 + (23 * j) % 1000 for j in range(n)] for n in (9, 14)]

    async with engine_on(demo_path, "tiny") as engine:
        model = engine.info.model

        def run(make: type[BatchGenerator]) -> tuple[dict[int, list[int]], int]:
            cache = make_prompt_cache(model)
            model(mx.array([prefix]), cache=cache)
            mx.eval([c.state for c in cache])
            gen = make(model, completion_batch_size=8, prefill_batch_size=8)
            gen.insert([rest, other], max_tokens=[5, 5], caches=[cache, None],
                       all_tokens=[list(prefix), []])  # mlx-lm extends these lists
            held = 0
            tokens: dict[int, list[int]] = {}
            while sum(map(len, tokens.values())) < 10:
                _, responses = gen.next()
                held = max(held, len(getattr(gen, "first_logits", {})))
                for r in responses:
                    tokens.setdefault(r.uid, []).append(r.token)
            gen.close()
            return tokens, held

        def both() -> tuple:
            return run(FinalChunkGenerator), run(BatchGenerator)

        (ours, held), (theirs, _) = await asyncio.wrap_future(engine.call(both))
    assert held == 0 and ours == theirs, (held, ours, theirs)


def _drive(make: type[BatchGenerator], model: Any, first: list[int], joining: list[int],
           cancel: list[int] | None) -> tuple[dict[int, list[int]], dict[int, tuple], dict]:
    """One prompt's final chunk, then a one-token prompt joins as that prompt's generation
    starts (and `cancel`, if given, is removed between its final chunk and its first
    token). Each sequence's tokens, the progress each split reported, and what the final
    chunk left in first_logits."""
    gen = make(model, completion_batch_size=8, prefill_batch_size=8)
    prompts = [first, cancel] if cancel else [first]
    uids = gen.insert(prompts, max_tokens=[5] * len(prompts))
    gen.next()  # the final chunk (one chunk: the prompts are short)
    held = dict(getattr(gen, "first_logits", {}))
    if cancel:
        gen.remove([uids[1]])
    gen.insert([joining], max_tokens=[5])
    tokens: dict[int, list[int]] = {}
    progress: dict[int, tuple] = {}
    for _ in range(20):
        prompt_responses, responses = gen.next()
        for r in prompt_responses:
            if r.end_of_prompt:
                progress[r.uid] = r.progress
        for r in responses:
            tokens.setdefault(r.uid, []).append(r.token)
        if tokens and all(len(t) == 5 for t in tokens.values()) and len(tokens) == 2:
            break
    leftover = dict(getattr(gen, "first_logits", {}))
    gen.close()
    return tokens, progress, {"held": held, "leftover": leftover}


async def test_a_one_token_prompt_joining_a_final_chunk_and_a_cancel_between(demo_path):
    """On the engine thread: a 20-token prompt's final chunk holds its logits (so does a
    second one's, cancelled before its first token: those are dropped); a one-token
    prompt joins as the first starts generating, so the split mixes a row whose logits
    are known with one whose last token still runs. Each is paired with its own progress
    and both decode what mlx-lm's own BatchGenerator decodes."""
    first = [1 + (3 * j) % 1000 for j in range(20)]
    cancel = [1 + (5 * j) % 1000 for j in range(20)]
    async with engine_on(demo_path, "tiny") as engine:
        model = engine.info.model

        def both() -> tuple:
            return (_drive(FinalChunkGenerator, model, first, [7], cancel),
                    _drive(BatchGenerator, model, first, [7], cancel))

        (ours, our_progress, held), (theirs, their_progress, _) = \
            await asyncio.wrap_future(engine.call(both))
    assert set(held["held"]) == {0, 1} and held["leftover"] == {}
    assert ours == theirs and sorted(ours) == [0, 2], (ours, theirs)
    assert our_progress == their_progress == {0: (20, 20), 2: (1, 1)}


async def test_a_cache_taken_between_the_final_chunk_and_the_first_token(demo_path):
    """mlx-lm's `remove(..., return_prompt_caches=True)` hands back a cache and the tokens
    it holds. Between a final chunk and the first token the chunk's cache holds the
    prompt's last token too, the tokens not yet: it comes back cut to them, so a request
    resumed from it decodes what mlx-lm's does. A one-shot iterable of uids removes them
    as mlx-lm's `remove` does."""
    prompt = [1 + (7 * j) % 1000 for j in range(12)]
    async with engine_on(demo_path, "tiny") as engine:
        model = engine.info.model

        def run(make: type[BatchGenerator]) -> tuple[int, int, list[int], list[int]]:
            gen = make(model, completion_batch_size=4, prefill_batch_size=4)
            uid, other = gen.insert([prompt, prompt[:5]], max_tokens=[5, 5])
            gen.next()  # the final chunk: both prompts end in it
            cache, tokens = gen.remove([uid], return_prompt_caches=True)[uid]
            (resumed,) = gen.insert([prompt[len(tokens):]], max_tokens=[5], caches=[cache],
                                    all_tokens=[list(tokens)])
            gen.remove(u for u in (other,))
            out: list[int] = []
            for _ in range(10):
                _, responses = gen.next()
                out += [r.token for r in responses if r.uid == resumed]
                assert other not in {r.uid for r in responses}
            left = len(getattr(gen, "first_logits", {}))
            gen.close()
            return cache[0].offset - len(tokens), left, tokens, out

        def both() -> tuple:
            return run(FinalChunkGenerator), run(BatchGenerator)

        ours, theirs = await asyncio.wrap_future(engine.call(both))
    assert ours[:2] == (0, 0) and theirs[0] == 0, (ours, theirs)
    assert ours[2:] == theirs[2:] and len(ours[3]) == 5, (ours, theirs)


def test_a_last_block_that_takes_another_argument_keeps_mlx_lm_s_path():
    """HunYuan's block takes the keys and values another layer shared, sized to the whole
    chunk, beside (x, mask, cache): it cannot run the last row apart, so the model keeps
    mlx-lm's path, with mlx-lm's tokens (a small random HunYuan)."""
    from mlx_lm.models import hunyuan

    mx.random.seed(0)
    model = hunyuan.Model(hunyuan.ModelArgs(
        model_type="hunyuan", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        attention_bias=False, moe_topk=1, num_experts=1, num_shared_expert=1,
        use_mixed_mlp_moe=False, use_qk_norm=True, rms_norm_eps=1e-5, rope_theta=10000.0,
        use_cla=True, cla_share_factor=2,
        rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"}))
    mx.eval(model.parameters())
    why = last_block.split_reason(model)
    assert why is not None and "shared_kv_states" in why, why
    # Marked anyway (as a model would be if its check let it through), the block still
    # runs every row when called with more than (x, mask, cache).
    block = last_block.last_of(model)
    last_block.mark(block)
    try:
        tokens = {}
        for make in (BatchGenerator, FinalChunkGenerator):
            gen = make(model, completion_batch_size=4, prefill_batch_size=4)
            gen.insert([[1 + (7 * j) % 250 for j in range(12)]], max_tokens=[4])
            out: list[int] = []
            for _ in range(8):
                out += [r.token for r in gen.next()[1]]
            gen.close()
            tokens[make.__name__] = out
    finally:
        last_block.unmark(block)
    assert tokens["FinalChunkGenerator"] == tokens["BatchGenerator"], tokens
    assert len(tokens["BatchGenerator"]) == 4


def test_a_model_whose_caches_rotate_keeps_mlx_lm_s_own_path(demo_path):
    """A sliding-window cache does not hand a chunk's rows back as decode rows: such a
    model, like one whose last block takes other arguments, runs its last token apart."""
    model = load_model(str(demo_path)).model
    assert last_block.split_reason(model) is None
    model.make_cache = lambda: [RotatingKVCache(64) for _ in model.layers]
    why = last_block.split_reason(model)
    assert why is not None and "RotatingKVCache" in why


def test_the_split_of_a_chunk_mask():
    """The first rows' mask and the last row's, cut from a chunk's."""
    mask = mx.tril(mx.ones((4, 6), dtype=mx.bool_), k=2)
    first, last = last_block._split_mask(mask, 4)
    assert mx.array_equal(first, mask[:3, :5]).item()
    assert mx.array_equal(last, mask[3:, :]).item()
    assert last_block._split_mask("causal", 4) == ("causal", None)
    assert last_block._split_mask(None, 4) == (None, None)
    assert last_block._split_mask(mask, 3) is None  # not this chunk's


def test_serve_flag_runs_the_last_token_apart(tmp_path, server):
    """`plimsoll serve --no-prefill-last-token` says so at load and serves the tokens
    the default does (the shared server's, which says it prefills them with the chunk)."""
    assert build_parser().parse_args(["serve"]).prefill_last_token is True
    prompt = [1 + (17 * i) % 1000 for i in range(33)]
    req = inference_pb2.GenerateRequest(
        model_id="demo-tiny", token_ids=inference_pb2.TokenIds(ids=prompt), max_tokens=6,
        ignore_eos=True, sampling=inference_pb2.SamplingParams(temperature=0))

    def tokens(srv) -> list[int]:
        with srv.stubs() as (_, inference):
            return [t for m in inference.Generate(req, timeout=60)
                    if m.WhichOneof("event") == "chunk" for t in m.chunk.token_ids]

    apart_server = start_server(tmp_path, "--no-prefill-last-token")
    try:
        assert "runs as a decode step of its own (turned off by the settings)" in \
            apart_server.log()
        apart = tokens(apart_server)
    finally:
        apart_server.stop()
    assert "prefilled with its final chunk" in server.log()
    merged = tokens(server)
    assert merged == apart and len(merged) == 6
