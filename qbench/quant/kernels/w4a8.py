"""Real W4A8: int4 weights (per output channel or per group) × int8 absmax activations, integer dot products.

The scheme is ``absmax-fine:w=4`` (``absmax-fine:w=4,group=32`` …): weights absmax 4-bit, codes c ∈ [−7, 7]
with one scale per output channel or per group of g input channels; activations absmax 8-bit per token (or per
sequence, ``absmax-moderate:w=4``). It is how int4 models are deployed on CPUs — llama.cpp multiplies its Q4
weight blocks with Q8-quantised activations in integer arithmetic — because int4 *weight-only* with float
activations spends its time turning nibbles into floats (``int4.py``), while an int8 × int4 product keeps the
integer rate of W8A8 and reads half its bytes.

The zero-point variant (``zeropoint-w4a8``, ``zeropoint-w4a8-g32``; ``absmax-fine:w=4,sym=false`` …) is
llama.cpp's Q4_1 arithmetic: codes u ∈ [0, 15] with one zero point per group, ŵ = s · (u − z), the primitives'
zeropoint formulas (as ``Int4Linear``), int8 activations as above. Its kernel is the symmetric one reading the
nibble as u − 8, plus the exact correction s_x · Σ_g s_g (8 − z_g) Σ_{k∈g} q_k (``qk_w4a8_zero_correct``, the
"m · Σ q" term of llama.cpp's Q4_1 dot product).

Storage (``qweight`` has the ``int4.pack_int4`` layout, so the same byte order serves every int4 kernel):

- ``qweight``  uint8 (out, ⌈in'/2⌉): c + 8 ∈ [1, 15] (zero-point: u ∈ [0, 15]) of input channel 2j in the low
  nibble, 2j+1 in the high;
- ``scales``   float32 (out, in'/g): ŵ = s · c, equal to ``fake_quantize(W, 4, PerAxis(0) or PerGroup(g), True)``;
- ``zeros``    uint8 (out, in'/g) for zero-point codes (None: absmax): ŵ = s · (u − z), equal to
  ``fake_quantize(W, 4, …, symmetric=False)``;
  in' = in rounded up to whole groups: a group that does not divide the row is completed with zero channels,
  as fake mode does (``fake.pad_to_groups``), and the input is zero-padded to match (zeros change no absmax).

Forward: x' = ``transform_input(x, input_scale, rotation)`` (SmoothQuant / Hadamard, as ``FakeQuantLinear``),
q, s_x = ``int8.quantize_activation(x')``; then y = s_x · Σ_g s_g · Σ_{k∈g} c_k q_k + b with exact int32 group
sums (per output channel: (acc · s_x) · s_w + b, W8A8's epilogue). CPU float32 with g = in, 32 or a multiple
of 64: one C call (``native.c``, ``qk_w4a8_forward_path``: up to 16 rows a GEMV reading the nibbles, more rows the
int16 panel GEMM); otherwise the torch path F.linear(s_x · q, Ŵ) + b — fake mode's own arithmetic on the
stored codes. Both equal fake mode to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.fake import pad_to_groups, transform_input, transform_weight
from qbench.quant.granularity import Granularity, PerAxis, PerGroup, PerToken, check_granularity, unit
from qbench.quant.kernels import native, paths
from qbench.quant.kernels.base import LayerInputs, RealLinear, as_rotation, check_input_scale
from qbench.quant.kernels.int4 import pack_int4, unpack_int4
from qbench.quant.kernels.int8 import ACT_GRANULARITIES, PER_TOKEN, quantize_activation
from qbench.quant.primitives import QParams, given_or_chosen, quantize
from qbench.quant.schemes import QuantScheme

BITS = 4
OFFSET = (
    8  # stored nibble = code + 8: codes [−7, 7] become [1, 15], the unsigned operand of the C dot product
)


def check_group(group_size: int | None) -> None:
    if group_size is not None and group_size < 1:
        raise UserError(f"W4A8 group_size={group_size} must be a positive number of input channels")


def kernel_group_ok(group_size: int | None) -> bool:
    """The group sizes the C kernels take: per output channel, 32, or a multiple of 64 (others: torch path)."""
    return group_size is None or group_size == 32 or group_size % 64 == 0


class Int4A8Linear(RealLinear):
    """y = s_x · Σ_g s_g (c · q)_g + b: int4 weights × per-token int8 activations (see the module docstring);
    c = u − z with ``zeros`` (zero-point codes), else the absmax code."""

    def __init__(
        self,
        qweight: Tensor,
        scales: Tensor,
        bias: Tensor | None,
        in_features: int,
        group_size: int | None = None,
        *,
        act: Granularity = PER_TOKEN,
        input_scale: Tensor | None = None,
        rotation: nn.Module | None = None,
        zeros: Tensor | None = None,
    ) -> None:
        super().__init__()
        check_granularity("Int4A8Linear activation granularity", act, ACT_GRANULARITIES)
        if zeros is not None and zeros.shape != scales.shape:
            raise UserError(f"W4A8 zeros {tuple(zeros.shape)} must match the scales {tuple(scales.shape)}")
        self.in_features, self.out_features, self.act = in_features, qweight.shape[0], act
        self.group_size = group_size  # None: one group per output channel
        # qweight (out, ⌈in/2⌉) uint8 nibbles c + 8 (zero-point: u), zeros (out, groups) or None, scales (out, groups)
        self.store(
            {"qweight": qweight, "zeros": zeros},
            {"scales": scales, "bias": bias},
            input_scale=input_scale,
            rotation=rotation,
        )

    def zero_term(self) -> Tensor | None:
        """The kernels' (G, N) float32 (s · (8 − z))ᵀ of zero-point codes (None: absmax), derived once and kept
        while ``scales`` and ``zeros`` are the same tensors, unmodified (their pointers and versions: a replaced,
        moved or in-place-edited one rebuilds it). Inference tensors (a layer built under
        ``torch.inference_mode``) keep no version counter: after editing one of those in place, call
        :meth:`invalidate`."""
        if self.zeros is None:
            return None
        if torch.compiler.is_compiling():  # traced: computed in the graph, no state kept
            return native.zero_term(self.scales, self.zeros)
        # inference tensors keep no version counter (see above)
        key = tuple(
            (t.data_ptr(), t.device, None if t.is_inference() else t._version)
            for t in (self.scales, self.zeros)
        )
        cached = self.__dict__.get("_zero_term")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_zero_term"] = (key, native.zero_term(self.scales, self.zeros))
        return cached[1]

    def invalidate(self) -> None:
        super().invalidate()
        self.__dict__.pop("_zero_term", None)

    def nbytes(self) -> int:
        """Stored tensors, plus for zero-point codes with a C loop the (G, N) float32 term those kernels read
        (counted whether or not a forward has built it: the size of the layer as it runs, not of its history)."""
        term = 0
        if self.zeros is not None and kernel_group_ok(self.group_size):
            term = self.scales.numel() * 4
        return super().nbytes() + term

    @classmethod
    def from_float(
        cls,
        weight: Tensor,
        bias: Tensor | None = None,
        group_size: int | None = None,
        *,
        act: Granularity = PER_TOKEN,
        input_scale: Tensor | None = None,
        rotation: nn.Module | Tensor | None = None,
        weight_qparams: QParams | None = None,
        symmetric: bool = True,
    ) -> Int4A8Linear:
        """Quantise R(W · diag(s)) of an (out, in) float weight, 4-bit per output channel or group: absmax, or
        zero-point (``symmetric=False``, the primitives' zeropoint formulas)."""
        out_features, in_features = weight.shape
        check_group(group_size)
        if group_size is not None and group_size >= in_features:
            group_size = (
                None  # one group per row: per output channel (as ``QuantScheme.weight_granularity_for``)
            )
        granularity = PerAxis(0) if group_size is None else PerGroup(group_size)
        rotation = as_rotation(rotation, in_features)
        w = transform_weight(weight, check_input_scale(input_scale, in_features), rotation)
        # a group that does not divide the row: zero channels complete the last group, exactly as fake mode
        # quantises it (zeros change no absmax); the input is padded to match in forward
        w = pad_to_groups(w, granularity)
        qp = given_or_chosen(w, BITS, granularity, symmetric, weight_qparams)
        # absmax: int8 in [−7, 7], stored + 8; zero-point: uint8 u in [0, 15], stored as is
        codes = quantize(w, qp, BITS, granularity, symmetric=symmetric)
        scales = qp.scale.reshape(out_features, -1).float().contiguous()
        b = None if bias is None else bias.detach().float().clone()
        if symmetric:
            packed, zeros = pack_int4((codes.to(torch.int16) + OFFSET).to(torch.uint8)), None
        else:
            packed = pack_int4(codes)
            zeros = qp.zero_point.reshape(out_features, -1).to(torch.uint8).contiguous()
        return cls(
            packed,
            scales,
            b,
            in_features,
            group_size,
            act=act,
            input_scale=input_scale,
            rotation=rotation,
            zeros=zeros,
        )

    @property
    def group(self) -> int:
        return self.in_features if self.group_size is None else self.group_size

    @property
    def padded_features(self) -> int:
        """Input channels as stored: in_features rounded up to whole groups (zero codes beyond in_features)."""
        return self.in_features + (-self.in_features % self.group)

    def dequantized_weight(self) -> Tensor:
        """Ŵ = s · c (zero-point: s · (u − z)) in float32, (out, in) — equal to the fake-quantised weight."""
        k = self.padded_features
        codes = unpack_int4(self.qweight, k).float().view(self.out_features, -1, self.group)
        codes = codes - (OFFSET if self.zeros is None else self.zeros.float().unsqueeze(-1))
        w = (codes * self.scales.unsqueeze(-1)).view(self.out_features, k)
        return w[:, : self.in_features]

    def _forward(self, x: Tensor) -> Tensor:
        x = transform_input(x, self.input_scale, self.rotation)
        per_token = isinstance(self.act, PerToken)
        if kernel_group_ok(self.group_size):
            padded = (
                x
                if self.padded_features == x.shape[-1]
                else F.pad(x, (0, self.padded_features - x.shape[-1]))
            )
            y = paths.w4a8_forward(
                self, padded, self.qweight, self.scales, self.bias, per_token, self.zero_term()
            )
            if y is not None:
                return y
        return self._torch_forward(x, per_token)

    def fast_direct(self) -> bool:
        return self.rotation is None and self.input_scale is None and self.padded_features == self.in_features

    def _torch_forward(self, x: Tensor, per_token: bool) -> Tensor:
        """Fake mode's arithmetic on the stored codes: F.linear(s_x · q, Ŵ) + b (any device and dtype)."""
        lead = x.shape[:-1]
        x3 = x.float().reshape(1 if x.dim() <= 2 else x.shape[0], -1, self.in_features)
        q, scale = quantize_activation(x3, per_token)
        bias = None if self.bias is None else self.bias.float()
        y = F.linear(q.float() * scale, self.dequantized_weight().to(x3.device), bias)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        gran = "per output channel" if self.scales.shape[1] == 1 else f"per group of {self.group}"
        act = f"per {unit(self.act, 'act')}"  # token or sequence
        kind = "absmax" if self.zeros is None else "zeropoint"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"W int4 {kind} {gran}, A int8 absmax {act}, {self.nbytes() / 2**20:.2f} MiB"
        )


def build_w4a8(
    weight: Tensor,
    bias: Tensor | None,
    scheme: QuantScheme,
    inputs: LayerInputs,
) -> nn.Module:
    """The registry's builder for W4A8 schemes (``registry.REAL_KERNELS``)."""
    g = scheme.weight_granularity_for(weight.shape[1])  # a group ≥ the row is per channel
    group = g.group_size if isinstance(g, PerGroup) else None
    return Int4A8Linear.from_float(
        weight,
        bias,
        group,
        act=scheme.act_granularity,
        input_scale=inputs.input_scale,
        rotation=inputs.rotation,
        weight_qparams=inputs.weight_qparams,
        symmetric=scheme.weight_symmetric,
    )
