"""Request metrics (names from `telemetry.names`): admissions by verdict, requests
running and waiting, time to first token, tokens generated."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from opentelemetry.metrics import CallbackOptions, Observation

from telemetry import meter, names


class RequestMetrics:
    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        """`counts` returns (running, waiting) across the loaded models."""
        m = meter()
        self._counts = counts
        self.admissions = m.create_counter(
            names.METRIC_ADMISSIONS, description="Admission decisions by verdict")
        self.ttft = m.create_histogram(
            names.METRIC_TTFT, unit="s", description="Time to first token")
        self.tokens = m.create_counter(
            names.METRIC_TOKENS_GENERATED, description="Tokens generated")
        m.create_observable_gauge(names.METRIC_REQUESTS_RUNNING, [self._running],
                                  description="Requests decoding in a batch")
        m.create_observable_gauge(names.METRIC_REQUESTS_WAITING, [self._waiting],
                                  description="Requests waiting for admission or a slot")

    def admitted(self, verdict: str, model: str) -> None:
        self.admissions.add(1, {names.ATTR_VERDICT: verdict, names.ATTR_MODEL: model})

    def finished(self, model: str, ttft_s: float, tokens: int) -> None:
        self.ttft.record(ttft_s, {names.ATTR_MODEL: model})
        self.tokens.add(tokens, {names.ATTR_MODEL: model})

    def _running(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._counts()[0])

    def _waiting(self, _options: CallbackOptions) -> Iterable[Observation]:
        yield Observation(self._counts()[1])
