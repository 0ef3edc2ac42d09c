"""Which sessions are "active": the real in-flight set plus pinned sessions.

Not a time stamp: MTPLX stamped sessions with a TTL, which both leaked
protection to idle sessions and dropped it from long requests. Here a session
is active exactly while a request for it runs or a lease pins it.

`ActiveSessions` is the callable a `SessionBank` takes as `active_sessions`.
Both helpers are thread-safe: the asyncio side pins and counts requests, the
engine and enforcer threads read.
"""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionPin:
    """A lease keeping a session's cache resident (shed only in emergency)."""

    lease_id: str
    session_id: str
    owner: str
    created_at: float
    expires_at: float | None = None  # None: until Unpin

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


class SessionPins:
    """Lease id -> pin, with optional TTL expiry against an injected clock."""

    def __init__(
        self,
        clock: Callable[[], float],
        id_factory: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._clock = clock
        self._new_id = id_factory
        self._lock = threading.Lock()
        self._pins: dict[str, SessionPin] = {}

    def pin(self, session_id: str, owner: str = "", ttl_s: float | None = None) -> SessionPin:
        if ttl_s is not None and ttl_s < 0:
            raise ValueError(f"ttl_s must be >= 0, got {ttl_s}")
        now = self._clock()
        expires = now + ttl_s if ttl_s else None  # 0 or None: until Unpin
        pin = SessionPin(self._new_id(), session_id, owner, now, expires)
        with self._lock:
            self._pins[pin.lease_id] = pin
        return pin

    def unpin(self, lease_id: str) -> SessionPin | None:
        with self._lock:
            return self._pins.pop(lease_id, None)

    def expire(self, now: float | None = None) -> list[SessionPin]:
        """Drop expired leases; returns them."""
        now = self._clock() if now is None else now
        with self._lock:
            gone = [p for p in self._pins.values() if not p.live(now)]
            for p in gone:
                del self._pins[p.lease_id]
        return gone

    def leases(self, now: float | None = None) -> list[SessionPin]:
        now = self._clock() if now is None else now
        with self._lock:
            return [p for p in self._pins.values() if p.live(now)]

    def active_ids(self, now: float | None = None) -> frozenset[str]:
        """Sessions with at least one live lease (expired ones no longer count)."""
        return frozenset(p.session_id for p in self.leases(now))


class ActiveSessions:
    """In-flight request counts per session, united with pinned sessions.

    Pass an instance as `SessionBank(active_sessions=...)`.
    """

    def __init__(self, pins: SessionPins | None = None) -> None:
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

    @contextmanager
    def track(self, session_id: str | None) -> Iterator[None]:
        """Marks the session in flight for the duration of a request."""
        self.begin(session_id)
        try:
            yield
        finally:
            self.end(session_id)

    def in_flight_ids(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._in_flight)

    def __call__(self) -> frozenset[str]:
        pinned = self.pins.active_ids() if self.pins is not None else frozenset()
        return self.in_flight_ids() | pinned
