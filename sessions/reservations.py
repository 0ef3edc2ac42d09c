"""Admit tickets: a reservation holds exactly its own projected bytes for a following
Generate, bound to its model, until redeemed or expired (one `TtlMap`)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass

from .ttl import TtlMap

DEFAULT_RESERVATION_TTL_S = 30.0


@dataclass(frozen=True)
class Reservation:
    ticket: str
    nbytes: int
    model: str
    created_at: float
    expires_at: float


class ReservationBook:
    """Outstanding tickets count against every *other* request's projection."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        default_ttl_s: float = DEFAULT_RESERVATION_TTL_S,
        id_factory: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._map: TtlMap[Reservation] = TtlMap(clock)
        self._default_ttl_s = default_ttl_s
        self._new_id = id_factory

    def __len__(self) -> int:
        return len(self._map)

    def reserve(self, nbytes: int, model: str, ttl_s: float | None = None) -> Reservation:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        ttl = ttl_s if ttl_s else self._default_ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        ticket = self._new_id()
        now = self._map.now()
        res = Reservation(ticket, nbytes, model, now, now + ttl)
        self._map.put(ticket, res, ttl)
        return res

    def redeem(self, ticket: str) -> Reservation | None:
        """Consume a ticket; None when unknown or expired (an expired one is dropped)."""
        held = self._map.pop(ticket)
        return held.value if held is not None else None

    def expire(self) -> list[Reservation]:
        return [h.value for h in self._map.expire()]

    def reserved_bytes(self, excluding: str | None = None, *, model: str | None = None) -> int:
        """Bytes held by live tickets other than `excluding` (optionally one model's)."""
        return sum(h.value.nbytes for h in self._map.live()
                   if h.value.ticket != excluding and (model is None or h.value.model == model))
