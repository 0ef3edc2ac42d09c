"""A decode step's RoPE and RMSNorm as compiled MLX functions, on a Linux CPU.

On MLX's CPU backend `mx.fast.rope` and `mx.fast.rms_norm` are not one kernel each: they
run as a handful of elementwise operations, and a decode step's arrays are so small
that each operation costs its dispatch, not its arithmetic (a RoPE of one token's 16
heads: ~160 us evaluated alone, ~50 us compiled). A decode step of a llama-style model
calls two RoPEs and two norms per block, so `mx.compile` fusing each into one kernel
takes ~10 % off the step on the small and medium demo models (docs/benchmarks.md). The
compiled function runs the same operations: the logits are the stock path's bit for
bit (tests/integration/test_compiled_decode.py).

Only decode-sized calls take it (one token per sequence, `decode_sized`): a prefill
chunk's cost is arithmetic, and every chunk length would need a trace of its own. A
prefill chunk's RoPE takes its cosines and sines from a table instead
(engine/rope_table.py, the same bits); its norms stay stock. The position goes in as an
array, so one trace serves every offset (an int offset would be a constant of the
trace), and the functions are shared by every layer with the same settings, weights
passed in.

What is compiled: `nn.RMSNorm`, `nn.RoPE` and mlx-lm's `Llama3RoPE` (frequencies passed
in); other RoPE variants (scaled, dynamic) and model-specific norms stay stock. The
modules keep their parameters, names and `isinstance`: their class is swapped for a
subclass, and `uninstall` swaps it back.

The first call of a new fused kernel compiles it with the system's C++ compiler (MLX
caches the result on disk); `install` runs each kernel once at load, for one sequence and
for a batch, so serving never waits on the compiler, and leaves the model stock if that
fails (no compiler, say).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils

from engine import rope_table


@dataclass
class CompiledDecode:
    """What `install` did for one model."""

    enabled: bool
    reason: str
    modules: list[weakref.ref] = field(default_factory=list)

    def summary(self) -> str:
        if not self.enabled:
            return f"compiled decode ops off: {self.reason}"
        return f"compiled decode ops: {self.reason}"


# -- the compiled functions, shared by configuration -------------------------------------

_functions: dict[tuple, Callable[..., mx.array]] = {}


def _norm_fn(eps: float) -> Callable[[mx.array, mx.array], mx.array]:
    key = ("rms_norm", eps)
    fn = _functions.get(key)
    if fn is None:
        fn = _functions[key] = mx.compile(lambda x, w: mx.fast.rms_norm(x, w, eps))
    return fn


def _rope_fn(dims: int, traditional: bool, base: float | None, scale: float,
             with_freqs: bool) -> Callable[..., mx.array]:
    key = ("rope", dims, traditional, base, scale, with_freqs)
    fn = _functions.get(key)
    if fn is None:
        if with_freqs:
            fn = mx.compile(lambda x, offset, freqs: mx.fast.rope(
                x, dims, traditional=traditional, base=None, scale=scale, offset=offset,
                freqs=freqs))
        else:
            fn = mx.compile(lambda x, offset: mx.fast.rope(
                x, dims, traditional=traditional, base=base, scale=scale, offset=offset))
        _functions[key] = fn
    return fn


def decode_sized(x: mx.array) -> bool:
    """One token per sequence: (batch, 1, width) into a norm, (batch, heads, 1, dim) into
    a RoPE."""
    return x.ndim >= 3 and x.shape[-2] == 1


def _offset_array(offset: Any) -> mx.array:
    return offset if isinstance(offset, mx.array) else mx.array(offset, dtype=mx.int32)


# -- the modules' subclasses ---------------------------------------------------------------


class _CompiledRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if not decode_sized(x):
            return super().__call__(x)
        return _norm_fn(self.eps)(x, self["weight"])


class _CompiledRoPE(nn.RoPE):
    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not decode_sized(x):
            key = ("rope", self.dims, self.traditional, self.base, self.scale)
            return rope_table.rotate(self, x, offset, super().__call__, key)
        fn = _rope_fn(self.dims, self.traditional, self.base, self.scale, False)
        return fn(x, _offset_array(offset))


class _CompiledLlama3RoPE(rope_utils.Llama3RoPE):
    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not decode_sized(x):
            key = ("llama3", self.dims, self.traditional, bytes(memoryview(self._freqs)))
            return rope_table.rotate(self, x, offset, super().__call__, key)
        fn = _rope_fn(self.dims, self.traditional, None, 1.0, True)
        return fn(x, _offset_array(offset), self._freqs)


_COMPILED: dict[type, type] = {
    nn.RMSNorm: _CompiledRMSNorm,
    nn.RoPE: _CompiledRoPE,
    rope_utils.Llama3RoPE: _CompiledLlama3RoPE,
}
_STOCK: dict[type, type] = {v: k for k, v in _COMPILED.items()}


# -- deciding and installing ------------------------------------------------------------


def environment_reason() -> str | None:
    """Why this process keeps the stock ops, or None when it can compile them."""
    if sys.platform != "linux":
        return f"not Linux ({sys.platform})"
    if mx.default_device() != mx.cpu:
        return f"MLX runs on {mx.default_device()}, where these ops are single kernels"
    return None


def _rope_input(m: nn.Module, rows: int, dtype: mx.Dtype) -> mx.array:
    # Laid out as attention makes it: (batch, tokens, heads, dim) transposed.
    return mx.zeros((rows, 1, 2, m.dims), dtype=dtype).transpose(0, 2, 1, 3)


def _warm(modules: list[nn.Module], dtype: mx.Dtype) -> None:
    """Runs each distinct compiled function once for one sequence and for a batch (a
    scalar offset and one per sequence make different kernels), so that the compiler
    runs at load and not under a request."""
    seen: set[tuple] = set()
    for m in modules:
        if isinstance(m, nn.RMSNorm):
            key: tuple = ("norm", m.eps, m["weight"].shape, m["weight"].dtype)
            if key in seen:
                continue
            seen.add(key)
            w = m["weight"]
            for rows in (1, 2):
                mx.eval(m(mx.zeros((rows, 1, w.shape[-1]), dtype=w.dtype)))
        else:
            key = ("rope", type(m), m.dims, m.traditional, dtype)
            if key in seen:
                continue
            seen.add(key)
            mx.eval(m(_rope_input(m, 1, dtype), offset=3))
            mx.eval(m(_rope_input(m, 2, dtype), offset=mx.array([3, 5])))


def install(model: nn.Module, *, enabled: bool = True) -> CompiledDecode:
    """Swaps the model's RMSNorm and RoPE modules for their compiled-decode subclasses;
    on the thread that will run the model. Stock when turned off, when the environment
    does not qualify, or when a warm-up compile fails."""
    if not enabled:
        return CompiledDecode(False, "turned off by the settings")
    why = environment_reason()
    if why is not None:
        return CompiledDecode(False, why)
    found = [m for _, m in model.named_modules() if type(m) in _COMPILED]
    if not found:
        return CompiledDecode(False, "no nn.RMSNorm or nn.RoPE / Llama3RoPE modules")
    for m in found:
        m.__class__ = _COMPILED[type(m)]
    plan = CompiledDecode(True, "", [weakref.ref(m) for m in found])
    norms = [m for m in found if isinstance(m, nn.RMSNorm)]
    dtype = norms[0]["weight"].dtype if norms else mx.float32
    try:
        _warm(found, dtype)
    except Exception as exc:  # no C++ compiler, an unwritable cache folder, ...
        uninstall(plan)
        return CompiledDecode(False, f"compiling failed: {exc}")
    ropes = len(found) - len(norms)
    plan.reason = f"{len(norms)} RMSNorm and {ropes} RoPE modules fused per decode call"
    return plan


def uninstall(plan: CompiledDecode) -> None:
    """Gives the modules their stock classes back."""
    for ref in plan.modules:
        m = ref()
        if m is not None and type(m) in _STOCK:
            m.__class__ = _STOCK[type(m)]
    plan.modules = []
    plan.enabled = False
