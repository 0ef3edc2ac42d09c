"""The engine's prefill planner over memory.chunking, with scripted readings."""

from memory.ceiling import compute_limits
from memory.config import MemoryConfig
from memory.levels import GIB, MIB
from memory.readings import MemoryReadings
from service.enforcement import PrefillGuard


def guard_at(process_bytes: int, mlx_active: int) -> PrefillGuard:
    config = MemoryConfig.from_mapping({"custom_ceiling_gib": 4})  # custom: fraction 0.95
    readings = MemoryReadings(process_bytes=process_bytes, system_total_bytes=64 * GIB,
                              mlx_active_bytes=mlx_active)
    g = PrefillGuard(kv_bytes_per_token=256 * 1024, min_chunk=32, max_chunk=2048)
    g.update(readings, compute_limits(readings, config))
    return g


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
