"""Building real layers: :func:`make_real_linear` calls the builder of the first :data:`~.registry.REAL_KERNELS` entry;
what each layer runs on this machine (:func:`kernel_paths`, :func:`available_backends`) for ``qbench env``."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.kernels.base import LayerInputs
from qbench.quant.kernels.bnb import build_bnb
from qbench.quant.kernels.int4 import int4pack_available
from qbench.quant.kernels.int8 import build_w8a8, int_mm_available
from qbench.quant.kernels.lowbit import build_weight_only
from qbench.quant.kernels.registry import PATH_LAYERS, REAL_KERNELS, real_kernel_for
from qbench.quant.kernels.w4a8 import build_w4a8
from qbench.quant.kernels.w8 import build_w8_weight_only
from qbench.quant.primitives import QParams
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
    weight_qparams: QParams | None = None,
) -> nn.Module:
    """A real-kernel layer computing the same function as ``FakeQuantLinear(weight, bias, scheme, …)``.

    ``act_static`` / ``out_static``: calibrated ``static.StaticQuantizer``s of a ``static=true`` scheme;
    ``weight_qparams``: the weight grid an algorithm fixed (GPTQ), used instead of round-to-nearest's choice.
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
    inputs = LayerInputs(input_scale, rotation, act_static, out_static, weight_qparams)
    return build(kernel.layer, weight, bias, scheme, inputs)


def build(
    layer: str, weight: Tensor, bias: Tensor | None, scheme: QuantScheme, inputs: LayerInputs
) -> nn.Module:
    """The builder of the registry entry whose layer is ``layer``, called with ``make_real_linear``'s arguments.

    Written out, not a table: a reader follows a scheme from the registry's choice straight into its layer's file.
    The builders live beside their layers; the registry only names them, as it must stay importable without torch
    (``qbench ls schemes`` reads it) and every layer file imports torch."""
    match layer:
        case "BnbLinear":
            return build_bnb(weight, bias, scheme, inputs)
        case "Int8Linear":
            return build_w8a8(weight, bias, scheme, inputs)
        case "Int4A8Linear":
            return build_w4a8(weight, bias, scheme, inputs)
        case "Int8WeightOnlyLinear":
            return build_w8_weight_only(weight, bias, scheme, inputs)
        case "Int4Linear / LowBitLinear":
            return build_weight_only(weight, bias, scheme, inputs)
    raise AssertionError(f"the registry names layer {layer!r}, which has no builder in dispatch.build")


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
