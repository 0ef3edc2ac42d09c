"""Sessions across workers behind SMG: `--policy consistent_hashing` keyed by the
`X-SMG-Routing-Key` header puts every turn of a conversation on one worker, where the
turn before left its KV in the session bank (SMG reports the reuse as
`usage.prompt_tokens_details.cached_tokens`); when that worker drains, the next turn
goes to the other one and pays a cold prefill, and completes.
"""

from __future__ import annotations

import signal
import time

import pytest
from tokenizers import Tokenizer

from plimsoll.v1 import control_pb2, control_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.gateways.smg import SMG, smg_fleet

pytestmark = pytest.mark.skipif(SMG is None, reason="the smg gateway is not installed")

MODEL = "demo-tiny"
MAX_TOKENS = 6
CANDIDATES = ("Once upon a time there was", "The quick brown fox jumps over",
              "In the beginning the sky was", "A long road leads to the old")


def _smg_sessions(worker) -> list[str]:
    """The SMG lineage sessions (service/smg_worker.py) a worker's bank holds."""
    with worker.channel() as ch:
        listed = control_pb2_grpc.ControlServiceStub(ch).ListSessions(
            control_pb2.ListSessionsRequest(), timeout=10)
    return [s.session_id for s in listed.sessions if s.session_id.startswith("smg-")]


def _greedy(worker, text: str) -> tuple[list[int], str]:
    with worker.channel() as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        answers = list(stub.Generate(inference_pb2.GenerateRequest(
            text=text, max_tokens=MAX_TOKENS, ignore_eos=True,
            sampling=inference_pb2.SamplingParams(temperature=0.0)), timeout=60))
    chunks = [r.chunk for r in answers if r.HasField("chunk")]
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks)


def _round_trips(tok: Tokenizer, worker, text: str) -> str | None:
    """`text` + its greedy continuation, when that tokenizes to the prompt's tokens and
    then the generated ones: the next turn then extends the stored KV's tokens exactly
    (the bank restores by exact token prefix)."""
    ids, completion = _greedy(worker, text)
    prompt = tok.encode(text).ids
    if tok.encode(text + completion + " next").ids[:len(prompt) + len(ids)] == prompt + ids:
        return text + completion
    return None


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, demo_path):
    with smg_fleet(tmp_path_factory.mktemp("smg-sessions"), demo_path, "consistent_hashing") as both:
        yield both


def test_turns_follow_their_kv_and_move_cold_when_its_worker_drains(fleet, demo_path):
    gateway, workers = fleet
    tok = Tokenizer.from_file(str(demo_path / "tokenizer.json"))
    first = next((t for t in CANDIDATES if _round_trips(tok, workers[0], t)), None)
    assert first is not None, "no candidate prompt round-trips through the tokenizer"
    key = {"X-SMG-Routing-Key": "conversation-1"}

    def turn(prompt: str) -> dict:
        answer = gateway.post("/v1/completions", {
            "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}, key)
        assert answer.status == 200, answer.body
        return answer.json()

    one = turn(first)
    assert one["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    holders = [w for w in workers if _smg_sessions(w)]
    assert len(holders) == 1, "turn one's KV is on exactly one worker"
    holder = holders[0]
    other = next(w for w in workers if w is not holder)

    second_prompt = first + one["choices"][0]["text"] + " next"
    two = turn(second_prompt)
    # Same worker (the other holds nothing), and the first turn's prompt and answer
    # came from the bank instead of a prefill.
    cached = two["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(tok.encode(first).ids), two["usage"]
    assert _smg_sessions(other) == []

    holder.proc.send_signal(signal.SIGTERM)  # drain: health says not healthy at once
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = {w["url"]: w["status"] for w in gateway.workers()}
        if states.get(f"grpc://{holder.address}") != "ready":
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"SMG still routes to the draining worker: {states}")

    three = turn(second_prompt + two["choices"][0]["text"] + " again")
    # Moved to the other worker: its prefill is cold, and the turn completes.
    assert three["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert three["choices"][0]["finish_reason"] == "length"
    assert len(_smg_sessions(other)) == 1
