"""The enforcer's view of the engines: `memory.protocols` implemented over the model pool.

`memory` knows nothing of engines and `engine` nothing of the enforcer; this
module is the narrow bridge between them. Everything here is cheap and never
touches MLX: it reads the engines' own samples and sets their flags.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from engine.errors import Aborted
from engine.pool import ModelEntry, ModelPool, ModelState
from memory.ceiling import Limits
from memory.chunking import PrefillCostModel, plan_chunk, should_abort_before_chunk
from memory.levels import PressureLevel, Tier
from memory.readings import MemoryReadings
from memory.store_cache import next_cap
from memory.views import EngineState, EngineView, RequestView

log = logging.getLogger(__name__)

_STATES = {
    ModelState.LOADING: EngineState.LOADING,
    ModelState.READY: EngineState.READY,
    ModelState.UNLOADING: EngineState.UNLOADING,
}

# (usage, ceiling) of the latest tick, for the figures an aborted client receives.
Figures = Callable[[], tuple[int, int]]


class EngineHandleAdapter:
    """One model as the enforcer sees it (`memory.protocols.EngineHandle`)."""

    def __init__(self, entry: ModelEntry, figures: Figures) -> None:
        self.model_id = entry.model_id
        self._entry = entry
        self._figures = figures

    def view(self) -> EngineView:
        e = self._entry
        engine = e.engine
        stats = engine.stats if engine else None
        kv = e.kv_bytes_per_token or 0
        requests: tuple[RequestView, ...] = ()
        active = 0
        if stats is not None:
            active = stats.active_requests + stats.waiting_requests
            requests = tuple(
                RequestView(rid, started, tokens * kv if kv else None)
                for rid, started, tokens in zip(
                    stats.request_ids, stats.request_started, stats.request_tokens,
                    strict=False,
                )
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
            store_cache_cap=engine.batch_cap if engine else 1,
            max_num_seqs=engine.settings.max_num_seqs if engine else 1,
        )

    def request_pressure_reclaim(self) -> bool:
        engine = self._entry.engine
        return engine.request_pressure_reclaim() if engine else False

    def request_idle_reclaim(self) -> None:
        if self._entry.engine:
            self._entry.engine.request_idle_reclaim()

    def abort_requests(self, reason: str, request_ids: Sequence[str] | None = None) -> list[str]:
        engine = self._entry.engine
        if engine is None:
            return []
        usage, ceiling = self._figures()
        error = Aborted(
            f"aborted by the memory enforcer ({reason}): usage {usage} bytes, "
            f"ceiling {ceiling} bytes",
            reason="MEMORY_PRESSURE",
            retry_after_s=2.0,
            metadata={"usage_bytes": str(usage), "ceiling_bytes": str(ceiling),
                      "enforcer_reason": reason, "model": self.model_id},
        )
        current = set(engine.stats.request_ids)
        ids = list(current) if request_ids is None else [r for r in request_ids if r in current]
        engine.abort(error, None if request_ids is None else ids)
        return ids

    def flag_load_abort(self) -> None:
        if self._entry.engine:
            self._entry.engine.flag_load_abort()

    def adjust_store_cache_cap(self, level: PressureLevel) -> int:
        engine = self._entry.engine
        if engine is None:
            return 0
        engine.batch_cap = next_cap(engine.batch_cap, engine.settings.max_num_seqs, level)
        return engine.batch_cap

    def mlx_sample(self) -> tuple[int, int] | None:
        engine = self._entry.engine
        if engine is None or not engine.stats.sampled_at:
            return None
        return engine.stats.mlx_active_bytes, engine.stats.mlx_pool_bytes


class PoolAdapter:
    """The model pool as the enforcer sees it (`memory.protocols.EnginePool`)."""

    def __init__(self, pool: ModelPool, figures: Figures) -> None:
        self._pool = pool
        self._figures = figures
        self._handles: dict[str, EngineHandleAdapter] = {}

    def handles(self) -> list[EngineHandleAdapter]:
        live = [e for e in self._pool.entries()
                if e.state in (ModelState.LOADING, ModelState.READY) and e.engine is not None]
        for e in live:
            h = self._handles.get(e.model_id)
            if h is None or h._entry is not e:
                self._handles[e.model_id] = EngineHandleAdapter(e, self._figures)
        return [self._handles[e.model_id] for e in live]

    async def unload(self, model_id: str, reason: str) -> int:
        # The tick decided from a snapshot: a Pin or a request may have arrived since.
        entry = self._pool.get(model_id)
        if entry.pinned or entry.busy or entry.state != ModelState.READY:
            log.info("not evicting %s (%s): pinned, busy or not ready since the tick",
                     model_id, reason)
            return 0
        result = await self._pool.unload(model_id, force=True, reason=reason)
        return result.freed_bytes

    def mark_pending_unload(self, model_id: str, reason: str) -> None:
        entry = self._pool.get(model_id)
        entry.pending_unload_reason = reason
        if not entry.busy:
            asyncio.ensure_future(self._pool.unload_if_pending(model_id))


class PrefillGuard:
    """`engine.model_engine.PrefillPlanner` over `memory.chunking`: chunk sizes shrink
    as projected usage nears the tier's fraction of the stable abort cap.

    The service refreshes the limits every enforcer tick; the engine thread asks for
    a plan before each prefill step with its own MLX sample, so nothing here calls MLX.
    """

    def __init__(self, kv_bytes_per_token: int, min_chunk: int, max_chunk: int) -> None:
        # Static floor: the KV itself plus attention scratch of a few rows per token.
        self.cost = PrefillCostModel(static_bytes_per_token=max(1, kv_bytes_per_token * 4))
        self.min_chunk = min_chunk
        self.max_chunk = max_chunk
        self.tier: Tier | None = None
        self.abort_cap = 0
        self.non_mlx_bytes = 0  # process usage beyond MLX active, at the last tick

    def update(self, readings: MemoryReadings, limits: Limits) -> None:
        self.non_mlx_bytes = max(0, readings.process_bytes - (readings.mlx_active_bytes or 0))
        self.abort_cap = limits.abort_cap_bytes
        self.tier = limits.tier

    def plan(self, mlx_active_bytes: int, remaining_tokens: int) -> tuple[int, bool]:
        if self.tier is None:
            return min(self.max_chunk, remaining_tokens), False
        usage = self.non_mlx_bytes + mlx_active_bytes
        per_token = self.cost.bytes_per_token
        chunk = plan_chunk(tier=self.tier, abort_cap_bytes=self.abort_cap, usage_bytes=usage,
                           bytes_per_token=per_token, remaining_tokens=remaining_tokens,
                           min_chunk=self.min_chunk, max_chunk=self.max_chunk)
        abort = should_abort_before_chunk(tier=self.tier, abort_cap_bytes=self.abort_cap,
                                          usage_bytes=usage, chunk_tokens=chunk,
                                          bytes_per_token=per_token)
        return chunk, abort

    def observe(self, tokens: int, bytes_delta: int) -> None:
        self.cost = self.cost.observe(tokens, bytes_delta)
