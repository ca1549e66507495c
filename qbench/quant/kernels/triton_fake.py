"""Triton kernels for the CUDA path of ``qbench::fake_quantize`` on an (R, L) rows view (one scale per row).

Two kernels, both bit-exact with ``primitives.fake_quantize``:

- ``_rows_kernel`` (rows up to ``SPLIT_LEN`` elements: per token, per channel, per group): one program per row,
  two sweeps over it — a max (and min) reduction, then quantise and store — so a row is read from HBM once and
  from cache once.
- ``_apply_kernel`` (longer rows: per tensor, per sequence): one row would be one program, far too little
  parallelism, so the scales come from the torch primitive (a fast reduction) and one program per BLOCK-wide
  piece of a row quantises. The grid is 1-d (program p = row · pieces + piece): CUDA caps a grid's second and
  third dimensions at 65,535 blocks, which a 2-d (rows, pieces) grid exceeded for rows longer than ~268 M
  elements (a per-tensor scale on a large tensor); the first dimension allows 2^31 − 1.

NaN propagates as in the torch primitive (a NaN in a row makes that row's scale, and so the whole row, NaN).
Triton's ``tl.maximum``/``tl.minimum`` and the ``tl.max``/``tl.min`` reductions return the other operand when
one is NaN (maxnum semantics, also under the interpreter), which turned a NaN input into a finite output on CUDA
while the CPU path reports the cell non-finite; every max/min here passes ``propagate_nan=ALL``, and the
reductions use a NaN-propagating combine function.

Exactness needs IEEE arithmetic: Triton's ``/`` on fp32 is an approximate division, so we use ``div_rn``; and
round-half-to-even is ``(y + 1.5·2^23) − 1.5·2^23``, exact for |y| < 2^22 (here |y| ≤ 2^8 + 1) and, unlike
libdevice's ``rint``, also available under ``TRITON_INTERPRET=1``, where the tests run these kernels on CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from qbench.quant.primitives import TINY, blocked_qparams, qrange

SPLIT_LEN = 1 << 16  # rows longer than this take the two-step path
_MAX_BLOCK = 4096
_ROUND_MAGIC = tl.constexpr(
    12582912.0
)  # 1.5 * 2**23: adding then subtracting rounds to the nearest even integer
_TINY = tl.constexpr(TINY)


_NAN = tl.constexpr(tl.PropagateNan.ALL)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b, propagate_nan=_NAN)


@triton.jit
def _min(a, b):
    return tl.minimum(a, b, propagate_nan=_NAN)


@triton.jit
def _round_half_even(y):
    return (y + _ROUND_MAGIC) - _ROUND_MAGIC


@triton.jit
def _to_bf16_rne(y):
    """float32 -> bfloat16 rounding to nearest even by bit arithmetic (torch's rule; the interpreter truncates)."""
    bits = y.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    bits = tl.where(y != y, 0x7FC0, bits)  # NaN stays NaN (a NaN with low payload bits would round to inf)
    return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _quantize_store(
    x_ptr,
    out_ptr,
    start,
    stop,
    scale,
    zp,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    for offset in range(start, stop, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        mask = offs < stop
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_half_even(tl.math.div_rn(x, scale))
        if SYMMETRIC:  # noqa: SIM108 - a constexpr branch
            q = _min(_max(q, QMIN), QMAX)
        else:
            q = _min(_max(q + zp, QMIN), QMAX) - zp
        y = q * scale
        if OUT_BF16:
            y = _to_bf16_rne(y)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_kernel(
    x_ptr,
    out_ptr,
    L,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    start = tl.program_id(0).to(tl.int64) * L
    hi = tl.zeros([BLOCK], dtype=tl.float32)  # starting at 0 is the clamp to [min(x, 0), max(x, 0)]
    lo = tl.zeros([BLOCK], dtype=tl.float32)
    for offset in range(start, start + L, BLOCK):
        offs = offset + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < start + L, other=0.0).to(tl.float32)
        if SYMMETRIC:
            hi = _max(hi, tl.abs(x))
        else:
            hi = _max(hi, x)
            lo = _min(lo, x)
    hi_max = tl.reduce(hi, 0, _max)  # not tl.max: it drops NaN
    if SYMMETRIC:
        scale = _max(tl.math.div_rn(hi_max, QMAX), _TINY)
        zp = 0.0
    else:
        lo_min = tl.reduce(lo, 0, _min)
        scale = _max(tl.math.div_rn(hi_max - lo_min, QMAX), _TINY)
        zp = _min(_max(_round_half_even(tl.math.div_rn(-lo_min, scale)), 0.0), QMAX)
    _quantize_store(x_ptr, out_ptr, start, start + L, scale, zp, QMIN, QMAX, SYMMETRIC, OUT_BF16, BLOCK)


@triton.jit
def _apply_kernel(
    x_ptr,
    out_ptr,
    scale_ptr,
    zp_ptr,
    L,
    PIECES,
    QMIN: tl.constexpr,
    QMAX: tl.constexpr,
    SYMMETRIC: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row = pid // PIECES
    scale = tl.load(scale_ptr + row)
    if SYMMETRIC:  # noqa: SIM108 - a constexpr branch: the symmetric kernel never loads a zero point
        zp = 0.0
    else:
        zp = tl.load(zp_ptr + row)
    start = row * L + (pid % PIECES) * BLOCK
    stop = tl.minimum(start + BLOCK, row * L + L)
    _quantize_store(x_ptr, out_ptr, start, stop, scale, zp, QMIN, QMAX, SYMMETRIC, OUT_BF16, BLOCK)


def fake_quantize_rows(rows: Tensor, bits: int, symmetric: bool, split_len: int = SPLIT_LEN) -> Tensor:
    """Fake-quantise a contiguous (R, L) tensor with one scale per row; same dtype and shape."""
    R, L = rows.shape
    out = torch.empty_like(rows)
    qmin, qmax = qrange(bits, symmetric)
    out_bf16 = rows.dtype == torch.bfloat16
    if L <= split_len:
        block = min(triton.next_power_of_2(L), _MAX_BLOCK)
        _rows_kernel[(R,)](
            rows, out, L, QMIN=qmin, QMAX=qmax, SYMMETRIC=symmetric, OUT_BF16=out_bf16, BLOCK=block
        )
        return out
    scale, zp = blocked_qparams(rows.view(R, 1, 1, L), bits, symmetric)
    zp = scale if zp is None else zp  # an unused pointer when symmetric
    pieces = triton.cdiv(L, _MAX_BLOCK)
    _apply_kernel[apply_grid(R, L)](
        rows,
        out,
        scale.reshape(R).contiguous(),
        zp.reshape(R).contiguous(),
        L,
        pieces,
        QMIN=qmin,
        QMAX=qmax,
        SYMMETRIC=symmetric,
        OUT_BF16=out_bf16,
        BLOCK=_MAX_BLOCK,
    )
    return out


def apply_grid(R: int, L: int, block: int = _MAX_BLOCK) -> tuple[int]:
    """The 1-d launch grid of ``_apply_kernel``: one program per ``block``-wide piece of each row."""
    return (R * triton.cdiv(L, block),)
