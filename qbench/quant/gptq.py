"""GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained Transformers", ICLR 2023)
on qbench's own integer grids: the codes and scales it returns are ordinary ``primitives.QParams`` codes, so the fake
layer and every real kernel run them unchanged (``apply.quantize`` passes them as ``weight_qparams``).

What is implemented, from the paper's §4 ("The Full Algorithm") and Algorithm 1:

- The layer objective argmin_Ŵ ‖WX − ŴX‖², X the layer's calibration inputs (columns are tokens). Its Hessian is
  H = 2XXᵀ; :class:`HessianAccumulator` keeps the running mean H = (2/n) Σ x xᵀ over the n calibration tokens, so
  the scale of H does not depend on n (the dampening below is relative to it anyway).
- Dampening λ = ``damp`` · mean(diag H) added to the diagonal (§4, "Cholesky Reformulation": 1 % of the average
  diagonal value). Inputs that never fire (diag H = 0) get H_jj = 1 and their weight column quantises as is.
- H⁻¹ through its Cholesky factor: U = chol(H⁻¹) upper-triangular, whose rows hold every quantity the
  column-by-column update needs (Algorithm 1: for column j, err = (w_j − q_j) / U_jj; the remaining columns of the
  block move by −err · U_j,j+1:).
- Lazy batch updates (§4, "Lazy Batch-Updates"): the columns are processed in blocks of ``block`` (128); inside a
  block the updates are applied column by column, the rest of the matrix is updated once per block with the
  block's accumulated errors, W_:,rest −= E · U_block,rest. With groups a block is rounded up to whole groups
  (so a group never spans two blocks). The codes equal the unbatched algorithm (the paper's Eq. 2–3, one column at
  a time with H⁻¹ updated by Gaussian elimination) in exact arithmetic, with each group's grid taken as below.
- Quantisation grid: the scheme's bits, symmetry and granularity with qbench's qparams formulas
  (``primitives.qparams_from_stats``). Per channel and per tensor, the qparams come from the original W; for
  groups of g input channels they are chosen when the algorithm reaches the group's first column, from that
  group's weights as they were when its lazy block began: the error compensation of the earlier blocks in, that
  of the columns before it in the same block not yet — the reference code's rule (IST-DASLab ``gptq.py``
  ``find_params(W[:, i1 + i : i1 + i + groupsize])`` on ``W``, not the block's working copy; GPTQModel alike;
  llm-compressor 0.14 instead fixes every group's grid from the original weights before the sweep, as act order's
  static groups do here). So with g below ``block`` the grid depends on the block size, as in the reference. (The
  grid from the fully updated weights, qbench's rule before, gave 0–3 % larger layer errors in 19 of 20 synthetic
  comparisons.) A group that does not divide the row leaves a shorter last group, as round-to-nearest does
  (``fake.pad_to_groups``).
- ``act_order`` (the reference code's ``--act-order``, the paper's discussion of LLaMA/OPT-66B outliers): columns
  in order of decreasing diag H. With groups this uses the *static-groups* rule: every group's qparams are
  computed from the original W before the permutation, so group membership stays contiguous in the original
  column order and the result is stored exactly like round-to-nearest's (no group index per column).

The Hessians are gathered by ``qbench.quant.solve``: by default block by block, each block fed the outputs of the
blocks already quantised (``qbench.quant.sequential``), as the reference implementation, GPTQModel and
llm-compressor run it; with ``sequential=false`` every layer's from the float model's inputs in one cached pass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from models.errors import UserError
from qbench.quant.granularity import Granularity, PerAxis, PerGroup, PerTensor
from qbench.quant.primitives import NonFiniteError, QParams, qparams_from_stats, qrange

GPTQ_DEFAULTS = {"damp": 0.01, "block": 128, "act_order": False}


class HessianAccumulator:
    """Running mean of 2·x xᵀ over the rows x of the inputs it is given (float32, (in, in)), and of |x| per channel.

    ``add(x)`` takes any (..., in) tensor; rows are tokens. ``hessian`` is (2/n) Σ x xᵀ, n the tokens seen.
    The running-mean update (H ← H·n/(n+m) + (2/(n+m))·XᵀX) keeps the sums in range for many tokens.
    """

    def __init__(self, dim: int, device: torch.device | None = None) -> None:
        self.dim = dim
        self.n = 0
        self.h = torch.zeros(dim, dim, dtype=torch.float32, device=device)
        self.abs_sum = torch.zeros(dim, dtype=torch.float64, device=device)  # AWQ's s_X (``abs_mean``)

    def add(self, x: Tensor) -> None:
        rows = x.detach().reshape(-1, self.dim).float()
        m = rows.shape[0]
        if m == 0:
            return
        total = self.n + m
        self.abs_sum += rows.abs().sum(0, dtype=torch.float64)
        self.h.mul_(self.n / total)
        # 2/(n+m) · XᵀX, scaled before the product so that large activations stay in float32 range
        scaled = rows * math.sqrt(2.0 / total)
        self.h.addmm_(scaled.t(), scaled)
        self.n = total

    @property
    def hessian(self) -> Tensor:
        return self.h

    @property
    def abs_mean(self) -> Tensor:
        """Each input channel's mean |x| over the tokens seen (float32, (in,))."""
        return (self.abs_sum / max(self.n, 1)).float()


