"""Whether this worker should be sent new inference work, as balancers read it.

One decision with two outputs: the grpc.health.v1 status of "" and
plimsoll.v1.InferenceService, and the line the HAProxy agent check answers
(service.agent_check). Inputs: draining, whether the models named at start are
ready, the pressure level, and a clock.

- Drain wins over everything: NOT_SERVING, agent ``down #draining``.
- Not ready (loading): NOT_SERVING, agent ``down #loading``.
- Hard or emergency shuts a *pressure gate*: NOT_SERVING, agent ``drain`` (hard)
  or ``down #emergency``. The gate opens again only once the level has stayed
  below hard (ok or soft) for `hold_s` without a break: the enforcer's relief at
  hard often drops the level to soft within a tick, and a balancer that sent the
  traffic straight back would push it over again (flapping). While held, the
  agent keeps answering ``drain``.
- Open gate: SERVING, agent ``up ready 100%`` at ok, ``up ready 50%`` at soft.
  HAProxy's ``drain`` is an administrative state that only ``ready`` cancels and
  ``down`` an operational one that only ``up`` cancels, so every serving answer
  says both.

`decide` is pure (state, level, clock in; status out); `ReadinessWatch` is the
thin loop that feeds it every pressure transition and applies its answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from memory.levels import PressureLevel

log = logging.getLogger(__name__)

DEFAULT_HOLD_S = 5.0  # a few enforcer ticks (1 s under pressure) of calm before SERVING
SOFT_WEIGHT_PERCENT = 50
RECHECK_FLOOR_S = 0.01


@dataclass(frozen=True)
class PressureGate:
    """Shut at hard or emergency until the level has stayed below hard for the hold."""

    shut: bool = False
    calm_since: float | None = None  # shut, and below hard since then


@dataclass(frozen=True)
class Decision:
    gate: PressureGate
    serving: bool
    agent_line: str  # without the newline
    recheck_at: float | None  # when the hold ends: decide again then, with no new input


def step_gate(gate: PressureGate, level: PressureLevel, now: float,
              hold_s: float) -> PressureGate:
    if level >= PressureLevel.HARD:
        return PressureGate(shut=True)
    if not gate.shut:
        return gate
    calm_since = now if gate.calm_since is None else gate.calm_since
    if now >= calm_since + hold_s:  # the very expression of Decision.recheck_at
        return PressureGate()
    return PressureGate(shut=True, calm_since=calm_since)


def agent_line(level: PressureLevel, gate: PressureGate, *, draining: bool,
               models_ready: bool) -> str:
    # "down #why", with the space: HAProxy 2.6 takes "down#why" for an agent error
    # and leaves the server up.
    if draining:
        # The process is leaving: no new work at all, persistence included; HAProxy
        # does not cut streams already forwarded to a server marked down.
        return "down #draining"
    if not models_ready:
        return "down #loading"
    if level >= PressureLevel.EMERGENCY:
        return "down #emergency"
    if gate.shut:
        return "drain"
    weight = 100 if level <= PressureLevel.OK else SOFT_WEIGHT_PERCENT
    return f"up ready {weight}%"


def decide(gate: PressureGate, level: PressureLevel, now: float, hold_s: float, *,
           draining: bool, models_ready: bool) -> Decision:
    """The gate after `level` is seen at `now`, and what health and the agent say."""
    gate = step_gate(gate, level, now, hold_s)
    recheck = None
    if gate.shut and gate.calm_since is not None:
        recheck = gate.calm_since + hold_s
    return Decision(
        gate=gate,
        serving=not draining and models_ready and not gate.shut,
        agent_line=agent_line(level, gate, draining=draining, models_ready=models_ready),
        recheck_at=recheck,
    )


class ReadinessWatch:
    """Feeds `decide` every pressure transition (an in-process WatchPressure
    subscription, transitions only) and wakes for the end of a hold; calls `apply`
    with the new serving status whenever it changes.

    `publisher` is a service.pressure_broker.PressurePublisher: its `level` is the
    level last published, and `subscribe(False, False)` streams every transition
    (None before the first measurement).
    """

    def __init__(self, publisher, *, models_ready: Callable[[], bool],
                 draining: Callable[[], bool], apply: Callable[[bool], Awaitable[None]],
                 hold_s: float = DEFAULT_HOLD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._publisher = publisher
        self._models_ready = models_ready
        self._draining = draining
        self._apply = apply
        self.hold_s = hold_s
        self._clock = clock
        self._level = PressureLevel(publisher.level)
        self._gate = PressureGate()
        self._applied: bool | None = None  # the serving status last applied
        self._apply_lock = asyncio.Lock()
        self.decision = self._decide()
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    @property
    def level(self) -> PressureLevel:
        return self._level

    @property
    def serving(self) -> bool:
        return self.decision.serving

    def agent_line(self) -> str:
        """The agent check's answer now (the hold may have ended since the last input)."""
        return self.refresh().agent_line

    def _decide(self) -> Decision:
        return decide(self._gate, self._level, self._clock(), self.hold_s,
                      draining=self._draining(), models_ready=self._models_ready())

    def see(self, level: PressureLevel) -> Decision:
        self._level = PressureLevel(level)
        return self.refresh()

    def refresh(self) -> Decision:
        """Decide again with the inputs as they are now; apply a change of status."""
        previous = self.decision
        self.decision = d = self._decide()
        self._gate = d.gate
        if d.serving != previous.serving or self._applied is None:
            asyncio.ensure_future(self._apply_latest())
        if d.recheck_at != previous.recheck_at or d.gate.shut != previous.gate.shut:
            if previous.gate.shut != d.gate.shut:
                log.info("pressure gate %s at level %s (health %s, agent %r)",
                         "shut" if d.gate.shut else "open", self._level.label,
                         "SERVING" if d.serving else "NOT_SERVING", d.agent_line)
            self._wake.set()  # the loop's timeout changes
        return d

    async def _apply_latest(self) -> None:
        # One at a time, and always the latest decision: two quick changes must not
        # interleave their writes and leave the health names disagreeing.
        async with self._apply_lock:
            serving = self.decision.serving
            if serving != self._applied:
                await self._apply(serving)
                self._applied = serving

    def start(self) -> None:
        self.refresh()
        self._task = asyncio.create_task(self._run(), name="readiness")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    async def _run(self) -> None:
        while not self._draining():
            sub = self._publisher.subscribe(False, False, internal=True)
            if sub is None:  # no measurement yet
                await asyncio.sleep(0.5)
                continue
            try:
                await self._follow(sub)
            finally:
                self._publisher.broker.unsubscribe(sub)
            # The stream ended: overflowed (re-subscribe for a fresh snapshot) or
            # closed by the drain (the loop condition ends it).

    async def _follow(self, sub) -> None:
        while True:
            self._wake.clear()
            timeout = None
            if self.decision.recheck_at is not None:
                # A floor, so a clock that has not quite reached the time cannot spin us.
                timeout = max(RECHECK_FLOOR_S, self.decision.recheck_at - self._clock())
            next_msg = asyncio.ensure_future(sub.next())
            woke = asyncio.ensure_future(self._wake.wait())
            done, _ = await asyncio.wait({next_msg, woke}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
            woke.cancel()
            if next_msg not in done:
                # Nothing popped: Subscriber.next() takes a message only on return.
                next_msg.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await next_msg
                self.refresh()  # the hold may have ended
                continue
            msg = next_msg.result()
            if msg is None:
                return
            kind = msg.WhichOneof("event")
            level = (msg.snapshot.level if kind == "snapshot"
                     else msg.transition.to_level if kind == "transition" else 0)
            if level in _LEVELS:  # the wire's UNSPECIFIED (0) says nothing
                self.see(PressureLevel(level))


_LEVELS = frozenset(int(v) for v in PressureLevel)
