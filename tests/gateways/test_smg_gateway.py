"""SMG in front, for real: `smg launch` over two Plimsoll workers on loopback, OpenAI
`/v1/chat/completions` (streaming and not) and `/v1/completions` through it, each
answer the same as a direct plimsoll.v1 Generate under greedy decoding.
"""

from __future__ import annotations

import pytest

from plimsoll.v1 import inference_pb2, inference_pb2_grpc
from tests.gateways.smg import SMG, smg_fleet, smg_version

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg gateway is not installed")

MODEL = "demo-tiny"
MAX_TOKENS = 12
STORY = [{"role": "user", "content": "Tell me a story"}]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, demo_path):
    with smg_fleet(tmp_path_factory.mktemp("smg-fleet"), demo_path, "round_robin") as both:
        yield both


def _direct(worker, **prompt) -> tuple[str, int]:
    """(text, prompt tokens) of a greedy plimsoll.v1 Generate on `worker`."""
    with worker.channel() as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        req = inference_pb2.GenerateRequest(
            max_tokens=MAX_TOKENS, sampling=inference_pb2.SamplingParams(temperature=0.0),
            **prompt)
        answers = list(stub.Generate(req, timeout=60))
    return "".join(r.chunk.text for r in answers if r.HasField("chunk")), \
        answers[0].start.prompt_tokens


def _chat_messages() -> inference_pb2.ChatMessages:
    return inference_pb2.ChatMessages(messages=[inference_pb2.ChatMessage(**m) for m in STORY])


def test_gateway_version_and_workers(fleet):
    gateway, workers = fleet
    assert smg_version() == "1.13.0"
    assert "version  1.13.0" in gateway.log()  # the binary's banner
    listed = gateway.workers()
    assert {w["url"] for w in listed} == {f"grpc://{w.address}" for w in workers}
    for w in listed:
        # Read from our GetModelInfo: the model id SMG serves is the worker's.
        assert (w["runtime_type"], w["model_id"], w["status"]) == ("mlx", MODEL, "ready")
        assert w["labels"]["eos_token_ids"] == "[2,4]"
    models = gateway.get("/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL]


def test_completions_match_a_direct_generate(fleet):
    gateway, workers = fleet
    text, prompt_tokens = _direct(workers[0], text="The quick brown fox")
    for _ in workers:  # round robin: once on each worker
        body = gateway.post("/v1/completions", {
            "model": MODEL, "prompt": "The quick brown fox", "max_tokens": MAX_TOKENS,
            "temperature": 0}).json()
        assert body["choices"][0]["text"] == text
        assert body["choices"][0]["finish_reason"] in ("length", "stop")
        assert body["usage"]["prompt_tokens"] == prompt_tokens


def test_chat_completions_match_a_direct_generate(fleet):
    gateway, workers = fleet
    text, prompt_tokens = _direct(workers[1], chat=_chat_messages())
    body = gateway.post("/v1/chat/completions", {
        "model": MODEL, "messages": STORY, "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    assert body["choices"][0]["message"]["content"] == text
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    events = gateway.stream("/v1/chat/completions", {
        "model": MODEL, "messages": STORY, "max_tokens": MAX_TOKENS, "temperature": 0,
        "stream_options": {"include_usage": True}})
    streamed = "".join(e["choices"][0]["delta"].get("content") or ""
                       for e in events if e.get("choices"))
    assert streamed == text
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] <= MAX_TOKENS
