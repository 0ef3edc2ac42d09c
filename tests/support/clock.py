"""The one scripted clock for tests."""

from __future__ import annotations


class FakeClock:
    """A scripted monotonic clock: `clock()` reads, `advance()` / `set()` move it."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now

    def set(self, now: float) -> None:
        self.now = now
