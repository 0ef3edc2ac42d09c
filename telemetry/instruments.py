"""Every Plimsoll instrument, created once per process (one instrument per metric name).

Counters are plain attributes. Gauges observe providers registered at run time
(a governor, a bank, the request counts); a provider is held weakly, so a
stopped server's objects are not kept alive by a gauge. Providers run on
whichever thread collects (a Prometheus scrape runs on the metrics listener's),
so they only read figures already measured: no MLX call, no long-held lock.

`Instruments.catalogue` lists every instrument with its kind, so the Prometheus
exposition can declare a family that has no sample yet (a counter before its
first event).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from opentelemetry import metrics

from telemetry import meter, names

Reading = Callable[[], "int | float | None"]
Key = str | tuple[str, ...]

# Time-to-first-token buckets in seconds: the SDK's defaults are sized for milliseconds.
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                  1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


@dataclass(frozen=True)
class Declared:
    """One instrument as the exposition declares it."""

    name: str
    kind: str  # counter | gauge | histogram
    unit: str
    description: str


class _Gauge:
    """An observable gauge summing the values of its live providers."""

    def __init__(self, m: metrics.Meter, name: str, unit: str, description: str) -> None:
        self._providers: weakref.WeakKeyDictionary[object, Callable[[object], int | None]] = (
            weakref.WeakKeyDictionary())
        m.create_observable_gauge(name, [self._observe], unit=unit, description=description)

    def register(self, owner: object, read: Callable[[object], int | float | None]) -> None:
        self._providers[owner] = read

    def read(self) -> int | float | None:
        """The sum over the live providers; None when none has a figure."""
        values = [read(owner) for owner, read in list(self._providers.items())]
        present = [v for v in values if v is not None]
        return sum(present) if present else None

    def _observe(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        value = self.read()
        if value is not None:
            yield metrics.Observation(value)


class _Labelled:
    """An observable gauge or counter with one series per key, summed over providers.
    A key is one label's value, or a tuple of values for several labels."""

    def __init__(self, create: Callable, name: str, labels: tuple[str, ...], unit: str,
                 description: str) -> None:
        self._labels = labels
        self._providers: weakref.WeakKeyDictionary[
            object, Callable[[object], Mapping[Key, int | float]]] = weakref.WeakKeyDictionary()
        create(name, [self._observe], unit=unit, description=description)

    def register(self, owner: object,
                 read: Callable[[object], Mapping[Key, int | float]]) -> None:
        self._providers[owner] = read

    def read(self) -> dict[Key, int | float]:
        total: dict[Key, int | float] = {}
        for owner, read in list(self._providers.items()):
            for key, value in read(owner).items():
                total[key] = total.get(key, 0) + value
        return total

    def _observe(self, _options: metrics.CallbackOptions) -> Iterable[metrics.Observation]:
        for key, value in self.read().items():
            values = key if isinstance(key, tuple) else (key,)
            yield metrics.Observation(value, dict(zip(self._labels, values, strict=True)))


