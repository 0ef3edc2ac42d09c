"""Which sessions are "active": the real in-flight set plus pinned sessions.

Not a time stamp: a TTL stamp would both leak protection to idle sessions and
drop it from long requests. Here a session is active exactly while a request for
it runs or a lease pins it.

`ActiveSessions` is the callable a `SessionBank` takes as `active_sessions`.
Thread-safe: the asyncio side counts requests, the engine and governor threads read.
"""

from __future__ import annotations

import threading
from collections import Counter

from .leases import Leases


class ActiveSessions:
    """In-flight request counts per session, united with pinned sessions.

    Pass an instance as `SessionBank(active_sessions=...)`.
    """

    def __init__(self, pins: Leases | None = None) -> None:
        self.pins = pins
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()

    def begin(self, session_id: str | None) -> None:
        if session_id is None:
            return
        with self._lock:
            self._in_flight[session_id] += 1

    def end(self, session_id: str | None) -> None:
        if session_id is None:
            return
        with self._lock:
            self._in_flight[session_id] -= 1
            if self._in_flight[session_id] <= 0:
                del self._in_flight[session_id]

    def in_flight_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._in_flight)

    def __call__(self) -> frozenset[str]:
        pinned = self.pins.pinned_sessions() if self.pins is not None else frozenset()
        return self.in_flight_ids() | pinned
