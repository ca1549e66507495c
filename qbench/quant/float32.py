"""Buffers that must stay float32 when a quantised model is cast.

``qmodel.to(torch.bfloat16)`` (or ``.half()``) casts every floating buffer. For a quantised layer that silently
changes what it computes: a rotation matrix in bf16 is no longer orthogonal to float precision, and an int8
scale rounded to bf16 (8 significant bits) moves every dequantised value off the grid the weights were
quantised on. Modules that hold such tensors list them in ``_float32_buffers``; a cast then moves them to the
new device but keeps them float32 (the layers already compute with them in float32 and return the input's dtype).

The real-kernel layers do not list names: ``kernels.base.RealLinear`` keeps *every* float32 tensor of the layer
(and of its rotation) float32, because their C kernels read them through float32 pointers.
"""

from __future__ import annotations

from torch import Tensor, nn


class Float32Buffers(nn.Module):
    """Mixin: the buffers named in ``_float32_buffers`` follow device moves but never dtype casts (they stay
    float32); those in ``_dtype_kept_buffers`` follow device moves and keep whatever dtype they have (a float
    weight a layer quantises on the fly: its Ŵ is cast, the weight it is rounded from is not)."""

    _float32_buffers: tuple[str, ...] = ()
    _dtype_kept_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        kept: dict[str, Tensor] = {}
        for name in (*self._float32_buffers, *self._dtype_kept_buffers):
            t = self._buffers.get(name)
            if t is not None and t.dtype.is_floating_point:
                kept[name] = t
                self._buffers[name] = None  # nn.Module._apply skips None buffers
        try:
            super()._apply(fn, recurse)
        finally:
            for name, t in kept.items():
                target = fn(t.new_empty(0)).device  # where the cast sends tensors (.to, .cuda, .cpu, .half)
                t = t.to(target)
                self._buffers[name] = t.float() if name in self._float32_buffers else t
        return self
