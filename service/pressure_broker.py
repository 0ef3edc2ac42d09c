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


@dataclass
class Subscriber:
    include_samples: bool
    include_actions: bool
    capacity: int = DEFAULT_CAPACITY
    queue: deque = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    overflowed: bool = False
    closed: bool = False
    _sequence: int = 0
    _sample_slot: int | None = None  # index in queue of the pending sample, if any
    _base: int = 0  # queue index offset (items popped so far)

    def _next_sequence(self) -> int:
        self._sequence += 1
        return self._sequence

    def offer(self, kind: str, payload, when: timestamp_pb2.Timestamp) -> None:
        if self.overflowed or self.closed:
            return
        if kind == "sample":
            if not self.include_samples:
                return
            if self._sample_slot is not None and self._sample_slot >= self._base:
                # Coalesce: the queued sample is replaced, keeping its sequence number.
                i = self._sample_slot - self._base
                seq = self.queue[i].sequence
                self.queue[i] = _response(seq, kind, payload, when)
                return
        elif kind == "action" and not self.include_actions:
            return
        if len(self.queue) >= self.capacity:
            self.overflowed = True
            self.wakeup.set()
            return
        if kind == "sample":
            self._sample_slot = self._base + len(self.queue)
        self.queue.append(_response(self._next_sequence(), kind, payload, when))
        self.wakeup.set()

    def first(self, snapshot: control_pb2.PressureSnapshot,
              when: timestamp_pb2.Timestamp) -> None:
        self.queue.appendleft(_response(self._next_sequence(), "snapshot", snapshot, when))
        self._base -= 1  # indices already recorded shift by one
        self.wakeup.set()

    def pop(self) -> control_pb2.WatchPressureResponse:
        self._base += 1
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
