"""Test helpers for code that uses `sessions`: an entry maker and span capture.

The scripted clock is `tests.support.clock.FakeClock`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from sessions.bank import SessionEntry


def make_entry(
    tokens: Sequence[int],
    nbytes: int,
    session_id: str | None = None,
    *,
    model: str = "m",
    payload: Any = None,
    live_ref: bool = False,
) -> SessionEntry:
    return SessionEntry(
        model=model, tokens=tuple(tokens), session_id=session_id,
        payload=payload if payload is not None else object(), nbytes=nbytes, live_ref=live_ref,
    )


class SpanRecorder:
    """An SDK tracer that keeps finished spans in memory (no global provider)."""

    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer: Tracer = self.provider.get_tracer("plimsoll-test")

    def spans(self, name: str | None = None) -> list[ReadableSpan]:
        return [s for s in self.exporter.get_finished_spans() if name is None or s.name == name]

    def clear(self) -> None:
        self.exporter.clear()
