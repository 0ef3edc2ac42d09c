"""The engine's prefill planner over memory.chunking, with scripted readings."""

from memory.ceiling import compute_limits
from memory.config import MemoryConfig
from memory.levels import GIB, MIB
from memory.plans.tick import plan_propagate
from memory.readings import MemoryReadings
from service.engines import PrefillGuard


def guard_for(readings: MemoryReadings, config: MemoryConfig) -> PrefillGuard:
    """A guard updated the way the governor does it every tick (PropagateLimits)."""
    limits = compute_limits(readings, config)
    p = plan_propagate(readings, limits)
    g = PrefillGuard(kv_bytes_per_token=256 * 1024, min_chunk=32, max_chunk=2048)
    g.update(p.ceiling_bytes, p.abort_cap_bytes, p.non_mlx_bytes, p.tier)
    return g


def guard_at(process_bytes: int, mlx_active: int) -> PrefillGuard:
    config = MemoryConfig.from_mapping({"custom_ceiling_gib": 4})  # custom: fraction 0.95
    readings = MemoryReadings(process_bytes=process_bytes, system_total_bytes=64 * GIB,
                              mlx_active_bytes=mlx_active)
    return guard_for(readings, config)


def test_without_limits_the_step_is_the_max():
    g = PrefillGuard(kv_bytes_per_token=1024, min_chunk=32, max_chunk=512)
    assert g.plan(0, 10_000) == (512, False)
    assert g.plan(0, 100) == (100, False)


def test_chunk_shrinks_near_the_ceiling():
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)  # 512 MiB outside MLX
    roomy, abort = g.plan(512 * MIB, 100_000)
    assert not abort and roomy == 2048
    # 4 GiB * 0.95 (custom) = 3.8 GiB target; 1 MiB per token (256 KiB KV x 4).
    tight, abort = g.plan(int(3.7 * GIB) - 512 * MIB, 100_000)
    assert not abort
    assert tight == int((0.95 * 4 * GIB - 3.7 * GIB) // MIB)
    assert 32 <= tight < 2048


def test_aborts_when_even_the_smallest_chunk_crosses_the_margin():
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)
    chunk, abort = g.plan(int(4 * GIB * 0.95) - 512 * MIB, 100_000)
    assert chunk == 32 and abort


def test_measured_cost_raises_the_per_token_estimate():
    g = guard_at(process_bytes=GIB, mlx_active=512 * MIB)
    before = g.cost.bytes_per_token
    g.observe(100, 100 * 4 * MIB)  # 4 MiB per token measured
    assert g.cost.bytes_per_token > before


def test_chunk_target_follows_the_dynamic_ceiling_not_the_stable_cap():
    """64 GiB machine, balanced: static 58 GiB; the system can give only enough for a
    50 GiB dynamic ceiling. Chunks aim at 0.92 x 50 GiB and never past the ceiling."""
    process = 10 * GIB
    readings = MemoryReadings(process_bytes=process, system_total_bytes=64 * GIB,
                              mlx_active_bytes=process, footprint_bytes=process,
                              system_available_bytes=40 * GIB)
    g = guard_for(readings, MemoryConfig())
    assert g.ceiling == 50 * GIB and g.abort_cap == 58 * GIB
    target = int(0.92 * 50 * GIB)
    # 1 MiB per token (256 KiB KV x 4): headroom of 100 tokens under the target.
    chunk, abort = g.plan(target - 100 * MIB, 100_000)
    assert (chunk, abort) == (100, False)
    # At 0.93 of the stable cap (53.9 GiB) a chunk would run past the 50 GiB ceiling.
    chunk, abort = g.plan(50 * GIB - 16 * MIB, 100_000)
    assert abort
