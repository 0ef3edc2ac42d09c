"""The one executor: the only code that touches the pool, the engines and the bank for memory.

`measure()` builds a `Snapshot` (readings with the engines' own MLX samples,
engine views, the bank's figures); `perform()` carries out one action;
`preview()` predicts what an action would free without doing it (Admit's dry
run). It decides nothing: plans decide (`memory.plans`), the governor drives.
Everything here is reached through `memory.protocols`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from memory import actions as act
from memory.actions import Action, Outcome
from memory.plans.steps import AdmissionQuery, Snapshot
from memory.protocols import AdmissionDesk, EngineHandle, EnginePool, ReadingsSource, SessionTier
from memory.readings import MemoryReadings, MlxFigures
from memory.views import EngineState, EngineView

log = logging.getLogger(__name__)

# A sample older than this is not a reading of now: usage falls back to the footprint.
MAX_SAMPLE_AGE_S = 2.0
# How long a measurement after a freeing action waits for an engine's next sample.
FRESH_SAMPLE_WAIT_S = 0.25
# How long an admission reclaim waits for the engines to drain their pools.
RECLAIM_WAIT_S = 0.5

AuxCache = Callable[[], int]
"""Clears one cheap auxiliary cache the server keeps; returns bytes freed (0 if unknown)."""


@dataclass
class PreviewContext:
    """What earlier steps of one dry run assumed done, so later steps plan on top."""

    evicted_keys: list[object] = field(default_factory=list)
    evicted_models: set[str] = field(default_factory=set)
    pool_reclaimed: bool = False


class Executor:
    def __init__(
        self,
        reader: ReadingsSource,
        pool: EnginePool,
        *,
        bank: SessionTier | None = None,
        desk: AdmissionDesk | None = None,
        aux_caches: Mapping[str, AuxCache] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reader = reader
        self._pool = pool
        self._bank = bank
        self._desk = desk
        self._aux = dict(aux_caches or {})
        self._clock = clock
        self._handles: dict[str, EngineHandle] = {}
        # (taken at, readings, engine views, MLX sample time) of the last measurement
        self._last: tuple[float, MemoryReadings, tuple[EngineView, ...], float | None] | None = None

    @property
    def aux_cache_names(self) -> tuple[str, ...]:
        return tuple(self._aux)

    # -- measuring ------------------------------------------------------------------
    async def measure(self, query: AdmissionQuery | None = None,
                      fresh_after: float = float("-inf"), max_age_s: float = 0.0,
                      keep: bool = True) -> Snapshot:
        """Readings now. MLX figures come from the engines' samples taken after
        `fresh_after` (the end of the last action that freed memory) and not older
        than MAX_SAMPLE_AGE_S; an engine with no such sample is asked for one.

        `max_age_s`: readings taken at most this long ago (and after `fresh_after`)
        may serve again, so a burst of admissions shares one; the bank's figures for
        the query are always fresh. `keep`: remember the engines and the readings for
        the actions that follow (a preview keeps nothing)."""
        now = self._clock()
        last = self._last
        if (max_age_s > 0 and last is not None and now - last[0] <= max_age_s
                and last[0] >= fresh_after):
            _, readings, views, mlx_at = last
        else:
            try:
                handles = list(self._pool.handles())
            except Exception:
                log.exception("engine pool handles() failed; measuring without engines")
                handles = []
            views = tuple(self._view(h) for h in handles)
            mlx = await self._mlx_figures(handles, views, fresh_after)
            readings = self._reader.read(mlx)
            mlx_at = mlx.at if mlx is not None else None
            if keep:
                self._handles = {h.model_id: h for h in handles}
                self._last = (self._clock(), readings, views, mlx_at)
        bank = self._bank
        figures = None
        pinned: tuple[str, ...] = ()
        desk = self._desk
        if desk is not None:
            pinned = desk.pinned_sessions()
        more: tuple = ()
        if query is not None and bank is not None:
            figures = bank.figures(query.model, query.prompt_tokens, pinned)
            more = tuple(bank.figures(q.model, q.prompt_tokens, pinned) for q in query.more)
        return Snapshot(
            readings=readings,
            engines=views,
            session_bytes=bank.total_bytes() if bank is not None else None,
            bank_max_bytes=bank.max_bytes if bank is not None else None,
            sessions_expired=bank.expired_count() if bank is not None else 0,
            bank=figures,
            more_banks=more,
            reserved_bytes=desk.reserved_bytes() if desk is not None else 0,
            queue=desk.queue_view() if desk is not None else None,
            pinned_sessions=pinned,
            mlx_sampled_at=mlx_at,
        )

    async def _mlx_figures(self, handles: Sequence[EngineHandle], views: Sequence[EngineView],
                           fresh_after: float) -> MlxFigures | None:
        now = self._clock()

        async def sample_of(handle: EngineHandle, view: EngineView) -> MlxFigures | None:
            try:
                sample = handle.mlx_sample()
                stale = (sample is None or sample.at < fresh_after
                         or now - sample.at > MAX_SAMPLE_AGE_S)
                if stale and not view.loading:  # a loading engine samples only when done
                    sample = await handle.fresh_sample(FRESH_SAMPLE_WAIT_S)
            except Exception:
                log.exception("engine %s MLX sample failed", handle.model_id)
                return None
            if sample is None or sample.at < fresh_after or now - sample.at > MAX_SAMPLE_AGE_S:
                return None
            return sample

        got = await asyncio.gather(*(sample_of(h, v) for h, v in zip(handles, views, strict=True)))
        fresh = [s for s in got if s is not None]
        if not fresh:
            return None
        # MLX's allocator is process-wide: each engine reports the same figures at
        # different moments; the largest is the safe one.
        device = next((s for s in fresh if s.device_limit_bytes), None)
        return MlxFigures(max(s.active_bytes for s in fresh), max(s.pool_bytes for s in fresh),
                          min(s.at for s in fresh),
                          device.device_limit_bytes if device else None,
                          device.device_source if device else None)

    @staticmethod
    def _view(handle: EngineHandle) -> EngineView:
        try:
            return handle.view()
        except Exception:
            # Unknown state: never evict it blind (pinned), keep polling fast (busy).
            log.exception("engine %s view() failed", handle.model_id)
            return EngineView(model_id=handle.model_id, state=EngineState.READY, pinned=True,
                              active_requests=None)

    def _newest_sample(self) -> MlxFigures | None:
        """MLX's pool is process-wide: the newest sample of any engine is the pool as it
        stands (another engine's reclaim may have emptied it since this one sampled)."""
        samples = []
        for h in self._handles.values():
            try:
                sample = h.mlx_sample()
            except Exception:
                log.exception("engine %s MLX sample failed", h.model_id)
                continue
            if sample is not None:
                samples.append(sample)
        return max(samples, key=lambda s: s.at, default=None)

    def _handle(self, model_id: str) -> EngineHandle:
        handle = self._handles.get(model_id)
        if handle is None:
            raise LookupError(f"no engine handle for model {model_id!r}")
        return handle

    # -- doing ------------------------------------------------------------------------
    async def perform(self, action: Action) -> Outcome:
        try:
            return await self._perform(action)
        except Exception as exc:
            log.exception("memory action %r failed", action)
            return Outcome.failed(action, f"{type(exc).__name__}: {exc}")

    async def _perform(self, action: Action) -> Outcome:
        match action:
            case act.AdjustStoreCacheCap(model_id=m, level=level):
                return Outcome(action, value=int(self._handle(m).adjust_store_cache_cap(level)))
            case act.AdjustBatchCap(model_id=m, level=level):
                return Outcome(action, value=int(self._handle(m).adjust_batch_cap(level)))
            case act.PropagateLimits():
                failed = [h.model_id for h in self._handles.values()
                          if not self._set_limits(h, action)]
                if failed:
                    return Outcome.failed(action, f"set_limits failed on {', '.join(failed)}")
                return Outcome(action)
            case act.ClearAuxCaches():
                return Outcome(action, bytes_freed=self._clear_aux())
            case act.PressureReclaim(model_id=m, wait=wait):
                handle = self._handle(m)
                before = self._newest_sample()
                accepted = bool(handle.request_pressure_reclaim())
                if not (wait and accepted):
                    return Outcome(action, accepted=accepted)
                after = await handle.fresh_sample(RECLAIM_WAIT_S)
                freed = (max(0, before.pool_bytes - after.pool_bytes)
                         if before is not None and after is not None else 0)
                return Outcome(action, accepted=accepted, bytes_freed=freed)
            case act.IdleReclaim(model_id=m):
                self._handle(m).request_idle_reclaim()
                return Outcome(action, accepted=True)
            case act.ShrinkSessionCache():
                return self._shrink(action)
            case act.ExpireSessions():
                if self._bank is None:
                    return Outcome(action, entries=0, bytes_freed=0)
                before = self._bank.total_bytes()
                n = self._bank.expire_idle()
                return Outcome(action, entries=n, bytes_freed=max(0, before - self._bank.total_bytes()))
            case act.EvictModel(model_id=m):
                # The plan decided from a snapshot: a Pin or a request may have come since.
                blocker = self._pool.eviction_blocker(m)
                if blocker is not None:
                    return Outcome(action, skipped=blocker)
                freed, ended = await self._pool.unload(m, action.reason)
                return Outcome(action, bytes_freed=int(freed), request_ids=tuple(ended))
            case act.AbortRequests(model_id=m, request_ids=ids, reason=reason):
                ended = await self._handle(m).abort_requests(
                    reason, list(ids) if ids is not None else None)
                if not ended:  # nothing was running (a queued request is not in the batch)
                    return Outcome(action, skipped="no running requests")
                return Outcome(action, request_ids=tuple(ended))
            case act.MarkPendingUnload(model_id=m, reason=reason):
                self._pool.mark_pending_unload(m, reason)
                return Outcome(action)
            case act.AbortLoad(model_id=m):
                self._handle(m).flag_load_abort()
                return Outcome(action)
            case act.PauseAdmission(level=level):
                if self._desk is not None:
                    self._desk.set_paused(level)
                return Outcome(action)
            case act.ResumeAdmission():
                if self._desk is not None:
                    self._desk.set_paused(None)
                return Outcome(action)
            case act.Refuse() | act.PrefillAborted() | act.Transition():
                return Outcome(action)  # recorded by the governor; nothing to touch
        raise TypeError(f"unknown memory action {action!r}")

    @staticmethod
    def _set_limits(handle: EngineHandle, action: act.PropagateLimits) -> bool:
        # One engine failing must not leave the others without this tick's limits.
        try:
            handle.set_limits(action.ceiling_bytes, action.abort_cap_bytes,
                              action.non_mlx_bytes, action.tier)
        except Exception:
            log.exception("engine %s: set_limits failed", handle.model_id)
            return False
        return True

    def _shrink(self, action: act.ShrinkSessionCache) -> Outcome:
        bank = self._bank
        if bank is None:
            return Outcome(action, entries=0, bytes_freed=0)
        before = bank.total_bytes()
        if action.mode is act.ShrinkMode.FOR_ADMISSION:
            nt, t = bank.shrink_for_admission(
                action.target_bytes, protect_tokens=action.protect_tokens, model=action.model,
                reason=action.reason, protect_active=action.protect_active,
                protect_session_ids=action.protect_session_ids)
            return Outcome(action, entries=nt + t, non_terminal=nt, terminal=t,
                           bytes_freed=max(0, before - bank.total_bytes()))
        n = bank.shrink_to_bytes(action.target_bytes, protect_active=action.protect_active,
                                 reason=action.reason,
                                 protect_session_ids=action.protect_session_ids)
        return Outcome(action, entries=n, bytes_freed=max(0, before - bank.total_bytes()))

    def _clear_aux(self) -> int:
        freed = 0
        for name, clear in self._aux.items():
            try:
                freed += int(clear() or 0)
            except Exception:
                log.exception("auxiliary cache %s: clear failed", name)
        return freed

    # -- predicting -----------------------------------------------------------------------
    def preview(self, action: Action, snap: Snapshot, ctx: PreviewContext) -> Outcome:
        """What `action` would free now, on top of what `ctx` already assumed."""
        match action:
            case act.PressureReclaim():
                freed = 0 if ctx.pool_reclaimed else snap.readings.pool_bytes
                ctx.pool_reclaimed = True
                return Outcome(action, accepted=True, bytes_freed=freed, preview=True)
            case act.ShrinkSessionCache() if self._bank is not None:
                entries, freed, keys = self._bank.preview_freed(
                    action.target_bytes, mode=action.mode.value,
                    protect_active=action.protect_active, protect_tokens=action.protect_tokens,
                    model=action.model, protect_session_ids=action.protect_session_ids,
                    assume_evicted=ctx.evicted_keys)
                ctx.evicted_keys.extend(keys)
                return Outcome(action, entries=entries, bytes_freed=freed, preview=True)
            case act.EvictModel(model_id=m):
                blocker = self._pool.eviction_blocker(m)
                if blocker is not None or m in ctx.evicted_models:
                    return Outcome(action, skipped=blocker or "already assumed", preview=True)
                ctx.evicted_models.add(m)
                view = next((e for e in snap.engines if e.model_id == m), None)
                freed = view.measured_bytes or 0 if view is not None else 0
                return Outcome(action, bytes_freed=freed, preview=True)
        return Outcome(action, preview=True)
