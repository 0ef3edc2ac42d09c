"""The model pool: which models are loaded, their measured sizes, LRU order and use counts.

Runs on the asyncio loop; each loaded model's MLX work happens on its own engine
thread (`engine.model_engine`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum

from opentelemetry import trace

from engine.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PlimsollError,
    ResourceExhausted,
    Unavailable,
)
from engine.loading import default_model_id, estimate_load_bytes, is_local
from engine.model_engine import EngineSettings, FinishHook, ModelEngine
from telemetry import names, tracer

log = logging.getLogger(__name__)

# How often a pending unload looks again at an engine still finishing sequences
# nobody holds any more (a cancel or abort lands within one step).
PENDING_UNLOAD_POLL_S = 0.05


class ModelState(Enum):
    LOADING = 1
    READY = 2
    UNLOADING = 3
    UNLOADED = 4


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
    last_used: float = 0.0  # monotonic; LRU order
    last_used_wall: float = 0.0
    in_use: int = 0  # requests holding the model (acquire/release)
    pins: int = 0  # leases on the model (ControlService.Pin)
    pending_unload_reason: str = ""
    is_default: bool = False

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
        self._measured: dict[str, int] = {}  # source -> bytes measured at its last load
        # model id -> the task that unloads it once idle (kept so it is not collected)
        self._pending_unloads: dict[str, asyncio.Future[None]] = {}

    # -- lookup -------------------------------------------------------------------
    def entries(self) -> list[ModelEntry]:
        return list(self._entries.values())

    def lru(self) -> list[ModelEntry]:
        """Loaded models, least recently used first."""
        ready = [e for e in self._entries.values() if e.state == ModelState.READY]
        return sorted(ready, key=lambda e: e.last_used)

    def get(self, model_id: str) -> ModelEntry:
        if not model_id:
            default = next((e for e in self._entries.values() if e.is_default), None)
            if default is None:
                raise NotFound("no default model is configured; name one in model", "model")
            return default
        entry = self._entries.get(model_id)
        if entry is None:
            known = ", ".join(sorted(self._entries)) or "none"
            raise NotFound(f"model '{model_id}' is not known (known: {known})", "model")
        return entry

    def ready(self, model_id: str) -> ModelEntry:
        entry = self.get(model_id)
        if entry.state == ModelState.LOADING:
            raise Unavailable(f"model '{entry.model_id}' is loading", retry_after_s=2.0)
        if entry.state != ModelState.READY or entry.engine is None:
            raise Unavailable(
                f"model '{entry.model_id}' is not loaded; load it with LoadModel",
                retry_after_s=1.0,
            )
        if entry.pending_unload_reason:
            raise ResourceExhausted(
                f"model '{entry.model_id}' is being unloaded under memory pressure "
                f"({entry.pending_unload_reason})",
                reason="MEMORY_PRESSURE",
                retry_after_s=5.0,
                metadata={"model": entry.model_id, "pending_unload": entry.pending_unload_reason},
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
        """What loading `source` will take: measured last time, else its weight files."""
        return self._measured.get(source) or estimate_load_bytes(source)

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
        if not source:
            raise InvalidArgument("source is empty: give a local folder or a repository id",
                                  "source")
        model_id = model_id or default_model_id(source)
        new = False
        async with self._lock:
            entry = self._entries.get(model_id)
            if entry is not None and entry.state in (ModelState.READY, ModelState.LOADING):
                if entry.source != source:
                    raise FailedPrecondition(
                        f"model id '{model_id}' is already used by {entry.source}",
                        "ALREADY_EXISTS",
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
                    raise
                if is_local(entry.source) or entry.source.startswith(("/", ".", "~")):
                    raise NotFound(
                        f"cannot load model from '{entry.source}': {exc}", "source"
                    ) from exc
                # A repository id: mlx-lm fetched it through huggingface_hub and failed.
                raise Unavailable(
                    f"cannot fetch repository '{entry.source}': "
                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                    retry_after_s=30.0,
                ) from exc
            entry.measured_bytes = info.measured_bytes or info.weights_bytes
            self._measured[entry.source] = entry.measured_bytes
            entry.weights_bytes = info.weights_bytes
            entry.context_length = info.context_length
            entry.kv_bytes_per_token = info.kv_bytes_per_token
            entry.attention_heads = info.attention_heads
            entry.vocab_size = info.vocab_size
            entry.state = ModelState.READY
            entry.pending_unload_reason = ""
            self.touch(entry)
            span.set_attribute(names.ATTR_BYTES_AFTER, entry.measured_bytes)
        log.info("loaded %s from %s (%d bytes)", entry.model_id, entry.source,
                 entry.measured_bytes)
        self._notify()
        return entry

    async def unload(self, model_id: str, force: bool = False,
                     reason: str = "requested") -> UnloadResult:
        entry = self.get(model_id)
        engine = entry.engine
        if entry.state != ModelState.READY or engine is None:
            raise FailedPrecondition(
                f"model '{entry.model_id}' is not loaded (state {entry.state.name.lower()})",
                "NOT_LOADED",
            )
        active = engine.stats.active_requests + engine.stats.waiting_requests
        if active and not force:
            raise FailedPrecondition(
                f"model '{entry.model_id}' has {active} active request(s); "
                "set force to abort them",
                "MODEL_BUSY",
            )
        with tracer().start_as_current_span(names.SPAN_MODEL_UNLOAD) as span:
            span.set_attribute(names.ATTR_MODEL, entry.model_id)
            span.set_attribute(names.ATTR_REASON, reason)
            entry.state = ModelState.UNLOADING
            self._notify()
            error = Aborted(
                f"model '{entry.model_id}' was unloaded ({reason})",
                reason="MODEL_UNLOADED",
                metadata={"model": entry.model_id},
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

    async def close(self) -> None:
        for task in list(self._pending_unloads.values()):
            task.cancel()
        for entry in self.entries():
            if entry.engine is not None:
                await asyncio.wrap_future(entry.engine.stop())
                entry.engine = None
                entry.state = ModelState.UNLOADED

    def _notify(self) -> None:
        for listener in self.listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener must not break the pool
                log.exception("pool listener failed")
