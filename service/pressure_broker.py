"""Fan-out of pressure events to WatchPressure subscribers.

Runs on the event loop, beside the enforcer task. Publishing never waits on a
subscriber: each has a bounded queue. Samples coalesce (a newer sample replaces
a queued one); transitions and actions are never dropped silently — a subscriber
whose queue is full of them is ended with RESOURCE_EXHAUSTED and re-subscribes
for a fresh snapshot. Sequence numbers are per process: every published event
takes the next one, whoever subscribes. The last transitions and actions are
retained, so a client that re-subscribes with the last number it saw gets what
it missed replayed before its snapshot. Every message names the process
(`instance`, random at start), so a client tells a restart from a reconnect and a
resume from another process's numbers replays nothing.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from google.protobuf import timestamp_pb2

from engine.errors import WATCHER_LIMIT, ResourceExhausted
from memory.actions import Action, Outcome, Transition, model_of, reason_of
from memory.ceiling import Limits
from memory.levels import PressureLevel
from memory.protocols import TickSample
from memory.readings import MemoryReadings
from memory.recording import event_kind
from plimsoll.v1 import control_pb2, types_pb2
from service import convert

DEFAULT_CAPACITY = 1024
# WatchPressure streams open at once (--max-watchers): each holds a queue and a task.
DEFAULT_MAX_SUBSCRIBERS = 256
RETAINED_EVENTS = 512  # transitions and actions kept for a re-subscriber's replay


@dataclass(eq=False)  # identity-hashed: subscribers live in a set
class Subscriber:
    include_samples: bool
    include_actions: bool
    capacity: int = DEFAULT_CAPACITY
    queue: deque = field(default_factory=deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    overflowed: bool = False
    closed: bool = False
    internal: bool = False  # the server's own: not counted against max_subscribers

    def wants(self, kind: str) -> bool:
        return ((kind != "sample" or self.include_samples)
                and (kind != "action" or self.include_actions))

    def offer(self, msg: control_pb2.WatchPressureResponse) -> None:
        if self.overflowed or self.closed:
            return
        kind = msg.WhichOneof("event")
        if not self.wants(kind):
            return
        if kind == "sample" and self.queue and self.queue[-1].WhichOneof("event") == "sample":
            # Coalesce: a newer sample replaces the unsent one. Only the newest item:
            # a sample never jumps ahead of a transition.
            self.queue[-1] = msg
            return
        if len(self.queue) >= self.capacity:
            self.overflowed = True
            self.wakeup.set()
            return
        self.queue.append(msg)
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


def _response(seq: int, kind: str, payload, when: timestamp_pb2.Timestamp,
              instance: str) -> control_pb2.WatchPressureResponse:
    msg = control_pb2.WatchPressureResponse(sequence=seq, event_time=when, instance=instance)
    getattr(msg, kind).CopyFrom(payload)
    return msg


def now_timestamp() -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.GetCurrentTime()
    return ts


class PressureBroker:
    def __init__(self, capacity: int = DEFAULT_CAPACITY,
                 retained: int = RETAINED_EVENTS,
                 max_subscribers: int = DEFAULT_MAX_SUBSCRIBERS) -> None:
        self.capacity = capacity
        self.max_subscribers = max_subscribers
        self._subscribers: set[Subscriber] = set()
        self._sequence = 0
        # Sequences start again in a new process: this tells the processes apart.
        self.instance = secrets.token_hex(8)
        self._retained: deque[control_pb2.WatchPressureResponse] = deque(maxlen=retained)
        self._forgotten_through = 0  # the last retained-kind event that fell out

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    @property
    def sequence(self) -> int:
        """The number of the last event published."""
        return self._sequence

    def subscribe(self, snapshot: control_pb2.PressureSnapshot, include_samples: bool,
                  include_actions: bool, resume_after: int = 0, *,
                  resume_instance: str = "", internal: bool = False) -> Subscriber:
        """`internal`: the server's own (readiness): not a client, not counted."""
        clients = sum(1 for s in self._subscribers if not s.internal)
        if not internal and clients >= self.max_subscribers:
            raise ResourceExhausted(
                f"{clients} WatchPressure streams are open, the limit "
                "(--max-watchers); retry, or share one stream", reason=WATCHER_LIMIT,
                retry_after_s=5.0, metadata={"limit": str(self.max_subscribers)})
        sub = Subscriber(include_samples, include_actions, self.capacity)
        sub.internal = internal
        if resume_after and resume_instance not in ("", self.instance):
            snapshot.replay_incomplete = True  # another process's numbers: nothing to replay
        elif resume_after:
            for msg in self._retained:
                if msg.sequence > resume_after and sub.wants(msg.WhichOneof("event")):
                    replay = control_pb2.WatchPressureResponse()
                    replay.CopyFrom(msg)
                    replay.replayed = True
                    sub.queue.append(replay)
            snapshot.replay_incomplete = resume_after < self._forgotten_through
        sub.queue.append(_response(self._sequence, "snapshot", snapshot, now_timestamp(),
                                   self.instance))
        sub.wakeup.set()
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
        self._sequence += 1
        msg = _response(self._sequence, kind, payload, now_timestamp(), self.instance)
        if kind != "sample":
            if len(self._retained) == self._retained.maxlen:
                self._forgotten_through = self._retained[0].sequence
            self._retained.append(msg)
        for sub in self._subscribers:
            sub.offer(msg)


