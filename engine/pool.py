"""The model pool: which models are loaded, their measured sizes, LRU order and use counts.

Runs on the asyncio loop; each loaded model's MLX work happens on its own engine
thread (`engine.model_engine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from opentelemetry import trace

from engine import errors
from engine.errors import (
    Aborted,
    AlreadyExists,
    FailedPrecondition,
    NotFound,
    PlimsollError,
    Unavailable,
)
from engine.loading import default_model_id, estimate_load_bytes
from engine.model_engine import (
    EngineSettings,
    FinishHook,
    ModelEngine,
    thread_gone,
    wait_threads_gone,
)
from engine.sources import check_source
from memory.chunking import ConversionTransient
from telemetry import names, tracer

log = logging.getLogger(__name__)

# Retry hints (RetryInfo) of the model-state errors.
RETRY_LOADING_S = 2.0  # MODEL_LOADING: a load takes seconds
RETRY_UNLOADING_S = 1.0  # MODEL_UNLOADING: then the state is known (usually not loaded)
RETRY_UNLOADED_S = 1.0  # MODEL_UNLOADED: resend once the model is loaded again
KNOWN_LISTED = 20  # model ids quoted in a MODEL_NOT_FOUND message

# How often a pending unload looks again at an engine still finishing sequences
# nobody holds any more (a cancel or abort lands within one step).
PENDING_UNLOAD_POLL_S = 0.05
# How long close() waits for the engine threads: a step (a prefill chunk) or a load
# in progress ends first.
ENGINE_STOP_TIMEOUT_S = 60.0


class ModelState(Enum):
    LOADING = 1
    READY = 2
    UNLOADING = 3
    UNLOADED = 4


@dataclass(frozen=True)
class KeepAlive:
    """A model's keep-alive as a request sets it: unloaded once unused `seconds`;
    None keeps it loaded (until pressure, the loaded-model limits or UnloadModel)."""

    seconds: float | None

    @classmethod
    def from_seconds(cls, seconds: float) -> KeepAlive:
        """The wire's convention: negative keeps the model loaded."""
        return cls(None if seconds < 0 else seconds)


@dataclass
class ModelEntry:
    model_id: str
    source: str
    state: ModelState = ModelState.UNLOADED
    engine: ModelEngine | None = None
    measured_bytes: int = 0
    weights_bytes: int = 0
    context_length: int = 0
    kv_bytes_per_token: int = 0
    attention_heads: int = 1
    vocab_size: int = 0
    prefill_conversion: ConversionTransient | None = None  # engine/fast_prefill.py
    last_used: float = 0.0  # monotonic; LRU order
    last_used_wall: float = 0.0
    loaded_at: float | None = None  # monotonic, when the load finished; the warm-up's start
    in_use: int = 0  # requests holding the model (acquire/release)
    pins: int = 0  # leases on the model (ControlService.Pin)
    pending_unload_reason: str = ""
    is_default: bool = False
    # Unloaded by the governor once unused this long (memory.plans.model_limits);
    # None: kept loaded until pressure or UnloadModel. A Generate may renew or set it.
    keep_alive_s: float | None = None

    @property
    def pinned(self) -> bool:
        return self.pins > 0

    @property
    def active_requests(self) -> int:
        return self.engine.stats.active_requests if self.engine else 0

    @property
    def waiting_requests(self) -> int:
        return self.engine.stats.waiting_requests if self.engine else 0

    @property
    def busy(self) -> bool:
        # in_use covers a request from before submit until its stream ended, the
        # window the engine's own figures (its batch and held inserts) cannot see.
        return self.in_use > 0 or (self.engine is not None and self.engine.busy)


def _model_resource(entry: ModelEntry) -> dict[str, str]:
    return {"resource_type": "model", "resource_name": entry.model_id}


def not_loaded(entry: ModelEntry) -> FailedPrecondition:
    """MODEL_NOT_LOADED: known, unloaded, and nothing will load it by itself."""
    return FailedPrecondition(
        f"model '{entry.model_id}' is not loaded; load it with LoadModel or Pin it "
        "(Pin loads it again from its source)",
        errors.MODEL_NOT_LOADED, **_model_resource(entry))


@dataclass
class UnloadResult:
    freed_bytes: int
    aborted_requests: int
    ended_request_ids: tuple[str, ...] = ()  # the requests the unload ended


