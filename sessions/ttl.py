"""One TTL map for everything held for a while: model leases, session pins, Admit tickets.

Id -> value with an optional expiry on an injected monotonic clock. Reads see
only live entries (an expired one is gone the moment its time passes, whether
or not anyone called `expire`); `expire` drops and returns the expired ones.
Thread-safe: the event loop writes, engine and governor threads read.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(frozen=True)
class Held(Generic[V]):
    value: V
    created_at: float
    expires_at: float | None  # None: until removed

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


class TtlMap(Generic[V]):
    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._items: dict[str, Held[V]] = {}

    def now(self) -> float:
        return self._clock()

    def put(self, key: str, value: V, ttl_s: float | None) -> Held[V]:
        """Hold `value` for `ttl_s` seconds (None or 0: until removed)."""
        if ttl_s is not None and ttl_s < 0:
            raise ValueError(f"ttl must be >= 0, got {ttl_s}")
        now = self._clock()
        held = Held(value, now, now + ttl_s if ttl_s else None)
        with self._lock:
            # Sweep what has expired, so entries nobody reads again do not pile up.
            for k in [k for k, h in self._items.items() if not h.live(now)]:
                del self._items[k]
            self._items[key] = held
        return held

    def get(self, key: str) -> Held[V] | None:
        with self._lock:
            held = self._items.get(key)
        return held if held is not None and held.live(self._clock()) else None

    def pop(self, key: str) -> Held[V] | None:
        """Remove and return the entry if it is live (an expired one is dropped: None)."""
        with self._lock:
            held = self._items.pop(key, None)
        return held if held is not None and held.live(self._clock()) else None

    def live(self) -> list[Held[V]]:
        now = self._clock()
        with self._lock:
            return [h for h in self._items.values() if h.live(now)]

    def expire(self) -> list[Held[V]]:
        now = self._clock()
        with self._lock:
            gone = [k for k, h in self._items.items() if not h.live(now)]
            return [self._items.pop(k) for k in gone]

    def __len__(self) -> int:
        return len(self.live())
