"""The real-kernel registry: which real layer serves which scheme — the dispatch, described without torch.

An ordered list of :class:`RealKernel` entries (what it covers, its layer class, its kernels, a predicate on the
scheme); the first entry whose predicate holds builds the layer (``dispatch.make_real_linear``, through the
builder ``dispatch.BUILDERS`` holds for its layer). ``qbench ls schemes`` (its real-kernel column), ``qbench env``, ``qbench speed``
and the table in docs/schemes.md (:func:`kernels_table`; a test keeps the page equal to it) read it. The
predicates look only at a scheme's fields, so listing schemes imports no torch. Adding an integer format with a
real kernel: write the kernel, the layer (on :class:`~.base.RealLinear`) with its builder in the same file, and
one entry here; test it against fake mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qbench.quant.granularity import PerAxis, PerGroup, PerTensor, PerToken
from qbench.quant.schemes import QuantScheme

if TYPE_CHECKING:
    pass

PACKED_BITS = (2, 3, 4)  # the weight-only widths LowBitLinear packs (lowbit.py)


def per_out_channel(scheme: QuantScheme) -> bool:
    return isinstance(scheme.weight_granularity, PerAxis) and scheme.weight_granularity.axis in (0, -2)


def _is_w8a8(scheme: QuantScheme) -> bool:
    weight_ok = (
        scheme.weight_bits == 8
        and scheme.weight_symmetric
        and (per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerTensor))
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
    """int4 weights, absmax or zero-point (per output channel or group) × int8 absmax activations per token /
    sequence, dynamic."""
    return (
        not scheme.static
        and scheme.weight_bits == 4
        and (per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
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
        and (per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
    )


def _is_weight_only_lowbit(scheme: QuantScheme) -> bool:
    """Weight-only 2/3/4-bit, per output channel or per group, either symmetry (the grouped schemes)."""
    return (
        scheme.weight_bits in PACKED_BITS
        and scheme.act_bits is None
        and scheme.out_bits is None
        and (per_out_channel(scheme) or isinstance(scheme.weight_granularity, PerGroup))
    )


# --------------------------------------------------------------------------------------------- the registry


@dataclass(frozen=True)
class RealKernel:
    """One real layer: which schemes it serves (``applies``) and what to call it (its builder: ``dispatch.BUILDERS``)."""

    covers: str  # the schemes it serves, in words (error messages, docs)
    layer: str  # its class name, as records' ``backend`` names it
    kernels: str  # what computes it, per device
    applies: Callable[[QuantScheme], bool]
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
    ),
    RealKernel(
        "W8A8 absmax (W per channel/tensor, A per token/sequence or static per tensor, optional O8 per sequence)",
        "Int8Linear",
        "CPU: C int8 GEMV/GEMM, torch._int_mm where faster; CUDA: torch._int_mm",
        lambda s: not _is_bnb(s) and _is_w8a8(s),
        (("W8A8 (Int8Linear)", "w8a8"),),
        native=("Int8Linear",),
    ),
    RealKernel(
        "W4A8 (W int4 absmax or zero-point per channel or group, A int8 absmax per token/sequence)",
        "Int4A8Linear",
        "CPU: C int4×int8 GEMV/GEMM, torch._int_mm on the codes unpacked to int8 where faster (groups of 32 or "
        "64·n; others torch); else F.linear on s_x·q and Ŵ",
        lambda s: not _is_bnb(s) and _is_w4a8(s),
        (("W4A8 (Int4A8Linear)", "w4a8"),),
        native=("Int4A8Linear",),
    ),
    RealKernel(
        "W8 weight-only (W8A16-style), zeropoint or absmax, per channel/group",
        "Int8WeightOnlyLinear",
        "CPU fp32: C kernels reading the codes; else dequantise on the fly",
        lambda s: not _is_bnb(s) and _is_w8_weight_only(s),
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
    if getattr(scheme, "format", "int") != "int" or getattr(scheme, "method", "rtn") == "gguf":
        return (
            None  # float formats: fake only; llama.cpp's file types: llama.cpp's own kernels (quant.llamacpp)
        )
    return next((k for k in REAL_KERNELS if k.applies(scheme)), None)


def kernels_table() -> str:
    """The registry as a markdown table (docs/schemes.md holds it; a test keeps them equal)."""
    lines = ["| real layer | serves | kernels |", "|---|---|---|"]
    lines += [f"| `{k.layer}` | {k.covers} | {k.kernels} |" for k in REAL_KERNELS]
    return "\n".join(lines) + "\n"
