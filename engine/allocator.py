"""Give freed memory back to the operating system (glibc only; a no-op elsewhere).

MLX frees a model's buffers on unload, but glibc keeps large freed chunks in its
heap, so RSS — what the enforcer and the OOM killer see — stays high. Serving
large allocations from mmap returns them on free; `malloc_trim` returns the rest.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20


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
