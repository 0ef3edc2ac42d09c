"""Assembly: build the service's parts and wire them together. Wiring only.

pool (engine threads) ─┐
session bank, leases,  ├─ executor ── governor ── publisher (WatchPressure)
reservations, queue ───┘      ▲           ▲
                              │           ├── GeneratePipeline (Generate, Admit)
                              └───────────┴── ControlPlane (pins, load/unload, sessions)
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path

from engine.pool import KeepAlive, ModelPool
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.governor import Governor
from memory.plans.admission import AdmissionSettings, validate_scheduler_settings
from memory.protocols import PressureSink, ReadingsSource
from memory.readings import MemoryReader
from memory.store_cache import StoreCacheGate
from service.aux_caches import server_aux_caches
from service.control import ControlPlane
from service.desk import AdmissionDesk
from service.engines import PoolAdapter
from service.generate import GeneratePipeline, PipelineSettings
from service.lifecycle import Lifecycle
from service.metrics import RequestMetrics, register_blas_info, register_memory_gauges
from sessions.activity import ActiveSessions
from sessions.admission import queue_from_settings
from sessions.bank import SessionBank
from sessions.cold_tier import REASON_SHUTDOWN, ColdTier, ColdTierSettings, compat_of
from sessions.leases import Leases
from sessions.reservations import ReservationBook

GIB = 1024**3


@dataclass
class ServiceSettings:
    max_queued_requests: int = 256  # requests in flight (running + waiting) per server
    default_max_tokens: int = PipelineSettings.default_max_tokens
    scheduler_mode: str = "default"
    admission_queue_limit: int = 32  # requests waiting for a slot while admission pauses
    admission_timeout_s: float = 30.0
    chain_shed: bool = True  # the admission-chain shed (shrink_for_admission)
    session_bank: bool = True
    bank_max_bytes: int = 8 * GIB
    bank_per_session_max_bytes: int = 4 * GIB
    bank_max_entries: int = 256
    bank_idle_ttl_s: float = 3600.0
    reservation_ttl_s: float = 30.0  # an Admit ticket's lifetime when the client sets none
    max_reservation_ttl_s: float = 300.0  # longer asks are clamped to this
    # LoadModel's keep-alive when the request sets none; None: kept loaded. Models
    # named at start are kept loaded either way.
    keep_alive_s: float | None = None
    max_leases_per_owner: int = 64  # Pin leases one owner may hold (service.control)
    max_reservations_per_owner: int = 64  # live Admit tickets one owner may hold
    max_sessions_per_owner: int | None = None  # sessions one owner keeps in the bank
    # The session cold tier (sessions/cold_tier.py): off unless a folder is given.
    session_disk_dir: str = ""
    session_disk_cap_bytes: int = 32 * GIB
    session_disk_write_bytes_per_hour: int | None = 16 * GIB
    session_disk_min_free_bytes: int = 2 * GIB
    session_disk_min_prefix_tokens: int = 64
    session_kv_bits: int = 0  # 8 or 4: bank snapshots (RAM and disk) quantized


@dataclass(frozen=True)
class AdmissionFigures:
    """Admission as status and WatchPressure report it."""

    paused: bool
    reserved_bytes: int
    reservations: int
    running: int
    waiting: int
    draining: bool
    session_bank_bytes: int


class Service:
    """Every part of a running Plimsoll, wired."""

    def __init__(self, pool: ModelPool, settings: ServiceSettings | None = None,
                 memory: MemoryConfig | None = None, sink: PressureSink | None = None,
                 reader: ReadingsSource | None = None) -> None:
        self.pool = pool
        self.settings = s = settings or ServiceSettings()
        self.memory_config = (memory or MemoryConfig()).validate()
        admission: AdmissionSettings = dataclasses.replace(
            validate_scheduler_settings(s.scheduler_mode, pool.settings.max_num_seqs,
                                        queue_limit=s.admission_queue_limit),
            chain_shed=s.chain_shed)
        self.lifecycle = Lifecycle()
        self.leases = Leases(time.monotonic)
        self.active_sessions = ActiveSessions(self.leases)
        self.cold: ColdTier | None = None
        if s.session_bank and s.session_disk_dir:
            self.cold = ColdTier(ColdTierSettings(
                directory=Path(s.session_disk_dir), cap_bytes=s.session_disk_cap_bytes,
                write_budget_bytes_per_hour=s.session_disk_write_bytes_per_hour,
                min_free_bytes=s.session_disk_min_free_bytes,
                min_prefix_tokens=s.session_disk_min_prefix_tokens, kv_bits=s.session_kv_bits),
                gate_for=self._store_gate, on_queue_full=lambda: self.governor.wake(),
            ).open()
        self.bank = SessionBank(
            max_bytes=s.bank_max_bytes, per_session_max_bytes=s.bank_per_session_max_bytes,
            max_entries=s.bank_max_entries, idle_ttl_s=s.bank_idle_ttl_s,
            active_sessions=self.active_sessions,
            on_evict=self.cold.offer if self.cold is not None else None,  # spill, not drop
            max_sessions_per_owner=s.max_sessions_per_owner,
        )
        if self.cold is not None:
            self.bank.cold_lookup = self.cold.restore_figures
        self.reservations = ReservationBook(time.monotonic, default_ttl_s=s.reservation_ttl_s,
                                            max_ttl_s=s.max_reservation_ttl_s)
        self.queue = queue_from_settings(admission)
        self.engines = PoolAdapter(pool, self.figures,
                                   min_chunk=self.memory_config.prefill_min_chunk_tokens,
                                   max_chunk=self.memory_config.prefill_max_chunk_tokens)
        self.reader = reader or MemoryReader()
        self.executor = executor = Executor(
            self.reader, self.engines,
            bank=self.bank if s.session_bank else None,
            desk=AdmissionDesk(self.queue, self.reservations, self.leases),
            aux_caches=server_aux_caches(pool),
        )
        self.governor = Governor(self.memory_config, executor, sink, admission=admission)
        self.engines.report = self.governor.report
        self.metrics = RequestMetrics(self._request_counts)
        register_memory_gauges(self.governor, self.reservations, pool)
        register_blas_info()
        self.pipeline = GeneratePipeline(
            pool, self.governor, self.bank, self.queue, self.reservations,
            self.active_sessions,
            PipelineSettings(max_queued_requests=s.max_queued_requests,
                             default_max_tokens=s.default_max_tokens,
                             admission_timeout_s=s.admission_timeout_s,
                             session_bank=s.session_bank,
                             session_kv_bits=s.session_kv_bits,
                             max_reservations_per_owner=s.max_reservations_per_owner),
            self.lifecycle, self.metrics,
        )
        self.pipeline.cold = self.cold
        pool.on_finish_hook = self.pipeline.store_session
        self.control = ControlPlane(pool, self.governor, self.leases, self.bank, self.lifecycle,
                                    KeepAlive(s.keep_alive_s), s.max_leases_per_owner)
        self.control.cold = self.cold
        pool.load_guard = self.control.make_room_for_load
        pool.listeners.append(self.governor.wake)  # a load or unload changes the cadence
        if self.cold is not None:  # before the drop below: an unloaded model's entries spill
            pool.listeners.insert(0, self._register_cold_models)
        pool.listeners.append(self.control.drop_sessions_of_unloaded_models)

    # -- the session cold tier ------------------------------------------------------------
    def _store_gate(self, model_id: str) -> StoreCacheGate | None:
        entry = next((e for e in self.pool.entries() if e.model_id == model_id), None)
        return entry.engine.store_gate if entry is not None and entry.engine else None

    def _register_cold_models(self) -> None:
        """A pool listener: tell the cold tier each loaded model's compatibility key (by
        content hash), which collects its files made with other weights."""
        cold = self.cold
        if cold is None:
            return
        for e in self.pool.entries():
            info = e.engine.info if e.engine is not None else None
            if info is None or not info.content_hash or cold.compat_for(e.model_id) is not None:
                continue
            dtype = str(info.config.get("torch_dtype") or info.config.get("dtype") or "unknown")
            cold.register_model(e.model_id, compat_of(info.content_hash, dtype,
                                                      self.settings.session_kv_bits))

    def close_cold_tier(self, timeout_s: float = 30.0) -> None:
        """At shutdown (off the loop): spill what the bank still holds, within the tier's
        budgets, and finish the queued writes, so a restart restores these sessions."""
        cold = self.cold
        if cold is None:
            return
        entries = self.bank.entries()
        entries.reverse()  # most recently used first: the budgets keep the freshest
        cold.offer_all(entries, REASON_SHUTDOWN, timeout_s)
        cold.close(timeout_s)

    @property
    def draining(self) -> bool:
        return self.lifecycle.draining

    def figures(self) -> tuple[int, int]:
        """(usage, ceiling) of the latest measurement, for abort statuses."""
        readings, limits = self.governor.readings, self.governor.limits
        if readings is None or limits is None:
            return 0, 0
        return readings.process_bytes, limits.ceiling_bytes

    def admission_figures(self) -> AdmissionFigures:
        running, waiting = self._request_counts()
        return AdmissionFigures(
            paused=self.governor.admission_paused,
            reserved_bytes=self.reservations.reserved_bytes(),
            reservations=len(self.reservations),
            running=running, waiting=waiting,
            draining=self.lifecycle.draining,
            session_bank_bytes=self.bank.total_bytes(),
        )

    def _request_counts(self) -> tuple[int, int]:
        engines = [e.engine for e in self.pool.entries() if e.engine is not None]
        running = sum(e.stats.active_requests for e in engines)
        waiting = sum(e.stats.waiting_requests for e in engines) + self.queue.waiting
        return running, waiting
