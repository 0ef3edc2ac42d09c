"""Generate over real gRPC on loopback, against the real tiny demo model through MLX."""

from __future__ import annotations

import threading
import time

import grpc
import mlx_lm
import pytest
from mlx_lm.generate import stream_generate

from plimsoll.v1 import control_pb2, inference_pb2


def run(stub, timeout: float = 120, **fields) -> list[inference_pb2.GenerateResponse]:
    sampling = fields.pop("sampling", None)
    req = inference_pb2.GenerateRequest(**fields)
    if sampling:
        for k, v in sampling.items():
            setattr(req.sampling, k, v)
    return list(stub.Generate(req, timeout=timeout))


def tokens_of(msgs) -> list[int]:
    return [t for m in msgs if m.WhichOneof("event") == "chunk" for t in m.chunk.token_ids]


def text_of(msgs) -> str:
    return "".join(m.chunk.text for m in msgs if m.WhichOneof("event") == "chunk")


def active_requests(control) -> int:
    resp = control.ListModels(control_pb2.ListModelsRequest(), timeout=10)
    return sum(m.active_requests + m.waiting_requests for m in resp.models)


def wait_idle(control, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while active_requests(control) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert active_requests(control) == 0, "a sequence leaked in the batch"


def test_stream_shape(inference):
    msgs = run(inference, text="hello there", max_tokens=12, ignore_eos=True)
    kinds = [m.WhichOneof("event") for m in msgs]
    assert kinds[0] == "start" and kinds[-1] == "end"
    assert set(kinds[1:-1]) == {"chunk"}
    start, end = msgs[0].start, msgs[-1].end
    assert start.request_id and start.model_id == "demo-tiny"
    assert start.prompt_tokens > 0
    assert start.pressure_level == 1  # PRESSURE_LEVEL_OK
    assert len(tokens_of(msgs)) == 12
    assert end.finish_reason == inference_pb2.FINISH_REASON_LENGTH
    assert end.usage.completion_tokens == 12
    assert end.usage.prompt_tokens == start.prompt_tokens
    assert end.timings.time_to_first_token.ToNanoseconds() / 1e9 > 0


def test_greedy_matches_mlx_lm(inference, demo_path):
    prompt = "The quick brown fox"
    msgs = run(inference, text=prompt, max_tokens=24, ignore_eos=True)
    model, tokenizer = mlx_lm.load(str(demo_path))
    expected = [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24)]
    got = tokens_of(msgs)
    # mlx-lm's generate stops at EOS; we asked to ignore it, so compare its length.
    assert got[: len(expected)] == expected


def test_seed_repeats_output(inference):
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": 1234}
    a = tokens_of(run(inference, text="once upon", max_tokens=20, ignore_eos=True,
                      sampling=sampling))
    b = tokens_of(run(inference, text="once upon", max_tokens=20, ignore_eos=True,
                      sampling=sampling))
    c = tokens_of(run(inference, text="once upon", max_tokens=20, ignore_eos=True,
                      sampling={**sampling, "seed": 99}))
    assert a == b
    assert a != c


def test_eight_concurrent_clients(server):
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        try:
            with server.channel() as ch:
                from plimsoll.v1 import inference_pb2_grpc

                stub = inference_pb2_grpc.InferenceServiceStub(ch)
                results[i] = run(stub, text=f"client {i} says", max_tokens=16,
                                 ignore_eos=True)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    assert len(results) == 8
    ids = {r[0].start.request_id for r in results.values()}
    assert len(ids) == 8
    assert all(len(tokens_of(r)) == 16 for r in results.values())