class Instruments:
    def __init__(self, m: metrics.Meter) -> None:
        self._m = m
        self.catalogue: list[Declared] = []
        self.evictions = self._counter(
            names.METRIC_EVICTIONS, "Models and session entries evicted, by kind and reason",
            unit="1")
        self.aborts = self._counter(
            names.METRIC_ABORTS, "Requests and loads aborted for memory", unit="1")
        self.transitions = self._counter(
            names.METRIC_TRANSITIONS, "Pressure level transitions", unit="1")
        self.shrinks = self._counter(
            names.METRIC_SHRINKS, "Session bank shrinks, by reason", unit="1")
        self.reclaims = self._counter(
            names.METRIC_RECLAIMS, "MLX pool and cache reclaims, by kind", unit="1")
        self.refusals = self._counter(
            names.METRIC_REFUSALS, "Loads and requests refused for memory", unit="1")
        self.admissions = self._counter(names.METRIC_ADMISSIONS,
                                        "Admission decisions by verdict")
        self.bank_hits = self._counter(names.METRIC_BANK_HITS, "Session bank hits")
        self.bank_misses = self._counter(names.METRIC_BANK_MISSES, "Session bank misses")
        self.ttft = m.create_histogram(names.METRIC_TTFT, unit="s",
                                       description="Time to first token",
                                       explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S)
        self._declare(names.METRIC_TTFT, "histogram", "s", "Time to first token")
        self.tokens = self._counter(names.METRIC_TOKENS_GENERATED, "Tokens generated")
        self.usage = self._gauge(names.METRIC_MEMORY_USAGE, "By", "Process memory usage")
        self.ceiling = self._gauge(names.METRIC_MEMORY_CEILING, "By", "Memory ceiling")
        self.soft_mark = self._gauge(names.METRIC_SOFT_MARK, "By",
                                     "Soft mark: pressure is soft from here")
        self.hard_mark = self._gauge(names.METRIC_HARD_MARK, "By",
                                     "Hard mark: pressure is hard from here")
        self.level = self._gauge(names.METRIC_PRESSURE_LEVEL, "1",
                                 "Pressure level (1 ok, 2 soft, 3 hard, 4 emergency)")
        self.pool = self._gauge(names.METRIC_POOL_BYTES, "By", "MLX buffer pool bytes")
        self.bank_bytes = self._gauge(names.METRIC_BANK_BYTES, "By",
                                      "Bytes held by the session bank, live references included")
        self.bank_entries = self._gauge(names.METRIC_BANK_ENTRIES, "1",
                                        "Entries in the session bank")
        self.reserved = self._gauge(names.METRIC_RESERVED_BYTES, "By",
                                    "Bytes held by live Admit reservations")
        self.running = self._gauge(names.METRIC_REQUESTS_RUNNING, "1",
                                   "Requests decoding in a batch")
        self.waiting = self._gauge(names.METRIC_REQUESTS_WAITING, "1",
                                   "Requests waiting for admission or a slot")
        self.cold_bytes = self._gauge(names.METRIC_COLD_BYTES, "By",
                                      "Bytes of session snapshots in the disk tier")
        self.cold_entries = self._gauge(names.METRIC_COLD_ENTRIES, "1",
                                        "Session snapshots in the disk tier")
        self.cold_writes = self._counter(names.METRIC_COLD_WRITES,
                                         "Session snapshots written to the disk tier")
        self.cold_written_bytes = self._counter(names.METRIC_COLD_WRITTEN_BYTES,
                                                "Bytes written to the disk tier", unit="By")
        self.cold_restores = self._counter(names.METRIC_COLD_RESTORES,
                                           "Restores from the disk tier, by outcome")
        self.cold_drops = self._counter(names.METRIC_COLD_DROPS,
                                        "Shed snapshots not written to disk, by reason")
        self.cold_collected = self._counter(names.METRIC_COLD_COLLECTED,
                                            "Disk tier files deleted, by reason")
        self.session_hits = self._counter(names.METRIC_SESSION_HITS,
                                          "Session lookups by the tier that answered")
        description = "Measured bytes of each loaded model"
        self.model_bytes = _Labelled(m.create_observable_gauge, names.METRIC_MODEL_BYTES,
                                     (names.LABEL_MODEL_ID,), "By", description)
        self._declare(names.METRIC_MODEL_BYTES, "gauge", "By", description)
        description = ("Layer products of prefill chunks on the Linux CPU fast path, by "
                       "path: a float32 conversion of the layer, or the decode kernels")
        self.prefill_products = _Labelled(
            m.create_observable_counter, names.METRIC_PREFILL_PRODUCTS,
            (names.LABEL_MODEL_ID, names.LABEL_PATH), "1", description)
        self._declare(names.METRIC_PREFILL_PRODUCTS, "counter", "1", description)
        description = "The BLAS MLX's products go to, as labels (always 1)"
        self.blas_info = _Labelled(
            m.create_observable_gauge, names.METRIC_BLAS_INFO,
            (names.LABEL_BLAS, names.LABEL_VERSION, names.LABEL_OPTIMIZED,
             names.LABEL_THREADS), "1", description)
        self._declare(names.METRIC_BLAS_INFO, "gauge", "1", description)

    def _declare(self, name: str, kind: str, unit: str, description: str) -> None:
        self.catalogue.append(Declared(name, kind, unit, description))

    def _counter(self, name: str, description: str, unit: str = "") -> metrics.Counter:
        self._declare(name, "counter", unit, description)
        return self._m.create_counter(name, unit=unit, description=description)

    def _gauge(self, name: str, unit: str, description: str) -> _Gauge:
        self._declare(name, "gauge", unit, description)
        return _Gauge(self._m, name, unit, description)


_instruments: Instruments | None = None
_lock = threading.Lock()


def instruments() -> Instruments:
    global _instruments
    with _lock:
        if _instruments is None:
            _instruments = Instruments(meter())
        return _instruments
