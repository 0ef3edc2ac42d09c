"""Leases taken through ControlService.Pin: on a model or on a session's cache.

A lease has an owner, an id and an optional TTL (one `TtlMap`). Pinned models are
never LRU victims; pinned sessions are shed only in an emergency.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .ttl import Held, TtlMap


@dataclass(frozen=True)
class Lease:
    lease_id: str
    owner: str
    model_id: str = ""  # exactly one of model_id and session_id is set
    session_id: str = ""
    client_request_id: str = ""  # a retry with it gets this lease back


@dataclass(frozen=True)
class HeldLease:
    lease: Lease
    created_at: float  # monotonic
    expires_at: float | None

    @property
    def lease_id(self) -> str:
        return self.lease.lease_id


def _held(h: Held[Lease]) -> HeldLease:
    return HeldLease(h.value, h.created_at, h.expires_at)


class Leases:
    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 id_factory: Callable[[], str] = lambda: uuid.uuid4().hex) -> None:
        self._map: TtlMap[Lease] = TtlMap(clock)
        self._new_id = id_factory

    def pin_model(self, model_id: str, owner: str = "", ttl_s: float | None = None,
                  client_request_id: str = "") -> HeldLease:
        return self._put(Lease(self._new_id(), owner, model_id=model_id,
                               client_request_id=client_request_id), ttl_s)

    def pin_session(self, session_id: str, owner: str = "", ttl_s: float | None = None,
                    client_request_id: str = "") -> HeldLease:
        return self._put(Lease(self._new_id(), owner, session_id=session_id,
                               client_request_id=client_request_id), ttl_s)

    def retried(self, client_request_id: str, *, model_id: str = "",
                session_id: str = "") -> HeldLease | None:
        """The live lease an earlier Pin with this id took on the same target, if any."""
        if not client_request_id:
            return None
        for h in self._map.live():
            v = h.value
            if (v.client_request_id == client_request_id and v.model_id == model_id
                    and v.session_id == session_id):
                return _held(h)
        return None

    def _put(self, lease: Lease, ttl_s: float | None) -> HeldLease:
        return _held(self._map.put(lease.lease_id, lease, ttl_s))

    def unpin(self, lease_id: str) -> HeldLease | None:
        held = self._map.pop(lease_id)
        return _held(held) if held is not None else None

    def expire(self) -> list[HeldLease]:
        return [_held(h) for h in self._map.expire()]

    def leases(self) -> list[HeldLease]:
        return [_held(h) for h in self._map.live()]

    def owner_count(self, owner: str) -> int:
        return sum(1 for h in self._map.live() if h.value.owner == owner)

    def model_count(self, model_id: str) -> int:
        return sum(1 for h in self._map.live() if h.value.model_id == model_id)

    def pinned_sessions(self) -> frozenset[str]:
        """Sessions with at least one live lease (expired ones no longer count)."""
        return frozenset(h.value.session_id for h in self._map.live() if h.value.session_id)