@dataclass(frozen=True)
class GPTQResult:
    """Codes (int8 symmetric / uint8 asymmetric, (out, in)), their qparams in the granularity's block-grid shape
    (a ragged last group padded, as ``fake.pad_to_groups``), the dequantised weight Ŵ (float32, (out, in)), and
    the statistics of the solve (``dead``: inputs with diag H = 0; ``damp``: the λ added)."""

    codes: Tensor
    qparams: QParams
    weight: Tensor
    dead: int
    damp: float


def _group_size(granularity: Granularity, cols: int) -> int | None:
    """g for a grouped granularity, None for per channel / per tensor (qparams from the whole row / matrix)."""
    if isinstance(granularity, PerGroup):
        return None if granularity.group_size >= cols else granularity.group_size
    if isinstance(granularity, PerTensor) or (
        isinstance(granularity, PerAxis) and granularity.axis in (0, -2)
    ):
        return None
    raise ValueError(f"GPTQ supports per-channel, per-tensor and grouped weights, not {granularity.label}")


def _qparams(
    w: Tensor, bits: int, symmetric: bool, per_tensor: bool, mse: bool = False
) -> tuple[Tensor, Tensor | None]:
    """(scale, zero) of each row of ``w`` (out, k) — or of all of it when ``per_tensor`` — as (out, 1) / (1, 1):
    from the range, or with ``mse`` from the range shrunk by the reference quantiser's search (``clip.py``: the
    GPTQ code's ``find_params`` with ``mse=True``, as QuaRot runs GPTQ with ``--w_clip``)."""
    if mse:
        from qbench.quant.clip import mse_weight_qparams

        qp = mse_weight_qparams(w, bits, PerTensor() if per_tensor else PerAxis(0), symmetric)
        shape = (1, 1) if per_tensor else (w.shape[0], 1)
        zero = None if qp.zero_point is None else qp.zero_point.float().reshape(shape)
        return qp.scale.reshape(shape), zero
    dims = (0, 1) if per_tensor else (1,)
    stats = (w.amin(dims, keepdim=True), w.amax(dims, keepdim=True))
    return qparams_from_stats(stats, bits, symmetric)


def _round(w: Tensor, scale: Tensor, zero: Tensor | None, qmin: int, qmax: int) -> Tensor:
    """Codes of ``w`` on the grid (scale, zero): clamp(round(w / s) + z, qmin, qmax), as float (half to even)."""
    q = torch.round(w / scale)
    if zero is not None:
        q = q + zero
    return q.clamp_(qmin, qmax)


