"""Clipped quantiser ranges, as QuaRot runs its quantisers (Ashkboos et al. 2024: its experiments' settings and
its reference code's ``quant_utils``): a range narrower than [min, max] trades a few saturated values for a finer
grid.

- **Activation clip ratio** (``aclip``; QuaRot's ``--a_clip_ratio``, 0.9 in its runs: ``schemes.QUAROT_ACT_CLIP``): each block's (per token)
  range [min(x, 0), max(x, 0)] is scaled by the ratio before the scale and zero point are chosen; values beyond
  saturate. :func:`clipped_fake_quantize`.
- **Weight clipping search** (``wclip=mse``; QuaRot's ``--w_clip``, the GPTQ reference quantiser's ``mse=True``):
  per output channel (or group), the range scaled by r = 1, 1 − 1/``grid``, … down to 1 − ``max_shrink`` + 1/grid
  (100 points, 0.8), keeping the r whose rounding error Σ|Q(w) − w|^``norm`` (norm 2.4) is smallest — an
  error of the weights alone, with no calibration data. :func:`mse_weight_qparams`.

Both use qbench's own grids (``primitives.qparams_from_stats``: a symmetric grid of ±(2^(b−1)−1), an asymmetric
one of [0, 2^b − 1] whose zero point is rounded), so a clipped scheme is stored and run exactly like its unclipped
form with other scales.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qbench.quant.granularity import Granularity
from qbench.quant.primitives import (
    QParams,
    block_dims,
    block_sizes,
    block_stats,
    blocked,
    check_finite,
    check_input,
    qparams_from_stats,
    qrange,
)

MSE_GRID, MSE_MAX_SHRINK, MSE_NORM = (
    100,
    0.8,
    2.4,
)  # the GPTQ reference quantiser's mse search, as QuaRot runs it


def _fake(xb: Tensor, lo: Tensor, hi: Tensor, bits: int, symmetric: bool) -> Tensor:
    """A blocked view rounded onto the grid of the range [lo, hi] per block (values beyond saturate), float32."""
    scale, zero = qparams_from_stats((lo, hi), bits, symmetric)
    qmin, qmax = qrange(bits, symmetric)
    q = torch.round(xb.float() / scale)
    if zero is not None:
        return (q.add_(zero).clamp_(qmin, qmax).sub_(zero)).mul_(scale)
    return q.clamp_(qmin, qmax).mul_(scale)


def clipped_fake_quantize(
    x: Tensor, bits: int, granularity: Granularity, symmetric: bool, ratio: float
) -> Tensor:
    """``x`` fake-quantised with every block's range scaled by ``ratio`` (0 < ratio ≤ 1), in ``x``'s dtype;
    ratio 1 equals ``primitives.fake_quantize``."""
    check_input(x, "clipped_fake_quantize")
    if x.numel() == 0:
        return x.clone()
    xb = blocked(x, block_sizes(x.shape, granularity))
    lo, hi = block_stats(xb)
    check_finite((lo, hi), "clipped_fake_quantize")
    lo, hi = lo.float().clamp_max(0) * ratio, hi.float().clamp_min(0) * ratio
    return _fake(xb, lo, hi, bits, symmetric).reshape(x.shape).to(x.dtype)


def mse_weight_qparams(
    w: Tensor,
    bits: int,
    granularity: Granularity,
    symmetric: bool,
    grid: int = MSE_GRID,
    max_shrink: float = MSE_MAX_SHRINK,
    norm: float = MSE_NORM,
) -> QParams:
    """The qparams of ``w`` (whose shape the granularity tiles: pad a ragged group first) with each block's range
    shrunk by the r that minimises Σ|Q(w) − w|^norm over the block (module docstring), in the block-grid shape
    ``primitives.choose_qparams`` gives; ties keep the larger r (the first tried)."""
    check_input(w, "mse_weight_qparams")
    sizes = block_sizes(w.shape, granularity)
    xb = blocked(w.float(), sizes)
    lo, hi = block_stats(xb)
    check_finite((lo, hi), "mse_weight_qparams")
    lo, hi = lo.clamp_max(0), hi.clamp_min(0)
    dims = block_dims(w.ndim)
    best = best_lo = best_hi = None
    for i in range(int(max_shrink * grid)):
        r = 1 - i / grid
        err = (_fake(xb, r * lo, r * hi, bits, symmetric) - xb).abs_().pow_(norm).sum(dims, keepdim=True)
        if best is None:
            best, best_lo, best_hi = err, r * lo, r * hi
            continue
        better = err < best
        best = torch.where(better, err, best)
        best_lo, best_hi = torch.where(better, r * lo, best_lo), torch.where(better, r * hi, best_hi)
    scale, zero = qparams_from_stats((best_lo, best_hi), bits, symmetric)
    shape = [n // b for n, b in zip(w.shape, sizes)]
    return QParams(scale.reshape(shape), None if zero is None else zero.reshape(shape).to(torch.int32))
