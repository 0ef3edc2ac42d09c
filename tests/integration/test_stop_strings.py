"""Stop strings over real gRPC, on the tiny demo model, greedy: every chunk's text and
ids describe the same tokens, a stop string's tokens and the end-of-sequence token are
in neither, and GenerateEnd.matched_stop names the stop string that matched.

The rule (engine/textstream.py): ids travel only with their complete text; on a match,
output ends at the last token boundary at or before the match's start where the text
of the tokens before it is whole characters.
"""

from __future__ import annotations

import functools
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import load

from engine.demo_models import ensure_demo_model
from plimsoll.v1 import inference_pb2, inference_pb2_grpc

PROMPTS = ("stop test", "The quick brown fox")
MAX_TOKENS = 40
STOP = inference_pb2.FINISH_REASON_STOP
LENGTH = inference_pb2.FINISH_REASON_LENGTH


@functools.cache
def tokenizer():
    path = ensure_demo_model("tiny")
    config = json.loads((path / "config.json").read_text())
    return load(path, eos_token_ids=config.get("eos_token_id"))  # as mlx_lm.load does


def generate(stub, prompt: str, stop=(), **fields) -> list[inference_pb2.GenerateResponse]:
    req = inference_pb2.GenerateRequest(text=prompt, max_tokens=fields.pop("max_tokens",
                                                                            MAX_TOKENS),
                                        stop=list(stop), **fields)
    req.sampling.temperature = 0.0
    return list(stub.Generate(req, timeout=120))


def chunks(msgs):
    return [m.chunk for m in msgs if m.WhichOneof("event") == "chunk"]


def ids_of(msgs) -> list[int]:
    return [t for c in chunks(msgs) for t in c.token_ids]


def text_of(msgs) -> str:
    return "".join(c.text for c in chunks(msgs))


def check_consistent(msgs) -> None:
    """Each chunk's text is its ids' text; joined, the text is the ids' decoding."""
    tok = tokenizer()
    for c in chunks(msgs):
        assert c.token_ids
        assert c.text == tok.decode(list(c.token_ids))
    assert text_of(msgs) == tok.decode(ids_of(msgs))
    end = msgs[-1].end
    assert end.usage.completion_tokens == len(ids_of(msgs))


def clean_cut(ids: list[int], limit: int) -> int:
    """The most tokens whose decoding is whole characters and ends at or before limit."""
    tok = tokenizer()
    best = 0
    for j in range(1, len(ids) + 1):
        text = tok.decode(ids[:j])
        if len(text) > limit:
            break
        if not text.endswith("\ufffd"):
            best = j
    return best


def token_spans(ids: list[int]) -> list[tuple[int, int, int]]:
    """(token index, text start, text end) of tokens with clean boundaries on both
    sides, whose own text is whole characters."""
    tok = tokenizer()
    ends = [len(tok.decode(ids[:j])) if not tok.decode(ids[:j]).endswith("\ufffd")
            else None for j in range(len(ids) + 1)]
    ends[0] = 0
    return [(k, ends[k], ends[k + 1]) for k in range(len(ids))
            if ends[k] is not None and ends[k + 1] is not None]


@pytest.fixture(scope="module")
def free(server):
    """The no-stop run of each prompt (ignoring EOS, so each runs to max_tokens)."""
    with server.channel() as ch:
        stub = inference_pb2_grpc.InferenceServiceStub(ch)
        out = {}
        for p in PROMPTS:
            msgs = generate(stub, p, ignore_eos=True)
            out[p] = (ids_of(msgs), text_of(msgs), msgs)
        return out


def check_stopped(inference, free, prompt: str, stops: list[str], expect: str) -> list:
    ids, text, _ = free[prompt]
    msgs = generate(inference, prompt, stops, ignore_eos=True)
    check_consistent(msgs)
    end = msgs[-1].end
    assert end.finish_reason == STOP
    assert end.matched_stop == expect
    got_ids, got_text = ids_of(msgs), text_of(msgs)
    assert not any(s in got_text for s in stops)
    assert not any(s in tokenizer().decode(got_ids) for s in stops)
    at = text.find(expect)
    assert at >= 0
    assert got_ids == ids[: clean_cut(ids, at)]
    assert text[:at].startswith(got_text)
    return msgs


