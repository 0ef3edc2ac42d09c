"""Incremental output of one request: token ids together with their text, and stop strings.

mlx-lm's streaming detokenizer turns tokens into text; this module decides which token
ids and which text a request may release, step by step. The rule (GenerateChunk's
contract):

1. **Ids travel with their complete text.** Output is released in pieces that end at a
   *clean boundary*: a token boundary where every byte of the tokens before it is in the
   text. A boundary inside a multi-byte character (or after bytes that do not decode yet)
   is not clean, so the tokens before it wait with their bytes. Each piece's text is the
   text of its ids, so the text of all pieces, joined, is the decoding of all their ids.
2. **What could begin a stop string is held back.** From the earliest position where the
   text's tail is a proper prefix of a stop string, text waits, and so do the tokens
   whose text reaches it.
3. **Stop strings are matched on text**, so one may begin inside a token or span
   several. The match that completes first wins, as if text arrived a character at a
   time (of two completing at the same character, the longer). On a match, the pieces
   that end at or before the match's start are released; the token holding the match's
   first character and every token after it are dropped, ids and text. So is whatever
   text lies between the last clean boundary and the match's start: the part of the
   token holding the match's start that comes before it, and of tokens that share a
   character with that token.
4. The end-of-sequence token is never added (the engine drops it), so it is in neither.

Text is the decoding `tokenizer.decode` gives. mlx-lm's BPE detokenizer differs in two
ways, both mended here: it drops a leading space from the first text of a stream, which
`decode` keeps (for a completion, " jumps" after "The fox" is two words, not one), and
it turns the byte 0 into 'Ā'.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.tokenizer_utils import (
    BPEStreamingDetokenizer,
    NaiveStreamingDetokenizer,
    SPMStreamingDetokenizer,
    _byte_decoder,
)


@dataclass
class Piece:
    """Token ids and their text: the decoding of the ids, whole characters only."""

    token_ids: list[int]
    text: str


class TextStream:
    """One request's output. `add` each generated token (not the end-of-sequence
    token), then `finish` unless a stop string matched (`stopped`)."""

    def __init__(self, detokenizer, stop: tuple[str, ...]) -> None:
        self._detok = _faithful(detokenizer)
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        self._ids: list[int] = []  # taken, not yet released
        # (ids taken, text end) at each clean boundary among them, in order.
        self._cuts: list[tuple[int, int]] = []
        self._released = 0  # characters of detok.text released
        self._searched = 0  # characters of detok.text already searched for stop strings
        self.matched = ""  # the stop string that ended the output, once one has

    @property
    def stopped(self) -> bool:
        return bool(self.matched)

    def add(self, token: int) -> list[Piece]:
        """Takes one generated token; returns the pieces it releases (often none)."""
        if self.matched:
            return []
        self._detok.add_token(token)
        self._ids.append(token)
        clean = _settle(self._detok)
        text = self._detok.text
        if clean:
            self._cuts.append((len(self._ids), len(text)))
        return self._advance(text, final=False)

    def finish(self) -> list[Piece]:
        """Generation ended without a stop string (so far): releases the rest. The
        flushed text may still complete a stop string; `stopped` tells."""
        if self.matched:
            return []
        _finalize(self._detok)
        text = self._detok.text
        self._cuts.append((len(self._ids), len(text)))
        return self._advance(text, final=True)

    def _advance(self, text: str, final: bool) -> list[Piece]:
        hit = self._find_stop(text)
        if hit is not None:
            start, self.matched = hit
            pieces = self._release(start, text)
            self._ids, self._cuts = [], []
            return pieces
        return self._release(len(text) if final else self._safe_end(text), text)

    def _release(self, limit: int, text: str) -> list[Piece]:
        """The pieces up to the last clean boundary whose text ends at or before limit."""
        pieces: list[Piece] = []
        taken = passed = 0
        for n, end in self._cuts:
            if end > limit:
                break
            passed += 1
            if n > taken:
                pieces.append(Piece(self._ids[taken:n], text[self._released:end]))
                taken, self._released = n, end
        if passed:
            self._ids = self._ids[taken:]
            self._cuts = [(n - taken, end) for n, end in self._cuts[passed:]]
        return pieces

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the match that completes first, if any."""
        best: tuple[tuple[int, int], int, str] | None = None
        for s in self._stop:
            # A match ending in text already searched would have been found then.
            i = text.find(s, max(self._released, self._searched - len(s) + 1))
            if i >= 0:
                key = (i + len(s), -len(s))
                if best is None or key < best[0]:
                    best = (key, i, s)
        self._searched = len(text)
        return None if best is None else (best[1], best[2])

    def _safe_end(self, text: str) -> int:
        """Where text that could still begin a stop string starts (len(text): none)."""
        end = len(text)
        for s in self._stop:
            i = text.find(s[0], max(self._released, len(text) - len(s) + 1))
            while 0 <= i < end:
                if s.startswith(text[i:]):
                    end = i
                    break
                i = text.find(s[0], i + 1)
        return end


def _as_is(text: str) -> str:
    return text


def _bpe_decode_bytes(seq: str) -> str:
    # mlx-lm's own version turns the byte 0 into 'Ā' (it tests the byte for truth).
    table = _byte_decoder()
    out = bytearray()
    for c in seq:
        b = table.get(c)
        if b is None:
            out.extend(c.encode("utf-8"))  # an added token's text
        else:
            out.append(b)
    return out.decode("utf-8", "replace")


def _faithful(detok):
    """Makes the text what tokenizer.decode gives (see the module docstring)."""
    if isinstance(detok, BPEStreamingDetokenizer):
        # Shadows the methods on this copy only (the tokenizer hands out copies).
        detok._maybe_trim_space = _as_is
        detok._decode_bytes = _bpe_decode_bytes
    return detok


def _finalize(detok) -> None:
    if isinstance(detok, BPEStreamingDetokenizer):
        # mlx-lm's finalize looks each character up in the byte table, and an added
        # token's text may hold characters the table lacks.
        detok.text += _bpe_decode_bytes(detok._unflushed)
        detok._unflushed = ""
    else:
        detok.finalize()


def _settle(detok) -> bool:
    """After add_token: whether detok.text now holds every byte of the tokens added.

    Reads mlx-lm's detokenizer internals (mlx-lm is pinned to a tested minor range).
    """
    if isinstance(detok, BPEStreamingDetokenizer):
        if detok._unflushed:
            pending = detok._decode_bytes(detok._unflushed)
            if pending.endswith("\ufffd"):
                return False  # an incomplete character
            # A lone space token, held back only so a leading space could be dropped;
            # this stream keeps it, so holding it would only delay it.
            detok.text += pending
            detok._unflushed = ""
        return True
    if isinstance(detok, SPMStreamingDetokenizer):
        return not detok._unflushed
    if isinstance(detok, NaiveStreamingDetokenizer):
        detok.text  # noqa: B018 - the property moves finished lines out of the tail
        tail = detok._current_tokens
        return not tail or detok._tokenizer.decode(tail) == detok._current_text
    return True  # an unknown kind: every boundary counts as clean
