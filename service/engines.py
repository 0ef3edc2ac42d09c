"""The engines as the executor sees them: `memory.protocols` over the model pool.

`memory` knows nothing of engines and `engine` nothing of the governor; this
module is the narrow bridge between them. Nothing here touches MLX: it reads
the engines' own samples, sets their flags and enqueues their commands.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.errors import ENFORCER_ABORT, Aborted, PlimsollError
from engine.model_engine import MlxSample, ModelEngine, PrefillAbortReport
from engine.pool import ModelEntry, ModelPool, ModelState
from memory.actions import PrefillAborted
from memory.chunking import (
    PrefillCostModel,
    PrefillFigures,
    plan_chunk,
    should_abort_before_chunk,
)
from memory.levels import PressureLevel, Tier
from memory.readings import MlxFigures
from memory.views import EngineState, EngineView, RequestView

log = logging.getLogger(__name__)

_STATES = {
    ModelState.LOADING: EngineState.LOADING,
    ModelState.READY: EngineState.READY,
    ModelState.UNLOADING: EngineState.UNLOADING,
}

# (usage, ceiling) of the latest measurement, for the figures an aborted client receives.
Figures = Callable[[], tuple[int, int]]
GuardMaker = Callable[[ModelEntry], "PrefillGuard"]


def _figures(sample: MlxSample | None) -> MlxFigures | None:
    if sample is None:
        return None
    return MlxFigures(sample.active_bytes, sample.pool_bytes, sample.at,
                      sample.device_limit_bytes, sample.device_source)


@dataclass(frozen=True)
class GuardLimits:
    ceiling_bytes: int
    abort_cap_bytes: int
    non_mlx_bytes: int  # process usage beyond MLX's active memory and pool, last tick
    tier: Tier


class PrefillGuard:
    """`engine.model_engine.PrefillPlanner` over `memory.chunking`: chunk sizes shrink
    as projected usage nears the tier's fraction of the ceiling recomputed every tick;
    a chunk that would cross the pre-chunk abort line is not started.

    The governor hands it each tick's limits; the engine thread asks for a plan
    before each prefill step with its own MLX sample, so nothing here calls MLX.
    """

    def __init__(self, figures: PrefillFigures, min_chunk: int, max_chunk: int) -> None:
        # The static estimate admission projects with too, times a learned factor.
        self.cost = PrefillCostModel(figures)
        self.min_chunk = min_chunk
        self.max_chunk = max_chunk
        # One tuple, replaced whole: the engine thread never reads two ticks' figures.
        self.limits: GuardLimits | None = None

    @property
    def cost_factor(self) -> float:
        """Read by admission on the loop; a float, replaced whole by the engine thread."""
        return self.cost.factor

    @property
    def ceiling(self) -> int:
        return self.limits.ceiling_bytes if self.limits else 0

    @property
    def abort_cap(self) -> int:
        return self.limits.abort_cap_bytes if self.limits else 0

    def update(self, ceiling_bytes: int, abort_cap_bytes: int, non_mlx_bytes: int,
               tier: Tier) -> None:
        self.limits = GuardLimits(ceiling_bytes, abort_cap_bytes, non_mlx_bytes, tier)

    def plan(self, mlx_bytes: int, remaining_tokens: int,
             prompt_tokens: int = 0) -> tuple[int, bool]:
        limits = self.limits
        if limits is None:
            return min(self.max_chunk, remaining_tokens), False
        # Attention over the whole prompt, as admission projects its last chunk.
        per_token, fixed = self.cost.linear(prompt_tokens or remaining_tokens)
        usage = limits.non_mlx_bytes + mlx_bytes + fixed
        chunk = plan_chunk(tier=limits.tier, ceiling_bytes=limits.ceiling_bytes,
                           usage_bytes=usage, bytes_per_token=per_token,
                           remaining_tokens=remaining_tokens, min_chunk=self.min_chunk,
                           max_chunk=self.max_chunk)
        abort = should_abort_before_chunk(tier=limits.tier,
                                          abort_cap_bytes=limits.abort_cap_bytes,
                                          ceiling_bytes=limits.ceiling_bytes,
                                          usage_bytes=usage, chunk_tokens=chunk,
                                          bytes_per_token=per_token)
        return chunk, abort

    def observe(self, tokens: int, bytes_delta: int, prompt_tokens: int = 0) -> None:
        self.cost = self.cost.observe(tokens, bytes_delta, prompt_tokens)


class EngineHandleAdapter:
    """One model as the executor sees it (`memory.protocols.EngineHandle`)."""

    def __init__(self, entry: ModelEntry, figures: Figures, make_guard: GuardMaker,
                 report: Callable[[PrefillAbortReport], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.model_id = entry.model_id
        self.entry = entry
        self.engine = entry.engine  # the handle is for this engine; a reload gets a new one
        self._figures = figures
        self._make_guard = make_guard
        self._report = report
        self._clock = clock
        self.guard: PrefillGuard | None = None

    @property
    def _engine(self) -> ModelEngine | None:
        return self.entry.engine

    def view(self) -> EngineView:
        e = self.entry
        engine = e.engine
        kv = e.kv_bytes_per_token or 0
        requests: tuple[RequestView, ...] = ()
        active = 0
        if engine is not None:
            stats = engine.stats
            active = stats.active_requests + stats.waiting_requests
            requests = tuple(
                RequestView(r.request_id, r.started_at, r.tokens * kv if kv else None)
                for r in stats.requests
            )
        return EngineView(
            model_id=e.model_id,
            state=_STATES.get(e.state, EngineState.UNLOADING),
            pinned=e.pinned,
            active_requests=active + e.in_use if engine else 0,
            requests=requests,
            last_used=e.last_used,
            measured_bytes=e.measured_bytes or None,
            pending_unload=bool(e.pending_unload_reason),
            store_cache_cap=engine.store_gate.cap if engine else 1,
            max_num_seqs=engine.settings.max_num_seqs if engine else 1,
            loaded_age_s=self._loaded_age(),
            keep_alive_s=e.keep_alive_s,
        )

    def _loaded_age(self) -> float | None:
        """Seconds since the load finished; None unless the model is ready."""
        e = self.entry
        if e.state is not ModelState.READY or e.loaded_at is None:
            return None
        return max(0.0, self._clock() - e.loaded_at)

    def request_pressure_reclaim(self) -> bool:
        engine = self._engine
        return engine.request_pressure_reclaim() if engine else False

    async def fresh_sample(self, timeout_s: float) -> MlxFigures | None:
        engine = self._engine
        if engine is None:
            return None
        try:
            sample = await asyncio.wait_for(asyncio.wrap_future(engine.fresh_sample()),
                                            timeout_s)
        except (TimeoutError, concurrent.futures.CancelledError, RuntimeError, PlimsollError):
            return None
        return _figures(sample)

    def request_idle_reclaim(self) -> None:
        if self._engine:
            self._engine.request_idle_reclaim()

    async def abort_requests(self, reason: str,
                             request_ids: Sequence[str] | None = None) -> list[str]:
        engine = self._engine
        if engine is None:
            return []
        usage, ceiling = self._figures()
        error = Aborted(
            f"aborted by the memory enforcer ({reason}): usage {usage} bytes, "
            f"ceiling {ceiling} bytes",
            reason=ENFORCER_ABORT,
            retry_after_s=2.0,
            metadata={"usage_bytes": str(usage), "ceiling_bytes": str(ceiling),
                      "enforcer_reason": reason, "model": self.model_id},
        )
        ended = await asyncio.wrap_future(
            engine.abort(error, None if request_ids is None else list(request_ids)))
        return list(ended)

    def flag_load_abort(self) -> None:
        if self._engine:
            self._engine.flag_load_abort()

    def adjust_store_cache_cap(self, level: PressureLevel) -> int:
        engine = self._engine
        return engine.adjust_store_cache_cap(level) if engine else 0

    def adjust_batch_cap(self, level: PressureLevel) -> int:
        engine = self._engine
        return engine.adjust_batch_cap(level) if engine else 0

    def set_limits(self, ceiling_bytes: int, abort_cap_bytes: int, non_mlx_bytes: int,
                   tier: Tier) -> None:
        """This tick's limits. The first time the model is ready, its prefill guard is
        made (its KV size is known only then) and handed to the engine."""
        engine = self._engine
        if self.guard is None:
            if engine is None or self.entry.state is not ModelState.READY:
                return
            self.guard = self._make_guard(self.entry)
            engine.on_prefill_abort = self._report
            engine.prefill_planner = self.guard
        self.guard.update(ceiling_bytes, abort_cap_bytes, non_mlx_bytes, tier)

    def mlx_sample(self) -> MlxFigures | None:
        engine = self._engine
        return _figures(engine.mlx_sample()) if engine else None


class PoolAdapter:
    """The model pool as the executor sees it (`memory.protocols.EnginePool`).

    It also equips every engine once it is ready: a prefill guard sized from the
    memory settings, and the report of pre-chunk aborts to the governor.
    """

    def __init__(self, pool: ModelPool, figures: Figures, *, min_chunk: int,
                 max_chunk: int, clock: Callable[[], float] = time.monotonic) -> None:
        # `clock` must be the pool's (it stamps `ModelEntry.loaded_at`): both default
        # to time.monotonic.
        self._pool = pool
        self._clock = clock
        self._figures = figures
        self._min_chunk = min_chunk
        self._max_chunk = max_chunk
        self._handles: dict[str, EngineHandleAdapter] = {}
        self.report: Callable[[PrefillAborted], None] | None = None

    def handles(self) -> list[EngineHandleAdapter]:
        live = [e for e in self._pool.entries()
                if e.state in (ModelState.LOADING, ModelState.READY) and e.engine is not None]
        for e in live:
            h = self._handles.get(e.model_id)
            if h is None or h.engine is not e.engine:
                self._handles[e.model_id] = EngineHandleAdapter(
                    e, self._figures, self._make_guard, self._on_prefill_abort, self._clock)
        return [self._handles[e.model_id] for e in live]

    def _make_guard(self, entry: ModelEntry) -> PrefillGuard:
        step = self._pool.settings.prefill_step_size
        figures = PrefillFigures(entry.kv_bytes_per_token, entry.attention_heads,
                                 entry.prefill_conversion)
        return PrefillGuard(figures, self._min_chunk, min(self._max_chunk, step))

    def _on_prefill_abort(self, r: PrefillAbortReport) -> None:
        # On the engine thread: hand the record to the governor (it moves it to the loop).
        if self.report is not None:
            self.report(PrefillAborted(r.model_id, r.request_id, r.prompt_tokens,
                                       r.remaining_tokens, r.chunk_tokens))

    def eviction_blocker(self, model_id: str) -> str | None:
        entry = self._pool.get(model_id)
        if entry.pinned:
            return "pinned since the decision"
        if entry.busy:
            return "busy since the decision"
        if entry.state != ModelState.READY:
            return f"{entry.state.name.lower()} since the decision"
        return None

    async def unload(self, model_id: str, reason: str) -> tuple[int, list[str]]:
        result = await self._pool.unload(model_id, force=True, reason=reason)
        return result.freed_bytes, list(result.ended_request_ids)

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        self._pool.mark_pending_unload(model_id, reason)
