"""Where freed memory goes: back to the operating system, or to MLX's pool for reuse.

MLX frees a model's buffers on unload, but glibc keeps large freed chunks in its
heap, so RSS — what the enforcer and the OOM killer see — stays high. Serving
large allocations from mmap returns them on free; `malloc_trim` returns the rest.

Within a prefill chunk it is the other way round: every layer frees and allocates the
same transients again, and MLX keeps freed buffers for reuse only up to its cache limit
— 32 MiB on Linux CPU, far below a batch's transients, so they went back to the system
and came back as fresh pages, layer after layer. A fresh page costs ~1.2 µs here on first
touch; an 8 x 255 chunk of the small float32 demo model took ~120,000 of them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20
# MLX's buffer pool (its cache): at least this much of freed buffers is kept for reuse,
# and at most 1/MLX_POOL_CEILING_SHARE of the memory ceiling. The governor counts the
# pool as reclaimable, and an engine empties it whenever its batch drains.
MLX_POOL_BYTES = 512 << 20
MLX_POOL_CEILING_SHARE = 32


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None


_LIBC = _libc()


def release_large_allocations_on_free() -> bool:
    """Allocations of 1 MiB or more come from mmap, so freeing them shrinks RSS."""
    if _LIBC is None:
        return False
    return bool(_LIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def trim() -> None:
    """Return free heap pages to the operating system."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def mlx_pool_bytes(wanted: int, ceiling_bytes: int | None) -> int:
    """The pool to ask MLX for: `wanted`, within its share of the memory ceiling."""
    if ceiling_bytes:
        return max(0, min(wanted, ceiling_bytes // MLX_POOL_CEILING_SHARE))
    return max(0, wanted)


def raise_mlx_pool(limit_bytes: int) -> int:
    """Lets MLX keep up to `limit_bytes` of freed buffers for reuse; a larger limit (its
    default on Metal) stays. Returns the limit in force."""
    import mlx.core as mx  # here: the optimized BLAS is preloaded before MLX

    previous = mx.set_cache_limit(limit_bytes)
    if previous > limit_bytes:
        mx.set_cache_limit(previous)
        return previous
    return limit_bytes