@pytest.mark.parametrize("prompt", PROMPTS)
def test_without_stop_strings_every_id_goes_out_with_its_text(inference, free, prompt):
    ids, text, msgs = free[prompt]
    check_consistent(msgs)
    assert len(ids) == MAX_TOKENS
    assert msgs[-1].end.finish_reason == LENGTH and msgs[-1].end.matched_stop == ""
    # A stop string that never appears changes nothing.
    absent = "\x01never\x02"
    assert absent not in text
    again = generate(inference, prompt, [absent], ignore_eos=True)
    assert (ids_of(again), text_of(again)) == (ids, text)
    assert again[-1].end.finish_reason == LENGTH and again[-1].end.matched_stop == ""


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stop_starting_mid_token(inference, free, prompt):
    ids, text, _ = free[prompt]
    k, start, end = next(s for s in token_spans(ids) if s[0] > 0 and s[2] - s[1] >= 3)
    stop = text[start + 1 : end + 2]  # from inside token k into what follows
    assert text.find(stop) == start + 1, "pick a stop string whose first match is there"
    msgs = check_stopped(inference, free, prompt, [stop], stop)
    # Token k holds the match's start: it goes, with its text before the match.
    assert ids_of(msgs) == ids[:k]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_stop_spanning_tokens_from_a_boundary(inference, free, prompt):
    ids, text, _ = free[prompt]
    spans = token_spans(ids)
    k, start, end = next(s for s in spans if s[0] > 1 and text.find(text[s[1]:s[2] + 3])
                         == s[1] and s[2] + 3 <= len(text))
    stop = text[start : end + 3]
    msgs = check_stopped(inference, free, prompt, [stop], stop)
    assert ids_of(msgs) == ids[:k]
    assert text_of(msgs) == text[:start]


def test_several_stop_strings_the_first_to_complete_wins(inference, free):
    prompt = PROMPTS[0]
    ids, text, _ = free[prompt]
    k, start, end = next(s for s in token_spans(ids) if s[0] > 3 and s[2] - s[1] >= 2)
    early = text[start:end]
    late = text[start - 2 : end + 4]  # begins earlier, completes later
    stops = ["\x01nope", late, early]
    first = min((text.find(s) + len(s), -len(s), s) for s in stops if s in text)[2]
    assert first == early
    check_stopped(inference, free, prompt, stops, early)


@pytest.mark.parametrize("per_chunk", [1, 3])
def test_coalescing_keeps_chunks_consistent(inference, free, per_chunk):
    prompt = PROMPTS[1]
    ids, text, _ = free[prompt]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    msgs = generate(inference, prompt, [stop], ignore_eos=True,
                    max_tokens_per_chunk=per_chunk)
    check_consistent(msgs)
    assert msgs[-1].end.matched_stop == stop
    assert ids_of(msgs) == ids[: clean_cut(ids, text.find(stop))]


def test_the_end_of_sequence_token_is_in_neither(inference):
    eos = tokenizer().eos_token_ids
    for prompt in ("the stop", "upon no", "bye a", "bye stop"):
        msgs = generate(inference, prompt, max_tokens=64)
        end = msgs[-1].end
        if end.finish_reason == STOP:
            break
    else:
        pytest.fail("no prompt ended at the end-of-sequence token")
    assert end.matched_stop == ""
    assert not set(ids_of(msgs)) & set(eos)
    check_consistent(msgs)
    # Ignoring EOS, the same run goes on; what came before the EOS is the same.
    longer = generate(inference, prompt, max_tokens=64, ignore_eos=True)
    n = len(ids_of(msgs))
    assert ids_of(longer)[:n] == ids_of(msgs)
    assert ids_of(longer)[n] in eos


@st.composite
def stop_of(draw, texts):
    prompt = draw(st.sampled_from(PROMPTS))
    text = texts[prompt]
    start = draw(st.integers(0, len(text) - 1))
    length = draw(st.integers(1, min(6, len(text) - start)))
    return prompt, text[start : start + length]


def test_property_output_is_the_free_run_cut_at_the_stop(inference, free):
    texts = {p: free[p][1] for p in PROMPTS}

    @settings(max_examples=25, deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture,
                                     HealthCheck.too_slow])
    @given(stop_of(texts))
    def prop(case):
        prompt, stop = case
        check_stopped(inference, free, prompt, [stop], stop)

    prop()