def gptq_quantize(
    weight: Tensor,
    hessian: Tensor,
    bits: int,
    granularity: Granularity,
    symmetric: bool,
    *,
    damp: float = GPTQ_DEFAULTS["damp"],
    block: int = GPTQ_DEFAULTS["block"],
    act_order: bool = GPTQ_DEFAULTS["act_order"],
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
    weight_clip: str = "none",
) -> GPTQResult:
    """GPTQ of one (out, in) weight given its input Hessian (in, in) (module docstring). Neither input is modified.

    ``dtype``: the arithmetic of the solve (float32; float64 for tests against a reference). ``name``: the layer,
    for the errors. NaN/inf in either input, or a solve that overflows, raise ``NonFiniteError`` (the harness
    records a non-finite cell); a damped Hessian that is still not positive definite raises ``UserError``."""
    if weight.ndim != 2 or hessian.shape != (weight.shape[1], weight.shape[1]):
        raise ValueError(
            f"gptq_quantize: weight (out, in) and hessian (in, in), got {weight.shape}, {hessian.shape}"
        )
    rows, cols = weight.shape
    what = f"GPTQ of layer {name!r}" if name else f"GPTQ of a {rows}x{cols} weight"
    if not bool(torch.isfinite(weight).all()):
        raise NonFiniteError(f"{what}: the weight holds NaN or inf; cannot quantise")
    if not bool(torch.isfinite(hessian).all()):
        raise NonFiniteError(
            f"{what}: its input Hessian holds NaN or inf (the inputs overflow); cannot quantise"
        )
    group = _group_size(granularity, cols)
    per_tensor = isinstance(granularity, PerTensor)
    qmin, qmax = qrange(bits, symmetric)
    w = weight.detach().to(dtype).clone()
    h = hessian.detach().to(dtype).clone()

    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0

    # qparams fixed before the solve: per channel / tensor from the original W; static groups (act order)
    n_groups = 1 if group is None else -(-cols // group)
    scales = torch.empty(rows if not per_tensor else 1, n_groups, dtype=torch.float32, device=w.device)
    zeros = None if symmetric else torch.empty_like(scales)

    def set_group(g: int, source: Tensor) -> None:
        s, z = _qparams(source.float(), bits, symmetric, per_tensor, weight_clip == "mse")
        scales[:, g : g + 1] = s
        if zeros is not None:
            zeros[:, g : g + 1] = z

    if group is None:
        set_group(0, w)
    elif act_order:
        for g in range(n_groups):
            set_group(g, w[:, g * group : (g + 1) * group])

    perm = torch.argsort(torch.diagonal(h), descending=True) if act_order else None
    if perm is not None:
        w, h = w[:, perm], h[perm][:, perm]
    u, lam = _damped_inverse_factor(h, what, damp)

    if group is not None and not act_order:
        block = group * -(-block // group)  # whole groups per block (see the loop)
    codes = torch.zeros_like(w)
    col_group = torch.arange(cols, device=w.device) if perm is None else perm  # original column index
    for start in range(0, cols, block):
        end = min(start + block, cols)
        w1 = w[:, start:end].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[start:end, start:end]
        for i in range(end - start):
            j = int(col_group[start + i])
            if group is not None and not act_order and j % group == 0:
                # a group's grid from its columns as they were when this lazy block began — the earlier blocks'
                # updates in, this block's not yet (``w``, not ``w1``): the reference code's rule
                # (IST-DASLab gptq.py: find_params(W[:, i1 + i : i1 + i + groupsize]); GPTQModel)
                set_group(j // group, w[:, start + i : start + i + group])
            g = 0 if group is None else j // group
            s = scales[:, g].to(dtype)
            z = None if zeros is None else zeros[:, g].to(dtype)
            col = w1[:, i]
            q = _round(col, s, z, qmin, qmax)
            codes[:, start + i] = q
            deq = s * (q - (0 if z is None else z))
            e = (col - deq) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, end:] -= err1 @ u[start:end, end:]

    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    code_dtype = torch.int8 if symmetric else torch.uint8
    zp = None if zeros is None else zeros.to(torch.int32)
    qparams = QParams(scales.contiguous(), None if zp is None else zp.contiguous())
    deq = _dequantize(codes, qparams, group, cols)
    if not bool(torch.isfinite(deq).all()):
        raise NonFiniteError(f"{what}: the solve overflowed float32 (a weight or Hessian entry too large)")
    return GPTQResult(codes.to(code_dtype), qparams, deq, int(dead.sum()), lam)


# The largest damping tried when the factorisation fails: λ = the Hessian's mean diagonal. Beyond it the solve
# would mostly reflect the damping, not the calibration data.
MAX_DAMP = 1.0


def _damped_inverse_factor(h: Tensor, what: str, damp: float) -> tuple[Tensor, float]:
    """(U, λ): U = chol((H + λI)⁻¹), upper — the reference's Cholesky reformulation (H⁻¹ = UᵀU) — with
    λ = ``damp`` · mean diag H, ``damp`` raised ×10 while the factorisation fails, up to :data:`MAX_DAMP`, as
    GPTQModel and llm-compressor raise theirs (a rank-deficient H from too few calibration tokens, a float32
    cancellation). Then a one-line error naming the layer (``what``), not torch's linear-algebra traceback.
    ``h`` is damped in place with the λ that worked."""
    mean = float(torch.diagonal(h).mean())
    tried = damp
    while True:
        damped = h.clone()
        damped.diagonal().add_(tried * mean)
        u = _inverse_factor(damped, what)
        if u is not None:
            h.copy_(damped)
            return u, tried * mean
        if tried * 10 > MAX_DAMP * (1 + 1e-9):
            raise UserError(
                f"{what}: the Hessian is not positive definite even damped by {tried:g} of its mean diagonal "
                f"(tried from damp={damp:g}, ×10 up to {MAX_DAMP:g}); calibrate on more tokens (--calib-tokens)"
            )
        tried *= 10


def _inverse_factor(h: Tensor, what: str) -> Tensor | None:
    """chol(h⁻¹), upper, or None when ``h`` is not positive definite; NonFiniteError when float32 overflowed."""
    lower, info = torch.linalg.cholesky_ex(h)
    inverse = torch.cholesky_inverse(lower) if int(info) == 0 else None
    if inverse is not None:
        u, info = torch.linalg.cholesky_ex(inverse, upper=True)
        if int(info) == 0 and bool(torch.isfinite(u).all()):
            return u
    if not bool(torch.isfinite(h).all()) or (inverse is not None and not bool(torch.isfinite(inverse).all())):
        raise NonFiniteError(f"{what}: the damped Hessian or its inverse overflows float32; cannot quantise")
    return None


def _dequantize(codes: Tensor, qparams: QParams, group: int | None, cols: int) -> Tensor:
    """Ŵ = s · (q − z) per column's group (float32)."""
    index = (
        torch.zeros(cols, dtype=torch.long, device=codes.device)
        if group is None
        else (torch.arange(cols, device=codes.device) // group)
    )
    s = qparams.scale.float()[:, index]
    q = codes.float()
    if qparams.zero_point is not None:
        q = q - qparams.zero_point.float()[:, index]
    return q * s


def layer_error(weight: Tensor, quantised: Tensor, hessian: Tensor) -> float:
    """The GPTQ objective from the Hessian: ‖(W − Ŵ)X‖² / n = ½ tr(ΔW H ΔWᵀ) for H = (2/n) XXᵀ (per token)."""
    delta = weight.double() - quantised.double()
    return float(0.5 * torch.einsum("oi,ij,oj->", delta, hessian.double(), delta))
