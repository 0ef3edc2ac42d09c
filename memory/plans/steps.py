"""What a plan yields to the governor, and what it gets back. Plain data.

A plan is a generator: it yields `Measure(reason)` and receives a fresh
`Snapshot`; it yields `Execute(actions)` and receives one `Outcome` per action;
it returns its result. The governor (`memory.governor`) is the only driver.
"""

from __future__ import annotations

from dataclasses import dataclass

from memory.actions import Action
from memory.readings import MemoryReadings
from memory.views import BankFigures, EngineView, QueueView


@dataclass(frozen=True)
class AdmissionQuery:
    """What admission asks the executor to measure beside the readings."""

    model: str
    prompt_tokens: tuple[int, ...]
    # A burst measured at once (`admission_batch_plan`): the bank's figures for these
    # prompts too, in order, in `Snapshot.more_banks`.
    more: tuple[AdmissionQuery, ...] = ()


@dataclass(frozen=True)
class Snapshot:
    """One measurement of everything a plan looks at."""

    readings: MemoryReadings
    engines: tuple[EngineView, ...] = ()
    session_bytes: int | None = None  # None: no session tier
    bank_max_bytes: int | None = None  # the bank's configured budget
    sessions_expired: int = 0  # bank entries idle past the TTL now
    mlx_sampled_at: float | None = None  # when the oldest MLX sample used was taken
    # Admission only (Measure with a query):
    bank: BankFigures | None = None
    more_banks: tuple[BankFigures, ...] = ()  # for AdmissionQuery.more, in order
    reserved_bytes: int = 0  # outstanding Admit reservations
    queue: QueueView | None = None
    pinned_sessions: tuple[str, ...] = ()


@dataclass(frozen=True)
class Measure:
    reason: str
    query: AdmissionQuery | None = None


@dataclass(frozen=True)
class Execute:
    actions: tuple[Action, ...]


Step = Measure | Execute
