"""The ceiling: the moving hard limit, recomputed from every reading.

ceiling = min over the terms that are available:

- ``static``    total RAM − reserve(tier, total)
- ``dynamic``   own usage + what the system can still give (not for tier custom):
                 macOS vm stats: footprint + free + inactive + active × ratio(tier);
                 elsewhere: footprint + available (Linux "available" already
                 counts reclaimable page cache, so no active share is added)
- ``container`` cgroup limit − min(tier reserve, 10 % of the limit)
- ``device``    the Metal recommended working set / CUDA device memory
- ``custom``    the operator's gigabytes (tier custom)
- ``operator``  an explicit operator cap (any tier)

The abort cap is the same minimum without the dynamic term: a stable figure
that does not jitter with the page cache, used to kill in-flight prefill.
Pure: readings and config in, `Limits` out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memory.config import MemoryConfig
from memory.levels import Tier, active_reclaim_ratio, container_reserve_bytes, static_reserve_bytes
from memory.readings import MemoryReadings

TERM_STATIC = "static"
TERM_DYNAMIC = "dynamic"
TERM_CONTAINER = "container"
TERM_DEVICE = "device"
TERM_CUSTOM = "custom"
TERM_OPERATOR = "operator"
# Tie-break order when two terms are equal: the more explainable one binds.
TERM_ORDER = (TERM_STATIC, TERM_CONTAINER, TERM_DEVICE, TERM_CUSTOM, TERM_OPERATOR, TERM_DYNAMIC)


@dataclass(frozen=True)
class Limits:
    ceiling_bytes: int
    soft_bytes: int
    hard_bytes: int
    abort_cap_bytes: int
    binding_term: str
    abort_binding_term: str
    terms: dict[str, int] = field(default_factory=dict)
    tier: Tier = Tier.BALANCED
    soft_fraction: float = 0.90
    hard_fraction: float = 0.95

    def headroom_bytes(self, usage_bytes: int) -> int:
        """Bytes left under the ceiling (negative when over)."""
        return self.ceiling_bytes - usage_bytes


def dynamic_term(readings: MemoryReadings, tier: Tier) -> int | None:
    """Own usage + what the system can still give; None for custom or when unknown."""
    ratio = active_reclaim_ratio(tier)
    if ratio is None:
        return None
    own = readings.own_bytes
    vm = (readings.system_free_bytes, readings.system_inactive_bytes, readings.system_active_bytes)
    if all(v is not None for v in vm):
        free, inactive, active = (int(v) for v in vm)  # type: ignore[arg-type]
        return own + free + inactive + int(active * ratio)
    available = readings.system_available_bytes
    limit, used = readings.container_limit_bytes, readings.container_usage_bytes
    if limit is not None and used is not None:
        # Inside a container, what can still be given is its own headroom: a
        # neighbour in the same cgroup (or a balloon) shrinks it.
        headroom = max(0, limit - used)
        available = headroom if available is None else min(available, headroom)
    if available is not None:
        return own + available
    return None


def limit_terms(readings: MemoryReadings, config: MemoryConfig) -> dict[str, int]:
    """Every available term of the ceiling, by name."""
    total = readings.system_total_bytes
    tier = config.tier
    terms: dict[str, int] = {TERM_STATIC: total - static_reserve_bytes(tier, total)}
    dynamic = dynamic_term(readings, tier)
    if dynamic is not None:
        terms[TERM_DYNAMIC] = dynamic
    limit = readings.container_limit_bytes
    if limit is not None:
        terms[TERM_CONTAINER] = limit - container_reserve_bytes(tier, total, limit)
    if readings.device_limit_bytes is not None:
        terms[TERM_DEVICE] = readings.device_limit_bytes
    custom = config.custom_ceiling_bytes
    if tier is Tier.CUSTOM and custom is not None:
        terms[TERM_CUSTOM] = custom
    if config.operator_cap_bytes is not None:
        terms[TERM_OPERATOR] = config.operator_cap_bytes
    return {name: max(1, value) for name, value in terms.items()}


def _binding(terms: dict[str, int]) -> tuple[str, int]:
    name = min(terms, key=lambda n: (terms[n], TERM_ORDER.index(n)))
    return name, terms[name]


def compute_limits(readings: MemoryReadings, config: MemoryConfig) -> Limits:
    terms = limit_terms(readings, config)
    binding, ceiling = _binding(terms)
    stable = {k: v for k, v in terms.items() if k != TERM_DYNAMIC}
    abort_binding, abort_cap = _binding(stable)
    soft_fraction = config.effective_soft_fraction
    hard_fraction = config.effective_hard_fraction
    return Limits(
        ceiling_bytes=ceiling,
        soft_bytes=int(ceiling * soft_fraction),
        hard_bytes=int(ceiling * hard_fraction),
        abort_cap_bytes=abort_cap,
        binding_term=binding,
        abort_binding_term=abort_binding,
        terms=terms,
        tier=config.tier,
        soft_fraction=soft_fraction,
        hard_fraction=hard_fraction,
    )
