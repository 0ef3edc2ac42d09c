"""The store-cache gate: a ±1 cap walk between 1 and max_num_seqs, a non-blocking counter."""

from __future__ import annotations

import threading

import pytest

from memory.levels import PressureLevel
from memory.store_cache import StoreCacheGate, next_cap

OK, SOFT, HARD, EMERGENCY = list(PressureLevel)


def test_next_cap_steps_one_and_clamps():
    assert next_cap(4, 8, OK) == 5
    assert next_cap(8, 8, OK) == 8
    for level in (SOFT, HARD, EMERGENCY):
        assert next_cap(4, 8, level) == 3
        assert next_cap(1, 8, level) == 1


def test_gate_walks_down_under_pressure_and_back_up_at_ok():
    gate = StoreCacheGate(3)
    assert gate.cap == 3
    assert [gate.adjust(HARD) for _ in range(4)] == [2, 1, 1, 1]
    assert [gate.adjust(OK) for _ in range(4)] == [2, 3, 3, 3]


def test_gate_counts_in_flight_stores_and_never_blocks():
    gate = StoreCacheGate(2)
    assert gate.try_acquire() and gate.try_acquire()
    assert not gate.try_acquire() and not gate.can_admit()
    gate.adjust(SOFT)  # the cap drops below in-flight: they finish, new ones wait
    gate.release()
    assert (gate.in_flight, gate.cap) == (1, 1) and not gate.can_admit()
    gate.release()
    assert gate.can_admit()
    with pytest.raises(RuntimeError):
        gate.release()
    with pytest.raises(ValueError):
        StoreCacheGate(0)


def test_gate_is_thread_safe():
    gate = StoreCacheGate(4)
    peak = []
    lock = threading.Lock()

    def worker() -> None:
        for _ in range(2000):
            if gate.try_acquire():
                with lock:
                    peak.append(gate.in_flight)
                gate.release()

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert gate.in_flight == 0 and max(peak) <= 4
