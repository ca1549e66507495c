"""Real quantised linear layers: what ``quantize(model, scheme, mode="real")`` puts in place of each linear.

``make_real_linear(weight, bias, scheme, input_scale=, rotation=)`` takes the same arguments as
``FakeQuantLinear`` and computes the same function with real low-precision storage and kernels:

=====================================  ==============================  =========================================
scheme (method, bits)                  module                          kernel
=====================================  ==============================  =========================================
rtn / smoothquant / hadamard, W8A8     :class:`~.int8.Int8Linear`      ``torch._int_mm`` (int8×int8→int32)
absmax (W per channel or tensor,
A per token or per sequence,
optional O8 per sequence)
rtn / hadamard, W4 zeropoint,          :class:`~.int4.Int4Linear`      dequantise on the fly; CPU bf16:
weight-only (per channel or group)                                     ``_weight_int4pack_mm_for_cpu``
llm-int8                               :class:`~.bnb.BnbLinear`        bitsandbytes ``Linear8bitLt``
bnb-nf4                                :class:`~.bnb.BnbLinear`        bitsandbytes ``Linear4bit`` (nf4)
=====================================  ==============================  =========================================

Anything else (another bit width, asymmetric int8, per-input-channel activation scales, a group-wise int8 weight)
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
from qbench.quant.schemes import QuantScheme

__all__ = [
    "Int4Linear",
    "Int8Linear",
    "available_backends",
    "int_mm",
    "make_real_linear",
    "pack_int4",
    "unpack_int4",
]

REAL_KERNELS = (
    "W8A8 absmax (W per channel/tensor, A per token/sequence, optional O8 per sequence)",
    "W4 zeropoint weight-only (per channel/group)",
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
) -> nn.Module:
    """A real-kernel layer computing the same function as ``FakeQuantLinear(weight, bias, scheme, …)``."""
    if scheme.method in ("llm-int8", "bnb-nf4"):
        return _bnb_linear(weight, bias, scheme, input_scale, rotation)
    if scheme.method == "smoothquant" and input_scale is None:
        raise UserError(f"scheme {scheme.name!r}: smoothquant needs calibrated input scales (input_scale)")
    if scheme.method == "hadamard" and rotation is None:
        raise UserError(f"scheme {scheme.name!r}: hadamard needs a rotation")
    if _is_w8a8(scheme):
        return Int8Linear.from_float(
            weight,
            bias,
            weight_granularity="per_channel" if _per_out_channel(scheme) else "per_tensor",
            act="per_token" if isinstance(scheme.act_granularity, PerToken) else "per_tensor",
            out_quant=scheme.out_bits is not None,
            input_scale=input_scale,
            rotation=rotation,
        )
    if _is_w4_weight_only(scheme):
        g = scheme.weight_granularity
        return Int4Linear.from_float(
            weight,
            bias,
            g.group_size if isinstance(g, PerGroup) else None,
            input_scale=input_scale,
            rotation=rotation,
        )
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


def _is_w4_weight_only(scheme: QuantScheme) -> bool:
    g = scheme.weight_granularity
    return (
        scheme.weight_bits == 4
        and not scheme.weight_symmetric
        and scheme.act_bits is None
        and scheme.out_bits is None
        and (_per_out_channel(scheme) or isinstance(g, PerGroup))
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


def available_backends() -> dict[str, bool]:
    """Which real kernels work here: integer GEMM and int4 packing per device, and bitsandbytes."""
    from qbench.quant.kernels.bnb import bnb_available

    cuda = torch.cuda.is_available()
    return {
        "int8 _int_mm (cpu)": int_mm_available("cpu"),
        "int8 _int_mm (cuda)": cuda and int_mm_available("cuda"),
        "int4 pack (cpu, bf16)": int4pack_available("cpu"),
        "int4 pack (cuda)": cuda and int4pack_available("cuda"),
        "bitsandbytes": bnb_available(),
    }
