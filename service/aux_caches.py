"""The cheap auxiliary caches the server keeps, which a tick at soft clears first.

- `c_heap`: free pages glibc keeps in its heap after Python and MLX freed
  small buffers (a short session's KV lives there); `malloc_trim` hands them
  back. Bytes freed: the drop in RSS.
- `tokenizer_bpe`: each loaded tokenizer's BPE word cache (the `tokenizers`
  library keeps up to 10,000 words per model). It reports no size.

Neither touches MLX.
"""

from __future__ import annotations

import logging

import psutil
from tokenizers.models import BPE

from engine import allocator
from engine.pool import ModelPool, ModelState
from memory.executor import AuxCache

log = logging.getLogger(__name__)


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def clear_c_heap() -> int:
    before = _rss()
    allocator.trim()
    return max(0, before - _rss())


def tokenizer_bpe(pool: ModelPool) -> AuxCache:
    def clear() -> int:
        for entry in pool.entries():
            info = entry.engine.info if entry.engine is not None else None
            if entry.state is not ModelState.READY or info is None:
                continue
            try:  # fast (Rust) tokenizers only; a slow one keeps no such cache
                model = info.tokenizer.backend_tokenizer.model
            except AttributeError:
                continue
            if isinstance(model, BPE):
                model._clear_cache()
        return 0

    return clear


def server_aux_caches(pool: ModelPool) -> dict[str, AuxCache]:
    return {"c_heap": clear_c_heap, "tokenizer_bpe": tokenizer_bpe(pool)}
