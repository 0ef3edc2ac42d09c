"""Bank metrics, and real MLX arrays really freed on eviction."""

from __future__ import annotations

import gc

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from sessions.bank import REASON_CAP_ENTRIES, SessionBank
from telemetry import names
from telemetry.instruments import Instruments
from tests.support.clock import FakeClock
from tests.support.sessions import make_entry


def collect(reader) -> dict[str, list]:
    out: dict[str, list] = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                out[m.name] = [(dict(p.attributes), p.value) for p in m.data.data_points]
    return out


def test_bank_gauges_and_hit_miss_eviction_counters():
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter("test")
    clock = FakeClock()
    bank = SessionBank(clock=clock, inst=Instruments(meter), max_entries=2)
    bank.put(make_entry([1, 2], 100, "s"))
    bank.put(make_entry([7], 20, None))
    clock.advance(1)
    bank.longest_prefix("m", [1, 2, 3])
    bank.longest_prefix("m", [9, 9])
    bank.shrink_to_bytes(100, reason="memory_pressure")
    got = collect(reader)
    assert got[names.METRIC_BANK_BYTES] == [({}, 100)]
    assert got[names.METRIC_BANK_ENTRIES] == [({}, 1)]
    assert got[names.METRIC_BANK_HITS] == [({names.ATTR_MODEL: "m"}, 1)]
    assert got[names.METRIC_BANK_MISSES] == [({names.ATTR_MODEL: "m"}, 1)]
    # A shrink is the governor's to count (memory.recording); the bank counts none.
    assert names.METRIC_EVICTIONS not in got
    assert bank.stats().evictions == {"memory_pressure": 1}
    # An eviction the bank makes on its own (a cap at put) it counts itself, by kind.
    clock.advance(1)
    bank.put(make_entry([3], 1, None))
    bank.put(make_entry([4], 1, None))
    got = collect(reader)
    assert got[names.METRIC_EVICTIONS] == [
        ({names.ATTR_REASON: REASON_CAP_ENTRIES, names.ATTR_EVICTION_KIND: "session_entry"}, 1)]
    assert got[names.METRIC_BANK_ENTRIES] == [({}, 2)]
    assert bank.stats().evictions == {"memory_pressure": 1, REASON_CAP_ENTRIES: 1}


def test_two_banks_on_one_instruments_sum_their_gauges():
    reader = InMemoryMetricReader()
    inst = Instruments(MeterProvider(metric_readers=[reader]).get_meter("test"))
    a, b = SessionBank(clock=FakeClock(), inst=inst), SessionBank(clock=FakeClock(), inst=inst)
    a.put(make_entry([1], 30, None))
    b.put(make_entry([1], 12, None))
    got = collect(reader)
    assert got[names.METRIC_BANK_BYTES] == [({}, 42)]
    assert got[names.METRIC_BANK_ENTRIES] == [({}, 2)]


def test_evicted_mlx_arrays_are_really_freed():
    mx = pytest.importorskip("mlx.core")
    gc.collect()
    mx.clear_cache()
    n = 16 * 1024 * 1024  # 64 MiB of float32 per entry
    bank = SessionBank(clock=FakeClock(), active_sessions=lambda: {"live"})
    for i, sid in enumerate(["idle", "live"]):
        # A prompt-cache-like payload: per-layer (keys, values), evaluated.
        layers = [(mx.ones((n // 4,)) * i, mx.ones((n // 4,)) * i) for _ in range(2)]
        mx.eval(layers)
        nbytes = sum(k.nbytes + v.nbytes for k, v in layers)
        bank.put(make_entry([i + 1], nbytes, sid, payload=layers))
        del layers
    gc.collect()
    before = mx.get_active_memory()
    assert bank.shrink_to_bytes(0, protect_active=True) == 1
    gc.collect()
    mx.clear_cache()
    freed = before - mx.get_active_memory()
    assert abs(freed - n * 4) <= 1024 * 1024, freed  # about the entry's 64 MiB
    assert mx.get_cache_memory() == 0
    assert bank.total_bytes() == n * 4  # the live session's entry is untouched
