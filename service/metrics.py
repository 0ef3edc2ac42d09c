"""Request metrics (instruments from `telemetry.instruments`): admissions by verdict,
requests running and waiting, time to first token, tokens generated."""

from __future__ import annotations

from collections.abc import Callable

from telemetry import names
from telemetry.instruments import Instruments, instruments


class RequestMetrics:
    def __init__(self, counts: Callable[[], tuple[int, int]],
                 inst: Instruments | None = None) -> None:
        """`counts` returns (running, waiting) across the loaded models."""
        self._inst = inst or instruments()
        self._counts = counts
        self._inst.running.register(self, lambda m: m._counts()[0])
        self._inst.waiting.register(self, lambda m: m._counts()[1])

    def admitted(self, verdict: str, model: str) -> None:
        self._inst.admissions.add(1, {names.ATTR_VERDICT: verdict, names.ATTR_MODEL: model})

    def finished(self, model: str, ttft_s: float, tokens: int) -> None:
        self._inst.ttft.record(ttft_s, {names.ATTR_MODEL: model})
        self._inst.tokens.add(tokens, {names.ATTR_MODEL: model})
