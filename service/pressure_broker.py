"""Fan-out of pressure events to WatchPressure subscribers.

Runs on the event loop, beside the enforcer task. Publishing never waits on a
subscriber: each has a bounded queue. Samples coalesce (a newer sample replaces
a queued one); transitions and actions are never dropped silently — a subscriber
whose queue is full of them is ended with RESOURCE_EXHAUSTED and re-subscribes
for a fresh snapshot. Sequence numbers count the messages sent to one
subscriber, so any gap a client sees is a loss.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from google.protobuf import timestamp_pb2

from plimsoll.v1 import control_pb2

DEFAULT_CAPACITY = 1024


@dataclass(eq=False)  # identity-hashed: subscribers live in a set
class Subscriber:
    include_samples: bool
    include_actions: bool
    capacity: int = DEFAULT_CAPACITY
    queue: deque = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    overflowed: bool = False
    closed: bool = False
    _sequence: int = 0

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    def offer(self, kind: str, payload, when: timestamp_pb2.Timestamp) -> None:
        if self.overflowed or self.closed:
            return
        if kind == "sample":
            if not self.include_samples:
                return
            if self.queue and self.queue[-1].WhichOneof("event") == "sample":
                # Coalesce: a newer sample replaces the unsent one, keeping its number.
                # Only the newest item: a sample never jumps ahead of a transition.
                self.queue[-1] = _response(self.queue[-1].sequence, kind, payload, when)
                return
        elif kind == "action" and not self.include_actions:
            return
        if len(self.queue) >= self.capacity:
            self.overflowed = True
            self.wakeup.set()
            return
        self.queue.append(_response(self._next_sequence(), kind, payload, when))
        self.wakeup.set()

    def first(self, snapshot: control_pb2.PressureSnapshot,
              when: timestamp_pb2.Timestamp) -> None:
        self.queue.appendleft(_response(self._next_sequence(), "snapshot", snapshot, when))
        self.wakeup.set()

    def pop(self) -> control_pb2.WatchPressureResponse:
        return self.queue.popleft()

    async def next(self) -> control_pb2.WatchPressureResponse | None:
        """The next message; None once overflowed (the caller ends the stream)."""
        while not self.queue:
            if self.overflowed or self.closed:
                return None
            self.wakeup.clear()
            await self.wakeup.wait()
        return self.pop()


def _response(seq: int, kind: str, payload, when) -> control_pb2.WatchPressureResponse:
    msg = control_pb2.WatchPressureResponse(sequence=seq, time=when)
    getattr(msg, kind).CopyFrom(payload)
    return msg


def now_timestamp() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


class PressureBroker:
    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self._subscribers: set[Subscriber] = set()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def subscribe(self, snapshot: control_pb2.PressureSnapshot, include_samples: bool,
                  include_actions: bool) -> Subscriber:
        sub = Subscriber(include_samples, include_actions, self.capacity)
        sub.first(snapshot, now_timestamp())
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        sub.closed = True
        self._subscribers.discard(sub)

    def close_all(self) -> None:
        for sub in list(self._subscribers):
            sub.closed = True
            sub.wakeup.set()
        self._subscribers.clear()

    def publish(self, kind: str, payload) -> None:
        """kind: "transition", "sample" or "action"; payload: the matching message."""
        when = now_timestamp()
        for sub in self._subscribers:
            sub.offer(kind, payload, when)


# -- the enforcer's sink ---------------------------------------------------------------

_ACTION_KINDS = {
    "EvictModel": "evict_model",
    "AbortRequests": "abort_requests",
    "AbortLoad": "abort_load",
    "MarkPendingUnload": "mark_pending_unload",
    "PressureReclaim": "pressure_reclaim",
    "IdleReclaim": "idle_reclaim",
    "ShrinkSessionCache": "shrink_sessions",
    "ClearAuxCaches": "clear_aux_caches",
    "PauseAdmission": "pause_admission",
    "ResumeAdmission": "resume_admission",
    "AdjustStoreCacheCap": "store_cache_cap",
}


class PressurePublisher:
    """Turns enforcer events into WatchPressure messages for the broker."""

    def __init__(self, broker: PressureBroker) -> None:
        self.broker = broker
        self._caps: dict[str, int] = {}
        self.level = 1  # wire level of the last tick

    def on_transition(self, transition, readings, limits) -> None:
        from service.convert import transition_to_wire

        msg = transition_to_wire(transition, readings, limits)
        self.level = msg.to_level  # actions after it in the tick act at this level
        self.broker.publish("transition", msg)

    def on_sample(self, sample) -> None:
        from service.convert import level_to_wire, sample_to_wire

        self.level = level_to_wire(sample.level, sample.emergency)
        if self.broker.subscriber_count:
            self.broker.publish("sample", sample_to_wire(sample))

    def on_action(self, action, outcome) -> None:
        kind = _ACTION_KINDS.get(type(action).__name__)
        if kind is None:
            return
        model = getattr(action, "model_id", "")
        if kind == "store_cache_cap":
            # Every tick walks every cap; only a change is news.
            if outcome.value is None or self._caps.get(model) == outcome.value:
                return
            self._caps[model] = outcome.value
        level = getattr(action, "level", None)
        msg = control_pb2.EnforcerAction(
            kind=kind,
            model=model,
            request_ids=list(outcome.request_ids or ()),
            bytes_freed=max(0, int(outcome.bytes_freed or 0)),
            entries_evicted=int(outcome.entries or 0),
            reason=getattr(action, "reason", "") or (
                f"cap {outcome.value}" if kind == "store_cache_cap" else ""),
            level=int(level) if level is not None else self.level,
        )
        self.broker.publish("action", msg)

    def on_load_eviction(self, victim: str, loading: str, freed: int) -> None:
        self.broker.publish("action", control_pb2.EnforcerAction(
            kind="evict_model", model=victim, bytes_freed=freed,
            reason=f"make_room_for_load:{loading}", level=self.level))
