"""Real weight-only int4: zeropoint (asymmetric) codes packed two per byte, dequantised on the fly.

Storage for an (out, in) weight quantised per group of ``g`` input channels (per output channel: g = in):

- ``qweight``  uint8 (out, ⌈in/2⌉): code of input channel 2j in the low nibble, 2j+1 in the high nibble;
- ``scales``   float32 (out, in/g), ``zeros`` uint8 (out, in/g): x̂ = s · (q − z), the primitives' zeropoint
  formulas (lo = min(w, 0), hi = max(w, 0), s = (hi − lo) / 15, z = round(−lo / s)), so the real weight equals
  ``fake_quantize(W, 4, PerAxis(0) or PerGroup(g), symmetric=False)`` bit for bit.

Forward, CPU float32 (the default): the compiled kernels of ``paths.py`` — up to 16 rows a kernel that reads the
packed nibbles and never builds the float weight (equal to fake mode to float rounding), more rows one C pass
that dequantises, then torch's float32 GEMM (equal to fake mode bit for bit).

Forward, portable path (any device, any float dtype, or without a C compiler): dequantise the whole weight in
float32, cast to the input dtype, ``F.linear``. This saves memory, not time: each call rebuilds the float weight.

Forward, CPU fast path (bf16 activations): torch's tinygemm-style kernels
``_convert_weight_to_int4pack_for_cpu`` + ``_weight_int4pack_mm_for_cpu``. Their convention, measured: codes
q ∈ [0, 15], groups of 32/64/128/256 input channels, one (scale, zero) pair per (group, output channel) in a
(in/g, out, 2) tensor of the activation dtype, and ŵ = (q − 8) · scale + zero. Ours converts exactly in real
arithmetic: scale = s, zero = s · (8 − z); per-channel quantisation is expressed by repeating (s, z) over the
groups of a row. The kernel needs out % 16 == 0. The pair is stored in bf16, so the fast path equals the
dequantise path to bf16 rounding (scale rounding ≤ 2⁻⁹ relative; tests bound it), not bit for bit. The kernel
weight is built on first use and cached (counted by :meth:`Int4Linear.nbytes` once built).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.fake import transform_input, transform_weight
from qbench.quant.granularity import PerAxis, PerGroup
from qbench.quant.kernels import paths
from qbench.quant.kernels.base import RealLinear, as_rotation, check_input_scale
from qbench.quant.primitives import QParams, given_or_chosen, quantize

BITS = 4
KERNEL_GROUPS = (256, 128, 64, 32)  # the group sizes _weight_int4pack_mm_for_cpu accepts, largest first


def pack_int4(q: Tensor) -> Tensor:
    """Pack codes in [0, 15] along the last dim, two per byte: element 2j → low nibble, 2j+1 → high nibble.

    An odd last dimension is padded with one zero code. Returns uint8 (..., ⌈n/2⌉).
    """
    if q.dtype not in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        raise TypeError(f"pack_int4 needs integer codes, got {q.dtype}")
    q = q.to(torch.uint8)
    if q.shape[-1] % 2:
        q = F.pad(q, (0, 1))
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()  # the kernels read rows of bytes


def unpack_int4(packed: Tensor, n: int | None = None) -> Tensor:
    """Inverse of :func:`pack_int4`: uint8 (..., m) → uint8 codes (..., n) with n = 2m unless given (odd n)."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)  # (..., 2m)
    return codes if n is None else codes[..., :n]


def _check_group(in_features: int, group_size: int | None) -> int:
    group = in_features if group_size is None else group_size
    if group < 1 or in_features % group:
        raise UserError(f"int4 group_size={group_size} must divide in_features={in_features}")
    return group


