"""Half-precision mixture-of-experts layers multiplied in float32 on MLX's CPU backend.

mlx-lm's `SwitchLinear` (the experts of Mixtral, Qwen-MoE, DeepSeek, OLMoE, ...) runs
`mx.gather_mm`, which MLX's CPU backend takes in float32 only: a bfloat16 or float16
expert layer fails every step ("GatherMM::eval Currently only supports float32"), so
such a model cannot serve on a CPU at all. Here those layers keep their weights as
stored and multiply in float32, as MLX's Metal kernel sums (the result rounded back to
the activations' dtype):

- few (token, expert) pairs, a decode step (at most half as many as experts): only the
  chosen experts' weights are taken and converted;
- more, a prefill chunk: the layer's experts are converted once and `mx.gather_mm` runs
  on them.

What it adds at most is one layer's experts in float32, one layer at a time as MLX
evaluates; `install` reports it so that admission counts it with the prefill's other
conversions (`memory.chunking.ConversionTransient`). Quantized experts
(`QuantizedSwitchLinear`, `gather_qmm`) and float32 ones run as they are; on Metal
nothing is changed. The layers keep their module, parameters and names; only their class
is swapped for a subclass.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchLinear

from memory.chunking import ConversionTransient

HALF = (mx.bfloat16, mx.float16)
F32_BYTES = 4


@dataclass(frozen=True)
class SwitchFloat32:
    """What `install` did for one model: how many expert layers, and the float32 bytes
    of the largest one's experts (the transient it may add)."""

    layers: int = 0
    weight_bytes: int = 0

    def counted_in(self, transient: ConversionTransient | None) -> ConversionTransient | None:
        """The prefill's conversion transient with one expert layer in float32 counted:
        conversions run one layer at a time, so the larger layer is what one adds."""
        if not self.weight_bytes:
            return transient
        base = transient or ConversionTransient()
        return replace(base, weight_bytes=max(base.weight_bytes, self.weight_bytes))

    def summary(self) -> str:
        return (f"{self.layers} half-precision expert layers multiplied in float32 "
                f"(MLX's CPU gather_mm takes float32 only; up to "
                f"{self.weight_bytes / (1 << 20):.1f} MiB a layer)")


class Float32SwitchLinear(SwitchLinear):
    """`SwitchLinear` whose products run in float32 (module docstring)."""

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False
                 ) -> mx.array:
        weight = self["weight"]
        f32 = mx.float32
        if 2 * indices.size <= weight.shape[0]:
            # (..., k, out, in): each pair's expert, broadcast against x's (..., 1, in).
            # At most half the layer's experts: with their stored copy, under the
            # layer's float32 size, which the other way takes.
            chosen = weight[indices].astype(f32).swapaxes(-1, -2)
            y = x.astype(f32) @ chosen
        else:
            y = mx.gather_mm(x.astype(f32), weight.astype(f32).swapaxes(-1, -2),
                             rhs_indices=indices, sorted_indices=sorted_indices)
        y = y.astype(x.dtype)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


def install(model: nn.Module) -> SwitchFloat32:
    """Swaps the class of every half-precision `SwitchLinear` of `model` when MLX runs on
    the CPU; returns what it did (nothing elsewhere)."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return SwitchFloat32()
    found = [m for _, m in model.named_modules()
             if type(m) is SwitchLinear and m.weight.dtype in HALF]
    for m in found:
        m.__class__ = Float32SwitchLinear
    return SwitchFloat32(len(found), max((m.weight.size * F32_BYTES for m in found),
                                         default=0))
