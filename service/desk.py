"""The admission side the governor steers: the queue's pause, reservations, pins."""

from __future__ import annotations

from memory.levels import PressureLevel
from memory.views import QueueView
from sessions.admission import AdmissionQueue
from sessions.leases import Leases
from sessions.reservations import ReservationBook


class AdmissionDesk:
    """`memory.protocols.AdmissionDesk` over the queue, the reservations and the leases."""

    def __init__(self, queue: AdmissionQueue, reservations: ReservationBook,
                 leases: Leases) -> None:
        self._queue = queue
        self._reservations = reservations
        self._leases = leases

    def set_paused(self, level: PressureLevel | None) -> None:
        self._queue.set_paused(level)

    def queue_view(self) -> QueueView:
        return self._queue.view()

    def reserved_bytes(self) -> int:
        return self._reservations.reserved_bytes()

    def pinned_sessions(self) -> tuple[str, ...]:
        return tuple(sorted(self._leases.pinned_sessions()))
