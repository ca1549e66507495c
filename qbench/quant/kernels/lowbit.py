"""Real weight-only 2-, 3- and 4-bit linear: packed codes, per-channel or per-group scales, dequantised on the fly.

The real backend of the grouped weight-only schemes that :class:`~.int4.Int4Linear` does not cover: int3, int2, and
symmetric (absmax) int4. Float32 CPU input runs the C kernels (``paths.lowbit_forward``): up to 16 rows a loop
that reads the packed codes and never builds Ŵ (decode is bound by turning codes into floats: ~3× fp32
``F.linear`` at 2048 → 8192, one thread; equal to fake mode to float rounding), more rows one C
dequantisation per call, then ``F.linear`` (bit for bit fake mode). Elsewhere (CUDA, bf16, autograd) each call
rebuilds the float weight in torch and runs ``F.linear``.

Storage for an (out, in) weight, b bits, groups of g input channels (per output channel: g = in):

- ``qweight`` uint8, the unsigned codes u ∈ [0, 2^b − 1] packed along the input dim by :func:`pack_bits`;
  symmetric codes q ∈ [−qmax, qmax] are stored as u = q + qmax with zero point qmax (qmax = 2^(b−1) − 1);
- ``scales`` float32 (out, in/g); ``zeros`` uint8 (out, in/g) for asymmetric codes;
- ŵ = s · (u − z): the primitives' formulas (docs/metrics.md), so the real weight equals
  ``fake.fake_quantize_weight(W, b, granularity, symmetric)`` bit for bit (tested). A group that does not divide
  the row leaves a shorter last group (codes stored zero-padded to whole groups, sliced off when dequantised).

Packing, little-endian within a unit of ``k`` codes in ``k·b/8`` bytes: b = 2: 4 codes per byte (code i at bits
2i..2i+1); b = 3: 8 codes in 3 bytes (a 24-bit word, code i at bits 3i..3i+2, low byte first); b = 4: 2 codes per
byte (low nibble first, the layout of ``int4.pack_int4``). A last dimension that is not a multiple of k is padded
with zero codes; :func:`unpack_bits` takes the true length back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.fake import pad_to_groups, transform_input, transform_weight
from qbench.quant.granularity import Granularity, PerAxis, PerGroup
from qbench.quant.kernels import paths
from qbench.quant.kernels.base import LayerInputs, RealLinear, as_rotation, check_input_scale
from qbench.quant.kernels.registry import PACKED_BITS  # the registry's predicates read it too
from qbench.quant.primitives import QParams, given_or_chosen, qrange, quantize
from qbench.quant.schemes import QuantScheme


def _unit(bits: int) -> tuple[int, int]:
    """(codes, bytes) of one packing unit: the fewest codes that fill whole bytes."""
    if bits not in PACKED_BITS:
        raise UserError(
            f"no bit packing for {bits}-bit codes; packed widths: {', '.join(map(str, PACKED_BITS))}"
        )
    codes = 8 // math.gcd(8, bits)
    return codes, codes * bits // 8


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack unsigned ``bits``-bit codes along the last dim (module docstring): (..., n) -> uint8 (..., ⌈n/k⌉·bytes)."""
    k, nbytes = _unit(bits)
    if codes.dtype.is_floating_point or codes.dtype == torch.bool:
        raise TypeError(f"pack_bits needs integer codes, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 1 << bits):
        raise ValueError(f"pack_bits: codes must lie in [0, {(1 << bits) - 1}]")
    c = codes.to(torch.int32)
    if c.shape[-1] % k:
        c = F.pad(c, (0, k - c.shape[-1] % k))
    c = c.unflatten(-1, (-1, k))  # (..., units, k)
    shifts = torch.arange(k, dtype=torch.int32, device=c.device) * bits
    word = (c << shifts).sum(-1, dtype=torch.int32)  # ≤ 24 bits
    out = torch.stack([(word >> (8 * j)) & 0xFF for j in range(nbytes)], dim=-1)  # (..., units, bytes)
    return out.flatten(-2).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: uint8 (..., m) -> uint8 codes (..., n)."""
    k, nbytes = _unit(bits)
    b = packed.to(torch.int32).unflatten(-1, (-1, nbytes))  # (..., units, bytes)
    word = (b << (torch.arange(nbytes, dtype=torch.int32, device=b.device) * 8)).sum(-1, dtype=torch.int32)
    shifts = torch.arange(k, dtype=torch.int32, device=b.device) * bits
    codes = (word.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.flatten(-2)[..., :n].to(torch.uint8)


class LowBitLinear(RealLinear):
    """y = x' · Ŵᵀ + b, Ŵ = s · (u − z) from packed 2/3/4-bit codes (module docstring); x' as in FakeQuantLinear."""

    def __init__(
        self,
        qweight: Tensor,
        scales: Tensor,
        zeros: Tensor | None,
        bias: Tensor | None,
        in_features: int,
        bits: int,
        group: int | None = None,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | None = None,
    ) -> None:
        super().__init__()
        _unit(bits)
        self.in_features, self.out_features, self.bits = in_features, scales.shape[0], bits
        self.group = in_features if group is None else group  # the last group of a ragged row is shorter
        # qweight (out, packed) uint8, zeros (out, in/g) uint8 or None when symmetric (zero point qmax)
        self.store(
            {"qweight": qweight, "zeros": zeros},
            {"scales": scales, "bias": bias},
            input_scale=input_scale,
            rotation=rotation,
        )

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @classmethod
    def from_float(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        bits: int,
        granularity: Granularity,
        symmetric: bool,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | Tensor | None = None,
        weight_qparams: QParams | None = None,
    ) -> LowBitLinear:
        """Quantise R(W · diag(s)) of an (out, in) float weight per output channel (``PerAxis(0)``) or group."""
        out_features, in_features = weight.shape
        if not (isinstance(granularity, PerGroup) or granularity == PerAxis(0)):
            raise UserError(
                f"packed low-bit weights are per output channel or per group, not {granularity.label}"
            )
        rotation = as_rotation(rotation, in_features)
        w = transform_weight(weight, check_input_scale(input_scale, in_features), rotation)
        w = pad_to_groups(w, granularity)  # a ragged last group: zero codes beyond the row, sliced off on use
        qp = given_or_chosen(w, bits, granularity, symmetric, weight_qparams)
        q = quantize(w, qp, bits, granularity, symmetric)
        codes = q.to(torch.int32) - qrange(bits, symmetric)[0]  # unsigned: symmetric q + qmax
        zeros = None if symmetric else qp.zero_point.reshape(out_features, -1).to(torch.uint8).contiguous()
        return cls(
            pack_bits(codes, bits),
            qp.scale.reshape(out_features, -1).contiguous(),
            zeros,
            None if bias is None else bias.detach().float().clone(),
            in_features,
            bits,
            granularity.group_size if isinstance(granularity, PerGroup) else None,
            input_scale=input_scale,
            rotation=rotation,
        )

    def dequantized_weight(self) -> Tensor:
        """Ŵ = s · (u − z) in float32, (out, in) — equal to the fake-quantised weight."""
        padded = self.scales.shape[1] * self.group  # in_features rounded up to whole groups
        codes = unpack_bits(self.qweight, self.bits, padded).float()
        codes = codes.view(self.out_features, -1, self.group)  # (out, groups, g)
        zeros = -qrange(self.bits, True)[0] if self.symmetric else self.zeros.float().unsqueeze(-1)
        w = ((codes - zeros) * self.scales.unsqueeze(-1)).view(self.out_features, padded)
        return w[:, : self.in_features].contiguous()

    def _forward(self, x: Tensor) -> Tensor:
        x = transform_input(x, self.input_scale, self.rotation)
        # float32 CPU input: the C kernels (paths.py) — a loop reading the packed codes up to 16 rows, one C
        # dequantisation per call then F.linear above; else the torch path below
        zconst = -qrange(self.bits, True)[0]  # the zero point of symmetric codes (u = q + qmax)
        y = paths.lowbit_forward(
            self, x, self.qweight, self.bits, self.scales, self.zeros, zconst, self.bias, self.group
        )
        if y is not None:
            return y
        w = self.dequantized_weight().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def fast_direct(self) -> bool:
        whole_groups = self.scales.shape[1] * self.group == self.in_features  # else x is padded per call
        return self.rotation is None and self.input_scale is None and whole_groups

    def extra_repr(self) -> str:
        gran = "per output channel" if self.group == self.in_features else f"per group of {self.group}"
        kind = "absmax" if self.symmetric else "zeropoint"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int{self.bits} {kind} {gran}, packed, {self.nbytes() / 2**20:.2f} MiB"
        )


def build_weight_only(
    weight: Tensor,
    bias: Tensor | None,
    scheme: QuantScheme,
    inputs: LayerInputs,
) -> nn.Module:
    """The registry's builder for W2/W3/W4 weight-only schemes: asymmetric int4 -> Int4Linear (torch's int4 kernel with bf16); int2/int3, symmetric int4 and a group that
    does not divide the row (a shorter last group) -> LowBitLinear."""
    g = scheme.weight_granularity_for(weight.shape[1])  # a group ≥ the row is per channel
    group = g.group_size if isinstance(g, PerGroup) else None
    if scheme.weight_bits == 4 and not scheme.weight_symmetric and not weight.shape[1] % (group or 1):
        from qbench.quant.kernels.int4 import Int4Linear

        return Int4Linear.from_float(
            weight,
            bias,
            group,
            input_scale=inputs.input_scale,
            rotation=inputs.rotation,
            weight_qparams=inputs.weight_qparams,
        )
    return LowBitLinear.from_float(
        weight,
        bias,
        scheme.weight_bits,
        g,
        scheme.weight_symmetric,
        input_scale=inputs.input_scale,
        rotation=inputs.rotation,
        weight_qparams=inputs.weight_qparams,
    )
