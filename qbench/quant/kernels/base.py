"""The base of the real quantised layers: what they store, in which dtype, and what a cast may do to it.

Every real layer (``Int8Linear``, ``Int4Linear``, ``LowBitLinear``, ``Int4A8Linear``, ``Int8WeightOnlyLinear``,
``BnbLinear``) is a :class:`RealLinear`. The base

- keeps every float32 tensor of the layer (scales, bias, SmoothQuant input scale, rotation, static scales) in
  float32 whatever ``.to(dtype)`` / ``.half()`` / ``.bfloat16()`` does to the model: the C kernels read them
  through float32 pointers (a bf16 bias read as float32 gave NaN and drifts of 0.08), and a bf16 scale moves every
  dequantised weight off the grid it was quantised on. Device moves still apply. Integer codes are never cast
  by a dtype change in the first place (``nn.Module.to(dtype)`` touches floating tensors only);
- drops what was derived from the stored tensors (bound kernel calls, kernel-format copies) when they move or a
  state dict is loaded into them;
- reports the true storage (:meth:`nbytes`): every stored tensor, kernel-format copies, the rotation;
- answers an empty batch with an empty output, and otherwise runs the layer's ``_forward``. The output dtype is
  the input's, as in fake mode.

Which kernel runs is decided in ``paths.py``, which also checks the stored tensors' dtypes before a C call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def tensor_bytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


class RealLinear(nn.Module):
    """Base of the real-kernel linears (module docstring). Subclasses set ``in_features`` / ``out_features``,
    store their tensors as buffers (floating ones in float32) and implement ``_forward``."""

    in_features: int
    out_features: int

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(
                f"{type(self).__name__} expects (..., {self.in_features}) input, got {tuple(x.shape)}"
            )
        if x.numel() == 0:  # no rows: the reductions of activation quantisation have nothing to reduce
            return x.new_zeros(*x.shape[:-1], self.out_features)
        self.__dict__["last_path"] = "torch"  # what ran, for tests: paths.py overwrites it when a kernel runs
        # one layout: a strided input would otherwise take other BLAS loops (other roundings) than its copy
        return self._forward(x.contiguous())

    def _forward(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    # ------------------------------------------------------------------------------------ storage and casts

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> RealLinear:
        def keep_float32(t: Tensor) -> Tensor:
            if t.dtype != torch.float32:
                return fn(t)
            probe = fn(t.new_empty(0))  # where and to what the cast sends a float32 tensor
            # the cast's device move stays, its dtype change does not (casting and back would round the values)
            return fn(t) if probe.dtype == torch.float32 else t.to(probe.device)

        self.invalidate()
        return super()._apply(keep_float32, recurse)

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        # values are copied into the existing buffers (their dtypes stay); derived copies are now stale
        self.invalidate()
        super()._load_from_state_dict(*args, **kwargs)

    def invalidate(self) -> None:
        """Forget what was derived from the stored tensors (bound C calls, kernel-format weights)."""
        self.__dict__.pop("_native_call", None)

    def derived_tensors(self) -> tuple[Tensor | None, ...]:
        """Tensors built from the stored ones and held besides them (kernel-format copies), for :meth:`nbytes`."""
        return ()

    def nbytes(self) -> int:
        """True storage of this layer: its buffers and parameters, derived copies, its rotation.

        A rotation shared by several layers (one per input size) is counted by each; a model-level count that
        walks modules should not descend into a module that has ``nbytes()``.
        """
        return tensor_bytes(*self.parameters(), *self.buffers(), *self.derived_tensors())
