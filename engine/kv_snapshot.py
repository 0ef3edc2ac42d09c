"""Bank snapshots in RAM, on the engine thread: evaluated, optionally quantized
(mlx-lm's QuantizedKVCache), and dequantized again before a BatchGenerator insert."""

from __future__ import annotations

from typing import Any

KV_GROUP_SIZE = 64  # mlx-lm's default for quantized KV caches

def materialize(cache: list[Any], kv_bits: int = 0) -> list[Any]:
    """On the engine thread, when a turn is stored: give the snapshot its own buffers,
    evaluated (a sequence's cache is a view of its batch's, which it would keep alive
    whole: measured, 1.2 MiB held for 16 KiB counted on the tiny demo model) and, with
    `kv_bits`, keep it as mlx-lm's quantized KV cache."""
    import mlx.core as mx
    from mlx.utils import tree_map

    if kv_bits:
        cache = [_quantized(c, kv_bits) for c in cache]
    for c in cache:
        if getattr(c, "keys", None) is not None:
            c.state = tree_map(lambda a: mx.contiguous(a) if isinstance(a, mx.array) else a,
                               c.state)
    mx.eval([c.state for c in cache])
    return cache


def group_size_for(head_dim: int) -> int | None:
    """mlx-lm's default group (64) when it divides the head, else 32; None: neither
    does, the layer stays full precision."""
    for g in (KV_GROUP_SIZE, 32):
        if head_dim % g == 0:
            return g
    return None


def _quantized(c: Any, bits: int) -> Any:
    from mlx_lm.models.cache import KVCache

    # A plain KVCache only: `thaw` makes a quantized layer a KVCache again, and mlx-lm
    # cannot quantize the others (a sliding window's RotatingKVCache raises), so those
    # layers stay full precision, as a head no group divides does.
    if type(c) is not KVCache or c.empty():
        return c
    group = group_size_for(int(c.keys.shape[-1]))
    if group is None or int(c.values.shape[-1]) % group:
        return c
    return c.to_quantized(group_size=group, bits=bits)


def thaw(cache: list[Any]) -> list[Any]:
    """On the engine thread, before an insert: mlx-lm's BatchGenerator cannot merge a
    QuantizedKVCache (it has no `merge`), so quantized snapshots are dequantized into
    fresh KVCaches; the stored snapshot itself stays quantized."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    if not any(isinstance(c, QuantizedKVCache) for c in cache):
        return cache
    import mlx.core as mx

    out: list[Any] = []
    for c in cache:
        if not isinstance(c, QuantizedKVCache) or c.keys is None:
            out.append(c)
            continue
        full = KVCache()
        keys, values = c.keys_and_values()
        full.keys = mx.dequantize(*keys, group_size=c.group_size, bits=c.bits)
        full.values = mx.dequantize(*values, group_size=c.group_size, bits=c.bits)
        full.offset = c.offset
        out.append(full)
    return out


def cache_nbytes(cache: list[Any]) -> int:
    return sum(int(c.nbytes) for c in cache)
