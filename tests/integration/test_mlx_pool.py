"""MLX's buffer pool, as the server sizes it (engine/allocator.py).

MLX keeps freed buffers for reuse only up to its cache limit, 32 MiB on Linux CPU, so a
batch's prefill transients went back to the system and came back as fresh pages layer
after layer. The server raises the limit at start (512 MiB by default, at most 1/32 of
the memory ceiling; each engine thread applies it as it starts), never lowers a larger
one, and leaves MLX's own with `--mlx-pool-mb 0`. What it buys is measured by `tools.bench_prefill_step --compare
mlx-pool` (docs/benchmarks.md), not here.
"""

from __future__ import annotations

import asyncio
import re
import resource
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import pytest

from engine import allocator
from engine.model_engine import EngineSettings, ModelEngine
from tools.harness.server import start_server

MiB = 1 << 20
BUFFER = 64 * MiB
POOL_LINE = re.compile(r"MLX buffer pool: up to (\d+) MiB")


@pytest.fixture
def restore_pool() -> Iterator[int]:
    own = _pool_limit()
    try:
        yield own
    finally:
        mx.set_cache_limit(own)
        mx.clear_cache()


def _free_then_allocate_again() -> tuple[int, int]:
    """(MLX's pool after a 64 MiB buffer is freed, fresh pages the next one of its size
    takes when written)."""
    mx.clear_cache()
    a = mx.ones((BUFFER // 4,))
    mx.eval(a)
    del a
    pooled = mx.get_cache_memory()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    b = mx.ones((BUFFER // 4,))
    mx.eval(b)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    del b
    return pooled, faults


def test_a_raised_pool_keeps_a_freed_buffer_and_its_pages_are_used_again(restore_pool):
    mx.set_cache_limit(32 * MiB)  # MLX's own on Linux CPU
    pooled, faults = _free_then_allocate_again()
    assert pooled < BUFFER
    assert faults > BUFFER // 4096 // 2  # its pages came fresh from the system

    assert allocator.raise_mlx_pool(allocator.MLX_POOL_BYTES) == allocator.MLX_POOL_BYTES
    pooled, faults = _free_then_allocate_again()
    assert pooled >= BUFFER
    assert faults < BUFFER // 4096 // 10  # the pooled buffer's pages, touched already


def test_a_larger_limit_than_ours_stays(restore_pool):
    mx.set_cache_limit(4 << 30)  # as Metal's default is: the device's memory
    assert allocator.raise_mlx_pool(allocator.MLX_POOL_BYTES) == 4 << 30
    assert mx.set_cache_limit(4 << 30) == 4 << 30


def _pool_limit() -> int:
    own = mx.set_cache_limit(0)
    mx.set_cache_limit(own)
    return own


async def test_an_engine_raises_the_pool_on_its_own_thread_as_it_starts(demo_path,
                                                                        restore_pool):
    mx.set_cache_limit(32 * MiB)
    engine = ModelEngine("tiny", str(demo_path), asyncio.get_running_loop(),
                         EngineSettings(mlx_pool_bytes=256 * MiB))
    await asyncio.wrap_future(engine.start())
    try:
        assert await asyncio.wrap_future(engine.call(_pool_limit)) == 256 * MiB
    finally:
        await asyncio.wrap_future(engine.stop())


def test_the_pool_is_at_most_its_share_of_the_ceiling():
    share = allocator.MLX_POOL_CEILING_SHARE
    assert allocator.mlx_pool_bytes(512 * MiB, 2 << 30) == (2 << 30) // share
    assert allocator.mlx_pool_bytes(512 * MiB, 64 << 30) == 512 * MiB
    assert allocator.mlx_pool_bytes(512 * MiB, None) == 512 * MiB


@pytest.mark.parametrize("args,pool_mib", [
    ((), allocator.MLX_POOL_BYTES // MiB),  # the defaults, on a machine of 8 GiB or more
    (("--memory-guard-gb", "2"), 2048 // allocator.MLX_POOL_CEILING_SHARE),
    (("--mlx-pool-mb", "0"), None),  # MLX's own limit, untouched
])
def test_the_server_sizes_mlxs_pool_at_start(tmp_path: Path, args, pool_mib):
    srv = start_server(tmp_path, *args)
    try:
        found = POOL_LINE.findall(srv.log())
    finally:
        srv.stop()
    assert found == ([] if pool_mib is None else [str(pool_mib)]), srv.log()[-2000:]
