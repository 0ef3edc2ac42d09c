"""The governor: the one loop that makes every memory decision.

It owns the one policy state. Every decision is a plan (`memory.plans`): the
enforcer tick on its adaptive cadence, making room for a load, admission (live
for Generate, as a preview for Admit). The governor drives a plan's steps:
each `Measure` gets a fresh snapshot from the executor — fresh meaning taken
after the last action that freed memory — and each `Execute` hands its actions
to the executor one by one, inside the span the recording table names, then
reports them to the sink (WatchPressure). Decisions run one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Generator
from typing import Any, TypeVar

from memory.actions import (
    FREEING_ACTIONS,
    MEASURE_ADMISSION,
    Action,
    Outcome,
    PauseAdmission,
    ResumeAdmission,
    Transition,
)
from memory.cadence import extend_activity_hint, poll_interval
from memory.ceiling import Limits, compute_limits
from memory.config import MemoryConfig
from memory.executor import Executor, PreviewContext
from memory.levels import PressureLevel
from memory.plans.admission import (
    AdmissionRequest,
    AdmissionResult,
    AdmissionSettings,
    admission_batch_plan,
    admission_plan,
)
from memory.plans.load import LoadResult, load_plan
from memory.plans.model_limits import next_expiry_s
from memory.plans.steps import Execute, Measure, Snapshot, Step
from memory.plans.tick import PolicyState, TickResult, tick_plan
from memory.protocols import PressureSink, TickSample
from memory.readings import MemoryReadings
from memory.recording import Recorder
from telemetry import names

log = logging.getLogger(__name__)

R = TypeVar("R")

# How long one reading may serve the admissions of a burst (nothing freed meanwhile).
ADMISSION_READING_SHARE_S = 0.05
# The soonest the governor ticks again for a keep-alive that has run out.
KEEP_ALIVE_TICK_MIN_S = 0.05


class NullSink:
    """A sink that reports nowhere (no WatchPressure publisher)."""

    def on_transition(self, transition: Transition, readings: MemoryReadings,
                      limits: Limits) -> None:
        return None

    def on_sample(self, sample: TickSample) -> None:
        return None

    def on_action(self, action: Action, outcome: Outcome) -> None:
        return None


class Governor:
    """Keeps the process under its ceiling. One per process."""

    def __init__(
        self,
        config: MemoryConfig,
        executor: Executor,
        sink: PressureSink | None = None,
        *,
        admission: AdmissionSettings | None = None,
        recorder: Recorder | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config.validate()
        self._executor = executor
        self._sink: PressureSink = sink or NullSink()
        self.admission_settings = admission or AdmissionSettings()
        self._recorder = recorder or Recorder()
        self._clock = clock

        # Updated as a tick's transitions and pauses execute (a tick abandoned half
        # way keeps what it already published), then replaced by the tick's final state.
        self._state = PolicyState()
        self._last: TickResult | None = None
        self._last_sample: TickSample | None = None
        self._latest: Snapshot | None = None
        self._fresh_after = float("-inf")
        self._poll_interval = config.active_poll_s
        self._hint_until = float("-inf")
        self._hint_lock = threading.Lock()

        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None
        self._decision_lock: asyncio.Lock | None = None
        self._pending_wake = False
        self._stopped = False
        # Live admissions waiting for the next burst decision (`_admit_in_burst`).
        self._burst: list[tuple[AdmissionRequest, asyncio.Future]] = []
        self._burst_task: asyncio.Future | None = None
        inst = self._recorder.inst
        inst.usage.register(self, lambda g: g.readings.process_bytes if g.readings else None)
        inst.ceiling.register(self, lambda g: g.limits.ceiling_bytes if g.limits else None)
        inst.level.register(self, lambda g: int(g.level))
        inst.pool.register(self, lambda g: g.readings.mlx_pool_bytes if g.readings else None)

    # -- public state -----------------------------------------------------------
    @property
    def config(self) -> MemoryConfig:
        return self._config

    def set_config(self, config: MemoryConfig) -> None:
        """Swap settings (tier, fractions…); the next tick uses them."""
        self._config = config.validate()
        self.wake()

    @property
    def level(self) -> PressureLevel:
        return self._state.level

    @property
    def emergency(self) -> bool:
        return self._state.level is PressureLevel.EMERGENCY

    @property
    def state(self) -> PolicyState:
        return self._state

    @property
    def readings(self) -> MemoryReadings | None:
        return self._latest.readings if self._latest else None

    @property
    def limits(self) -> Limits | None:
        return compute_limits(self._latest.readings, self._config) if self._latest else None

    @property
    def last_result(self) -> TickResult | None:
        return self._last

    @property
    def last_sample(self) -> TickSample | None:
        return self._last_sample

    @property
    def admission_paused(self) -> bool:
        return self._state.admission_paused

    @property
    def bank_ceiling_bytes(self) -> int | None:
        return self._state.bank_ceiling_bytes

    @property
    def poll_interval(self) -> float:
        return self._poll_interval

    @property
    def activity_hint_until(self) -> float:
        return self._hint_until

    # -- loop ---------------------------------------------------------------------
    async def run(self) -> None:
        """Tick, then sleep the adaptive interval or until `wake()`; until `stop()`."""
        self._loop = asyncio.get_running_loop()
        self._event = asyncio.Event()
        if self._pending_wake:
            self._event.set()
        while not self._stopped:
            self._event.clear()  # a wake() during the tick re-checks right after it
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("memory governor tick failed; continuing")
            if self._stopped:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), timeout=self._poll_interval)

    def stop(self) -> None:
        self._stopped = True
        self.wake()

    def _extend_hint(self) -> None:
        now = self._clock()
        with self._hint_lock:
            self._hint_until = extend_activity_hint(now, self._hint_until,
                                                    self._config.active_poll_s)
        self._poll_interval = self._config.active_poll_s

    def note_activity(self) -> None:
        """A request arrived: poll fast for at least 2 s. Re-checks at once only when the
        loop sleeps the long idle interval — a burst of requests must not run a tick
        (and a sample to every subscriber) per request."""
        sleeping_long = self._poll_interval > self._config.active_poll_s
        if sleeping_long:
            self.wake()
        else:
            self._extend_hint()

    def wake(self) -> None:
        """Re-check early and extend an activity hint of at least 2 s. Safe from any thread."""
        self._extend_hint()
        loop, event = self._loop, self._event
        if loop is None or event is None:
            self._pending_wake = True
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            with contextlib.suppress(RuntimeError):  # loop already closed
                loop.call_soon_threadsafe(event.set)

    # -- decisions -------------------------------------------------------------------
    def _lock(self) -> asyncio.Lock:
        if self._decision_lock is None:
            self._decision_lock = asyncio.Lock()
        return self._decision_lock

    async def tick(self) -> TickResult | None:
        """Run one tick now. Returns None when a measurement failed (state unchanged)."""
        async with self._lock():
            now = self._clock()
            with self._recorder.tracer.start_as_current_span(names.SPAN_ENFORCER_TICK) as span:
                result = await self.run_plan(tick_plan(self._state, self._config, now))
                if result is not None:
                    span.set_attribute(names.ATTR_LEVEL, result.level.label)
                    span.set_attribute(names.ATTR_USAGE, result.readings.process_bytes)
                    span.set_attribute(names.ATTR_CEILING, result.limits.ceiling_bytes)
            if result is None:
                return None
            self._state = result.state
            self._last = result
            self._poll_interval = self._select_interval(result)
            self._last_sample = TickSample(
                at=now, level=result.level, emergency=result.emergency,
                readings=result.readings, limits=result.limits,
                session_bytes=result.session_bytes, deferred=result.deferred,
                grace_polls=result.state.grace_polls,
                admission_paused=result.state.admission_paused,
                poll_interval_s=self._poll_interval, engines=result.engines,
            )
            self._notify_sample(self._last_sample)
            return result

    async def make_room_for_load(self, model_id: str, estimate: int | None) -> LoadResult:
        """Before a load: evict idle LRU models down to soft, or refuse with the numbers."""
        self.wake()
        result = await self._decide(lambda: load_plan(model_id, estimate, self._config))
        return result if result is not None else LoadResult()

    async def admit(self, request: AdmissionRequest, *, preview: bool = False
                    ) -> AdmissionResult | None:
        """Admission for one request: live (Generate) or as a prediction (Admit).
        None when no measurement could be taken."""
        def plan() -> Generator[Step, Any, AdmissionResult]:
            return admission_plan(
                request, self._config, self.admission_settings, self._state.level,
                gate_level=self._gate_level(), bank_budget_bytes=self._state.bank_ceiling_bytes,
                preview=preview)

        if preview:
            return await self.run_plan(plan(), preview=PreviewContext())
        return await self._admit_in_burst(request)

    async def _admit_in_burst(self, request: AdmissionRequest) -> AdmissionResult | None:
        """Live admissions that arrive together are decided together: each joins the
        burst forming now; one decision task per burst takes, once it holds the decision
        lock, every request that joined by then (those arriving meanwhile form the
        next) and runs ONE `admission_batch_plan` over them, in arrival order — one
        measurement, each request seeing the ones admitted before it."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[AdmissionResult | None] = loop.create_future()
        self._burst.append((request, fut))
        if self._burst_task is None:
            self._burst_task = asyncio.ensure_future(self._decide_bursts())
        # Shielded: a caller that is cancelled stops waiting; the decision goes on.
        return await asyncio.shield(fut)

    async def _decide_bursts(self) -> None:
        try:
            while self._burst:
                async with self._lock():
                    burst, self._burst = self._burst, []
                    live = [(r, f) for r, f in burst if not f.done()]  # callers gone: skip
                    if not live:
                        continue
                    try:
                        results = await self.run_plan(admission_batch_plan(
                            [r for r, _ in live], self._config, self.admission_settings,
                            self._state.level, gate_level=self._gate_level(),
                            bank_budget_bytes=self._state.bank_ceiling_bytes))
                    except BaseException as exc:
                        for _, f in live:
                            if not f.done():
                                f.set_exception(exc)
                        if isinstance(exc, asyncio.CancelledError):
                            raise
                        continue
                    for i, (_, f) in enumerate(live):
                        if not f.done():
                            f.set_result(results[i] if results is not None else None)
        finally:
            self._burst_task = None
            for _, f in self._burst:  # only when cancelled (the loop is closing)
                if not f.done():
                    f.cancel()
            self._burst.clear()

    async def _decide(self, make_plan: Callable[[], Generator[Step, Any, R]]) -> R | None:
        """Run a live plan under the decision lock, in a task of the governor's own: a
        caller that is cancelled (a client gone, a deadline passed) stops waiting, but
        an eviction half way through still finishes and is recorded."""
        async def decide() -> R | None:
            async with self._lock():
                return await self.run_plan(make_plan())  # built with the lock held

        return await asyncio.shield(asyncio.ensure_future(decide()))

    def _gate_level(self) -> PressureLevel:
        """The level the admission gate pauses at: ok once admission resumed; while
        paused (the resume band holds it past the level's return to ok) at least soft."""
        if not self._state.admission_paused:
            return PressureLevel.OK
        return max(self._state.level, PressureLevel.SOFT)

    def report(self, action: Action) -> None:
        """An engine thread reports something it did (a pre-chunk prefill abort):
        recorded on the loop like any action. Safe from any thread."""
        loop = self._loop
        outcome = Outcome(action)
        if loop is None:
            self._record(action, outcome)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._record, action, outcome)

    def _record(self, action: Action, outcome: Outcome) -> None:
        usage = self.readings.process_bytes if self.readings else 0
        with self._recorder.span(action, self._state.level, usage) as span:
            self._recorder.finish(span, outcome)
        self._notify_action(action, outcome)

    # -- driving a plan ------------------------------------------------------------------
    async def run_plan(self, gen: Generator[Step, Any, R],
                       preview: PreviewContext | None = None) -> R | None:
        """Drive one plan to its end (the tick, a load and admission all come here).
        None when a measurement failed (the plan is abandoned)."""
        reply: Any = None
        latest: Snapshot | None = None
        while True:
            try:
                step = gen.send(reply)
            except StopIteration as stop:
                return stop.value
            if isinstance(step, Measure):
                if preview is not None and latest is not None:
                    reply = latest  # a preview predicts instead of measuring again
                    continue
                # A burst of admissions shares one reading; every other measurement
                # is taken anew.
                share = ADMISSION_READING_SHARE_S if step.reason == MEASURE_ADMISSION else 0.0
                try:
                    latest = await self._executor.measure(step.query, self._fresh_after, share,
                                                          keep=preview is None)
                except Exception:
                    log.exception("memory reading failed (%s); plan abandoned", step.reason)
                    gen.close()
                    return None
                if step.query is None:
                    self._latest = latest
                reply = latest
            elif isinstance(step, Execute):
                assert latest is not None
                if preview is not None:
                    reply = [self._executor.preview(a, latest, preview) for a in step.actions]
                else:
                    reply = [await self._execute(a, latest) for a in step.actions]
            else:  # pragma: no cover - plans yield only the two kinds
                raise TypeError(f"unknown plan step {step!r}")

    async def _execute(self, action: Action, snap: Snapshot) -> Outcome:
        usage = snap.readings.process_bytes
        with self._recorder.span(action, self._state.level, usage) as span:
            if isinstance(action, Transition):
                self._state = dataclasses.replace(self._state, level=action.to_level)
                self._publish_transition(action, snap)
                outcome = Outcome(action)
            else:
                outcome = await self._executor.perform(action)
            if isinstance(action, PauseAdmission | ResumeAdmission):
                paused = isinstance(action, PauseAdmission)
                self._state = dataclasses.replace(self._state, admission_paused=paused)
            self._recorder.finish(span, outcome)
        if isinstance(action, FREEING_ACTIONS) and outcome.done:
            self._fresh_after = self._clock()  # what was measured before is stale now
        self._notify_action(action, outcome)
        return outcome

    def _select_interval(self, result: TickResult) -> float:
        views = result.engines
        now = self._clock()
        interval = poll_interval(
            result.level, now, self._hint_until, any(v.loading for v in views),
            views, active_s=self._config.active_poll_s, idle_s=self._config.idle_poll_s,
            empty_s=self._config.empty_poll_s, os_pressure=result.readings.os_pressure,
        )
        # A keep-alive running out before the next poll: tick then, not up to 10 s late.
        expiry = next_expiry_s(views, now)
        if expiry is not None:
            interval = min(interval, max(KEEP_ALIVE_TICK_MIN_S, expiry))
        return interval

    # -- reporting ---------------------------------------------------------------------------
    def _publish_transition(self, transition: Transition, snap: Snapshot) -> None:
        log.log(
            logging.WARNING if transition.to_level > transition.from_level else logging.INFO,
            "memory pressure %s -> %s (%s): usage %d, ceiling %d, soft %d, hard %d",
            transition.from_level.label, transition.to_level.label, transition.reason,
            transition.usage_bytes, transition.ceiling_bytes, transition.soft_bytes,
            transition.hard_bytes,
        )
        try:
            self._sink.on_transition(transition, snap.readings,
                                     compute_limits(snap.readings, self._config))
        except Exception:
            log.exception("pressure sink on_transition failed")

    def _notify_sample(self, sample: TickSample) -> None:
        try:
            self._sink.on_sample(sample)
        except Exception:
            log.exception("pressure sink on_sample failed")

    def _notify_action(self, action: Action, outcome: Outcome) -> None:
        try:
            self._sink.on_action(action, outcome)
        except Exception:
            log.exception("pressure sink on_action failed")
