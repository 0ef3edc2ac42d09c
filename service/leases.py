"""Model leases taken through ControlService.Pin: owner, optional TTL, id.

Session leases live in `sessions.activity.SessionPins` (they feed the bank's
active set); model leases live here (they feed the pool's pin counts).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelLease:
    lease_id: str
    model_id: str
    owner: str
    created_at: float  # wall clock (leases are shown to people)
    expires_at: float | None = None

    def live(self, now: float) -> bool:
        return self.expires_at is None or now < self.expires_at


class ModelLeases:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, ModelLease] = {}

    def pin(self, model_id: str, owner: str = "", ttl_s: float | None = None) -> ModelLease:
        now = self._clock()
        lease = ModelLease(uuid.uuid4().hex, model_id, owner, now,
                           now + ttl_s if ttl_s else None)
        with self._lock:
            self._leases[lease.lease_id] = lease
        return lease

    def unpin(self, lease_id: str) -> ModelLease | None:
        with self._lock:
            return self._leases.pop(lease_id, None)

    def expire(self) -> list[ModelLease]:
        now = self._clock()
        with self._lock:
            gone = [lease for lease in self._leases.values() if not lease.live(now)]
            for lease in gone:
                del self._leases[lease.lease_id]
        return gone

    def leases(self) -> list[ModelLease]:
        with self._lock:
            return list(self._leases.values())

    def count(self, model_id: str) -> int:
        with self._lock:
            return sum(1 for lease in self._leases.values() if lease.model_id == model_id)
