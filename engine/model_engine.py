"""One engine thread per loaded model: it owns the model, its BatchGenerator and
every MLX call for it.

The loop: drain the inbox (insert, cancel, abort) → one `BatchGenerator.next()`
step → publish tokens → act on flags at the step boundary (clear the MLX pool,
stop). Other threads talk to it only through the inbox and GIL-atomic flags.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import gc
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, StopSequences

from engine import (
    allocator,
    batch_fixes,
    compiled_decode,
    fast_prefill,
    kv_snapshot,
    last_block,
    switch_experts,
)
from engine.demo_models import dtype_bytes
from engine.errors import (
    ENGINE_ERROR,
    PREFILL_ABORT,
    Aborted,
    Internal,
    PlimsollError,
    Unavailable,
)
from engine.final_chunk import FinalChunkGenerator
from engine.loading import LoadedModel, ModelFacts, load_model
from engine.request import (
    Chunk,
    Event,
    Failed,
    Finished,
    FinishReason,
    GenerationRequest,
)
from engine.sampling import make_request_processors, make_request_sampler
from engine.textstream import TextStream
from memory.levels import PressureLevel
from memory.store_cache import StoreCacheGate, next_cap

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
# Where a thread's OS-level end cannot be seen (no /proc): how long to let its
# thread-local destructors run after the join.
THREAD_SETTLE_S = 0.2
THREAD_POLL_S = 0.01
# How long the interpreter's exit waits for engine threads that were ending.
EXIT_WAIT_S = 10.0
_TASKS = Path("/proc/self/task")

_T = TypeVar("_T")


@dataclass
class EngineSettings:
    max_num_seqs: int = 32
    prefill_batch_size: int = 8
    prefill_step_size: int = 512
    # Steady token chunks go to the event loop at most this often; first tokens,
    # ends and errors go at once. Fewer, larger messages cost the loop (and the GIL
    # the engine thread needs) less per token; 0 sends every step.
    stream_interval_s: float = 0.002
    # An idle engine's first request waits while others follow within burst_gap_s of the
    # one before, at most burst_wait_s in all: the event loop hands a burst over one call
    # at a time, and prefilled apart its first requests delay all the others. 0 starts
    # each at once. After burst_lone_starts idle starts in a row that no other request
    # followed within burst_gap_s, it stops waiting (lone requests, one after another,
    # pay nothing) until one does again.
    burst_wait_s: float = 0.010
    burst_gap_s: float = 0.001
    burst_lone_starts: int = 8
    # Prefill chunks of bf16/fp16/quantized models through float32 and the optimized BLAS,
    # one layer converted at a time (engine/fast_prefill.py); False keeps the stock path.
    fast_prefill: bool = True
    # A prompt's last token prefilled with its final chunk (engine/final_chunk.py), not
    # as a decode step of its own as mlx-lm runs it: the first token one model pass sooner.
    prefill_last_token: bool = True
    fast_prefill_min_tokens: int = 16  # rows (tokens x sequences) of a converted chunk
    # Decode through float32: "auto" (measured per model at load), "stock", "fp32"; for
    # quantized layers, and for cache-sized dense half-precision ones with fast_decode_dense.
    fast_decode: str = "auto"
    fast_decode_dense: bool = False
    # Decode rows of dense bfloat16/float16 and 4/8-bit layers through the CBLAS shim's
    # kernels, where that measures faster at load (engine/shim_decode.py); False keeps
    # MLX's products.
    fast_decode_kernel: bool = True
    # A decode step's RoPE and RMSNorm as fused MLX kernels (Linux CPU, engine/compiled_decode.py);
    # the same logits, fewer operations per step. False keeps the stock ops.
    compiled_decode: bool = True
    # MLX may keep this much of freed buffers for reuse (engine/allocator.py; the server
    # sizes it to the ceiling at start). Process-wide and raised only: 0 leaves it as is.
    mlx_pool_bytes: int = 0


def _stop_sequences(req: GenerationRequest, eos: StopSequences, no_stop: StopSequences,
                    eos_ids: Iterable[int]) -> StopSequences:
    """EOS (unless ignore_eos) and the request's stop ids; the shared automata when
    it has no stop ids, so the common case builds nothing per request."""
    if not req.stop_token_ids:
        return no_stop if req.ignore_eos else eos
    ids = set(req.stop_token_ids)
    if not req.ignore_eos:
        ids.update(eos_ids)
    return StopSequences([(t,) for t in sorted(ids)])


@dataclass
class _Live:
    """Engine-thread state of one request in the batch."""

    request: GenerationRequest
    sink: asyncio.Queue
    uid: int
    text: TextStream
    cached_tokens: int
    inserted_at: float
    first_token_at: float | None = None
    generated: int = 0  # tokens sampled (each holds KV), the end-of-sequence one too
    sent: int = 0  # token ids released to the client (completion_tokens)
    prefilled: int = 0  # prompt tokens processed so far (cached ones excluded)
    stop_token: int | None = None  # the stop id (or EOS) that ended it
    sent_first_early: bool = False  # its first token went out before mlx-lm returned it


@dataclass(frozen=True)
class RequestStat:
    request_id: str
    started_at: float  # monotonic, when the request was created
    tokens: int  # tokens it holds in KV


@dataclass
class EngineStats:
    """What other threads may read about the engine without touching MLX.

    The engine thread is the only writer of every field, so no update is lost.
    """

    active_requests: int = 0
    # Inserts taken from the inbox but not yet in the batch (over batch_cap). Inserts
    # still in the inbox are not counted: the pool's ModelEntry.in_use covers them.
    waiting_requests: int = 0
    # One tuple replaced whole, so a reader on another thread never mixes two steps.
    requests: tuple[RequestStat, ...] = ()
    mlx_active_bytes: int = 0
    mlx_pool_bytes: int = 0
    sampled_at: float = 0.0
    idle_reclaims: int = 0  # idle-reclaim flags consumed
    pressure_reclaims: int = 0  # pressure-reclaim flags consumed
    stores_skipped: int = 0  # finish hooks skipped because the store gate was full
    burst_waits: int = 0  # idle starts that waited for the rest of a burst


@dataclass(frozen=True)
class MlxSample:
    """MLX memory as the engine thread read it; `at` is time.monotonic() then."""

    active_bytes: int
    pool_bytes: int
    at: float
    device_limit_bytes: int | None = None  # the device's cap, when MLX runs on one
    device_source: str | None = None


def _device_limit() -> tuple[int | None, str | None]:
    """The device's memory cap as MLX reports it (on the engine thread): the Metal
    recommended working set on macOS, device memory on CUDA; none on a CPU."""
    try:
        info = mx.device_info()
    except Exception:  # no device: no device term
        return None, None
    key = ("max_recommended_working_set_size" if sys.platform == "darwin"
           else "total_memory")
    value = info.get(key)
    if isinstance(value, int) and value > 0:
        return value, f"mlx device_info {key}"
    return None, None


@dataclass(frozen=True)
class PrefillAbortReport:
    """A request ended before a prefill chunk because the chunk could cross the ceiling.

    `remaining_tokens` and `chunk_tokens` are the planner's figures for the whole
    prefilling batch: the prompt tokens still to prefill and the chunk it sized.
    """

    model_id: str
    request_id: str
    prompt_tokens: int
    remaining_tokens: int
    chunk_tokens: int
    mlx_active_bytes: int


@dataclass
class _Insert:
    request: GenerationRequest
    sink: asyncio.Queue
    cache: list[Any] | None = None
    cached_tokens: int = 0
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass
class _Cancel:
    request_ids: Sequence[str] | None  # None: every request
    error: PlimsollError | None  # None: the client left, nobody to tell
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Call:
    """Run `fn` on the engine thread at the next inbox drain (MLX work that must
    happen there, e.g. building a restored cache); `done` resolves to its result."""

    fn: Callable[[], Any]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


FinishHook = Callable[[GenerationRequest, list[Any], list[int]], None]


class PrefillPlanner(Protocol):
    """Sizes prefill chunks against the memory ceiling (set by the service)."""

    def plan(self, mlx_bytes: int, remaining_tokens: int,
             prompt_tokens: int = 0) -> tuple[int, bool]:
        """(tokens for the next chunk, whether to abort before it); `mlx_bytes`: MLX's
        active memory and pool now; `prompt_tokens`: the longest prompt being prefilled
        (its attention spans all of it)."""
        ...

    def observe(self, tokens: int, bytes_delta: int, prompt_tokens: int = 0) -> None:
        """What a chunk of `tokens` over a prompt of `prompt_tokens` cost at its peak."""
        ...


class ModelEngine:
    """A model and the thread that owns it."""

    def __init__(
        self,
        model_id: str,
        source: str,
        loop: asyncio.AbstractEventLoop,
        settings: EngineSettings | None = None,
        on_finish: FinishHook | None = None,
    ) -> None:
        self.model_id = model_id
        self.source = source
        self.settings = settings or EngineSettings()
        self._loop = loop
        self._on_finish = on_finish
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # Set once, by the engine thread, before its last drain: later puts are
        # answered by the caller, so no command waits on a thread that is gone.
        self._inbox_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._run, name=f"engine-{model_id}", daemon=True
        )
        # Resolves to facts only: a future holding the model would keep it alive.
        self.loaded: concurrent.futures.Future[ModelFacts] = concurrent.futures.Future()
        self.stopped: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.stats = EngineStats()
        # GIL-atomic flags, consumed by the engine thread at the next step boundary.
        self._pressure_reclaim = False
        self._idle_reclaim = False
        self._load_abort = False
        self._stop = False
        self._stop_error: PlimsollError | None = None
        self.info: LoadedModel | None = None
        self.fast_prefill: fast_prefill.FastPrefill | None = None  # set at load
        self.prefill_last_token = False  # set at load (engine/final_chunk.py)
        self.compiled_decode: compiled_decode.CompiledDecode | None = None  # set at load
        # How many sequences may hold KV at once; the enforcer walks it one step per
        # tick (down under pressure, back to max_num_seqs at ok). Inserts beyond it wait.
        self.batch_cap = self.settings.max_num_seqs
        # Finished requests whose KV is being stored; the enforcer walks its cap.
        self.store_gate = StoreCacheGate(self.settings.max_num_seqs)
        self._held: list[_Insert] = []
        # Idle starts in a row that no request followed within burst_gap_s, and when the
        # last insert was submitted (engine thread only).
        self._lone_starts = 0
        self._last_submit_at = float("-inf")
        self.prefill_planner: PrefillPlanner | None = None
        # Called on the engine thread after a pre-chunk abort ended a request.
        self.on_prefill_abort: Callable[[PrefillAbortReport], None] | None = None
        self._sample: MlxSample | None = None
        self._device: tuple[int | None, str | None] = (None, None)  # probed on the thread
        self._sample_waiters: queue.SimpleQueue[concurrent.futures.Future[MlxSample]] = (
            queue.SimpleQueue())
        self._outbox: list[tuple[asyncio.Queue, Event]] = []
        self._urgent = False
        self._last_delivery = 0.0
        # MLX on the CPU: a queued decode step runs before the next token can be read
        # (`_publish_first_tokens`, `_end_at_max_tokens`); on an accelerator the wait does
        # not exist. Set at load.
        self._early_first_token = False

    # -- called from any thread -------------------------------------------------
    def start(self) -> concurrent.futures.Future[ModelFacts]:
        self._thread.start()
        return self.loaded

    def submit(
        self,
        request: GenerationRequest,
        sink: asyncio.Queue,
        cache: list[Any] | None = None,
        cached_tokens: int = 0,
    ) -> None:
        if self._stop or not self._thread.is_alive():
            raise Unavailable(f"model {self.model_id} is unloading", retry_after_s=1.0)
        # Only the engine thread counts it (waiting_requests), once it takes it.
        self._put(_Insert(request, sink, cache, cached_tokens))

    def call(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        """Runs `fn` on the engine thread between steps; the future holds its result."""
        cmd = _Call(fn)
        self._put(cmd)
        return cmd.done

    def cancel(self, request_id: str) -> None:
        """The client left: drop the sequence at the next step, tell nobody."""
        self._put(_Cancel([request_id], None))

    def abort(
        self, error: PlimsollError, request_ids: Sequence[str] | None = None
    ) -> concurrent.futures.Future:
        """Ends requests with `error`; resolves to the ids actually ended: those in the
        batch, those held over batch_cap, and inserts submitted before this call."""
        cmd = _Cancel(request_ids, error)
        self._put(cmd)
        return cmd.done

    def mlx_sample(self) -> MlxSample | None:
        """The engine thread's latest MLX reading; None before its first."""
        return self._sample

    def fresh_sample(self) -> concurrent.futures.Future[MlxSample]:
        """A sample the engine thread takes at its next step boundary, after any
        pending reclaim ran (within about IDLE_WAIT_S when idle)."""
        done: concurrent.futures.Future[MlxSample] = concurrent.futures.Future()
        with self._inbox_lock:
            running = self._thread.is_alive() and not self._closed
            if running:
                self._sample_waiters.put(done)
        if not running:
            done.set_exception(Unavailable(f"model {self.model_id} is not running"))
            return done
        self._put(None)  # wake an idle thread now rather than after its wait
        return done

    def adjust_store_cache_cap(self, level: PressureLevel) -> int:
        """Walks the store gate's cap one step for `level`; returns the new cap."""
        return self.store_gate.adjust(level)

    def adjust_batch_cap(self, level: PressureLevel) -> int:
        """Walks batch_cap one step for `level`; returns the new cap."""
        self.batch_cap = next_cap(self.batch_cap, self.settings.max_num_seqs, level)
        return self.batch_cap

    def request_pressure_reclaim(self) -> bool:
        self._pressure_reclaim = True
        return self._thread.is_alive()

    def request_idle_reclaim(self) -> None:
        self._idle_reclaim = True

    def flag_load_abort(self) -> None:
        self._load_abort = True

    def stop(self, error: PlimsollError | None = None) -> concurrent.futures.Future[int]:
        """Stops the thread; running requests end with `error`. Resolves to bytes freed."""
        self._stop_error = error or Unavailable(f"model {self.model_id} was unloaded")
        self._stop = True
        self._put(None)  # wake the thread
        if not self._thread.is_alive() and not self.stopped.done():
            self.stopped.set_result(0)
        return self.stopped

    @property
    def thread(self) -> threading.Thread:
        """The engine thread; the interpreter may exit only once it is gone
        (`wait_threads_gone`)."""
        return self._thread

    @property
    def is_loading(self) -> bool:
        return not self.loaded.done()

    @property
    def busy(self) -> bool:
        """Requests in the batch or held; the pool's in_use covers the inbox."""
        return self.stats.active_requests + self.stats.waiting_requests > 0

    def _put(self, cmd: _Insert | _Cancel | _Call | None) -> None:
        with self._inbox_lock:
            if not self._closed:
                self._inbox.put(cmd)
                return
        # The thread has drained its inbox for the last time: answer here.
        outbox: list[tuple[asyncio.Queue, Event]] = []
        _answer_unrun(cmd, self._stop_error or Unavailable(f"model {self.model_id} stopped"),
                      outbox)
        if outbox:
            self._loop.call_soon_threadsafe(_put_all, outbox)

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        self._device = _device_limit()
        if self.settings.mlx_pool_bytes > 0:
            allocator.raise_mlx_pool(self.settings.mlx_pool_bytes)
        self._early_first_token = mx.default_device().type == mx.DeviceType.cpu
        before = mx.get_active_memory()
        try:
            info = self._load()
        except BaseException as exc:  # noqa: BLE001 - reported through the future
            self._end_failed_load(exc)
            return
        info.measured_bytes = max(0, mx.get_active_memory() - before)
        self.info = info
        eos = StopSequences([(t,) for t in info.tokenizer.eos_token_ids])
        no_stop = StopSequences(None)
        gen = self._new_batch()
        self._sample_memory()
        self.loaded.set_result(info.facts())
        live: dict[int, _Live] = {}
        by_id: dict[str, _Live] = {}
        outbox: list[tuple[asyncio.Queue, Event]] = []
        try:
            while not self._stop:
                outbox = []
                self._drain_inbox(gen, live, by_id, outbox, eos, no_stop,
                                  block=not live and not self._held)
                if live and not self._stop:
                    try:
                        self._step(gen, live, by_id, outbox)
                    except Exception as exc:  # noqa: BLE001 - keep serving the others
                        log.exception("generation step failed on %s", self.model_id)
                        gen = self._reset_batch(gen, live, by_id, outbox, exc)
                    if not live:
                        # Batch drained: give freed buffers back (tests and operators
                        # expect memory to return to its baseline between bursts).
                        mx.clear_cache()
                self._deliver(outbox, flush=not live)
                outbox = []
                self._step_boundary(bool(live))
        except Exception:  # noqa: BLE001 - outside a step: end every request, then stop
            log.exception("engine thread of %s failed; its requests were ended and the "
                          "model is unloaded", self.model_id)
            self._stop_error = self._stop_error or Internal(
                f"the engine of model '{self.model_id}' failed; the request was ended and "
                "the model was unloaded", reason=ENGINE_ERROR, retry_after_s=1.0)
        finally:
            held = mx.get_active_memory()
            err = self._stop_error or Unavailable(f"model {self.model_id} stopped")
            # Events of the iteration that failed, not yet delivered, go out first.
            outbox = [*outbox, *((item.sink, Failed(err)) for item in live.values())]
            outbox += [(h.sink, Failed(err)) for h in self._held]
            self._held.clear()
            self._close_inbox(err, outbox)
            self._deliver(outbox, flush=True)
            live.clear()
            by_id.clear()
            # The last step queued the next one (async eval): let it finish before the
            # model's arrays go, so no MLX work outlives the engine.
            with contextlib.suppress(Exception):
                mx.synchronize(gen.stream)
            gen.close()
            del gen, eos, no_stop
            self.info = None
            del info  # the last reference: the model's arrays go with it
            try:
                self._free_memory()
            except Exception:  # noqa: BLE001 - whoever waits on `stopped` is told anyway
                log.exception("freeing the memory of %s failed", self.model_id)
            self.stats = self._final_stats()
            self._sample = self._read_sample()
            _ending_now()
            self.stopped.set_result(max(0, held - mx.get_active_memory()))

    def _load(self) -> LoadedModel:
        if self._load_abort:
            raise Aborted(f"load of {self.model_id} aborted", reason="LOAD_ABORTED")
        info = load_model(self.source)
        self._install_model_paths(info)
        if self._load_abort:
            # The traceback keeps this frame alive in `loaded`: drop the model first.
            del info
            raise Aborted(f"load of {self.model_id} aborted", reason="LOAD_ABORTED")
        return info

    def _install_model_paths(self, info: LoadedModel) -> None:
        paths = install_model_paths(info, self.settings, self.model_id)
        self.prefill_last_token = paths.prefill_last_token
        self.fast_prefill = paths.fast_prefill
        self.compiled_decode = paths.compiled_decode

    def _end_failed_load(self, exc: BaseException) -> None:
        if isinstance(exc, Aborted):
            log.info("load of %s aborted", self.model_id)
        else:
            log.warning("load of %s failed", self.model_id, exc_info=exc)
        # Frames of a failed load may still hold its arrays; `loaded` keeps the error.
        _drop_tracebacks(exc)
        self._free_memory()
        self._sample = self._read_sample()
        outbox: list[tuple[asyncio.Queue, Event]] = []
        self._close_inbox(Unavailable(f"model {self.model_id} failed to load"), outbox)
        self._deliver(outbox, flush=True)
        _ending_now()
        self.loaded.set_exception(exc)
        self.stopped.set_result(0)

    def _free_memory(self) -> None:
        gc.collect()
        mx.synchronize()
        mx.clear_cache()
        allocator.trim()

    def _final_stats(self) -> EngineStats:
        # Request figures go; the counters stay readable after the thread ended.
        s = self.stats
        return EngineStats(idle_reclaims=s.idle_reclaims,
                           pressure_reclaims=s.pressure_reclaims,
                           stores_skipped=s.stores_skipped)

    def _close_inbox(self, err: PlimsollError, outbox: list) -> None:
        """From now on callers answer their own commands (`_put`); answer the rest."""
        with self._inbox_lock:
            self._closed = True
        self._fail_pending_inserts(err, outbox)
        self._fail_sample_waiters()

    def _fail_pending_inserts(self, err: PlimsollError, outbox: list) -> None:
        for cmd in _take_all(self._inbox):
            _answer_unrun(cmd, err, outbox)

    def _fail_sample_waiters(self) -> None:
        for done in _take_all(self._sample_waiters):
            _fail(done, Unavailable(f"model {self.model_id} is not running"))

    def _drain_inbox(self, gen, live, by_id, outbox, eos, no_stop, block: bool) -> None:
        timeout = IDLE_WAIT_S if block else None
        gather_until: float | None = None
        while True:
            try:
                cmd = self._inbox.get(timeout=timeout) if timeout else self._inbox.get_nowait()
            except queue.Empty:
                break
            timeout = None
            if cmd is None:
                continue
            if isinstance(cmd, _Insert):
                self._held.append(cmd)
                # Counted at once: a burst's first request may wait here (below), and
                # an unload must still see it.
                self.stats.waiting_requests = len(self._held)
                if block and not live:
                    timeout, gather_until = self._burst_wait(cmd, gather_until)
                else:
                    self._note_submit(cmd)
            elif isinstance(cmd, _Call):
                try:
                    _settle(cmd.done, cmd.fn())
                except Exception as exc:  # noqa: BLE001 - the caller gets it
                    _fail(cmd.done, exc)
            else:
                self._cancel(gen, cmd, live, by_id, outbox)
        self._admit_held(gen, live, by_id, outbox, eos, no_stop)
        self.stats.waiting_requests = len(self._held)

    def _note_submit(self, cmd: _Insert) -> None:
        """A request submitted within burst_gap_s of the one before is part of a burst:
        idle starts wait for company again."""
        if cmd.submitted_at - self._last_submit_at <= self.settings.burst_gap_s:
            self._lone_starts = 0
        self._last_submit_at = cmd.submitted_at

    def _burst_wait(self, cmd: _Insert, until: float | None) -> tuple[float | None, float]:
        """After an insert to an idle engine: how long to wait for the next one of its
        burst (None: take what has come and start), and when the wait ends."""
        now = time.monotonic()
        if until is None:  # the idle start itself
            self._lone_starts += 1
        self._note_submit(cmd)
        if self.settings.burst_wait_s <= 0 or self._lone_starts > self.settings.burst_lone_starts:
            return None, now
        if until is None:
            until = now + self.settings.burst_wait_s
            self.stats.burst_waits += 1
        left = min(self.settings.burst_gap_s, until - now)
        return (left if left > 0 else None), until

    def _admit_held(self, gen, live, by_id, outbox, eos, no_stop) -> None:
        while self._held and len(live) < max(1, self.batch_cap):
            cmd = self._held.pop(0)
            try:
                args = self._insert_args(cmd, eos, no_stop)
            except Exception:  # noqa: BLE001 - this request ends; the batch goes on
                log.exception("request %s could not be inserted on %s",
                              cmd.request.request_id, self.model_id)
                outbox.append((cmd.sink, Failed(Internal(
                    f"the request could not be started on model '{self.model_id}'; the "
                    "model keeps serving", reason=ENGINE_ERROR))))
                continue
            self._insert(gen, cmd, args, live, by_id)

    def _insert_args(self, cmd: _Insert, eos, no_stop) -> dict[str, Any]:
        """What `BatchGenerator.insert` takes for one request; made apart, so that a
        request whose parts fail ends alone before the batch is touched."""
        req = cmd.request
        # A quantized bank snapshot is dequantized into fresh caches here (the batch
        # cannot merge quantized ones); the bank keeps its quantized copy.
        cache = kv_snapshot.thaw(cmd.cache) if cmd.cache is not None else None
        return dict(
            max_tokens=[req.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[req.prompt_tokens[: cmd.cached_tokens]],
            samplers=[make_request_sampler(req.sampling)],
            logits_processors=[make_request_processors(req.sampling)],
            stop_sequences=[_stop_sequences(req, eos, no_stop,
                                            self.info.tokenizer.eos_token_ids)],
        )

    def _insert(self, gen, cmd: _Insert, args: dict[str, Any], live, by_id) -> None:
        req = cmd.request
        (uid,) = gen.insert([req.prompt_tokens[cmd.cached_tokens :]], **args)
        item = _Live(
            request=req,
            sink=cmd.sink,
            uid=uid,
            text=TextStream(self.info.tokenizer.detokenizer, req.stop),
            cached_tokens=cmd.cached_tokens,
            inserted_at=time.monotonic(),
        )
        live[uid] = item
        by_id[req.request_id] = item
        self._refresh_stats(live)

    def _cancel(self, gen, cmd: _Cancel, live, by_id, outbox) -> None:
        wanted = None if cmd.request_ids is None else set(cmd.request_ids)
        held = [h for h in self._held if wanted is None or h.request.request_id in wanted]
        for h in held:
            self._held.remove(h)
            if cmd.error is not None:
                outbox.append((h.sink, Failed(cmd.error)))
        if wanted is None:
            targets = list(live.values())
        else:
            targets = [by_id[r] for r in wanted if r in by_id]
        if targets:
            gen.remove([t.uid for t in targets])
        for t in targets:
            del live[t.uid]
            del by_id[t.request.request_id]
            if cmd.error is not None:
                outbox.append((t.sink, Failed(cmd.error)))
        self._refresh_stats(live)
        _settle(cmd.done, [t.request.request_id for t in targets]
                + [h.request.request_id for h in held])

    def _publish_step(self, gen, responses, live, by_id, outbox) -> None:
        now = time.monotonic()
        finished: list[_Live] = []
        text_stopped: list[int] = []  # still in the batch: BatchGenerator did not stop them
        for r in responses:
            item = live.get(r.uid)
            if item is None:
                continue
            if item.sent_first_early:  # this is the token _publish_first_tokens sent
                item.sent_first_early = False
                pieces = []
            else:
                _, pieces = self._take_token(item, r.token, now)
            if item.text.stopped and r.finish_reason is None:
                text_stopped.append(item.uid)
            if self._settle(item, pieces, r.finish_reason, now, outbox) is not None:
                finished.append(item)
                if self._on_finish is not None and r.prompt_cache is not None:
                    self._store(item.request, r.prompt_cache, r.all_tokens or [])
        if finished:
            if text_stopped:
                gen.remove(text_stopped)
            for f in finished:
                live.pop(f.uid, None)
                by_id.pop(f.request.request_id, None)
        self._refresh_stats(live)

    def _settle(self, item: _Live, pieces: list, finish: str | None, now: float,
                outbox: list) -> FinishReason | None:
        """Send a token's text pieces and, where the sequence ends with it (mlx-lm's
        `finish`: "stop" or "length"; or a stop string its text completed), its end.
        Returns why it ended, or None."""
        stopped_by_text = item.text.stopped
        reason = None
        if stopped_by_text or finish == "stop":
            reason = FinishReason.STOP
        elif finish == "length":
            reason = FinishReason.LENGTH
        if reason is not None and not stopped_by_text:
            pieces = pieces + item.text.finish()
            if item.text.stopped:  # the flushed tail completed a stop string
                reason = FinishReason.STOP
        self._send_pieces(item, pieces, outbox)
        if reason is not None:
            outbox.append((item.sink, self._finished(item, reason, now)))
        return reason

    def _take_token(self, item: _Live, token: int, now: float) -> tuple[bool, list]:
        """Count one sampled token; return whether it is the end-of-sequence (or a stop
        id) and the text pieces it releases."""
        item.generated += 1
        if item.first_token_at is None:
            item.first_token_at = now
            self._urgent = True  # time to first token is never held back
        req = item.request
        is_eos = self._is_stop_id(req, token)
        if is_eos:
            item.stop_token = token
        # Ids go out only with their text, and neither holds a stop string's tokens
        # nor the end-of-sequence token (engine/textstream.py has the rule).
        return is_eos, [] if is_eos else item.text.add(token)

    def _is_stop_id(self, req: GenerationRequest, token: int) -> bool:
        return token in req.stop_token_ids or (
            token in self.info.tokenizer.eos_token_ids and not req.ignore_eos)

    @staticmethod
    def _send_pieces(item: _Live, pieces: list, outbox: list) -> None:
        for piece in pieces:
            item.sent += len(piece.token_ids)
            outbox.append((item.sink, Chunk(piece.token_ids, piece.text)))

    def _publish_first_tokens(self, gen, live, outbox) -> None:
        """Send the first token of each sequence that just left prefill, now.

        mlx-lm returns a sequence's first token from the *next* `next()`, after it has
        queued the decode step that follows; on MLX's CPU backend queueing a whole
        forward pass runs most of it, so waiting costs time to first token one decode
        step. The token is already sampled: read it and send it. A stop id stays for the
        normal path (it carries the finish), and the later response is not sent twice.
        On an accelerator the queued step does not block, and reading the token early
        would only end its overlap with this thread's work: not done there.
        """
        if not self._early_first_token:
            return
        batch = getattr(gen, "_generation_batch", None)
        upcoming = getattr(batch, "_next_tokens", None)
        if upcoming is None:
            return
        fresh = [(pos, item) for pos, uid in enumerate(batch.uids)
                 if (item := live.get(uid)) is not None and item.first_token_at is None]
        if not fresh:
            return
        tokens = upcoming.tolist()
        now = time.monotonic()
        for pos, item in fresh:
            token = tokens[pos]
            if self._is_stop_id(item.request, token):
                continue
            _, pieces = self._take_token(item, token, now)
            item.sent_first_early = True
            self._send_pieces(item, pieces, outbox)
        self._refresh_stats(live)

    def _end_at_max_tokens(self, gen, live, by_id, outbox) -> None:
        """End, now, each sequence whose last token by max_tokens is already sampled.

        mlx-lm returns a token from the *next* `next()`, after it has queued the step
        that follows; for a sequence at its max_tokens that step is thrown away, and on
        MLX's CPU backend queueing it runs most of it: the last token and the end came a
        decode step late, and a lone request paid that step. Read such a token now (a
        wait for the tail of the step just queued), send it with the end, and take the
        sequence out of the batch. A stop id read here ends it as mlx-lm would ("stop").
        The finish hook gets the batch's cache, which holds every token's KV but the
        last's, with those tokens; a turn whose KV the session bank keeps takes mlx-lm's
        path instead, so that the cache it stores holds the last token too. Not on an
        accelerator (`_publish_first_tokens`)."""
        batch = getattr(gen, "_generation_batch", None)
        upcoming = getattr(batch, "_next_tokens", None)
        if not self._early_first_token or upcoming is None:
            return
        ending = []
        for pos, uid in enumerate(batch.uids):
            item = live.get(uid)
            # The sampled token not yet taken: none where the first went out early.
            pending = 0 if item is None or item.sent_first_early else 1
            if (item is not None and item.generated + pending >= item.request.max_tokens
                    and not (self._on_finish is not None and item.request.session_id)):
                ending.append((pos, item))
        if not ending:
            return
        tokens = upcoming.tolist() if any(not i.sent_first_early for _, i in ending) else []
        now = time.monotonic()
        for pos, item in ending:
            is_eos, pieces = False, []
            if not item.sent_first_early:
                is_eos, pieces = self._take_token(item, tokens[pos], now)
            self._settle(item, pieces, "stop" if is_eos else "length", now, outbox)
        caches = gen.remove([item.uid for _, item in ending],
                            return_prompt_caches=self._on_finish is not None)
        for _, item in ending:
            live.pop(item.uid, None)
            by_id.pop(item.request.request_id, None)
            if item.uid in caches:  # every token's KV but the last's, and those tokens
                cache, held = caches[item.uid]
                self._store(item.request, cache, list(held))
        self._refresh_stats(live)

    def _store(self, req: GenerationRequest, cache: list[Any], tokens: list[int]) -> None:
        """The finish hook, within the store gate's cap; a full gate skips the store."""
        if not self.store_gate.try_acquire():
            self.stats.stores_skipped += 1
            return
        try:
            self._on_finish(req, cache, tokens)
        except Exception:  # noqa: BLE001 - a failed store must not fail the batch
            log.exception("storing the KV of %s failed on %s", req.request_id, self.model_id)
        finally:
            self.store_gate.release()

    def _step(self, gen, live, by_id, outbox) -> None:
        planned = self._plan_prefill(gen, live, by_id, outbox)
        active_before = 0
        if planned:
            # The chunk's cost is its peak (attention scores included), not what stays.
            active_before = mx.get_active_memory()
            mx.reset_peak_memory()
        prompt_responses, responses = gen.next()
        self._track_prefill(prompt_responses, live, planned, active_before)
        self._publish_step(gen, responses, live, by_id, outbox)
        if prompt_responses:  # only a step that prefilled can start a sequence's decode
            self._publish_first_tokens(gen, live, outbox)
        self._end_at_max_tokens(gen, live, by_id, outbox)

    def _reset_batch(self, gen, live, by_id, outbox, exc: Exception) -> BatchGenerator:
        """A failed step leaves the batch in an unknown state: end its requests with a
        typed status and start a fresh batch, so the model keeps serving."""
        # The log has the exception (log.exception above); the client gets no library text.
        error = Internal(f"generation failed on model '{self.model_id}'; the request was "
                         "ended and the model keeps serving", reason=ENGINE_ERROR,
                         retry_after_s=1.0)
        for item in live.values():
            outbox.append((item.sink, Failed(error)))
        live.clear()
        by_id.clear()
        self._refresh_stats(live)
        gen.close()
        mx.clear_cache()
        return self._new_batch()

    def _new_batch(self) -> BatchGenerator:
        make = FinalChunkGenerator if self.prefill_last_token else BatchGenerator
        return make(
            self.info.model,
            completion_batch_size=self.settings.max_num_seqs,
            prefill_batch_size=min(self.settings.prefill_batch_size, self.settings.max_num_seqs),
            prefill_step_size=self.settings.prefill_step_size,
        )

    def _plan_prefill(self, gen, live, by_id, outbox) -> int:
        """Before a step that prefills: size the chunk to the headroom, or abort the
        youngest prefilling request when even the smallest chunk would cross the
        pre-chunk abort margin. Returns the tokens the step may prefill."""
        while True:
            planner = self.prefill_planner
            prefilling = [i for i in live.values() if i.first_token_at is None]
            if planner is None or not prefilling:
                return 0
            remaining = sum(self._prefill_left(i) for i in prefilling)
            if remaining <= 0:
                return 0
            # MLX's memory now: active buffers and its pool (held, reusable by the chunk).
            active = mx.get_active_memory() + mx.get_cache_memory()
            longest = max(len(i.request.prompt_tokens) for i in prefilling)
            chunk, abort = planner.plan(active, remaining, longest)
            if not abort:
                gen.prefill_step_size = max(1, chunk)
                return chunk
            victim = max(prefilling, key=lambda i: i.request.created_at)
            report = PrefillAbortReport(self.model_id, victim.request.request_id,
                                        len(victim.request.prompt_tokens), remaining,
                                        chunk, active)
            self._cancel(gen, _Cancel([report.request_id], _prefill_error(report)), live,
                         by_id, outbox)
            self._report_prefill_abort(report)

    def _prefill_left(self, item: _Live) -> int:
        """The prompt tokens a prefill chunk has still to run for `item`. mlx-lm runs a
        prompt's last token as the sequence's first decode step, which holds no prefill
        transient (and was admitted). engine/final_chunk.py prefills it with the final
        chunk, but a last token left alone (a one-token prompt, a cached prefix of all
        the others, a chunk before it that took mlx-lm's path) still runs as that step."""
        left = len(item.request.prompt_tokens) - item.cached_tokens - item.prefilled
        if self.prefill_last_token:
            return left if left > 1 else 0
        return max(0, left - 1)

    def _report_prefill_abort(self, report: PrefillAbortReport) -> None:
        hook = self.on_prefill_abort
        if hook is None:
            return
        try:
            hook(report)
        except Exception:  # noqa: BLE001 - a broken observer must not stop the engine
            log.exception("on_prefill_abort failed on %s", self.model_id)

    def _track_prefill(self, prompt_responses, live, planned: int, before: int) -> None:
        processed = longest = 0
        for r in prompt_responses:
            item = live.get(r.uid)
            if item is not None and isinstance(r.progress, tuple):
                done = r.progress[0]
                processed += max(0, done - item.prefilled)
                item.prefilled = done
                longest = max(longest, len(item.request.prompt_tokens))
        if planned and processed and self.prefill_planner is not None:
            self.prefill_planner.observe(processed, mx.get_peak_memory() - before, longest)

    def _finished(self, item: _Live, reason: FinishReason, now: float) -> Finished:
        first = item.first_token_at or now
        return Finished(
            reason=reason,
            prompt_tokens=len(item.request.prompt_tokens),
            cached_tokens=item.cached_tokens,
            completion_tokens=item.sent,
            queue_seconds=item.inserted_at - item.request.created_at,
            ttft_seconds=first - item.request.created_at,
            decode_seconds=now - first,
            matched_stop=item.text.matched,
            matched_stop_token=item.stop_token,
        )

    def _deliver(self, outbox: list[tuple[asyncio.Queue, Event]], flush: bool) -> None:
        # One hop to the event loop per delivery, however many requests it touched.
        pending = self._outbox
        pending.extend(outbox)
        if not pending:
            return
        now = time.monotonic()
        urgent = flush or self._urgent or any(not isinstance(e, Chunk) for _, e in outbox)
        if not urgent and now - self._last_delivery < self.settings.stream_interval_s:
            return
        self._loop.call_soon_threadsafe(_put_all, pending)
        self._outbox = []
        self._urgent = False
        self._last_delivery = now

    def _step_boundary(self, busy: bool) -> None:
        # Only waiters already queued get this boundary's sample: a flag raised before
        # fresh_sample() was called is then sure to have run (it is read below).
        waiters = _take_all(self._sample_waiters)
        if self._pressure_reclaim:
            self._pressure_reclaim = False
            self._reclaim_pool()
            self.stats.pressure_reclaims += 1
        if self._idle_reclaim and not busy:
            self._idle_reclaim = False
            self._free_memory()
            self.stats.idle_reclaims += 1
        self._sample_memory()
        for done in waiters:
            _settle(done, self._sample)

    def _reclaim_pool(self) -> None:
        mx.synchronize()
        mx.clear_cache()
        # Small buffers (a short session's KV) live on the C heap: hand those pages
        # back too, or usage never drops and admission sheds on and on.
        allocator.trim()

    def _read_sample(self) -> MlxSample:
        return MlxSample(mx.get_active_memory(), mx.get_cache_memory(), time.monotonic(),
                         *self._device)

    def _sample_memory(self) -> None:
        sample = self._read_sample()
        self._sample = sample
        self.stats.mlx_active_bytes = sample.active_bytes
        self.stats.mlx_pool_bytes = sample.pool_bytes
        self.stats.sampled_at = sample.at

    def _refresh_stats(self, live: dict[int, _Live]) -> None:
        items = list(live.values())
        self.stats.active_requests = len(items)
        self.stats.waiting_requests = len(self._held)
        self.stats.requests = tuple(
            RequestStat(i.request.request_id, i.request.created_at,
                        len(i.request.prompt_tokens) + i.generated)
            for i in items)


@dataclass
class ModelPaths:
    """What `install_model_paths` chose for one model."""

    prefill_last_token: bool
    fast_prefill: fast_prefill.FastPrefill
    compiled_decode: compiled_decode.CompiledDecode


def install_model_paths(info: LoadedModel, s: EngineSettings, model_id: str) -> ModelPaths:
    """The per-model decisions, on the thread that will run the model (the engine's; a
    benchmark's own): mlx-lm's batch mistakes corrected (engine/batch_fixes.py),
    half-precision experts in float32 on a CPU (engine/switch_experts.py), the last
    token with the final chunk (engine/final_chunk.py), the fast prefill (what the
    experts and the fast prefill add to a prefill goes to admission with the model's
    facts), the compiled decode ops. Each is logged."""
    for fix in batch_fixes.install(info.model):
        log.info("%s: mlx-lm's model code corrected: %s", model_id, fix)
    experts = switch_experts.install(info.model)
    if experts.layers:
        log.info("%s: %s", model_id, experts.summary())
    # Marked before the fast path looks at it, which then leaves it marked.
    why = (last_block.split_reason(info.model) if s.prefill_last_token
           else "turned off by the settings")
    if why is None:
        last_block.mark(last_block.last_of(info.model))
    log.info("%s: a prompt's last token %s", model_id,
             "prefilled with its final chunk" if why is None
             else f"runs as a decode step of its own ({why})")
    plan = fast_prefill.install(
        info.model, enabled=s.fast_prefill, min_tokens=s.fast_prefill_min_tokens,
        decode=s.fast_decode, decode_dense=s.fast_decode_dense,
        decode_kernel=s.fast_decode_kernel,
        kv_bytes_per_token=info.kv_bytes_per_token,
        kv_dtype_bytes=dtype_bytes(info.config.get("torch_dtype") or info.config.get("dtype")))
    info.prefill_conversion = experts.counted_in(plan.prefill_transient)
    log.info("%s: %s", model_id, plan.summary())
    compiled = compiled_decode.install(info.model, enabled=s.compiled_decode)
    log.info("%s: %s", model_id, compiled.summary())
    return ModelPaths(why is None, plan, compiled)


def thread_gone(thread: threading.Thread) -> bool:
    """Whether `thread` has ended at the OS level, not only in Python.

    `Thread.join` returns once the thread's Python state is gone; its C++ thread-local
    destructors run after that. MLX's thread-local compile cache holds Python objects,
    so its destructor takes the GIL: if the interpreter is finalizing by then, CPython
    ends the thread with a forced unwind through that noexcept destructor and the
    process aborts ("terminate called without an active exception"). On Linux the
    thread's /proc entry outlives those destructors.
    """
    if thread.is_alive():
        return False
    if thread.native_id is None or not _TASKS.is_dir():
        return True
    return not (_TASKS / str(thread.native_id)).exists()


async def wait_threads_gone(threads: Sequence[threading.Thread], timeout_s: float) -> bool:
    """Polls until every thread is gone (`thread_gone`), releasing the GIL meanwhile
    so their destructors can run; False when some are still there at `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not all(thread_gone(t) for t in threads):
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(THREAD_POLL_S)
    if threads and not _TASKS.is_dir():
        # No way to see the OS thread end: give its destructors a moment instead.
        await asyncio.sleep(THREAD_SETTLE_S)
    return True


# Engine threads that resolved `stopped` and are about to end. Set on the engine thread
# before the future resolves, so a caller that awaits `stop()` and returns cannot reach
# the interpreter's exit before its thread is here.
_ending: set[threading.Thread] = set()
_ending_lock = threading.Lock()


def _ending_now() -> None:
    with _ending_lock:
        _ending.difference_update([t for t in _ending if thread_gone(t)])
        _ending.add(threading.current_thread())


def _wait_for_ending_threads() -> None:
    """At the interpreter's exit, until every ending engine thread is gone: a script
    that awaits `stop()` and returns would otherwise finalize while the thread's
    destructors run, and abort (`thread_gone`). The server waits for its threads
    itself; this covers whoever runs a `ModelEngine` directly."""
    with _ending_lock:
        threads = [t for t in _ending if not thread_gone(t)]
    if threads:
        asyncio.run(wait_threads_gone(threads, EXIT_WAIT_S))


atexit.register(_wait_for_ending_threads)


def _put_all(outbox: list[tuple[asyncio.Queue, Event]]) -> None:
    for sink, event in outbox:
        sink.put_nowait(event)


def _take_all(waiting: queue.SimpleQueue[_T]) -> list[_T]:
    taken: list[_T] = []
    while True:
        try:
            taken.append(waiting.get_nowait())
        except queue.Empty:
            return taken


def _answer_unrun(cmd: _Insert | _Cancel | _Call | None, err: PlimsollError,
                  outbox: list) -> None:
    """A command the engine thread will never run: fail an insert or a call, end nothing."""
    if isinstance(cmd, _Insert):
        outbox.append((cmd.sink, Failed(err)))
    elif isinstance(cmd, _Call):
        _fail(cmd.done, err)
    elif isinstance(cmd, _Cancel):
        _settle(cmd.done, [])


def _settle(done: concurrent.futures.Future, result: object) -> None:
    # The caller may have cancelled it (a timed-out wait): that must not raise here.
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        done.set_result(result)


def _fail(done: concurrent.futures.Future, err: BaseException) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        done.set_exception(err)


def _drop_tracebacks(exc: BaseException) -> None:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def _prefill_error(report: PrefillAbortReport) -> Aborted:
    # After the start message: ABORTED (PREFILL_ABORT), not a shed before prefill.
    return Aborted(
        f"prefill of {report.prompt_tokens} tokens would cross the memory ceiling's "
        "pre-chunk abort margin",
        reason=PREFILL_ABORT,
        retry_after_s=5.0,
        metadata={"prompt_tokens": str(report.prompt_tokens), "model": report.model_id,
                  "remaining_tokens": str(report.remaining_tokens),
                  "chunk_tokens": str(report.chunk_tokens)},
    )