# -- the governor's sink ---------------------------------------------------------------


class PressurePublisher:
    """`memory.protocols.PressureSink`: governor events as WatchPressure messages.

    It keeps the state it last published (level, readings, limits), so a new
    subscriber's snapshot is exactly where the stream it joins stands: a
    subscriber joining in the middle of a tick sees the level of the last
    transition published, and the next transition starts from that level.
    """

    def __init__(self, broker: PressureBroker) -> None:
        self.broker = broker
        # Set by the server once the service is built: admission figures for
        # snapshots and samples.
        self.admission_state: Callable[[], types_pb2.AdmissionState] = types_pb2.AdmissionState
        self._caps: dict[tuple[str, str], int] = {}
        self._level = PressureLevel.OK
        self._readings: MemoryReadings | None = None
        self._limits: Limits | None = None

    @property
    def level(self) -> PressureLevel:
        return self._level

    def snapshot(self) -> control_pb2.PressureSnapshot | None:
        """Where the stream stands now; None before the first measurement."""
        if self._readings is None or self._limits is None:
            return None
        return control_pb2.PressureSnapshot(
            level=int(self._level),
            readings=convert.readings_to_wire(self._readings),
            limits=convert.limits_to_wire(self._limits),
            admission=self.admission_state(),
        )

    def subscribe(self, include_samples: bool, include_actions: bool,
                  resume_after: int = 0, *, resume_instance: str = "",
                  internal: bool = False) -> Subscriber | None:
        snapshot = self.snapshot()
        if snapshot is None:
            return None
        return self.broker.subscribe(snapshot, include_samples, include_actions, resume_after,
                                     resume_instance=resume_instance, internal=internal)

    def on_transition(self, transition: Transition, readings: MemoryReadings,
                      limits: Limits) -> None:
        self._level, self._readings, self._limits = transition.to_level, readings, limits
        self.broker.publish("transition", convert.transition_to_wire(transition, readings,
                                                                     limits))

    def on_sample(self, sample: TickSample) -> None:
        self._level = sample.level
        self._readings, self._limits = sample.readings, sample.limits
        if self.broker.subscriber_count:
            self.broker.publish("sample", convert.sample_to_wire(sample, self.admission_state()))

    def on_action(self, action: Action, outcome: Outcome) -> None:
        kind = event_kind(action)
        if kind is None or not outcome.done:
            return  # bookkeeping, or decided but not carried out: not news
        model = model_of(action) or ""
        if kind in _CAPS:
            # Every tick walks every cap; only a change is news.
            key = (kind, model)
            if outcome.value is None or self._caps.get(key) == outcome.value:
                return
            self._caps[key] = outcome.value
        reason = reason_of(action) or ""
        if kind in _CAPS:
            reason = f"cap {outcome.value}"
        msg = control_pb2.EnforcerAction(
            kind=convert.ACTION_KINDS[kind],
            model_id=model,
            request_ids=list(outcome.request_ids),
            bytes_freed=max(0, int(outcome.bytes_freed or 0)),
            entries_evicted=int(outcome.entries or 0),
            reason=reason,
            level=int(self._level),
        )
        self.broker.publish("action", msg)


_CAPS = frozenset({"store_cache_cap", "batch_cap"})
