"""The admission queue: a bounded FIFO of requests waiting for the admission gate.

The gate itself (`memory.plans.admission.gate`) is shared with the admission
plan, so Admit's WAIT and Generate's queue agree. The governor pauses the gate
at soft and above and resumes it at ok; the memory cascade runs once a slot is
held.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

from memory.levels import PressureLevel
from memory.plans.admission import (
    BINDING_QUEUE_FULL,
    DEFAULT_QUEUE_LIMIT,
    RETRY_AFTER_WAIT_S,
    AdmissionSettings,
    SchedulerMode,
    gate,
)
from memory.views import QueueView

DEFAULT_QUEUE_TIMEOUT_S = 30.0


class QueueOutcome(StrEnum):
    ADMITTED = "admitted"
    TIMEOUT = "timeout"
    QUEUE_FULL = "queue_full"
    CLOSED = "closed"  # the server is shutting down: nothing more is admitted


@dataclass
class AdmissionSlot:
    """A held admission; release it when the request ends (idempotent)."""

    _queue: AdmissionQueue
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._queue.give_back()


@dataclass(frozen=True)
class QueueResult:
    outcome: QueueOutcome
    slot: AdmissionSlot | None = None
    waited_s: float = 0.0
    binding: str | None = None  # what made it wait (or fail)
    retry_after_s: float | None = None

    @property
    def admitted(self) -> bool:
        return self.outcome is QueueOutcome.ADMITTED


class AdmissionQueue:
    """Bounded FIFO waiting for the admission gate (pause at soft, hyper/admission cap).

    Asyncio-only: call every method on the event loop's thread. The gate is
    `gate()`, the same function `decide` uses, so Admit's WAIT and Generate's
    queue agree. The memory ladder is separate: run it once a slot is held.
    """

    def __init__(
        self,
        *,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        mode: SchedulerMode = SchedulerMode.DEFAULT,
        admission_cap: int | None = None,
        level: PressureLevel = PressureLevel.OK,
    ) -> None:
        self.queue_limit = queue_limit
        self.mode = mode
        self.admission_cap = admission_cap
        self._level = level
        self._in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @property
    def level(self) -> PressureLevel:
        return self._level

    def view(self) -> QueueView:
        return QueueView(in_flight=self._in_flight, waiting=len(self._waiters),
                         limit=self.queue_limit)

    def blocked_by(self) -> str | None:
        """What currently blocks a new admission (None when the gate is open)."""
        g = gate(self._level, self._in_flight, mode=self.mode, admission_cap=self.admission_cap,
                 queue_limit=1 << 62)
        return g[1] if g is not None else None

    def set_paused(self, level: PressureLevel | None) -> None:
        """The governor pauses admissions at `level`, or resumes them (None)."""
        self._level = PressureLevel.OK if level is None else level
        self._pump()

    def close(self) -> None:
        """Admit nothing more; every waiter leaves with CLOSED (a drain's cut)."""
        self._closed = True
        for fut in self._waiters:
            if not fut.done():
                fut.cancel()

    async def acquire(self, timeout_s: float | None = DEFAULT_QUEUE_TIMEOUT_S) -> QueueResult:
        loop = asyncio.get_running_loop()
        if self._closed:
            return QueueResult(QueueOutcome.CLOSED)
        blocked = self.blocked_by()
        if blocked is None and not self._waiters:
            self._in_flight += 1
            return QueueResult(QueueOutcome.ADMITTED, AdmissionSlot(self))
        if len(self._waiters) >= self.queue_limit:
            return QueueResult(QueueOutcome.QUEUE_FULL, binding=BINDING_QUEUE_FULL,
                               retry_after_s=RETRY_AFTER_WAIT_S)
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        started = loop.time()
        try:
            await asyncio.wait({fut}, timeout=timeout_s)
        except asyncio.CancelledError:
            self._abandon(fut)
            raise
        waited = loop.time() - started
        if fut.done() and not fut.cancelled():
            return QueueResult(QueueOutcome.ADMITTED, AdmissionSlot(self), waited_s=waited)
        self._abandon(fut)
        if self._closed:
            return QueueResult(QueueOutcome.CLOSED, waited_s=waited)
        return QueueResult(QueueOutcome.TIMEOUT, waited_s=waited,
                           binding=self.blocked_by() or blocked, retry_after_s=RETRY_AFTER_WAIT_S)

    def _abandon(self, fut: asyncio.Future[None]) -> None:
        """A waiter gives up: if it was granted meanwhile, hand the slot back."""
        if fut.done() and not fut.cancelled():
            self.give_back()
            return
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
        fut.cancel()

    def give_back(self) -> None:
        """A slot is released: the next waiter may go."""
        self._in_flight = max(0, self._in_flight - 1)
        self._pump()

    def _pump(self) -> None:
        """Grant waiters in FIFO order while the gate is open."""
        while self._waiters and self.blocked_by() is None:
            fut = self._waiters.popleft()
            if fut.done():
                continue
            self._in_flight += 1
            fut.set_result(None)


def queue_from_settings(settings: AdmissionSettings) -> AdmissionQueue:
    """An `AdmissionQueue` honouring validated start-up settings."""
    return AdmissionQueue(queue_limit=settings.queue_limit, mode=settings.scheduler_mode,
                          admission_cap=settings.admission_cap)
