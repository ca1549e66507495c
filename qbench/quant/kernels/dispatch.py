"""Building real layers: :func:`make_real_linear` and one builder per :data:`~.registry.REAL_KERNELS` entry;
what each layer runs on this machine (:func:`kernel_paths`, :func:`available_backends`) for ``qbench env``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.granularity import PerGroup, PerToken
from qbench.quant.kernels.int4 import Int4Linear, int4pack_available
from qbench.quant.kernels.int8 import Int8Linear, int_mm_available
from qbench.quant.kernels.lowbit import LowBitLinear
from qbench.quant.kernels.registry import PATH_LAYERS, REAL_KERNELS, _per_out_channel, real_kernel_for
from qbench.quant.kernels.w4a8 import Int4A8Linear
from qbench.quant.schemes import QuantScheme


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
    if scheme.method == "smoothquant" and input_scale is None:
        raise UserError(f"scheme {scheme.name!r}: smoothquant needs calibrated input scales (input_scale)")
    if scheme.method == "hadamard" and rotation is None:
        raise UserError(f"scheme {scheme.name!r}: hadamard needs a rotation")
    if scheme.static and scheme.act_bits is not None and act_static is None:
        raise UserError(
            f"scheme {scheme.name!r}: static scales need calibration (quantize(..., calibration=…))"
        )
    kernel = real_kernel_for(scheme)
    if kernel is None:
        raise UserError(
            f"scheme {scheme.name!r} ({scheme.label}) has no real kernel; real kernels exist for: "
            f"{'; '.join(k.covers for k in REAL_KERNELS)}. Run it with mode='fake'"
        )
    return globals()[kernel.builder](weight, bias, scheme, input_scale, rotation, act_static, out_static)


def _w8a8_linear(weight, bias, scheme, input_scale, rotation, act_static, out_static) -> nn.Module:
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


def _w4a8_linear(weight, bias, scheme, input_scale, rotation, act_static, out_static) -> nn.Module:
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


def _w8_weight_only_linear(weight, bias, scheme, input_scale, rotation, act_static, out_static) -> nn.Module:
    from qbench.quant.kernels.w8 import Int8WeightOnlyLinear

    g = scheme.weight_granularity_for(weight.shape[1])
    group = g.group_size if isinstance(g, PerGroup) else None
    return Int8WeightOnlyLinear.from_float(
        weight, bias, group, scheme.weight_symmetric, input_scale=input_scale, rotation=rotation
    )


def _weight_only_linear(weight, bias, scheme, input_scale, rotation, act_static, out_static) -> nn.Module:
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


def _bnb_linear(weight, bias, scheme, input_scale, rotation, act_static, out_static) -> nn.Module:
    from qbench.quant.kernels.bnb import bnb_int8_linear, bnb_nf4_linear

    if input_scale is not None or rotation is not None:
        raise UserError(f"scheme {scheme.name!r}: bitsandbytes layers take no input scale or rotation")
    if scheme.method == "llm-int8":
        return bnb_int8_linear(weight, bias, threshold=float(scheme.param("threshold")))
    return bnb_nf4_linear(weight, bias, blocksize=int(scheme.param("blocksize")))


def kernel_paths(rows: tuple[int, ...] = (1, 512)) -> dict[str, str]:
    """What each real layer runs on this CPU for float32 input at each row count, from the dispatch itself
    (``paths.choose``), the instruction set that decided it, and bitsandbytes' compute dtype."""
    from qbench.quant.kernels import paths
    from qbench.quant.kernels.bnb import bnb_available, dtype_name, nf4_cpu_compute_dtype

    out = {"cpu instruction set": paths.instruction_set()}
    for name, kind in PATH_LAYERS:
        out[f"path {name}"] = "; ".join(f"{r} row{'s' * (r != 1)}: {paths.describe(kind, r)}" for r in rows)
    if paths.dispatch_mode() == "rule":
        out["kernel dispatch"] = f"fixed rule ({paths.DISPATCH_ENV}=rule); the paths above"
    else:
        out["kernel dispatch"] = (
            f"measured per shape class at first use, cached in {paths.cache_file()} "
            f"({paths.DISPATCH_ENV}=rule: the fixed rule); the paths above until a class is measured"
        )
        for key, entry in sorted(paths.measured_choices().items()):
            times = ", ".join(f"{p} {ms:g} ms" for p, ms in sorted(entry.get("ms", {}).items()))
            out[f"measured {key}"] = f"{entry.get('path')} ({times})"
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
