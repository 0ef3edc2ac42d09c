"""A scripted driver for the pure memory plans (`memory.plans`): no governor, no event loop.

`drive(plan, snapshots, outcome=...)` answers the i-th `Measure` with `snapshots[i]`
and each `Execute` with one `Outcome` per action from `outcome(action)`, and keeps
every step in order, so a test can assert exactly what a plan asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from memory.actions import Action, EvictModel, Outcome, PressureReclaim, ShrinkSessionCache
from memory.plans.steps import Execute, Measure, Snapshot, Step


def default_outcome(action: Action) -> Outcome:
    """A cooperative world that frees nothing it was not told to: reclaims accepted,
    shrinks take nothing, an unload frees the model's predicted size."""
    if isinstance(action, PressureReclaim):
        return Outcome(action, accepted=True)
    if isinstance(action, ShrinkSessionCache):
        return Outcome(action, entries=0, bytes_freed=0)
    if isinstance(action, EvictModel):
        return Outcome(action, bytes_freed=action.predicted_bytes or 0)
    return Outcome(action)


@dataclass
class Driven:
    result: Any
    steps: list[Step] = field(default_factory=list)

    @property
    def measures(self) -> list[Measure]:
        return [s for s in self.steps if isinstance(s, Measure)]

    @property
    def executes(self) -> list[tuple[Action, ...]]:
        """The actions of each Execute, in order (one tuple per Execute)."""
        return [s.actions for s in self.steps if isinstance(s, Execute)]

    @property
    def actions(self) -> list[Action]:
        return [a for batch in self.executes for a in batch]

    def kinds(self) -> list[str]:
        """Every step as a short name: 'measure:<reason>' or the action's class name."""
        out: list[str] = []
        for s in self.steps:
            if isinstance(s, Measure):
                out.append(f"measure:{s.reason}")
            else:
                out.extend(type(a).__name__ for a in s.actions)
        return out


def drive(
    plan: Generator[Step, Any, Any],
    snapshots: Sequence[Snapshot],
    outcome: Callable[[Action], Outcome] = default_outcome,
    *,
    preview: bool = False,
    repeat_last: bool = False,
) -> Driven:
    """Run `plan` to its end. Asking for more measurements than were scripted fails the
    test (a plan must not measure more than the scenario says) unless `repeat_last`,
    which answers every further one with the last snapshot. `preview`: every outcome is
    marked as a prediction, as the governor's dry run marks them."""
    driven = Driven(result=None)
    reply: Any = None
    measured = 0
    while True:
        try:
            step = plan.send(reply)
        except StopIteration as stop:
            driven.result = stop.value
            return driven
        driven.steps.append(step)
        if isinstance(step, Measure):
            if measured >= len(snapshots) and not repeat_last:
                raise AssertionError(
                    f"measurement {measured + 1} ({step.reason}) was not scripted; "
                    f"steps so far: {driven.kinds()}")
            reply = snapshots[min(measured, len(snapshots) - 1)]
            measured += 1
        elif isinstance(step, Execute):
            outs = [outcome(a) for a in step.actions]
            reply = [replace(o, preview=True) for o in outs] if preview else outs
        else:  # pragma: no cover - plans yield only the two kinds
            raise TypeError(f"unknown plan step {step!r}")


class NoEngines:
    """An `EnginePool` with nothing loaded (for a real bank through the real executor)."""

    def handles(self) -> list:
        return []

    def eviction_blocker(self, model_id: str) -> str | None:
        return "not loaded"

    async def unload(self, model_id: str, reason: str) -> tuple[int, list[str]]:
        raise LookupError(model_id)

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        raise LookupError(model_id)
