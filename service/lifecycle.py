"""Where the server is in its life: serving, or draining toward exit."""

from __future__ import annotations

import gc
from dataclasses import dataclass


@dataclass
class Lifecycle:
    draining: bool = False


def settle_heap() -> None:
    """After start-up or a load: collect once and freeze what survives, so the
    long-lived objects (models, tokenizers, stubs) are never scanned again by a full
    collection — one took ~75 ms on the event loop, stalling every stream."""
    gc.collect()
    gc.freeze()
