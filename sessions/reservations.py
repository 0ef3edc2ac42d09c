"""Admit tickets: a reservation holds exactly its own projected bytes for the one
Generate it was issued for (its model and prompt), until redeemed or expired
(one `TtlMap`). Lifetimes are clamped to a server maximum."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .ttl import TtlMap

DEFAULT_RESERVATION_TTL_S = 30.0
MAX_RESERVATION_TTL_S = 300.0


def request_digest(model: str, prompt_tokens: Sequence[int], max_tokens: int) -> str:
    """What a ticket is bound to: the model, the prompt and the generation budget."""
    h = hashlib.sha256(model.encode())
    h.update(max_tokens.to_bytes(8, "little"))
    for t in prompt_tokens:
        h.update(int(t).to_bytes(4, "little"))
    return h.hexdigest()


@dataclass(frozen=True)
class Reservation:
    ticket: str
    nbytes: int
    model: str
    digest: str  # request_digest of the request it was issued for
    created_at: float
    expires_at: float
    client_request_id: str = ""
    owner: str = ""

    @property
    def ttl_s(self) -> float:
        return self.expires_at - self.created_at


@dataclass(frozen=True)
class Grant:
    reservation: Reservation
    clamped: bool  # the asked lifetime was over the maximum
    repeated: bool  # an earlier reservation with the same client_request_id


class ReservationBook:
    """Outstanding tickets count against every *other* request's projection."""

    def __init__(
        self,
        clock: Callable[[], float],
        *,
        default_ttl_s: float = DEFAULT_RESERVATION_TTL_S,
        max_ttl_s: float = MAX_RESERVATION_TTL_S,
        id_factory: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        if not 0 < default_ttl_s <= max_ttl_s:
            raise ValueError(f"reservation TTLs need 0 < default ({default_ttl_s}) "
                             f"<= max ({max_ttl_s})")
        self._map: TtlMap[Reservation] = TtlMap(clock)
        self._default_ttl_s = default_ttl_s
        self.max_ttl_s = max_ttl_s
        self._new_id = id_factory

    def __len__(self) -> int:
        return len(self._map)

    def reserve(self, nbytes: int, model: str, digest: str, ttl_s: float | None = None,
                client_request_id: str = "", owner: str = "") -> Grant:
        """Hold `nbytes` for the request `digest` names. A live reservation taken with
        the same `client_request_id` for the same request is returned, not doubled."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if client_request_id:
            earlier = self.by_client_request_id(client_request_id)
            if earlier is not None and earlier.digest == digest:
                return Grant(earlier, clamped=False, repeated=True)
        ttl = ttl_s if ttl_s else self._default_ttl_s
        if ttl <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl}")
        clamped = ttl > self.max_ttl_s
        ttl = min(ttl, self.max_ttl_s)
        ticket = self._new_id()
        now = self._map.now()
        res = Reservation(ticket, nbytes, model, digest, now, now + ttl, client_request_id,
                          owner)
        self._map.put(ticket, res, ttl)
        return Grant(res, clamped=clamped, repeated=False)

    def owner_count(self, owner: str) -> int:
        return sum(1 for h in self._map.live() if h.value.owner == owner)

    def by_client_request_id(self, client_request_id: str) -> Reservation | None:
        return next((h.value for h in self._map.live()
                     if h.value.client_request_id == client_request_id), None)

    def get(self, ticket: str) -> Reservation | None:
        held = self._map.get(ticket)
        return held.value if held is not None else None

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
