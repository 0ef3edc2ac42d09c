"""Request metrics (instruments from `telemetry.instruments`): admissions by verdict,
requests running and waiting, time to first token, tokens generated; the service's
memory gauges the governor does not register itself (marks, reservations, model bytes);
how the loaded models' prefill chunks ran (engine/fast_prefill.py); and which BLAS the
process loaded (engine/blas.py).

Every provider here reads a figure already held (the governor's last reading, the
pool's measured sizes): a scrape runs them on the metrics listener's thread."""

from __future__ import annotations

from collections.abc import Callable

from engine import blas
from engine.pool import ModelPool, ModelState
from memory.governor import Governor
from sessions.reservations import ReservationBook
from telemetry import names
from telemetry.instruments import Instruments, instruments

# Models that hold their memory: loaded, or unloading but not yet gone.
_HOLDING = (ModelState.READY, ModelState.UNLOADING)


class RequestMetrics:
    def __init__(self, counts: Callable[[], tuple[int, int]],
                 inst: Instruments | None = None) -> None:
        """`counts` returns (running, waiting) across the loaded models."""
        self._inst = inst or instruments()
        self._counts = counts
        self._inst.running.register(self, lambda m: m._counts()[0])
        self._inst.waiting.register(self, lambda m: m._counts()[1])

    def admitted(self, verdict: str, model: str) -> None:
        self._inst.admissions.add(1, {names.ATTR_VERDICT: verdict, names.ATTR_MODEL: model})

    def finished(self, model: str, ttft_s: float, tokens: int) -> None:
        self._inst.ttft.record(ttft_s, {names.ATTR_MODEL: model})
        self._inst.tokens.add(tokens, {names.ATTR_MODEL: model})


def _soft_mark(g: Governor) -> int | None:
    limits = g.limits
    return limits.soft_bytes if limits is not None else None


def _hard_mark(g: Governor) -> int | None:
    limits = g.limits
    return limits.hard_bytes if limits is not None else None


def loaded_model_bytes(pool: ModelPool) -> dict[str, int]:
    """Measured bytes by model id, for the models holding memory now."""
    return {e.model_id: e.measured_bytes for e in pool.entries() if e.state in _HOLDING}


def prefill_products(pool: ModelPool) -> dict[tuple[str, str], int]:
    """Layer products of prefill chunks by (model id, path) for the models holding memory:
    the engine thread's counts in each model's fast-prefill plan (read, not locked: a
    scrape sees them at most a chunk behind)."""
    out: dict[tuple[str, str], int] = {}
    for e in pool.entries():
        plan = e.engine.fast_prefill if e.engine is not None else None
        if e.state in _HOLDING and plan is not None and plan.layers:
            out[(e.model_id, "converted")] = plan.converted
            out[(e.model_id, "kernel")] = plan.through_kernel
    return out


def register_memory_gauges(governor: Governor, reservations: ReservationBook,
                           pool: ModelPool, inst: Instruments | None = None) -> None:
    """Providers for the soft and hard marks, reserved bytes, per-model bytes and
    prefill products (each held weakly by its instrument, like every provider)."""
    inst = inst or instruments()
    inst.soft_mark.register(governor, _soft_mark)
    inst.hard_mark.register(governor, _hard_mark)
    inst.reserved.register(reservations, lambda r: r.reserved_bytes())
    inst.model_bytes.register(pool, loaded_model_bytes)
    inst.prefill_products.register(pool, prefill_products)


def blas_series() -> dict[tuple[str, str, str, str], int]:
    """plimsoll_blas_info's one series: the BLAS chosen at start (name, version, whether
    it is an optimized one, threads of one call), valued 1 like any info metric."""
    s = blas.state()
    return {(s.name, s.version, "true" if s.optimized else "false", str(s.threads)): 1}


def register_blas_info(inst: Instruments | None = None) -> None:
    """The provider of plimsoll_blas_info, once per process: the process has one BLAS,
    so its owner is engine/blas.py itself (services built again in one process, as the
    tests build them, replace it rather than add a series of 2)."""
    (inst or instruments()).blas_info.register(blas, lambda _blas: blas_series())
