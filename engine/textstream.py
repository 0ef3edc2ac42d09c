"""Incremental text for one request: mlx-lm's streaming detokenizer plus stop strings.

The detokenizer already holds back bytes of an incomplete UTF-8 character. Stop
strings are matched on text (a stop string can be tokenized many ways), and the
tail that could still become a stop string is held back so it is never emitted.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TextDelta:
    text: str
    stopped: bool


class TextStream:
    def __init__(self, detokenizer, stop: tuple[str, ...]) -> None:
        self._detok = detokenizer
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._seen = 0  # characters of detok.text already taken
        self._pending = ""  # taken but not yet emitted (may start a stop string)

    def add(self, token: int) -> TextDelta:
        self._detok.add_token(token)
        return self._advance(final=False)

    def finish(self) -> str:
        """Flushes what is left when generation ends without a stop string."""
        self._detok.finalize()
        return self._advance(final=True).text

    def _advance(self, final: bool) -> TextDelta:
        text = self._detok.text
        self._pending += text[self._seen :]
        self._seen = len(text)
        if self._stop:
            hit = min(
                (i for i in (self._pending.find(s) for s in self._stop) if i >= 0),
                default=-1,
            )
            if hit >= 0:
                out, self._pending = self._pending[:hit], ""
                return TextDelta(out, stopped=True)
        if final or self._hold == 0:
            out, self._pending = self._pending, ""
        else:
            cut = max(0, len(self._pending) - self._hold)
            out, self._pending = self._pending[:cut], self._pending[cut:]
        return TextDelta(out, stopped=False)
