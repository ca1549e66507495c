"""Real weight-only int8 (W8A16-style: 8-bit weights, float activations), per output channel or per group.

Storage for an (out, in) weight, groups of g input channels (per output channel: g = in):

- ``qweight`` (out, in): int8 codes q ∈ [−127, 127] when symmetric (absmax), uint8 q ∈ [0, 255] when not;
- ``scales`` float32 (out, in/g); ``zeros`` uint8 (out, in/g) for asymmetric codes, else None;
- Ŵ = s · (q − z) (z = 0 when symmetric): the primitives' formulas, so the real weight equals
  ``fake_quantize(W, 8, granularity, symmetric)`` bit for bit (tested).

Forward: the compiled CPU kernels of ``paths.py`` for float32 input (≤ 16 rows: reads the int8 codes directly,
equal to fake mode to float rounding; more rows: one C dequantise pass + torch's float32 GEMM, equal bit for
bit); elsewhere (CUDA, other dtypes, no compiler) Ŵ is rebuilt in torch and ``F.linear`` runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.fake import transform_input, transform_weight
from qbench.quant.granularity import PerAxis, PerGroup
from qbench.quant.kernels import paths
from qbench.quant.kernels.base import LayerInputs, RealLinear, as_rotation, check_input_scale
from qbench.quant.primitives import QParams, given_or_chosen, quantize
from qbench.quant.schemes import QuantScheme

BITS = 8


class Int8WeightOnlyLinear(RealLinear):
    """y = x' · Ŵᵀ + b with Ŵ = s · (q − z) from int8 codes (module docstring); x' as in ``FakeQuantLinear``."""

    def __init__(
        self,
        qweight: Tensor,
        scales: Tensor,
        zeros: Tensor | None,
        bias: Tensor | None,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        # qweight (out, in) int8 (symmetric) or uint8, zeros (out, in/g) uint8 or None, scales (out, in/g)
        self.store(
            {"qweight": qweight, "zeros": zeros},
            {"scales": scales, "bias": bias},
            input_scale=input_scale,
            rotation=rotation,
        )

    @classmethod
    def from_float(
        cls,
        weight: Tensor,
        bias: Tensor | None = None,
        group_size: int | None = None,
        symmetric: bool = True,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | Tensor | None = None,
        weight_qparams: QParams | None = None,
    ) -> Int8WeightOnlyLinear:
        """Quantise R(W · diag(s)) of an (out, in) float weight per output channel (``group_size=None``) or group."""
        out_features, in_features = weight.shape
        if group_size is not None and (group_size < 1 or in_features % group_size):
            raise UserError(f"int8 group_size={group_size} must divide in_features={in_features}")
        granularity = PerAxis(0) if group_size is None else PerGroup(group_size)
        rotation = as_rotation(rotation, in_features)
        w = transform_weight(weight, check_input_scale(input_scale, in_features), rotation)
        qp = given_or_chosen(w, BITS, granularity, symmetric, weight_qparams)
        codes = quantize(w, qp, BITS, granularity, symmetric=symmetric).contiguous()
        zeros = None if symmetric else qp.zero_point.reshape(out_features, -1).to(torch.uint8).contiguous()
        b = None if bias is None else bias.detach().float().clone()
        scales = qp.scale.reshape(out_features, -1).contiguous()
        return cls(codes, scales, zeros, b, input_scale=input_scale, rotation=rotation)

    @property
    def group(self) -> int:
        return self.in_features // self.scales.shape[1]

    def dequantized_weight(self) -> Tensor:
        """Ŵ = s · (q − z) in float32, (out, in) — equal to the fake-quantised weight."""
        q = self.qweight.float().view(self.out_features, -1, self.group)
        if self.zeros is not None:
            q = q - self.zeros.float().unsqueeze(-1)
        return (q * self.scales.unsqueeze(-1)).view(self.out_features, self.in_features)

    def _forward(self, x: Tensor) -> Tensor:
        x = transform_input(x, self.input_scale, self.rotation)
        y = paths.weight_only_forward(self, x, self.qweight, False, self.scales, self.zeros, self.bias)
        if y is not None:
            return y
        return F.linear(
            x, self.dequantized_weight().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype)
        )

    def fast_direct(self) -> bool:
        return self.rotation is None and self.input_scale is None

    def extra_repr(self) -> str:
        gran = "per output channel" if self.scales.shape[1] == 1 else f"per group of {self.group}"
        kind = "absmax" if self.zeros is None else "zeropoint"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"W int8 {kind} {gran}, float activations, {self.nbytes() / 2**20:.2f} MiB"
        )


def build_w8_weight_only(
    weight: Tensor,
    bias: Tensor | None,
    scheme: QuantScheme,
    inputs: LayerInputs,
) -> nn.Module:
    """The registry's builder for W8 weight-only schemes (``registry.REAL_KERNELS``)."""
    g = scheme.weight_granularity_for(weight.shape[1])
    group = g.group_size if isinstance(g, PerGroup) else None
    return Int8WeightOnlyLinear.from_float(
        weight,
        bias,
        group,
        scheme.weight_symmetric,
        input_scale=inputs.input_scale,
        rotation=inputs.rotation,
        weight_qparams=inputs.weight_qparams,
    )