class Int4Linear(RealLinear):
    """y = x' · Ŵᵀ + b with Ŵ = s · (q − z) from packed 4-bit zeropoint codes (see the module docstring).

    x' = ``fake.transform_input(x, input_scale, rotation)`` and the quantised weight is
    ``fake.transform_weight(W, input_scale, rotation)``, as in ``FakeQuantLinear`` (both optional; the
    hadamard-zeropoint-int4 scheme uses the rotation).
    """

    def __init__(
        self,
        qweight: Tensor,
        scales: Tensor,
        zeros: Tensor,
        bias: Tensor | None,
        in_features: int,
        group_size: int | None = None,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, qweight.shape[0]
        self.group_size = group_size  # None: one group per output channel (the zeropoint-int4 scheme)
        # qweight (out, ⌈in/2⌉) uint8 nibbles, zeros (out, in/g) uint8, scales (out, in/g)
        self.store(
            {"qweight": qweight, "zeros": zeros},
            {"scales": scales, "bias": bias},
            input_scale=input_scale,
            rotation=rotation,
        )
        self._kernel_cache: tuple[Tensor, Tensor, int] | None = None

    @classmethod
    def from_float(
        cls,
        weight: Tensor,
        bias: Tensor | None = None,
        group_size: int | None = None,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | Tensor | None = None,
        weight_qparams: QParams | None = None,
    ) -> Int4Linear:
        """Quantise R(W · diag(s)) of an (out, in) float weight per output channel (``group_size=None``) or group."""
        out_features, in_features = weight.shape
        group = _check_group(in_features, group_size)
        granularity = PerAxis(0) if group_size is None else PerGroup(group)
        rotation = as_rotation(rotation, in_features)
        w = transform_weight(weight, check_input_scale(input_scale, in_features), rotation)
        qp = given_or_chosen(w, BITS, granularity, False, weight_qparams)
        codes = quantize(w, qp, BITS, granularity, symmetric=False)  # (out, in) uint8 in [0, 15]
        scales = qp.scale.reshape(out_features, -1).contiguous()
        zeros = qp.zero_point.reshape(out_features, -1).to(torch.uint8).contiguous()
        b = None if bias is None else bias.detach().float().clone()
        return cls(
            pack_int4(codes),
            scales,
            zeros,
            b,
            in_features,
            group_size,
            input_scale=input_scale,
            rotation=rotation,
        )

    @property
    def group(self) -> int:
        return self.in_features if self.group_size is None else self.group_size

    def dequantized_weight(self) -> Tensor:
        """Ŵ = s · (q − z) in float32, (out, in) — equal to the fake-quantised weight."""
        codes = unpack_int4(self.qweight, self.in_features).float()
        codes = codes.view(self.out_features, -1, self.group)  # (out, groups, g)
        zeros, scales = self.zeros.float().unsqueeze(-1), self.scales.unsqueeze(-1)
        return ((codes - zeros) * scales).view(self.out_features, self.in_features)

    def _forward(self, x: Tensor) -> Tensor:
        x = transform_input(x, self.input_scale, self.rotation)
        if self._fast_path_ok(x):
            self.__dict__["last_path"] = "int4pack"
            return self._forward_int4pack(x)
        y = paths.weight_only_forward(self, x, self.qweight, True, self.scales, self.zeros, self.bias)
        if y is not None:  # float32 on CPU: the compiled kernels (paths.py)
            return y
        w = self.dequantized_weight().to(x.dtype)
        return F.linear(x, w, None if self.bias is None else self.bias.to(x.dtype))

    def fast_direct(self) -> bool:
        return self.rotation is None and self.input_scale is None

    # ---------------------------------------------------------------------------------- CPU bf16 fast path

    def kernel_group(self) -> int | None:
        """The group size the CPU int4 kernel would use, or None when the shape does not fit it."""
        if self.out_features % 16:
            return None
        if self.group_size is not None:
            return self.group_size if self.group_size in KERNEL_GROUPS else None
        # per channel: any kernel group that tiles the row works, since (s, z) are repeated over its groups
        return next((g for g in KERNEL_GROUPS if self.in_features % g == 0), None)

    def _fast_path_ok(self, x: Tensor) -> bool:
        return (
            x.dtype == torch.bfloat16
            and x.device.type == "cpu"
            and self.kernel_group() is not None
            and int4pack_available("cpu")
        )

    def _int4pack_weights(self) -> tuple[Tensor, Tensor, int]:
        if self._kernel_cache is None or self._kernel_cache[0].device != self.qweight.device:
            group = self.kernel_group()
            codes = unpack_int4(self.qweight, self.in_features).to(
                torch.int32
            )  # (out, in): the kernel's input
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
            repeat = self.group // group  # > 1 only for per-channel quantisation
            s = self.scales.repeat_interleave(repeat, dim=1)  # (out, in/group)
            z = self.zeros.float().repeat_interleave(repeat, dim=1)
            # theirs: (q − 8)·scale + zero; ours: s·(q − z)  ⇒  scale = s, zero = s·(8 − z)
            pair = torch.stack((s, s * (8 - z)), dim=-1).transpose(0, 1)  # (in/group, out, 2)
            self._kernel_cache = (packed, pair.to(torch.bfloat16).contiguous(), group)
        return self._kernel_cache

    def _forward_int4pack(self, x: Tensor) -> Tensor:
        packed, pair, group = self._int4pack_weights()
        x2 = x.reshape(-1, self.in_features)
        y = torch._weight_int4pack_mm_for_cpu(x2.contiguous(), packed, group, pair)  # (M, out) bf16
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def invalidate(self) -> None:
        super().invalidate()
        self._kernel_cache = None  # a device move or a loaded state dict invalidates the kernel-format copy

    # ------------------------------------------------------------------------------------------- reporting

    def derived_tensors(self) -> tuple[Tensor | None, ...]:
        """The kernel-format copy of the bf16 fast path, once built."""
        return () if self._kernel_cache is None else self._kernel_cache[:2]

    def weight_nbytes(self) -> int:
        """Bytes of the quantised weight alone: packed codes + scales + zeros (what replaces the float weight)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))

    def extra_repr(self) -> str:
        gran = "per output channel" if self.group_size is None else f"per group of {self.group_size}"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"int4 zeropoint {gran}, packed 2/byte, {self.nbytes() / 2**20:.2f} MiB"
        )


@functools.cache
def int4pack_available(device: str = "cpu") -> bool:
    """Whether torch's int4 pack + matmul kernels run: "cpu" tries the _for_cpu pair on a tiny problem,
    "cuda" checks for tinygemm (``_weight_int4pack_mm``) and a GPU (not used by Int4Linear: it dequantises)."""
    if device != "cpu":
        return torch.cuda.is_available() and hasattr(torch.ops.aten, "_weight_int4pack_mm")
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 32, dtype=torch.int32), 1)
        pair = torch.ones(1, 16, 2, dtype=torch.bfloat16)
        torch._weight_int4pack_mm_for_cpu(torch.ones(1, 32, dtype=torch.bfloat16), packed, 32, pair)
    except (AttributeError, RuntimeError, NotImplementedError):
        return False
    return True
