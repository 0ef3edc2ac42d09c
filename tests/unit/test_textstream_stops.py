"""TextStream with the tiny demo model's real tokenizer (byte-level BPE): ids travel with
their complete text, stop strings cut at a clean token boundary, and are in neither."""

from __future__ import annotations

import functools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, load

from engine.demo_models import ensure_demo_model
from engine.textstream import Piece, TextStream


@functools.cache
def demo_tokenizer():
    return load(ensure_demo_model("tiny"))


@pytest.fixture(scope="module")
def tok():
    return demo_tokenizer()


def run(tok, ids, stop=(), detok=None):
    """Feeds ids as the engine does; returns (pieces, stream)."""
    stream = TextStream(detok or tok.detokenizer, tuple(stop))
    pieces: list[Piece] = []
    for t in ids:
        pieces += stream.add(t)
        if stream.stopped:
            break
    else:
        pieces += stream.finish()
    return pieces, stream


def joined(pieces):
    return [t for p in pieces for t in p.token_ids], "".join(p.text for p in pieces)


def clean_cut(tok, ids: list[int], limit: int) -> int:
    """The expected rule, from tokenizer.decode alone: the most tokens whose decoding
    is whole characters (no pending replacement character) and ends at or before limit."""
    best = 0
    for j in range(1, len(ids) + 1):
        text = tok.decode(ids[:j])
        if len(text) > limit:
            break
        if not text.endswith("\ufffd"):
            best = j
    return best


def check_pieces(tok, pieces):
    for p in pieces:
        assert p.token_ids, "a piece always carries ids"
        assert p.text == tok.decode(p.token_ids)
        p.text.encode("utf-8")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


# -- without stop strings --------------------------------------------------------------

def test_no_stop_releases_every_id_with_its_text(tok):
    text = " hello  world, café naïve 日本語 🙂!"
    ids = enc(tok, text)
    pieces, stream = run(tok, ids)
    check_pieces(tok, pieces)
    assert joined(pieces) == (ids, text)
    assert not stream.stopped and stream.matched == ""


def test_a_leading_space_is_kept_as_decode_keeps_it(tok):
    ids = enc(tok, " jumps over")
    pieces, _ = run(tok, ids)
    assert joined(pieces)[1] == " jumps over" == tok.decode(ids)


def test_a_character_split_over_tokens_waits_for_its_last_byte(tok):
    ids = enc(tok, "ab日本cd")  # 'ab' 'æ' 'Ĺ' '¥æ' 'ľ' '¬' 'c' 'd'
    assert len(ids) == 8
    stream = TextStream(tok.detokenizer, ())
    out = [stream.add(t) for t in ids]
    # '¥æ' ends 日 and begins 本: no clean boundary until 本 is whole.
    assert [[p.text for p in ps] for ps in out] == [
        ["ab"], [], [], [], [], ["日本"], ["c"], ["d"]]
    assert out[5][0].token_ids == ids[1:6]
    assert stream.finish() == []


def test_ids_are_released_as_soon_as_their_text_is(tok):
    ids = enc(tok, " hello world")
    stream = TextStream(tok.detokenizer, ())
    for t in ids:
        assert [p.token_ids for p in stream.add(t)] == [[t]]
    assert stream.finish() == []


def test_trailing_bytes_flush_at_finish_with_their_ids(tok):
    ids = enc(tok, "ok 日")[:-1]  # the last byte of 日 never comes
    pieces, _ = run(tok, ids)
    check_pieces(tok, pieces)
    assert joined(pieces) == (ids, tok.decode(ids))
    assert joined(pieces)[1].endswith("\ufffd")


# -- stop strings ----------------------------------------------------------------------

HELLO = " hello world, how are you"


@pytest.mark.parametrize(
    ("stop", "kept"),
    [
        (" world", " hello"),  # starts at a token boundary
        ("lo wo", " he"),  # starts inside a token ("ll"): that token goes, whole
        ("o wor", " hell"),  # spans several tokens
        ("d,", " hello wor"),  # the match begins at a token's last character
        (" hello", ""),  # the very first token
        ("you", " hello world, how are"),
    ],
)
def test_stop_cuts_at_the_token_holding_the_match_start(tok, stop, kept):
    ids = enc(tok, HELLO)
    pieces, stream = run(tok, ids, [stop])
    check_pieces(tok, pieces)
    got_ids, got_text = joined(pieces)
    assert got_text == kept == tok.decode(got_ids)
    assert got_ids == ids[: len(got_ids)]
    assert stop not in got_text
    assert stream.matched == stop


def test_stop_inside_a_character_split_over_tokens(tok):
    ids = enc(tok, "ab日本語cd")  # 'ab' 'æ' 'Ĺ' '¥æ' 'ľ' '¬è' 'ªŀ' 'c' 'd'
    pieces, stream = run(tok, ids, ["本"])
    got_ids, got_text = joined(pieces)
    # '¥æ' holds the match's first byte, so it goes, and 日 (which it ends) with it.
    assert (got_ids, got_text, stream.matched) == (ids[:1], "ab", "本")
    pieces, stream = run(tok, ids, ["語c"])
    assert joined(pieces) == (ids[:1], "ab")  # '¬è' ends 本 and begins 語
    pieces, stream = run(tok, ids, ["cd"])
    assert joined(pieces) == (ids[:7], "ab日本語")


