"""The store-cache gate: a cap on finished requests whose KV is still being stored.

Each engine owns one. The enforcer calls `adjust(level)` once per tick (through
the engine handle's `adjust_store_cache_cap`), so the cap walks one step per
poll: down toward 1 under pressure, back up toward `max_num_seqs` at ok.
Admission consults `can_admit()`; the store path brackets each store with
`try_acquire()` / `release()`. Never blocks.
"""

from __future__ import annotations

import threading

from memory.levels import PressureLevel


def next_cap(cap: int, max_num_seqs: int, level: PressureLevel) -> int:
    """One step: up by one at ok (to max_num_seqs), down by one otherwise (to 1)."""
    if level == PressureLevel.OK:
        return min(max_num_seqs, cap + 1)
    return max(1, cap - 1)


class StoreCacheGate:
    """Thread-safe counter of in-flight stores with a walking cap."""

    def __init__(self, max_num_seqs: int) -> None:
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self._max = max_num_seqs
        self._cap = max_num_seqs
        self._in_flight = 0
        self._lock = threading.Lock()

    @property
    def cap(self) -> int:
        return self._cap

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def max_num_seqs(self) -> int:
        return self._max

    def adjust(self, level: PressureLevel) -> int:
        """Move the cap one step for this level; returns the new cap.

        The cap may drop below the stores already in flight: they finish, new
        ones wait (no store is cancelled).
        """
        with self._lock:
            self._cap = next_cap(self._cap, self._max, level)
            return self._cap

    def can_admit(self) -> bool:
        with self._lock:
            return self._in_flight < self._cap

    def try_acquire(self) -> bool:
        with self._lock:
            if self._in_flight >= self._cap:
                return False
            self._in_flight += 1
            return True

    def release(self) -> None:
        with self._lock:
            if self._in_flight <= 0:
                raise RuntimeError("StoreCacheGate.release() without a matching acquire")
            self._in_flight -= 1
