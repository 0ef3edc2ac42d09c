"""Where Plimsoll keeps what it makes once per machine: the demo models, the benchmarks'
models, the compiled CBLAS shim. Standard library only: engine/blas.py reads it before
anything loads MLX."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "PLIMSOLL_CACHE_DIR"


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir` if given, else $PLIMSOLL_CACHE_DIR, else ~/.cache/plimsoll."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "plimsoll"
