"""Real quantised linear layers: what ``quantize(model, scheme, mode="real")`` puts in place of each linear.

``make_real_linear(weight, bias, scheme, input_scale=, rotation=)`` takes the same arguments as
``FakeQuantLinear`` and computes the same function with real low-precision storage and kernels:

=====================================  ==============================  =========================================
scheme (method, bits)                  module                          kernel
=====================================  ==============================  =========================================
rtn / smoothquant / hadamard, W8A8     :class:`~.int8.Int8Linear`      CPU: C int8 GEMV/GEMM (``native.c``),
absmax (W per channel or tensor,                                       ``torch._int_mm`` where faster; CUDA:
A per token or per sequence,                                           ``torch._int_mm`` (int8×int8→int32)
optional O8 per sequence)
rtn / hadamard, W4 zeropoint,          :class:`~.int4.Int4Linear`      CPU fp32: C kernels (``paths.py``);
weight-only (per channel or group)                                     CPU bf16: ``_weight_int4pack_mm_for_cpu``;
                                                                       else dequantise on the fly
W2/W3 (either symmetry), W4 absmax,    :class:`~.lowbit.LowBitLinear`  packed codes, dequantise on the fly
weight-only (per channel or group)
rtn / smoothquant / hadamard, W4A8     ``w4a8.Int4A8Linear``           CPU: C int4×int8 GEMV/GEMM
absmax (W per channel or group of                                      (``native.c``); else F.linear on
32 or 64·n, A per token or sequence)                                   s_x·q and Ŵ (fake's arithmetic)
W8A8 static (calibrated per-tensor     :class:`~.int8.Int8Linear`      ``torch._int_mm``, eager
activation/output scales)
W8 weight-only (W8A16-style,           ``w8.Int8WeightOnlyLinear``     CPU fp32: C kernels (``paths.py``);
per channel or group)                                                  else dequantise on the fly
llm-int8                               :class:`~.bnb.BnbLinear`        bitsandbytes ``Linear8bitLt``
bnb-nf4                                :class:`~.bnb.BnbLinear`        bitsandbytes ``Linear4bit`` (nf4)
=====================================  ==============================  =========================================

Anything else (another bit width, per-input-channel activation scales, an asymmetric or group-wise int8 weight
with int8 activations)
has no integer kernel here and raises :class:`UserError` — run it with ``mode="fake"``. ``weight`` is always
(out, in); the caller transposes GPT-2 ``Conv1D`` weights.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.granularity import PerAxis, PerGroup, PerTensor, PerToken
from qbench.quant.kernels.int4 import Int4Linear, int4pack_available, pack_int4, unpack_int4
from qbench.quant.kernels.int8 import Int8Linear, int_mm, int_mm_available
from qbench.quant.kernels.lowbit import PACKED_BITS, LowBitLinear, pack_bits, unpack_bits
from qbench.quant.kernels.w4a8 import Int4A8Linear
from qbench.quant.schemes import QuantScheme

__all__ = [
    "Int4A8Linear",
    "Int4Linear",
    "Int8Linear",
    "LowBitLinear",
    "available_backends",
    "int_mm",
    "kernel_paths",
    "make_real_linear",
    "pack_bits",
    "pack_int4",
    "unpack_bits",
    "unpack_int4",
]

REAL_KERNELS = (
    "W8A8 absmax (W per channel/tensor, A per token/sequence, optional O8 per sequence)",
    "W8A8 with static per-tensor activation/output scales",
    "W4A8 absmax (W per channel or group of 32 / 64·n, A per token/sequence)",
    "W2/W3/W4 weight-only, zeropoint or absmax (per channel/group)",
    "W8 weight-only (W8A16-style), zeropoint or absmax (per channel/group)",
    "llm-int8",
    "bnb-nf4",
)


def make_real_linear(
    weight: Tensor,
    bias: Tensor | None,
    scheme: QuantScheme,
    *,
    input_scale: Tensor | None = None,
    rotation: nn.Module | Tensor | None = None,
    act_static: nn.Module | None = None,
    out_static: nn.Module | None = None,
) -> nn.Module:
    """A real-kernel layer computing the same function as ``FakeQuantLinear(weight, bias, scheme, …)``.

    ``act_static`` / ``out_static``: calibrated ``static.StaticQuantizer``s of a ``static=true`` scheme.
    """
    if scheme.method in ("llm-int8", "bnb-nf4"):
        return _bnb_linear(weight, bias, scheme, input_scale, rotation)
    if scheme.method == "smoothquant" and input_scale is None:
        raise UserError(f"scheme {scheme.name!r}: smoothquant needs calibrated input scales (input_scale)")
    if scheme.method == "hadamard" and rotation is None:
        raise UserError(f"scheme {scheme.name!r}: hadamard needs a rotation")
    if scheme.static and scheme.act_bits is not None and act_static is None:
        raise UserError(
            f"scheme {scheme.name!r}: static scales need calibration (quantize(..., calibration=…))"
        )
    if _is_w8a8(scheme):
        return Int8Linear.from_float(
            weight,
            bias,
            weight_granularity="per_channel" if _per_out_channel(scheme) else "per_tensor",
            act="per_token" if isinstance(scheme.act_granularity, PerToken) else "per_tensor",
            out_quant=scheme.out_bits is not None,
            input_scale=input_scale,
            rotation=rotation,
            static_act_scale=None if act_static is None else act_static.scale,
            static_out_scale=None if out_static is None else out_static.scale,
        )
    if _is_w4a8(scheme) and act_static is None:
        g = scheme.weight_granularity_for(weight.shape[1])  # a group ≥ the row is per channel
        group = g.group_size if isinstance(g, PerGroup) else None
        return Int4A8Linear.from_float(
            weight,
            bias,
            group,
            act="per_token" if isinstance(scheme.act_granularity, PerToken) else "per_tensor",
            input_scale=input_scale,
            rotation=rotation,
        )
    if _is_w8_weight_only(scheme):
        return _w8_weight_only_linear(weight, bias, scheme, input_scale, rotation)
    if _is_weight_only_lowbit(scheme):
        return _weight_only_linear(weight, bias, scheme, input_scale, rotation)
    raise UserError(
        f"scheme {scheme.name!r} ({scheme.label}) has no real kernel; real kernels exist for: "
        f"{'; '.join(REAL_KERNELS)}. Run it with mode='fake'"
    )


def _per_out_channel(scheme: QuantScheme) -> bool:
    return isinstance(scheme.weight_granularity, PerAxis) and scheme.weight_granularity.axis in (0, -2)


def _is_w8a8(scheme: QuantScheme) -> bool:
    weight_ok = (
        scheme.weight_bits == 8
        and scheme.weight_symmetric
        and (_per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerTensor))
    )
    act_ok = (
        scheme.act_bits == 8
        and scheme.act_symmetric
        and isinstance(scheme.act_granularity, PerToken | PerTensor)
    )
    out_ok = scheme.out_bits is None or (
        scheme.out_bits == 8 and scheme.out_symmetric and isinstance(scheme.out_granularity, PerTensor)
    )
    return weight_ok and act_ok and out_ok


def _is_w4a8(scheme: QuantScheme) -> bool:
    """int4 absmax weights (per output channel or group) × int8 absmax activations per token / sequence."""
    return (
        scheme.weight_bits == 4
        and scheme.weight_symmetric
        and (_per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
        and scheme.act_bits == 8
        and scheme.act_symmetric
        and isinstance(scheme.act_granularity, PerToken | PerTensor)
        and scheme.out_bits is None
    )


def _is_w8_weight_only(scheme: QuantScheme) -> bool:
    """Weight-only int8 (W8A16-style), per output channel or per group, either symmetry (KERN)."""
    return (
        scheme.weight_bits == 8
        and scheme.act_bits is None
        and scheme.out_bits is None
        and (_per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
    )


def _w8_weight_only_linear(
    weight: Tensor, bias: Tensor | None, scheme: QuantScheme, input_scale: Tensor | None, rotation: object
) -> nn.Module:
    from qbench.quant.kernels.w8 import Int8WeightOnlyLinear

    g = scheme.weight_granularity_for(weight.shape[1])
    group = g.group_size if isinstance(g, PerGroup) else None
    return Int8WeightOnlyLinear.from_float(
        weight, bias, group, scheme.weight_symmetric, input_scale=input_scale, rotation=rotation
    )


def _is_weight_only_lowbit(scheme: QuantScheme) -> bool:
    """Weight-only 2/3/4-bit, per output channel or per group, either symmetry (SCHEME's grouped schemes)."""
    return (
        scheme.weight_bits in PACKED_BITS
        and scheme.act_bits is None
        and scheme.out_bits is None
        and (_per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
    )


def _weight_only_linear(
    weight: Tensor, bias: Tensor | None, scheme: QuantScheme, input_scale: Tensor | None, rotation: object
) -> nn.Module:
    """Asymmetric int4 -> Int4Linear (torch's int4 kernel with bf16); int2/int3, symmetric int4 and a group that
    does not divide the row (a shorter last group) -> LowBitLinear."""
    g = scheme.weight_granularity_for(weight.shape[1])  # a group ≥ the row is per channel
    group = g.group_size if isinstance(g, PerGroup) else None
    if scheme.weight_bits == 4 and not scheme.weight_symmetric and not weight.shape[1] % (group or 1):
        return Int4Linear.from_float(weight, bias, group, input_scale=input_scale, rotation=rotation)
    return LowBitLinear.from_float(
        weight,
        bias,
        scheme.weight_bits,
        g,
        scheme.weight_symmetric,
        input_scale=input_scale,
        rotation=rotation,
    )


def _bnb_linear(
    weight: Tensor,
    bias: Tensor | None,
    scheme: QuantScheme,
    input_scale: Tensor | None,
    rotation: nn.Module | Tensor | None,
) -> nn.Module:
    from qbench.quant.kernels.bnb import bnb_int8_linear, bnb_nf4_linear

    if input_scale is not None or rotation is not None:
        raise UserError(f"scheme {scheme.name!r}: bitsandbytes layers take no input scale or rotation")
    if scheme.method == "llm-int8":
        return bnb_int8_linear(weight, bias, threshold=float(scheme.param("threshold")))
    return bnb_nf4_linear(weight, bias, blocksize=int(scheme.param("blocksize")))


# (what ``qbench env`` calls a layer, its kind in ``paths.choose``)
PATH_LAYERS = (
    ("W8A8 (Int8Linear)", "w8a8"),
    ("W4A8 (Int4A8Linear)", "w4a8"),
    ("W4 zeropoint weight-only (Int4Linear)", "w4"),
    ("W8 weight-only (Int8WeightOnlyLinear)", "w8"),
    ("W2/W3/W4-absmax weight-only (LowBitLinear)", "lowbit"),
)


def kernel_paths(rows: tuple[int, ...] = (1, 512)) -> dict[str, str]:
    """What each real layer runs on this CPU for float32 input at each row count, from the dispatch itself
    (``paths.choose``), the instruction set that decided it, and bitsandbytes' compute dtype."""
    from qbench.quant.kernels import paths
    from qbench.quant.kernels.bnb import bnb_available, dtype_name, nf4_cpu_compute_dtype

    out = {"cpu instruction set": paths.instruction_set()}
    for name, kind in PATH_LAYERS:
        out[f"path {name}"] = "; ".join(f"{r} row{'s' * (r != 1)}: {paths.describe(kind, r)}" for r in rows)
    if int4pack_available("cpu"):
        out["path W4 zeropoint weight-only (Int4Linear)"] += "; bf16 input: torch int4pack (bf16 scales)"
    if bnb_available():
        nf4 = dtype_name(nf4_cpu_compute_dtype())
        repack = " (fp32 where out % 32 or in % blocksize ≠ 0)" if nf4 == "bf16" else ""
        out["path bnb-nf4 (BnbLinear)"] = f"bitsandbytes, {nf4} compute{repack}"
        out["path llm-int8 (BnbLinear)"] = "bitsandbytes int8 with fp16 outlier columns (fp16 compute)"
    return out


def available_backends() -> dict[str, bool]:
    """Which real kernels work here: the compiled C kernels, integer GEMM and int4 packing per device, bitsandbytes."""
    from qbench.quant.kernels import native
    from qbench.quant.kernels.bnb import bnb_available

    cuda = torch.cuda.is_available()
    isa = native.isa() if native.available() else None
    return {
        f"C kernels: W8A8, W4A8, weight-only (cpu{', ' + isa if isa else ''})": isa is not None,
        "int8 _int_mm (cpu)": int_mm_available("cpu"),
        "int8 _int_mm (cuda)": cuda and int_mm_available("cuda"),
        "int4 pack (cpu, bf16)": int4pack_available("cpu"),
        "int4 pack (cuda)": cuda and int4pack_available("cuda"),
        "bitsandbytes": bnb_available(),
    }
