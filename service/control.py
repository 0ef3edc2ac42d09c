"""The control operations: pins and leases, model load and unload, sessions.

Memory decisions are not made here: a load asks the governor to make room
(`Governor.make_room_for_load`) and is refused with its numbers when it cannot.
"""

from __future__ import annotations

import asyncio
import contextlib

from engine.errors import (
    LEASE_LIMIT,
    MODEL_PINNED,
    FailedPrecondition,
    NotFound,
    ResourceExhausted,
    Unavailable,
    check_owner_quota,
)
from engine.pool import KeepAlive, ModelEntry, ModelPool, ModelState, UnloadResult
from memory.config import ModelLimits
from memory.governor import Governor
from service.lifecycle import Lifecycle, settle_heap
from sessions.bank import REASON_MODEL_UNLOADED, SessionBank
from sessions.cold_tier import ColdTier
from sessions.leases import HeldLease, Leases

# Leases one owner may hold at once (owner "" is one owner too): a bound on the
# lease table a single client can grow.
DEFAULT_MAX_LEASES_PER_OWNER = 64


class ControlPlane:
    def __init__(self, pool: ModelPool, governor: Governor, leases: Leases, bank: SessionBank,
                 lifecycle: Lifecycle, default_keep_alive: KeepAlive | None = None,
                 max_leases_per_owner: int = DEFAULT_MAX_LEASES_PER_OWNER) -> None:
        self.default_keep_alive = default_keep_alive or KeepAlive(None)
        self.max_leases_per_owner = max_leases_per_owner
        self.pool = pool
        self.governor = governor
        self.leases = leases
        self.bank = bank
        self.cold: ColdTier | None = None  # the session cold tier, when on
        self.lifecycle = lifecycle

    # -- models -----------------------------------------------------------------------
    async def load_model(self, source: str, model_id: str = "",
                         keep_alive: KeepAlive | None = None) -> ModelEntry:
        """Loads (or finds loaded) and sets its keep-alive: the request's, else the
        server's --keep-alive, as every LoadModel does."""
        if self.lifecycle.draining:
            raise Unavailable("server is draining", retry_after_s=1.0, reason="DRAINING")
        entry = await self.pool.load(source, model_id)
        entry.keep_alive_s = (keep_alive or self.default_keep_alive).seconds
        settle_heap()
        return entry

    async def unload_model(self, model_id: str, force: bool) -> tuple[UnloadResult, int]:
        """A pinned model unloads only with `force`, which releases its leases too
        -> (what the unload freed, leases released)."""
        entry = self.pool.get(model_id)
        if entry.pinned and not force:
            raise FailedPrecondition(
                f"model '{entry.model_id}' is pinned by {entry.pins} lease(s); "
                "set force to unload it and release them", MODEL_PINNED,
                resource_type="model", resource_name=entry.model_id)
        result = await self.pool.unload(model_id, force=force)
        released = [self.leases.unpin(h.lease_id) for h in self.leases.leases()
                    if h.lease.model_id == entry.model_id]
        self._recount_pins(entry.model_id)
        return result, len(released)

    async def make_room_for_load(self, entry: ModelEntry, estimate: int | None) -> None:
        """Before a load (the pool's load guard): evict idle LRU models down to the
        soft mark; refuse when the model cannot fit under the soft mark even then."""
        config = self.governor.config
        limited = config.model_limits != ModelLimits()
        if not limited and (estimate is None or not config.enabled):
            return  # a repository not downloaded yet: the tick handles what follows
        result = await self.governor.make_room_for_load(entry.model_id, estimate)
        refusal = result.refusal
        if refusal is not None:
            raise ResourceExhausted(
                refusal.message, reason=refusal.error_reason,
                retry_after_s=refusal.retry_after_s,
                metadata={**{k: str(v) for k, v in refusal.numbers.items()},
                          "binding": refusal.binding},
            )

    def drop_sessions_of_unloaded_models(self) -> None:
        """A pool listener: drop the bank's entries of every unloaded model."""
        # KV snapshots are only good with the weights that made them; however a model
        # went (UnloadModel, the governor, a pending unload), its cache goes too.
        for e in self.pool.entries():
            if e.state == ModelState.UNLOADED:
                self.bank.drop_model(e.model_id, reason=REASON_MODEL_UNLOADED)

    # -- pins ---------------------------------------------------------------------------
    async def pin_model(self, model_id: str, owner: str, ttl_s: float | None,
                        client_request_id: str = "") -> HeldLease:
        # A model the server does not know is NOT_FOUND: only LoadModel, with a
        # source, fetches or loads anything new.
        entry = self.pool.get(model_id)
        again = self.leases.retried(client_request_id, model_id=entry.model_id)
        if again is not None:
            return again
        self._check_lease_quota(owner)
        while entry.state == ModelState.UNLOADING:
            await asyncio.sleep(0.05)  # let the unload finish, then load it again
        if entry.state == ModelState.UNLOADED:
            # Pinning a known, unloaded model loads it again from its source.
            entry = await self.load_model(entry.source, entry.model_id,
                                          KeepAlive(entry.keep_alive_s))  # kept as it was
        again = self.leases.retried(client_request_id, model_id=entry.model_id)
        if again is not None:  # the same retry raced this one through the load
            return again
        lease = self.leases.pin_model(entry.model_id, owner, ttl_s, client_request_id)
        self._recount_pins(entry.model_id)
        self._expire_after(ttl_s)
        return lease

    def pin_session(self, session_id: str, owner: str, ttl_s: float | None,
                    client_request_id: str = "") -> HeldLease:
        again = self.leases.retried(client_request_id, session_id=session_id)
        if again is not None:
            return again
        self._check_lease_quota(owner)
        lease = self.leases.pin_session(session_id, owner, ttl_s, client_request_id)
        self._expire_after(ttl_s)
        return lease

    def _check_lease_quota(self, owner: str) -> None:
        check_owner_quota(owner, self.leases.owner_count(owner), self.max_leases_per_owner,
                          what="leases", flag="--max-leases-per-owner", reason=LEASE_LIMIT,
                          remedy="unpin some, or let their TTLs run out")

    def unpin(self, lease_id: str) -> HeldLease:
        held = self.leases.unpin(lease_id)
        if held is None:
            raise NotFound(f"lease '{lease_id}' is not held (expired or never taken)", "lease",
                           resource_name=lease_id)
        if held.lease.model_id:
            self._recount_pins(held.lease.model_id)
        return held

    def expire_leases(self) -> None:
        for held in self.leases.expire():
            if held.lease.model_id:
                self._recount_pins(held.lease.model_id)

    def _expire_after(self, ttl_s: float | None) -> None:
        # An expired lease unpins on time, not at the next (maybe 10 s away) tick.
        if ttl_s:
            asyncio.get_running_loop().call_later(ttl_s + 0.01, self.expire_leases)

    def _recount_pins(self, model_id: str) -> None:
        with contextlib.suppress(NotFound):
            self.pool.get(model_id).pins = self.leases.model_count(model_id)

    # -- sessions -----------------------------------------------------------------------
    def drop_session(self, session_id: str) -> tuple[int, int]:
        entries, freed = self.bank.drop_session(session_id)
        if self.cold is not None:  # its disk copies go too
            disk_entries, disk_bytes = self.cold.drop_session(session_id)
            entries, freed = entries + disk_entries, freed + disk_bytes
        if not entries:
            raise NotFound(f"session '{session_id}' has no cached entries", "session",
                           resource_name=session_id)
        return entries, freed
