"""The base of the real quantised layers: what they store, in which dtype, and what a cast may do to it.

Every real layer (``Int8Linear``, ``Int4Linear``, ``LowBitLinear``, ``Int4A8Linear``, ``Int8WeightOnlyLinear``,
``BnbLinear``) is a :class:`RealLinear`. The base

- owns the stored tensors (:meth:`RealLinear.store`): codes as int8 / uint8 (the layouts the kernels read),
  scales and bias as float32, the SmoothQuant input scale, the rotation;
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.float32 import Float32Buffers
from qbench.quant.kernels import paths

if TYPE_CHECKING:
    from qbench.quant.primitives import QParams

CODE_DTYPES = (torch.int8, torch.uint8)  # what the kernels read codes as (packed nibbles, bit-packed, int8)


def tensor_bytes(*tensors: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, Tensor))


@dataclass(frozen=True)
class LayerInputs:
    """What ``make_real_linear`` hands a layer's builder besides its weight, bias and scheme — one object, so the
    five builders (``dispatch.build``) share one signature: SmoothQuant's input scale, a rotation (Hadamard,
    QuaRot), the calibrated static quantisers of a ``static=true`` scheme and a weight grid an algorithm fixed (GPTQ)."""

    input_scale: Tensor | None = None
    rotation: nn.Module | Tensor | None = None
    act_static: nn.Module | None = None
    out_static: nn.Module | None = None
    weight_qparams: QParams | None = None


class MatrixRotation(Float32Buffers):
    """x ↦ x · Rᵀ for an explicit (dim, dim) orthogonal matrix R (computed in float32, returned in x's dtype)."""

    _float32_buffers = ("matrix",)

    def __init__(self, matrix: Tensor) -> None:
        super().__init__()
        if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
            raise UserError(f"a rotation matrix must be square, got shape {tuple(matrix.shape)}")
        self.register_buffer("matrix", matrix.detach().float().clone())

    def forward(self, x: Tensor) -> Tensor:
        return (x.float() @ self.matrix.T).to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.matrix.shape[0]}, dense"


def as_rotation(rotation: nn.Module | Tensor | None, in_features: int) -> nn.Module | None:
    """A rotation module (``HadamardRotation``, …) as is; a matrix wrapped in :class:`MatrixRotation`."""
    if isinstance(rotation, Tensor):
        rotation = MatrixRotation(rotation)
    dim = getattr(rotation, "dim", None)
    if isinstance(rotation, MatrixRotation):
        dim = rotation.matrix.shape[0]
    if rotation is not None and dim is not None and dim != in_features:
        raise UserError(f"rotation of size {dim} does not fit a linear with in_features={in_features}")
    return rotation


def check_input_scale(input_scale: Tensor | None, in_features: int) -> Tensor | None:
    """A SmoothQuant input scale (in,) as a float32 copy, or None."""
    if input_scale is None:
        return None
    if input_scale.shape != (in_features,):
        raise UserError(f"input_scale must have shape ({in_features},), got {tuple(input_scale.shape)}")
    return input_scale.detach().float().clone()


class RealLinear(nn.Module):
    """Base of the real-kernel linears (module docstring). Subclasses set ``in_features`` / ``out_features``,
    store their tensors as buffers (floating ones in float32) and implement ``_forward``."""

    in_features: int
    out_features: int

    def forward(self, x: Tensor) -> Tensor:
        y = paths.run_fast(self, x)  # decode: the kept kernel call (paths.py), when it applies to x
        if y is not None:
            return y
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

    def fast_direct(self) -> bool:
        """Whether the bound C kernel's output is this layer's whole output for an input as given (no input
        transform, no output quantisation), so a decode call may go straight to it (``paths.run_fast``)."""
        return False

    def __setattr__(self, name: str, value: object) -> None:
        if not name.startswith("_"):  # a changed option or tensor may change what a forward must do
            self.__dict__.pop("_fast", None)
        super().__setattr__(name, value)

    def store(
        self,
        codes: dict[str, Tensor | None],
        floats: dict[str, Tensor | None],
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | Tensor | None = None,
    ) -> None:
        """Register the layer's stored tensors: integer ``codes`` as given (int8 / uint8, the layouts the kernels
        read), ``floats`` (scales, bias) as float32 copies, the SmoothQuant ``input_scale`` and the rotation."""
        for name, t in codes.items():
            if t is not None and t.dtype not in CODE_DTYPES:
                raise UserError(f"{type(self).__name__}: {name} must hold int8 or uint8 codes, got {t.dtype}")
            self.register_buffer(name, t)
        for name, t in floats.items():
            self.register_buffer(name, None if t is None else t.detach().float())
        self.register_buffer("input_scale", check_input_scale(input_scale, self.in_features))
        self.rotation = as_rotation(rotation, self.in_features)

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
        self.__dict__.pop("_fast", None)

    def derived_tensors(self) -> tuple[Tensor | None, ...]:
        """Tensors built from the stored ones and held besides them (kernel-format copies), for :meth:`nbytes`."""
        return ()

    def nbytes(self) -> int:
        """True storage of this layer: its buffers and parameters, derived copies, its rotation.

        A rotation shared by several layers (one per input size) is counted by each; a model-level count that
        walks modules should not descend into a module that has ``nbytes()``.
        """
        return tensor_bytes(*self.parameters(), *self.buffers(), *self.derived_tensors())