def test_concurrent_greedy_equals_solo(server, inference):
    """Continuous batching must not change a greedy sequence."""
    solo = tokens_of(run(inference, text="batch me", max_tokens=16, ignore_eos=True))
    out: list[list[int]] = []

    def client(text: str) -> None:
        with server.channel() as ch:
            from plimsoll.v1 import inference_pb2_grpc

            out.append(tokens_of(run(inference_pb2_grpc.InferenceServiceStub(ch),
                                     text=text, max_tokens=16, ignore_eos=True)))

    threads = [threading.Thread(target=client, args=("batch me",)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert out and all(o == solo for o in out)


def test_clients_of_different_lengths_at_once_end_at_their_max_tokens(server, inference,
                                                                        control):
    """Six clients at once with max_tokens 1 to 13: the engine ends each as soon as its
    last token is sampled and takes it out of the batch while the others decode on
    (engine/model_engine.py `_end_at_max_tokens`). Each gets its solo greedy tokens and
    a length end counting them, and no sequence is left in the batch."""
    lengths = (1, 2, 3, 5, 8, 13)
    solo = {n: tokens_of(run(inference, text="end me", max_tokens=n, ignore_eos=True))
            for n in lengths}
    out: dict[int, list] = {}

    def client(n: int) -> None:
        with server.channel() as ch:
            from plimsoll.v1 import inference_pb2_grpc

            out[n] = run(inference_pb2_grpc.InferenceServiceStub(ch), text="end me",
                         max_tokens=n, ignore_eos=True)

    threads = [threading.Thread(target=client, args=(n,)) for n in lengths]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(out) == list(lengths)
    for n, msgs in out.items():
        end = msgs[-1].end
        assert tokens_of(msgs) == solo[n] and len(solo[n]) == n
        assert end.finish_reason == inference_pb2.FINISH_REASON_LENGTH
        assert end.usage.completion_tokens == n
    wait_idle(control)


def test_token_id_prompt_and_chat(inference, demo_path):
    _, tokenizer = mlx_lm.load(str(demo_path))
    ids = tokenizer.encode("hello there")
    by_text = tokens_of(run(inference, text="hello there", max_tokens=8, ignore_eos=True))
    msgs = run(inference, token_ids=inference_pb2.TokenIds(ids=ids), max_tokens=8,
               ignore_eos=True)
    assert tokens_of(msgs) == by_text
    chat = inference_pb2.ChatMessages(messages=[
        inference_pb2.ChatMessage(role="system", content="be brief"),
        inference_pb2.ChatMessage(role="user", content="hi"),
    ])
    msgs = run(inference, chat=chat, max_tokens=8, ignore_eos=True)
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
    )
    assert msgs[0].start.prompt_tokens == len(expected)


def test_text_is_never_split_mid_character(inference, demo_path):
    _, tokenizer = mlx_lm.load(str(demo_path))
    msgs = run(inference, text="café naïve 日本語 🙂", max_tokens=48, ignore_eos=True,
               sampling={"temperature": 1.0, "seed": 5})
    ids = tokens_of(msgs)
    chunks = [m.chunk.text for m in msgs if m.WhichOneof("event") == "chunk"]
    # Each chunk is valid text on its own, and together they are the decoded tokens.
    assert "".join(chunks) == tokenizer.decode(ids)
    for c in chunks:
        c.encode("utf-8")  # no lone surrogates


def test_stop_string(inference):
    free = run(inference, text="stop test", max_tokens=30, ignore_eos=True)
    text = text_of(free)
    assert len(text) > 6
    stop = text[3:6]
    msgs = run(inference, text="stop test", max_tokens=30, ignore_eos=True, stop=[stop])
    assert msgs[-1].end.finish_reason == inference_pb2.FINISH_REASON_STOP
    assert stop not in text_of(msgs)
    assert text.startswith(text_of(msgs))


def test_cancel_mid_stream_frees_slot(inference, control):
    call = inference.Generate(
        inference_pb2.GenerateRequest(text="long one", max_tokens=3000, ignore_eos=True),
        timeout=120,
    )
    seen = 0
    for m in call:
        if m.WhichOneof("event") == "chunk":
            seen += 1
            if seen == 3:
                break
    assert active_requests(control) >= 1
    call.cancel()
    wait_idle(control)
    assert len(tokens_of(run(inference, text="next", max_tokens=4, ignore_eos=True))) == 4


def test_deadline_expiry_frees_slot(inference, control):
    with pytest.raises(grpc.RpcError) as info:
        run(inference, timeout=0.5, text="deadline", max_tokens=3000, ignore_eos=True)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_idle(control)
    assert len(tokens_of(run(inference, text="next", max_tokens=4, ignore_eos=True))) == 4
