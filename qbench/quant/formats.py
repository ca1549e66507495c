"""Floating-point number formats, emulated in fake mode: FP8, OCP Microscaling (MXFP8/6/4) and NVIDIA NVFP4.

Pure functions in torchao's style (``quant_primitives``, ``mx_formats``): inputs are never modified, all arithmetic
is float32 (float64 for float64 input), and the result is cast back to the input's dtype last.

**Element formats** (OCP 8-bit Floating Point Specification (OFP8) rev 1.0; OCP Microscaling Formats (MX) v1.0,
section 5.3): sign, ``exp_bits`` exponent bits with bias 2^(exp_bits−1) − 1, ``man_bits`` mantissa bits,
subnormals, and no infinities. Conversion is round-to-nearest, ties to even on the mantissa, saturating to ±the
largest normal (MX v1.0 §6.3 "clamping normal numbers to max normal"; our choice for FP8, as torchao does):

=========  ====  ====  ===========  ===========  ==================================================
element    bias  emax  max normal   min subnorm  non-negative values
=========  ====  ====  ===========  ===========  ==================================================
E2M1 fp4   1     2     6            0.5          0 0.5 1 1.5 2 3 4 6
E2M3 fp6   1     2     7.5          0.125        k/8 (k < 8), (1 + m/8)·2^e, e ∈ {0, 1, 2}
E3M2 fp6   3     4     28           0.0625       k/16 (k < 4), (1 + m/4)·2^e, e ∈ {−2 … 4}
E4M3 fp8   7     8     448          2^−9         torch.float8_e4m3fn (S.1111.111 is NaN)
E5M2 fp8   15    15    57344        2^−16        torch.float8_e5m2 (exponent 11111 is Inf/NaN)
=========  ====  ====  ===========  ===========  ==================================================

NaN propagates (a NaN element gives a NaN result); ±0 keep their sign; ±inf saturate to ±max normal when rounded
on their own, but in a scaled format they make the scale non-finite (below), so non-finite input gives non-finite
output — the int path raises ``NonFiniteError`` instead, and the harness records either as a non-finite cell.

**Scaled formats** (what a scheme's ``format`` names):

- ``fp8-e4m3`` / ``fp8-e5m2`` — s = max(amax / max_normal, TINY) over each block of the scheme's granularity
  (per tensor, per output channel, per token, per sequence); x̂ = s · fp8(clamp(x / s, ±max_normal)), the
  rounding done by torch's ``float8_e4m3fn`` / ``float8_e5m2`` casts (torchao's float8 tensorwise/rowwise
  recipes; clamping first makes the cast saturate on every torch version).
- ``mxfp8`` (E4M3), ``mxfp8-e5m2``, ``mxfp6`` (E2M3), ``mxfp6-e3m2``, ``mxfp4`` (E2M1) — MX v1.0 §6.3: blocks of
  k = 32 consecutive elements along the last dimension (the reduction axis of x · Wᵀ for both the (out, in)
  weight and the (..., in) activation) share X = 2^shared_exp, shared_exp = floor(log2(max_i |V_i|)) − emax_elem,
  stored as E8M0 (§5.4.1: exponents −127 … 127, no zero, 0xFF = NaN). Ours: shared_exp is clamped below at −127
  (an all-zero block gets X = 2^−127 and stays zero) and is NaN above 127 or when the block holds NaN/inf (the
  E8M0 NaN encoding), as torchao's FLOOR mode does. Elements P_i = round(V_i / X) in the element format,
  saturated; x̂ = X · P_i. Because X rounds the scale *down*, max|V|/X lies in [2^emax, 2^(emax+1)) and the
  largest elements of a block can saturate (e.g. an MXFP4 block whose amax/X = 7.5 stores 6) — that is the spec.
- ``nvfp4`` — NVIDIA's two-level NVFP4 recipe (NVIDIA, "Pretraining Large Language Models with NVFP4", 2025;
  Transformer Engine's quantiser, ``compute_decoding_scaling_factor`` in ``core_nvfp4.cuh``, casts
  amax_block / 6 · S_enc to E4M3 with no lower clamp): blocks of 16 along the last dimension, E2M1 elements; a
  float32 per-tensor scale s_t = amax_tensor / (448 · 6) (for activations per sequence, like every activation
  scale here; floored at TINY); an E4M3 block scale s_b = e4m3(min(amax_block / 6 / s_t, 448)), rounded to
  nearest even by the E4M3 cast *with its subnormals* (2^−9 … 7·2^−9), so a block far below the tensor's amax
  keeps a fine scale; a block whose scale rounds to zero in E4M3 (a zero block, or amax_block / 6 / s_t ≤ 2^−10)
  gets s_b = 0 and is stored as zeros (signs kept) instead of dividing by zero; x̂ = s_t · s_b ·
  e2m1(clamp(x / (s_t · s_b), ±6)).
- ``nvfp4-torchao`` — the same with torchao's ``nvfp4_quantize`` block scale: amax_block / 6 / s_t clamped below
  at 2^−6 (E4M3's smallest normal, torchao's ``E4M3_EPS``) before the cast. Every block whose scale would be
  smaller gets 2^−6, a coarser grid than it needs: with one massive channel (s_t large) the ordinary blocks of
  the tensor all sit on that floor and lose precision (``tests/qbench/quant/test_formats.py`` measures it).

**Tails**: when the last dimension is not a multiple of the block size, the last block is partial — it holds the
remaining n mod k elements and its scale is computed from them alone (implemented by zero padding, which changes
neither the block's amax nor its other elements, then slicing the padding off).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from models.errors import UserError, unknown_choice
from qbench.quant.format_specs import (  # noqa: F401 (re-exported: the descriptions live there, torch-free)
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    ELEMENTS,
    FORMATS,
    INT,
    NVFP4_BLOCK_SCALE_MIN,
    NVFP4_RECIPES,
    ElementFormat,
    NumberFormat,
    get_format,
)
from qbench.quant.granularity import Granularity, PerGroup, PerTensor, per_sequence
from qbench.quant.primitives import TINY, block_dims, block_sizes, blocked, check_input, true_div

_PER_TENSOR = PerTensor()
# Elementwise chains (frexp, ldexp, round, clamp) over an activation of a batch (tens of MB) run at the speed of
# fresh memory: each temporary is a new mapping whose pages fault in. In chunks of this many elements (256 KiB of
# float32) the temporaries stay in cache and are reused: 2-3x faster on 2 CPU cores, bitwise the same values.
ELEMENTWISE_CHUNK = 2**16


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def round_to_minifloat(x: Tensor, exp_bits: int, man_bits: int, max_normal: float) -> Tensor:
    """Round to the nearest value of a sign/``exp_bits``/``man_bits`` float with subnormals, ties to even,
    saturating at ±``max_normal`` (OFP8 rev 1.0 / MX v1.0 §5.3 element formats; conversion as MX v1.0 §6.3).

    In the binade of |x| (exponent e = floor(log2|x|), raised to the smallest normal exponent 1 − bias so that
    subnormals share its spacing) the representable values are the integer multiples of 2^(e − man_bits), and
    the multiple's parity is the mantissa's last bit: so ``torch.round`` (half to even) of x / 2^(e − man_bits)
    is the format's round-to-nearest-even, a carry into the next binade included. Both the division and the
    product are by powers of two, hence exact. NaN stays NaN; ±0 and values that round to zero keep their sign.
    """
    check_input(x, "round_to_minifloat")
    if x.numel() <= ELEMENTWISE_CHUNK or not x.is_contiguous():
        return _round_to_minifloat(x, exp_bits, man_bits, max_normal)
    # elementwise: in chunks that stay in cache, bitwise the same as one pass (ELEMENTWISE_CHUNK)
    out, flat = torch.empty_like(x), x.view(-1)
    for start in range(0, flat.numel(), ELEMENTWISE_CHUNK):
        part = flat[start : start + ELEMENTWISE_CHUNK]
        out.view(-1)[start : start + part.numel()] = _round_to_minifloat(part, exp_bits, man_bits, max_normal)
    return out


def _round_to_minifloat(x: Tensor, exp_bits: int, man_bits: int, max_normal: float) -> Tensor:
    v = x.to(_compute_dtype(x))
    _, exponent = torch.frexp(v)  # |v| = m · 2^exponent, m ∈ [0.5, 1): floor(log2|v|) = exponent − 1
    e = (exponent - 1).clamp_min(1 - (2 ** (exp_bits - 1) - 1))
    step = torch.ldexp(torch.ones_like(v), e - man_bits)
    return (torch.round(v / step) * step).clamp(-max_normal, max_normal).to(x.dtype)


def round_to_element(x: Tensor, element: ElementFormat) -> Tensor:
    """``x`` rounded to ``element`` (saturating), in x's dtype: torch's float8 cast for FP8, else
    :func:`round_to_minifloat`. Both give the same values (tests hold them so)."""
    if element.torch_dtype is None:
        return round_to_minifloat(x, element.exp_bits, element.man_bits, element.max_normal)
    return x.clamp(-element.max_normal, element.max_normal).to(element.torch_dtype).to(x.dtype)


def fake_quantize_fp8(x: Tensor, element: ElementFormat, granularity: Granularity) -> Tensor:
    """x̂ = s · fp8(clamp(x / s, ±max)), s = max(amax / max, TINY) per block of ``granularity`` (module docstring)."""
    check_input(x, "fake_quantize_fp8")
    if x.numel() == 0:
        return x.clone()
    xb = blocked(x, block_sizes(x.shape, granularity)).to(_compute_dtype(x))
    amax = xb.abs().amax(block_dims(x.ndim), keepdim=True)
    scale = true_div(amax, element.max_normal).clamp_min(TINY)
    return (round_to_element(xb / scale, element) * scale).reshape(x.shape).to(x.dtype)


def _last_dim_blocks(x: Tensor, block_size: int) -> Tensor:
    """(..., n) -> (..., ceil(n / k), k) in the compute dtype; a partial last block is padded with zeros."""
    if x.ndim == 0:
        raise UserError("a block-scaled format needs a tensor with at least one dimension")
    if not isinstance(block_size, int) or block_size < 1:
        raise UserError(f"block_size={block_size!r} must be a positive integer")
    v = x.to(_compute_dtype(x))
    pad = -x.shape[-1] % block_size
    return (F.pad(v, (0, pad)) if pad else v).unflatten(-1, (-1, block_size))


def _from_blocks(yb: Tensor, like: Tensor) -> Tensor:
    return yb.flatten(-2)[..., : like.shape[-1]].to(like.dtype)


def mx_shared_exponent(amax: Tensor, element: ElementFormat) -> Tensor:
    """MX v1.0 §6.3: shared_exp = floor(log2(amax)) − emax_elem, clamped below at −127 (E8M0's smallest), as a
    float tensor; NaN where amax is NaN or inf or shared_exp > 127 (E8M0's NaN). amax = 0 gives −127."""
    _, exponent = torch.frexp(amax)  # exact floor(log2 amax) = exponent − 1, also for float32 subnormals
    shared = (exponent - 1 - element.emax).to(amax.dtype)
    shared = torch.where(amax > 0, shared, E8M0_MIN_EXP).clamp_min(E8M0_MIN_EXP)
    return torch.where(torch.isfinite(amax) & (shared <= E8M0_MAX_EXP), shared, math.nan)


def quantize_mx(x: Tensor, element: ElementFormat, block_size: int = 32) -> tuple[Tensor, Tensor]:
    """(X, P): the E8M0 scales 2^shared_exp, shape (..., ceil(n / k), 1), and the elements on the element grid,
    shape (..., ceil(n / k), k) (zero padded), both in the compute dtype. x̂ = X · P (MX v1.0 §6.3)."""
    check_input(x, "quantize_mx")
    xb = _last_dim_blocks(x, block_size)
    scale = torch.exp2(mx_shared_exponent(xb.abs().amax(-1, keepdim=True), element))
    return scale, round_to_element(xb / scale, element)


def fake_quantize_mx(x: Tensor, element: ElementFormat, block_size: int = 32) -> Tensor:
    """dequantize(quantize_mx(x)) in x's shape and dtype: MX blocks along the last dimension (module docstring)."""
    if x.numel() == 0:
        return x.clone()
    rows = x.reshape(-1, x.shape[-1]) if x.ndim > 1 else x.reshape(1, -1)
    step = max(1, ELEMENTWISE_CHUNK // max(1, rows.size(1)))
    if rows.size(0) <= step:
        scale, elements = quantize_mx(x, element, block_size)
        return _from_blocks(elements * scale, x)
    # blocks lie along the last dimension: rows are independent, so in chunks that stay in cache (ELEMENTWISE_CHUNK)
    out = torch.cat(
        [fake_quantize_mx(rows[i : i + step], element, block_size) for i in range(0, rows.size(0), step)]
    )
    return out.reshape(x.shape)


def _tensor_amax(x: Tensor, granularity: Granularity) -> Tensor:
    """max|x| per block of a granularity whose blocks are whole dimensions or single indices, keepdim-shaped."""
    sizes = block_sizes(x.shape, granularity)
    if any(b not in (1, n) for n, b in zip(x.shape, sizes)):
        raise UserError(
            f"nvfp4's tensor scale needs a per-tensor or per-sequence granularity, got {granularity}"
        )
    amax = blocked(x, sizes).abs().amax(block_dims(x.ndim), keepdim=True)
    return amax.reshape([n // b for n, b in zip(x.shape, sizes)])  # broadcasts against x


def _nvfp4_floor(recipe: str) -> float:
    if recipe not in NVFP4_RECIPES:
        raise unknown_choice("NVFP4 recipe", recipe, NVFP4_RECIPES)
    return NVFP4_RECIPES[recipe]


def quantize_nvfp4(
    x: Tensor,
    block_size: int = 16,
    tensor_granularity: Granularity = _PER_TENSOR,
    recipe: str = "nvidia",
) -> tuple[Tensor, Tensor, Tensor]:
    """(s_t, s_b, P): the float32 tensor scale (keepdim-shaped per ``tensor_granularity``), the E4M3 block scales
    (..., ceil(n / k), 1) and the E2M1 elements (..., ceil(n / k), k); x̂ = s_t · s_b · P. ``recipe``: "nvidia"
    (E4M3 subnormal block scales, a zero scale and zero elements for a block whose scale rounds to zero) or
    "torchao" (block scales floored at 2^−6) — module docstring."""
    check_input(x, "quantize_nvfp4")
    floor = _nvfp4_floor(recipe)
    v = x.to(_compute_dtype(x))
    s_t = true_div(_tensor_amax(v, tensor_granularity), E4M3.max_normal * E2M1.max_normal).clamp_min(TINY)
    xb = _last_dim_blocks(v, block_size)
    s_t = s_t.unsqueeze(-1)  # broadcasts against the (..., blocks, k) view
    block_scale = true_div(xb.abs().amax(-1, keepdim=True), E2M1.max_normal) / s_t
    s_b = round_to_element(block_scale.clamp(floor, E4M3.max_normal), E4M3)
    # A zero scale cannot divide: its block is stored as zeros. xb · 0 keeps each zero's sign, and stays NaN
    # for a NaN element (whose tensor scale is NaN anyway, so s_b is never 0 there).
    zero = s_b == 0
    elements = round_to_element(xb / (s_t * torch.where(zero, 1.0, s_b)), E2M1)
    return s_t, s_b, torch.where(zero, xb * 0, elements)


def fake_quantize_nvfp4(
    x: Tensor,
    block_size: int = 16,
    tensor_granularity: Granularity = _PER_TENSOR,
    recipe: str = "nvidia",
) -> Tensor:
    """dequantize(quantize_nvfp4(x)) in x's shape and dtype."""
    if x.numel() == 0:
        return x.clone()
    s_t, s_b, elements = quantize_nvfp4(x, block_size, tensor_granularity, recipe)
    return _from_blocks(elements * (s_t * s_b), x)


def fake_quantize_format(x: Tensor, fmt: str, granularity: Granularity, *, activation: bool) -> Tensor:
    """Fake-quantise a linear's weight or input activation in format ``fmt`` (what ``FakeQuantLinear`` calls).

    FP8 scales follow ``granularity`` — for an activation per sequence (``granularity.per_sequence``), so nothing
    is shared across the sequences of a batch; MX and NVFP4 blocks are ``granularity``'s group (a ``PerGroup``)
    along the last dimension, and NVFP4's tensor scale is per tensor for a weight and per sequence for an
    activation. The gradient is the straight-through estimator, as for the integer op.
    """
    spec = get_format(fmt)
    if spec.scaling == "fp8":
        g = per_sequence(granularity, x.ndim) if activation else granularity
        y = fake_quantize_fp8(x.detach(), spec.element, g)
    else:
        if not isinstance(granularity, PerGroup):
            raise UserError(f"format {fmt!r} needs a PerGroup granularity (its block), got {granularity}")
        k = granularity.group_size
        if spec.scaling == "mx":
            y = fake_quantize_mx(x.detach(), spec.element, k)
        else:
            tensor_g = per_sequence(PerTensor(), x.ndim) if activation else PerTensor()
            y = fake_quantize_nvfp4(x.detach(), k, tensor_g, spec.recipe or "nvidia")
    return _StraightThrough.apply(x, y) if x.requires_grad else y


class _StraightThrough(torch.autograd.Function):
    """Forward: the fake-quantised ``y`` exactly; backward: the gradient reaches ``x`` unchanged."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


__all__ = [
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "ELEMENTS",
    "FORMATS",
    "NVFP4_RECIPES",
    "ElementFormat",
    "NumberFormat",
    "fake_quantize_format",
    "fake_quantize_fp8",
    "fake_quantize_mx",
    "fake_quantize_nvfp4",
    "get_format",
    "mx_shared_exponent",
    "quantize_mx",
    "quantize_nvfp4",
    "round_to_element",
    "round_to_minifloat",
]
