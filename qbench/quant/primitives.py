"""Pure quantisation math (torchao's ``quant_primitives`` layer): choose qparams, quantise, dequantise, fake-quantise.

Definitions (docs/metrics.md), for b bits, applied to every block of a granularity (see ``granularity.py``):

- absmax (``symmetric=True``): qmax = 2^(b−1) − 1; s = max(max|x| / qmax, TINY);
  q = clamp(round(x / s), −qmax, qmax); x̂ = s · q.
- zeropoint (``symmetric=False``): qmax = 2^b − 1; lo = min(min x, 0), hi = max(max x, 0);
  s = max((hi − lo) / qmax, TINY); z = clamp(round(−lo / s), 0, qmax); q = clamp(round(x / s) + z, 0, qmax);
  x̂ = s · (q − z).

``round`` is round-half-to-even (``torch.round``). TINY is the smallest normal float32 (≈1.18e-38): flooring the
scale is our form of "clamp the max away from 0" — an all-zero block then quantises to zeros, never NaN.
Scales, zero points and all rounding arithmetic are float32, also for bf16/fp16 input (so the grid does not
depend on the input dtype's rounding of the scale); fake-quantised values are cast back to the input dtype last.
Codes are ``int8`` when symmetric and ``uint8`` when asymmetric (0 … 2^b − 1 fits for b ≤ 8).
Scale and zero point have the *block-grid* shape ``shape[i] // block[i]`` (torchao's convention): (out, 1) for a
per-channel weight, (out, in // g) per group, (1, 1) per tensor, (B, T, 1) per token. Zero points are int32.

Every function is pure: inputs are never modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from models.errors import UserError
from qbench.quant.format_specs import check_bits
from qbench.quant.granularity import WHOLE, Granularity

TINY = torch.finfo(torch.float32).tiny


def true_div(x: Tensor, d: float) -> Tensor:
    """x / d rounded as IEEE division on every device, so a scale is the same float on CPU and CUDA.

    CUDA torch turns division by a Python number (a CPU scalar) into multiplication by its reciprocal
    (``div_true_kernel_cuda``), which differs from x / d in the last bit for a third of inputs when d is 3, 15,
    127 or 448 — enough to move codes at rounding ties. A 0-dim tensor on x's device is not a CPU scalar, so it
    keeps the true division; CPU torch already divides exactly (float32), so CPU input is left as is.
    """
    if x.device.type == "cpu":
        return x / d
    return x / torch.full((), d, dtype=x.dtype, device=x.device)


@dataclass(frozen=True, eq=False)
class QParams:
    """Scale (float32) and zero point (int32, ``None`` when symmetric), both in the block-grid shape."""

    scale: Tensor
    zero_point: Tensor | None


def qrange(bits: int, symmetric: bool) -> tuple[int, int]:
    """The code range: [−(2^(b−1)−1), 2^(b−1)−1] when symmetric, [0, 2^b−1] when not."""
    check_bits(bits)
    if symmetric:
        return -(2 ** (bits - 1) - 1), 2 ** (bits - 1) - 1
    return 0, 2**bits - 1


def block_sizes(shape: torch.Size | tuple[int, ...], granularity: Granularity) -> tuple[int, ...]:
    """The concrete block (``-1`` resolved to the dimension's size); each block must tile its dimension."""
    block = granularity.block(len(shape))
    sizes = tuple(max(n, 1) if b == WHOLE else b for n, b in zip(shape, block))
    for d, (n, b) in enumerate(zip(shape, sizes)):
        if n % b:
            raise UserError(f"{granularity} does not tile dimension {d} of size {n} (block {b})")
    return sizes


def blocked(x: Tensor, sizes: tuple[int, ...]) -> Tensor:
    """View ``x`` as (n0, b0, n1, b1, …) so that the odd dimensions run inside one block."""
    return x.reshape([v for n, b in zip(x.shape, sizes) for v in (n // b, b)])


def block_dims(ndim: int) -> tuple[int, ...]:
    """The dimensions of a ``blocked`` view to reduce over (the odd ones)."""
    return tuple(range(1, 2 * ndim, 2))


def check_input(x: Tensor, what: str) -> None:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        got = x.dtype if isinstance(x, Tensor) else type(x).__name__
        raise UserError(f"{what} needs a floating-point tensor, got {got}")


def block_stats(xb: Tensor) -> tuple[Tensor, Tensor]:
    """The raw per-block (min x, max x) of a ``blocked`` view, in x's dtype (NaN propagates into both).

    Two read-only reductions are cheaper than materialising |x| (max|x| = max(max x, −min x)).
    """
    dims = block_dims(xb.ndim // 2)
    return xb.amin(dims, keepdim=True), xb.amax(dims, keepdim=True)


def qparams_from_stats(
    stats: tuple[Tensor, Tensor], bits: int, symmetric: bool
) -> tuple[Tensor, Tensor | None]:
    """(scale, zero point), float32, from :func:`block_stats` by the module docstring's formulas."""
    _, qmax = qrange(bits, symmetric)
    lo, hi = stats[0].float().clamp_max(0), stats[1].float().clamp_min(0)
    if symmetric:
        return true_div(torch.maximum(hi, -lo), qmax).clamp_min(TINY), None  # max|x| = max(max x, −min x)
    scale = true_div(hi - lo, qmax).clamp_min(TINY)
    return scale, torch.round(-lo / scale).clamp(0, qmax)


class NonFiniteError(ValueError):
    """Quantisation met NaN or inf. The harness records such a cell as non-finite instead of failing the grid."""


def non_finite_error(what: str) -> NonFiniteError:
    return NonFiniteError(
        f"{what}: input contains NaN or inf (or its range overflows float32); cannot quantise"
    )


def check_finite(stats: tuple[Tensor, Tensor], what: str) -> None:
    """NaN and ±inf propagate through min/max into the stats, so checking them (small) checks the input."""
    extent = stats[1].float().clamp_min(0) - stats[0].float().clamp_max(0)
    if not bool(torch.isfinite(extent).all()):
        raise non_finite_error(what)


def blocked_qparams(xb: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, Tensor | None]:
    """(scale, zero point) of a ``blocked`` view, kept-dims shape, both float32; no finiteness check."""
    return qparams_from_stats(block_stats(xb), bits, symmetric)


def blocked_fake_quantize(xb: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """Fake-quantise a ``blocked`` view: (float32 result, block stats). In-place only on its own temporaries."""
    stats = block_stats(xb)
    scale, zp = qparams_from_stats(stats, bits, symmetric)
    qmin, qmax = qrange(bits, symmetric)
    y = xb.float().div(scale).round_()  # .float() is a no-op on fp32; div allocates, so x is never touched
    # Symmetric needs no clamp here: the scale comes from this very block, so |x / s| ≤ qmax·(1 + 2⁻²³) rounds
    # to at most qmax (s = max|x|/qmax rounded, or TINY when that is larger). Skipping it saves a pass.
    if zp is not None:
        y.add_(zp).clamp_(qmin, qmax).sub_(zp)
    return y.mul_(scale), stats


def choose_qparams(x: Tensor, bits: int, granularity: Granularity, symmetric: bool) -> QParams:
    """Scale (and zero point when asymmetric) of every block of ``x``, by the module docstring's formulas."""
    check_input(x, "choose_qparams")
    sizes = block_sizes(x.shape, granularity)
    stats = block_stats(blocked(x, sizes))
    check_finite(stats, "choose_qparams")
    scale, zp = qparams_from_stats(stats, bits, symmetric)
    grid = [n // b for n, b in zip(x.shape, sizes)]
    return QParams(scale.reshape(grid), None if zp is None else zp.reshape(grid).to(torch.int32))


def given_or_chosen(
    x: Tensor, bits: int, granularity: Granularity, symmetric: bool, given: QParams | None
) -> QParams:
    """``given`` (a weight's qparams fixed by an algorithm such as GPTQ, ``gptq.py``) after checking it fits ``x``'s
    block grid and symmetry, else :func:`choose_qparams` — the one place every weight quantiser picks its grid."""
    if given is None:
        return choose_qparams(x, bits, granularity, symmetric)
    grid = tuple(n // b for n, b in zip(x.shape, block_sizes(x.shape, granularity)))
    if tuple(given.scale.shape) != grid or (given.zero_point is None) != symmetric:
        raise ValueError(
            f"given weight qparams {tuple(given.scale.shape)} (zero point: {given.zero_point is not None}) do not "
            f"fit a {tuple(x.shape)} weight with block grid {grid}, symmetric={symmetric}"
        )
    return given


def _grid_to_blocked(
    qparams: QParams, shape: torch.Size, sizes: tuple[int, ...]
) -> tuple[Tensor, Tensor | None]:
    kept = [v for n, b in zip(shape, sizes) for v in (n // b, 1)]
    zp = qparams.zero_point
    return qparams.scale.reshape(kept), None if zp is None else zp.reshape(kept).float()


def quantize(x: Tensor, qparams: QParams, bits: int, granularity: Granularity, symmetric: bool) -> Tensor:
    """Integer codes of ``x``: int8 in [−qmax, qmax] when symmetric, uint8 in [0, 2^b − 1] when not."""
    check_input(x, "quantize")
    if (qparams.zero_point is None) != symmetric:
        raise ValueError(
            f"quantize(symmetric={symmetric}) needs qparams {'without' if symmetric else 'with'} a zero point"
        )
    qmin, qmax = qrange(bits, symmetric)
    sizes = block_sizes(x.shape, granularity)
    scale, zp = _grid_to_blocked(qparams, x.shape, sizes)
    q = torch.round(blocked(x, sizes).float() / scale)
    if zp is not None:
        q = q + zp
    return q.clamp(qmin, qmax).to(torch.int8 if symmetric else torch.uint8).reshape(x.shape)


def dequantize(
    q: Tensor, qparams: QParams, granularity: Granularity, dtype: torch.dtype = torch.float32
) -> Tensor:
    """x̂ = s · (q − z) (z = 0 when symmetric), computed in float32 and cast to ``dtype``."""
    sizes = block_sizes(q.shape, granularity)
    scale, zp = _grid_to_blocked(qparams, q.shape, sizes)
    qf = blocked(q, sizes).float()
    if zp is not None:
        qf = qf - zp
    return (qf * scale).reshape(q.shape).to(dtype)


def fake_quantize(x: Tensor, bits: int, granularity: Granularity, symmetric: bool) -> Tensor:
    """dequantize(quantize(x)) in one pass (equal to it exactly), in ``x``'s dtype. The reference the ops match."""
    check_input(x, "fake_quantize")
    check_bits(bits)
    if x.numel() == 0:
        return x.clone()
    y, stats = blocked_fake_quantize(blocked(x, block_sizes(x.shape, granularity)), bits, symmetric)
    check_finite(stats, "fake_quantize")
    return y.reshape(x.shape).to(x.dtype)
