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

from engine.pool import ModelPool
from memory.config import MemoryConfig
from memory.executor import Executor
from memory.governor import Governor
from memory.plans.admission import AdmissionSettings, validate_scheduler_settings
from memory.protocols import PressureSink, ReadingsSource
from memory.readings import MemoryReader
from service.aux_caches import server_aux_caches
from service.control import ControlPlane
from service.desk import AdmissionDesk
from service.engines import PoolAdapter
from service.generate import GeneratePipeline, PipelineSettings
from service.lifecycle import Lifecycle
from service.metrics import RequestMetrics, register_memory_gauges
from sessions.activity import ActiveSessions
from sessions.admission import queue_from_settings
from sessions.bank import SessionBank
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
        self.bank = SessionBank(
            max_bytes=s.bank_max_bytes, per_session_max_bytes=s.bank_per_session_max_bytes,
            max_entries=s.bank_max_entries, idle_ttl_s=s.bank_idle_ttl_s,
            active_sessions=self.active_sessions,
        )
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
        self.pipeline = GeneratePipeline(
            pool, self.governor, self.bank, self.queue, self.reservations,
            self.active_sessions,
            PipelineSettings(max_queued_requests=s.max_queued_requests,
                             default_max_tokens=s.default_max_tokens,
                             admission_timeout_s=s.admission_timeout_s,
                             session_bank=s.session_bank),
            self.lifecycle, self.metrics,
        )
        pool.on_finish_hook = self.pipeline.store_session
        self.control = ControlPlane(pool, self.governor, self.leases, self.bank, self.lifecycle)
        pool.load_guard = self.control.make_room_for_load
        pool.listeners.append(self.governor.wake)  # a load or unload changes the cadence
        pool.listeners.append(self.control.drop_sessions_of_unloaded_models)

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
