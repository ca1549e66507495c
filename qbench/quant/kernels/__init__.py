"""Real quantised linear layers: what ``quantize(model, scheme, mode="real")`` puts in place of each linear.

``make_real_linear(weight, bias, scheme, input_scale=, rotation=)`` takes the same arguments as
``FakeQuantLinear`` and computes the same function with real low-precision storage and kernels. Which layer a
scheme gets is decided by one registry, :data:`REAL_KERNELS`: an ordered list of :class:`RealKernel` entries —
what it covers, its layer class, its kernels, a predicate on the scheme and a builder — the first entry whose
predicate holds builds the layer. ``qbench ls schemes`` (its real-kernel column), ``qbench env``, ``qbench speed``
and the table in docs/schemes.md (:func:`kernels_table`; a test keeps the page equal to it) are generated from
it. Adding an integer format with a real kernel: write the layer (on :class:`~.base.RealLinear`) and its kernel,
add one entry here, and test it against fake mode.

The kernel tree: every compiled or GPU kernel of qbench lives in this package (a layout test holds it so).
``native_ref.c`` / ``native_avx2.c`` / ``native.c`` (+ ``native.h``) are the real layers' C library — portable
reference loops, AVX2 loops, and the entry points choosing between them at build time; ``native.py`` loads it
(``build.py``: the one compiler lookup) and wraps it; ``_ops.py`` registers the wrappers as ``torch.ops.qbench``
custom ops so compiled models keep them; ``paths.py`` decides which kernel a layer runs. ``fake_quant.c`` +
``fake_cpu.py`` and ``triton_fake.py`` serve ``qbench::fake_quantize`` (``qbench.quant.ops``).

Anything else (another bit width, per-input-channel activation scales, an asymmetric or group-wise int8 weight
with int8 activations)
has no integer kernel here and raises :class:`UserError` — run it with ``mode="fake"``. ``weight`` is always
(out, in); the caller transposes GPT-2 ``Conv1D`` weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
    "REAL_KERNELS",
    "Int4A8Linear",
    "Int4Linear",
    "Int8Linear",
    "LowBitLinear",
    "RealKernel",
    "available_backends",
    "int_mm",
    "kernel_paths",
    "kernels_table",
    "make_real_linear",
    "pack_bits",
    "pack_int4",
    "real_kernel_for",
    "unpack_bits",
    "unpack_int4",
]


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
    return kernel.build(weight, bias, scheme, input_scale, rotation, act_static, out_static)


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
    """int4 absmax weights (per output channel or group) × int8 absmax activations per token / sequence, dynamic."""
    return (
        not scheme.static
        and scheme.weight_bits == 4
        and scheme.weight_symmetric
        and (_per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
        and scheme.act_bits == 8
        and scheme.act_symmetric
        and isinstance(scheme.act_granularity, PerToken | PerTensor)
        and scheme.out_bits is None
    )


def _is_w8_weight_only(scheme: QuantScheme) -> bool:
    """Weight-only int8 (W8A16-style), per output channel or per group, either symmetry."""
    return (
        scheme.weight_bits == 8
        and scheme.act_bits is None
        and scheme.out_bits is None
        and (_per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
    )


def _w8_weight_only_linear(weight, bias, scheme, input_scale, rotation, act_static, out_static) -> nn.Module:
    from qbench.quant.kernels.w8 import Int8WeightOnlyLinear

    g = scheme.weight_granularity_for(weight.shape[1])
    group = g.group_size if isinstance(g, PerGroup) else None
    return Int8WeightOnlyLinear.from_float(
        weight, bias, group, scheme.weight_symmetric, input_scale=input_scale, rotation=rotation
    )


def _is_weight_only_lowbit(scheme: QuantScheme) -> bool:
    """Weight-only 2/3/4-bit, per output channel or per group, either symmetry (the grouped schemes)."""
    return (
        scheme.weight_bits in PACKED_BITS
        and scheme.act_bits is None
        and scheme.out_bits is None
        and (_per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
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


# --------------------------------------------------------------------------------------------- the registry


Builder = Callable[..., nn.Module]  # (weight, bias, scheme, input_scale, rotation, act_static, out_static)


@dataclass(frozen=True)
class RealKernel:
    """One real layer: which schemes it serves (``applies``), how it is built, and what to call it."""

    covers: str  # the schemes it serves, in words (error messages, docs)
    layer: str  # its class name, as records' ``backend`` names it
    kernels: str  # what computes it, per device
    applies: Callable[[QuantScheme], bool]
    build: Builder
    paths: tuple[tuple[str, str], ...] = ()  # (label, kind in ``paths.choose``) for ``qbench env``
    native: tuple[str, ...] = ()  # its layer classes that compiled C kernels serve on the CPU


def _is_bnb(scheme: QuantScheme) -> bool:
    return scheme.method in ("llm-int8", "bnb-nf4")


# First match wins: the order is the dispatch.
REAL_KERNELS: tuple[RealKernel, ...] = (
    RealKernel(
        "llm-int8 and bnb-nf4 (bitsandbytes)",
        "BnbLinear",
        "bitsandbytes Linear8bitLt / Linear4bit (nf4), CPU and CUDA",
        _is_bnb,
        _bnb_linear,
    ),
    RealKernel(
        "W8A8 absmax (W per channel/tensor, A per token/sequence or static per tensor, optional O8 per sequence)",
        "Int8Linear",
        "CPU: C int8 GEMV/GEMM, torch._int_mm where faster; CUDA: torch._int_mm",
        lambda s: not _is_bnb(s) and _is_w8a8(s),
        _w8a8_linear,
        (("W8A8 (Int8Linear)", "w8a8"),),
        native=("Int8Linear",),
    ),
    RealKernel(
        "W4A8 absmax (W per channel or group, A per token/sequence)",
        "Int4A8Linear",
        "CPU: C int4×int8 GEMV/GEMM, torch._int_mm on the codes unpacked to int8 where faster (groups of 32 or "
        "64·n; others torch); else F.linear on s_x·q and Ŵ",
        lambda s: not _is_bnb(s) and _is_w4a8(s),
        _w4a8_linear,
        (("W4A8 (Int4A8Linear)", "w4a8"),),
        native=("Int4A8Linear",),
    ),
    RealKernel(
        "W8 weight-only (W8A16-style), zeropoint or absmax, per channel/group",
        "Int8WeightOnlyLinear",
        "CPU fp32: C kernels reading the codes; else dequantise on the fly",
        lambda s: not _is_bnb(s) and _is_w8_weight_only(s),
        _w8_weight_only_linear,
        (("W8 weight-only (Int8WeightOnlyLinear)", "w8"),),
        native=("Int8WeightOnlyLinear",),
    ),
    RealKernel(
        "W2/W3/W4 weight-only, zeropoint or absmax, per channel/group "
        "(W4 zeropoint → Int4Linear where the group divides the row, else LowBitLinear)",
        "Int4Linear / LowBitLinear",
        "Int4Linear: CPU fp32 C kernels, CPU bf16 torch int4pack; LowBitLinear: CPU fp32 C kernels reading the "
        "packed codes (≤ 16 rows; above: C dequantise + sgemm); else dequantise on the fly",
        lambda s: not _is_bnb(s) and _is_weight_only_lowbit(s),
        _weight_only_linear,
        (
            ("W4 zeropoint weight-only (Int4Linear)", "w4"),
            ("W2/W3/W4-absmax weight-only (LowBitLinear)", "lowbit"),
        ),
        native=("Int4Linear", "LowBitLinear"),
    ),
)

# (what ``qbench env`` calls a layer, its kind in ``paths.choose``), from the registry
PATH_LAYERS = tuple(path for kernel in REAL_KERNELS for path in kernel.paths)
# Real layer classes with compiled C kernels on the CPU (``qbench speed`` names the instruction set for them)
NATIVE_LAYERS = tuple(name for kernel in REAL_KERNELS for name in kernel.native)


def real_kernel_for(scheme: QuantScheme) -> RealKernel | None:
    """The registry entry that builds ``scheme``'s real layer (None: fake mode only). Floating-point formats
    never have one (``quantize`` refuses them before asking)."""
    if getattr(scheme, "format", "int") != "int":
        return None
    return next((k for k in REAL_KERNELS if k.applies(scheme)), None)


def kernels_table() -> str:
    """The registry as a markdown table (docs/schemes.md holds it; a test keeps them equal)."""
    lines = ["| real layer | serves | kernels |", "|---|---|---|"]
    lines += [f"| `{k.layer}` | {k.covers} | {k.kernels} |" for k in REAL_KERNELS]
    return "\n".join(lines) + "\n"


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