class ModelPool:
    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        settings: EngineSettings | None = None,
        on_finish: FinishHook | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._loop = loop
        self.settings = settings or EngineSettings()
        self.on_finish_hook = on_finish
        self._clock = clock
        self._entries: dict[str, ModelEntry] = {}
        self._lock = asyncio.Lock()
        self.listeners: list[Callable[[], None]] = []  # told after every load/unload
        # Called before a load with (entry, estimated bytes); may evict or raise.
        self.load_guard: Callable[[ModelEntry, int | None], Awaitable[None]] | None = None
        self._weights: dict[str, int] = {}  # source -> weight bytes its last load held
        # model id -> the task that unloads it once idle (kept so it is not collected)
        self._pending_unloads: dict[str, asyncio.Future[None]] = {}
        # Every engine started and not yet seen gone, unloaded ones too: close() waits
        # for all their threads, so no MLX thread outlives the pool.
        self._engines: set[ModelEngine] = set()
        self._closed = False

    # -- lookup -------------------------------------------------------------------
    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def lru(self) -> list[ModelEntry]:
        """Loaded models, least recently used first."""
        ready = [e for e in self._entries.values() if e.state == ModelState.READY]
        return sorted(ready, key=lambda e: e.last_used)

    def get(self, model_id: str) -> ModelEntry:
        """The entry of a model the server knows, whatever its state; NotFound
        (MODEL_NOT_FOUND) otherwise. An empty id is the default model."""
        if not model_id:
            default = next((e for e in self._entries.values() if e.is_default), None)
            if default is None:
                raise NotFound("no model_id given and the server has no default model; "
                               "load one with LoadModel", "model", resource_name="")
            return default
        entry = self._entries.get(model_id)
        if entry is None:
            known = sorted(self._entries)
            listed = ", ".join(known[:KNOWN_LISTED]) or "none"
            if len(known) > KNOWN_LISTED:
                listed += f" and {len(known) - KNOWN_LISTED} more (ListModels)"
            raise NotFound(f"model '{model_id}' is not known (known: {listed})", "model",
                           resource_name=model_id)
        return entry

    def ready(self, model_id: str) -> ModelEntry:
        """The entry of a model that may take requests now; otherwise the error of the
        table (docs/errors.md): MODEL_NOT_FOUND, MODEL_LOADING, MODEL_UNLOADING (also a
        pending unload) or MODEL_NOT_LOADED."""
        entry = self.get(model_id)
        if entry.state == ModelState.LOADING:
            raise Unavailable(f"model '{entry.model_id}' is loading; retry shortly",
                              RETRY_LOADING_S, reason=errors.MODEL_LOADING,
                              **_model_resource(entry))
        if entry.state == ModelState.UNLOADING:
            raise Unavailable(f"model '{entry.model_id}' is being unloaded",
                              RETRY_UNLOADING_S, reason=errors.MODEL_UNLOADING,
                              **_model_resource(entry))
        if entry.state != ModelState.READY or entry.engine is None:
            raise not_loaded(entry)
        if entry.pending_unload_reason:
            raise Unavailable(
                f"model '{entry.model_id}' takes no new requests: it unloads once idle "
                f"({entry.pending_unload_reason})",
                RETRY_UNLOADING_S, reason=errors.MODEL_UNLOADING,
                metadata={"model_id": entry.model_id,
                          "pending_unload": entry.pending_unload_reason},
                **_model_resource(entry),
            )
        return entry

    def any_ready(self) -> bool:
        return any(e.state == ModelState.READY for e in self._entries.values())

    def acquire(self, entry: ModelEntry) -> None:
        entry.in_use += 1
        self.touch(entry)

    def release(self, entry: ModelEntry) -> None:
        entry.in_use = max(0, entry.in_use - 1)
        self.touch(entry)
        if entry.pending_unload_reason and entry.in_use == 0:
            self._unload_once_idle(entry.model_id)

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        """Refuse new requests for the model and unload it once it is idle."""
        entry = self.get(model_id)
        entry.pending_unload_reason = reason
        if entry.in_use == 0:
            self._unload_once_idle(model_id)

    def _unload_once_idle(self, model_id: str) -> None:
        running = self._pending_unloads.get(model_id)
        if running is not None and not running.done():
            return
        task = asyncio.ensure_future(self._wait_idle_then_unload(model_id))
        self._pending_unloads[model_id] = task
        task.add_done_callback(lambda t: self._forget_pending_unload(model_id, t))

    def _forget_pending_unload(self, model_id: str, task: asyncio.Future[None]) -> None:
        if self._pending_unloads.get(model_id) is task:
            del self._pending_unloads[model_id]

    async def _wait_idle_then_unload(self, model_id: str) -> None:
        # The last holder has gone, but the engine may still be ending its sequences
        # (a client cancel is queued, not done): wait for them, then unload.
        while True:
            entry = self._entries.get(model_id)
            if (entry is None or not entry.pending_unload_reason or entry.in_use > 0
                    or entry.state != ModelState.READY):
                return  # cleared, held again (its release schedules this anew) or gone
            if not entry.busy:
                break
            await asyncio.sleep(PENDING_UNLOAD_POLL_S)
        await self.unload_if_pending(model_id)

    def estimate_bytes(self, source: str) -> int | None:
        """What loading `source` will add: the larger of its weight files (plus 5 %) and
        the weights its last load held; None when neither is known (a repository not
        loaded yet). Not the last load's measured growth: that is process-wide MLX
        growth, which another engine decoding meanwhile inflates or deflates."""
        known = [b for b in (estimate_load_bytes(source), self._weights.get(source)) if b]
        return max(known, default=None)

    async def unload_if_pending(self, model_id: str) -> None:
        entry = self._entries.get(model_id)
        if (entry is None or not entry.pending_unload_reason or entry.busy
                or entry.state != ModelState.READY):
            return
        try:
            await self.unload(model_id, force=True, reason=entry.pending_unload_reason)
        except PlimsollError as err:
            log.warning("pending unload of %s failed: %s", model_id, err)

    def touch(self, entry: ModelEntry) -> None:
        entry.last_used = self._clock()
        entry.last_used_wall = time.time()

    # -- load / unload ------------------------------------------------------------------
    async def load(self, source: str, model_id: str = "", default: bool = False) -> ModelEntry:
        if self._closed:
            raise Unavailable("the server is shutting down; load on another replica",
                              retry_after_s=1.0, reason=errors.DRAINING)
        check_source(source)
        model_id = model_id or default_model_id(source)
        new = False
        async with self._lock:
            entry = self._entries.get(model_id)
            if entry is not None and entry.state == ModelState.UNLOADING:
                raise Unavailable(f"model '{model_id}' is being unloaded; retry to load it "
                                  "again", RETRY_UNLOADING_S, reason=errors.MODEL_UNLOADING,
                                  **_model_resource(entry))
            if entry is not None and entry.state in (ModelState.READY, ModelState.LOADING):
                if entry.source != source:
                    # The other source may be a server path: it is not quoted.
                    raise AlreadyExists(
                        f"model id '{model_id}' is already in use by another source; "
                        "choose another model_id, or unload it first",
                        reason=errors.MODEL_ID_IN_USE, resource_name=model_id,
                    )
                loading = entry.engine.loaded if entry.engine else None
            else:
                loading = None
                new = entry is None
                entry = entry or ModelEntry(model_id=model_id, source=source)
                entry.source = source
                entry.is_default = entry.is_default or default or not self._entries
                self._entries[model_id] = entry
        if loading is not None:
            await asyncio.wrap_future(loading)
            return entry
        try:
            return await self._start(entry)
        except BaseException:
            if new and entry.state is ModelState.UNLOADED:
                # A load that never succeeded leaves nothing behind (no ghost entry).
                self._entries.pop(model_id, None)
            raise

    async def _start(self, entry: ModelEntry) -> ModelEntry:
        if self.load_guard is not None:
            try:
                await self.load_guard(entry, self.estimate_bytes(entry.source))
            except BaseException:
                entry.state = ModelState.UNLOADED
                raise
        engine = ModelEngine(entry.model_id, entry.source, self._loop, self.settings,
                             self.on_finish_hook)
        self._engines = {e for e in self._engines if not thread_gone(e.thread)}
        self._engines.add(engine)
        entry.engine = engine
        entry.state = ModelState.LOADING
        self._notify()
        with tracer().start_as_current_span(names.SPAN_MODEL_LOAD) as span:
            span.set_attribute(names.ATTR_MODEL, entry.model_id)
            try:
                info = await asyncio.wrap_future(engine.start())
            except BaseException as exc:
                entry.engine = None
                entry.state = ModelState.UNLOADED
                self._notify()
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                if isinstance(exc, PlimsollError):
                    raise  # engine.loading says what is wrong, in our words
                # Unforeseen: the log has it; the client gets no library text or path.
                log.error("load of %s failed", entry.model_id, exc_info=exc)
                raise FailedPrecondition(
                    f"source '{entry.source}' could not be loaded as a model (the server "
                    "log has the details)", errors.LOAD_FAILED, resource_type="source",
                    resource_name=entry.source,
                ) from exc
            entry.measured_bytes = info.measured_bytes or info.weights_bytes
            if info.weights_bytes:
                self._weights[entry.source] = info.weights_bytes
            entry.weights_bytes = info.weights_bytes
            entry.context_length = info.context_length
            entry.kv_bytes_per_token = info.kv_bytes_per_token
            entry.attention_heads = info.attention_heads
            entry.prefill_conversion = info.prefill_conversion
            entry.vocab_size = info.vocab_size
            entry.state = ModelState.READY
            entry.pending_unload_reason = ""
            self.touch(entry)
            entry.loaded_at = entry.last_used
            span.set_attribute(names.ATTR_BYTES_AFTER, entry.measured_bytes)
        log.info("loaded %s from %s (%d bytes)", entry.model_id, entry.source,
                 entry.measured_bytes)
        engine.stopped.add_done_callback(lambda _: self._from_thread(
            self._engine_stopped, entry, engine))
        self._notify()
        return entry

    def _from_thread(self, fn: Callable[..., None], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody to tell
            self._loop.call_soon_threadsafe(fn, *args)

    def _engine_stopped(self, entry: ModelEntry, engine: ModelEngine) -> None:
        """An engine that stopped while its model was READY failed on its own thread
        (an unload changes the state first, a close the pool's): the model is unloaded, so a
        request naming it gets NOT_LOADED and a load starts it again."""
        if self._closed or entry.engine is not engine or entry.state != ModelState.READY:
            return
        log.error("model %s was unloaded: its engine stopped on its own", entry.model_id)
        entry.engine = None
        entry.state = ModelState.UNLOADED
        entry.in_use = 0
        entry.pending_unload_reason = ""
        self._notify()

    async def unload(self, model_id: str, force: bool = False,
                     reason: str = "requested") -> UnloadResult:
        entry = self.get(model_id)
        engine = entry.engine
        if entry.state == ModelState.LOADING:
            raise Unavailable(f"model '{entry.model_id}' is loading; unload it once it is "
                              "ready", RETRY_LOADING_S, reason=errors.MODEL_LOADING,
                              **_model_resource(entry))
        if entry.state == ModelState.UNLOADING:
            raise Unavailable(f"model '{entry.model_id}' is already being unloaded",
                              RETRY_UNLOADING_S, reason=errors.MODEL_UNLOADING,
                              **_model_resource(entry))
        if entry.state != ModelState.READY or engine is None:
            raise FailedPrecondition(f"model '{entry.model_id}' is not loaded",
                                     errors.MODEL_NOT_LOADED, **_model_resource(entry))
        active = engine.stats.active_requests + engine.stats.waiting_requests
        if active and not force:
            raise FailedPrecondition(
                f"model '{entry.model_id}' has {active} active request(s); "
                "set force to abort them",
                errors.MODEL_BUSY, metadata={"active_requests": active},
                **_model_resource(entry),
            )
        with tracer().start_as_current_span(names.SPAN_MODEL_UNLOAD) as span:
            span.set_attribute(names.ATTR_MODEL, entry.model_id)
            span.set_attribute(names.ATTR_REASON, reason)
            entry.state = ModelState.UNLOADING
            self._notify()
            error = Aborted(
                f"model '{entry.model_id}' was unloaded ({reason}); the request was "
                "ended",
                reason=errors.MODEL_UNLOADED,
                retry_after_s=RETRY_UNLOADED_S,
                metadata={"model_id": entry.model_id, "unload_reason": reason},
            )
            # Shielded: a caller cancelled half way (a client gone, a deadline passed)
            # must not leave the model UNLOADING with its engine stopped under it.
            freed = await asyncio.shield(
                asyncio.ensure_future(self._stop_engine(entry, engine, error, reason)))
            span.set_attribute(names.ATTR_BYTES_FREED, freed)
        return UnloadResult(freed_bytes=freed, aborted_requests=active)

    async def _stop_engine(self, entry: ModelEntry, engine: ModelEngine, error: Aborted,
                           reason: str) -> int:
        try:
            freed = await asyncio.wrap_future(engine.stop(error))
        finally:
            entry.engine = None
            entry.state = ModelState.UNLOADED
            entry.in_use = 0
            entry.pending_unload_reason = ""
            self._notify()
        log.info("unloaded %s (%s): freed %d bytes", entry.model_id, reason, freed)
        return freed

    async def close(self, error: PlimsollError | None = None,
                    timeout_s: float = ENGINE_STOP_TIMEOUT_S) -> None:
        """Stops every engine (requests still running end with `error`) and waits until
        each engine thread is gone, its MLX work finished at a step boundary; refuses
        loads from now on. Returns early, with a warning, only after `timeout_s`."""
        self._closed = True
        for task in list(self._pending_unloads.values()):
            task.cancel()
        error = error or Unavailable("the server is shutting down; retry on another replica",
                                     retry_after_s=1.0)
        stops = [asyncio.wrap_future(e.stop(error)) for e in self._engines]
        if stops:
            await asyncio.wait(stops, timeout=timeout_s)
        for entry in self.entries():
            entry.engine = None
            entry.state = ModelState.UNLOADED
        threads = [e.thread for e in self._engines]
        if not await wait_threads_gone(threads, timeout_s):
            alive = [t.name for t in threads if not thread_gone(t)]
            log.warning("engine threads still running after %.0fs: %s", timeout_s,
                        ", ".join(alive))
            return
        self._engines.clear()

    def _notify(self) -> None:
        for listener in self.listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener must not break the pool
                log.exception("pool listener failed")