def test_text_that_may_begin_a_stop_string_waits_with_its_ids(tok):
    ids = enc(tok, " hello world")  # ' he', 'll', 'o', ' wor', 'ld'
    stream = TextStream(tok.detokenizer, ("llo there",))
    out = [stream.add(t) for t in ids]
    assert [p.text for p in out[0]] == [" he"]
    assert out[1] == [] and out[2] == []  # "llo" could begin the stop string
    assert [p.text for p in out[3]] == ["ll", "o", " wor"]  # it did not
    assert out[4] == [Piece([ids[4]], "ld")]
    assert stream.finish() == [] and not stream.stopped
    # Held back at the end: released at finish.
    stream = TextStream(tok.detokenizer, ("lo there",))
    assert [p.text for t in ids[:3] for p in stream.add(t)] == [" he"]
    assert stream.finish() == [Piece(ids[1:2], "ll"), Piece(ids[2:3], "o")]


def test_the_match_that_completes_first_wins(tok):
    ids = enc(tok, HELLO)
    _, stream = run(tok, ids, ["lo world, how", "wor"])
    assert stream.matched == "wor"
    # Completing at the same character, the longer wins.
    pieces, stream = run(tok, ids, ["ld", "world"])
    assert stream.matched == "world" and joined(pieces)[1] == " hello"


def test_a_stop_string_can_complete_in_the_flushed_tail(tok):
    ids = enc(tok, " hi 日")[:-2]  # 'Ġh' 'i' 'Ġæ': " \ufffd" appears only at finish
    pieces, stream = run(tok, ids, ["\ufffd"])
    assert stream.stopped and stream.matched == "\ufffd"
    got_ids, got_text = joined(pieces)
    assert (got_ids, got_text) == (ids[:2], " hi")


def test_the_nul_byte_token_decodes_as_decode_does(tok):
    ids = [5, 193, 5]  # '!', the byte 0, '!' (mlx-lm's own BPE table maps 0 to 'Ā')
    pieces, _ = run(tok, ids)
    assert joined(pieces) == (ids, "!\x00!") and tok.decode(ids) == "!\x00!"


def test_empty_and_repeated_stop_strings(tok):
    ids = enc(tok, HELLO)
    pieces, stream = run(tok, ids, ["", "zzz", "zzz"])
    assert joined(pieces) == (ids, HELLO) and not stream.stopped


def test_naive_detokenizer_keeps_the_same_rule(tok):
    ids = enc(tok, " hello wörld 日本")
    for stop, kept in [((), " hello wörld 日本"), (("本",), " hello wörld"),
                       (("rld",), " hello wö")]:
        detok = NaiveStreamingDetokenizer(tok._tokenizer)
        pieces, stream = run(tok, ids, stop, detok=detok)
        check_pieces(tok, pieces)
        got_ids, got_text = joined(pieces)
        assert got_text == kept == tok.decode(got_ids)
        assert stream.matched == (stop[0] if stop else "")


# -- the property ----------------------------------------------------------------------

@st.composite
def output_and_stop(draw):
    ids = draw(st.lists(st.integers(0, 1023), min_size=1, max_size=40))
    text = demo_tokenizer().decode(ids)
    if not text:
        return ids, text, ""
    start = draw(st.integers(0, len(text) - 1))
    length = draw(st.integers(1, min(8, len(text) - start)))
    return ids, text, text[start : start + length]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(output_and_stop())
def test_property_output_is_the_free_run_cut_at_the_stop(case):
    ids, text, stop = case
    tok = demo_tokenizer()
    pieces, stream = run(tok, ids, [stop] if stop else [])
    got_ids, got_text = joined(pieces)
    check_pieces(tok, pieces)
    assert got_text == tok.decode(got_ids)
    if not stop:
        assert (got_ids, got_text) == (ids, text)
        return
    at = text.find(stop)
    assert stream.matched == stop
    assert stop not in got_text
    assert got_ids == ids[: clean_cut(tok, ids, at)]
    assert text[:at].startswith(got_text)


@st.composite
def output_and_stops(draw):
    ids, text, stop = draw(output_and_stop())
    others = draw(st.lists(st.text(alphabet=text or "x", min_size=1, max_size=4),
                           max_size=3))
    return ids, text, [stop, *others] if stop else others


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(output_and_stops())
def test_property_several_stops(case):
    ids, text, stops = case
    tok = demo_tokenizer()
    pieces, stream = run(tok, ids, stops)
    got_ids, got_text = joined(pieces)
    check_pieces(tok, pieces)
    assert got_text == tok.decode(got_ids)
    assert got_ids == ids[: len(got_ids)]
    assert not any(s in got_text for s in stops)
    found = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not found:
        assert (got_ids, got_text, stream.matched) == (ids, text, "")
        return
    end, _, first = min(found)
    assert stream.matched == first
    at = end - len(first)
    assert got_ids == ids[: clean_cut(tok, ids, at)]
