"""Every Plimsoll instrument, created once per process (one instrument per metric name).

Counters are plain attributes. Gauges observe providers registered at run time
(a governor, a bank, the request counts); a provider is held weakly, so a
stopped server's objects are not kept alive by a gauge.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable

from opentelemetry import metrics

from telemetry import meter, names

Reading = Callable[[], "int | float | None"]


class _Gauge:
    """An observable gauge summing the values of its live providers."""

    def __init__(self, m: metrics.Meter, name: str, unit: str, description: str) -> None:
        self._providers: weakref.WeakKeyDictionary[object, Callable[[object], int | None]] = (
            weakref.WeakKeyDictionary())
        m.create_observable_gauge(name, [self._observe], unit=unit, description=description)

    def register(self, owner: object, read: Callable[[object], int | float | None]) -> None:
        self._providers[owner] = read

    def _observe(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        values = [read(owner) for owner, read in list(self._providers.items())]
        present = [v for v in values if v is not None]
        if present:
            yield metrics.Observation(sum(present))


class Instruments:
    def __init__(self, m: metrics.Meter) -> None:
        self.evictions = m.create_counter(
            names.METRIC_EVICTIONS, unit="1",
            description="Models and session entries evicted, by kind and reason")
        self.aborts = m.create_counter(
            names.METRIC_ABORTS, unit="1", description="Requests and loads aborted for memory")
        self.transitions = m.create_counter(
            names.METRIC_TRANSITIONS, unit="1", description="Pressure level transitions")
        self.shrinks = m.create_counter(
            names.METRIC_SHRINKS, unit="1", description="Session bank shrinks, by reason")
        self.reclaims = m.create_counter(
            names.METRIC_RECLAIMS, unit="1", description="MLX pool and cache reclaims, by kind")
        self.refusals = m.create_counter(
            names.METRIC_REFUSALS, unit="1", description="Loads and requests refused for memory")
        self.admissions = m.create_counter(
            names.METRIC_ADMISSIONS, description="Admission decisions by verdict")
        self.bank_hits = m.create_counter(names.METRIC_BANK_HITS, description="Session bank hits")
        self.bank_misses = m.create_counter(names.METRIC_BANK_MISSES,
                                            description="Session bank misses")
        self.ttft = m.create_histogram(names.METRIC_TTFT, unit="s",
                                       description="Time to first token")
        self.tokens = m.create_counter(names.METRIC_TOKENS_GENERATED,
                                       description="Tokens generated")
        self.usage = _Gauge(m, names.METRIC_MEMORY_USAGE, "By", "Process memory usage")
        self.ceiling = _Gauge(m, names.METRIC_MEMORY_CEILING, "By", "Memory ceiling")
        self.level = _Gauge(m, names.METRIC_PRESSURE_LEVEL, "1", "Pressure level (1-4)")
        self.pool = _Gauge(m, names.METRIC_POOL_BYTES, "By", "MLX buffer pool bytes")
        self.bank_bytes = _Gauge(m, names.METRIC_BANK_BYTES, "By",
                                 "Bytes held by the session bank, live references included")
        self.bank_entries = _Gauge(m, names.METRIC_BANK_ENTRIES, "1",
                                   "Entries in the session bank")
        self.running = _Gauge(m, names.METRIC_REQUESTS_RUNNING, "1",
                              "Requests decoding in a batch")
        self.waiting = _Gauge(m, names.METRIC_REQUESTS_WAITING, "1",
                              "Requests waiting for admission or a slot")


_instruments: Instruments | None = None
_lock = threading.Lock()


def instruments() -> Instruments:
    global _instruments
    with _lock:
        if _instruments is None:
            _instruments = Instruments(meter())
        return _instruments
