"""AWQ (Lin et al., "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration", MLSys 2024)
on qbench's integer grids: per-input-channel scales searched on calibration statistics, then a weight-clipping
search; the result is an input scale and a weight grid per layer, which the fake layer and every real kernel take
as they take SmoothQuant's scale and GPTQ's grid (``apply.quantize``: ``input_scale=``, ``weight_qparams=``).

From the paper's §3.2 ("Searching to scale"):

- Scales s = s_X^α per input channel, s_X the mean |x| of that channel over the calibration tokens, α searched on
  a grid of ``grid`` points α = 0, 1/grid, …, (grid−1)/grid (20 in the paper and its reference code), normalised as
  the reference code does (s_X^α clamped at 1e-4, then s / √(max s · min s)), minimising the output error
  ‖Q(W · diag(s)) (diag(s)⁻¹ X) − W X‖². α = 0 is s = 1, plain round-to-nearest, so the search never does worse
  on its objective.
- Layers that read one tensor (q/k/v after the attention norm, gate/up after the MLP norm, GPT-2's fused c_attn)
  share one s, searched on the sum of their errors — the reference code's mappings, whose scale it folds into the
  norm before them. o_proj and down_proj get their own s (the reference folds those into v_proj / up_proj);
  on grouped-query attention, where v_proj has fewer outputs than o_proj has inputs and no fold exists, o_proj
  gets no scale (its clipping is still searched), as in llm-awq and AutoAWQ (``apply._grouped_query_output``).
- Clipping search (the reference code's ``auto_clip``): per output channel and group, the weight range clipped to
  r · max|w|, r = 1, 1 − 1/grid, … down to 1 − ``max_shrink`` (0.5), the r minimising that group's output error
  kept. q_proj and k_proj (and a fused qkv) are not clipped, as in the reference code (their errors are amplified
  through the attention scores).

Where this differs from the reference code, and why:

- The output error is each layer's own, computed from the Hessian of its inputs, ‖ΔW X‖²/n = ½ tr(ΔW H ΔWᵀ)
  (``gptq.layer_error``), rather than by running the whole attention or MLP block on cached inputs: the statistics
  GPTQ gathers then serve both (``qbench.quant.solve``: block by block through the quantised blocks before, as
  the reference code feeds each block, or from the float model's inputs with ``sequential=false``).
- The scale is applied inside each layer (x / s before the layer's own quantisation, W · diag(s) before rounding:
  ``fake.py``), not folded into the previous norm or linear. In float and for every quantised tensor this is the
  same computation as the fold (x / s is what the folded norm outputs); it works on every architecture, and the
  real kernels pay one elementwise division per call that a folded deployment would not.
- With quantised activations (W4A8) the search's objective is still the weight error only, as AWQ is a weight-only
  method; the activations are quantised after the division, as they would be after the fold.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from qbench.quant.fake import fake_quantize_weight, pad_to_groups
from qbench.quant.granularity import Granularity, PerGroup, PerTensor
from qbench.quant.primitives import NonFiniteError, QParams, qparams_from_stats, qrange

AWQ_DEFAULTS = {"grid": 20, "clip": True}
MAX_SHRINK = (
    0.5  # the clipping search goes down to (1 − MAX_SHRINK) · max|w| (the reference code's max_shrink)
)
NO_CLIP = (
    "q_proj",
    "k_proj",
    "c_attn",
    "qkv_proj",
    "query",
    "key",
)  # layer names left unclipped (see docstring)


def _error(delta: Tensor, h: Tensor) -> Tensor:
    """½ tr(Δ H Δᵀ) = ‖Δ X‖² / n for H = (2/n) XXᵀ, in float32 (Δ (out, in), H (in, in))."""
    return 0.5 * ((delta @ h) * delta).sum()


def candidate_scales(abs_mean: Tensor, grid: int) -> list[tuple[float, Tensor]]:
    """(α, s) for α = 0, 1/grid, …: s = max(s_X^α, 1e-4) normalised by √(max s · min s) — the reference's order
    (``auto_scale.py``: ``x_max.pow(ratio).clamp(min=1e-4)``, then the normalisation)."""
    x = abs_mean.float()
    out = []
    for i in range(grid):
        alpha = i / grid
        s = x.pow(alpha).clamp_min(1e-4)
        out.append((alpha, s / (s.max() * s.min()).sqrt()))
    return out


def search_scale(
    weights: list[Tensor],
    hessian: Tensor,
    abs_mean: Tensor,
    bits: int,
    granularity: Granularity,
    symmetric: bool,
    grid: int = AWQ_DEFAULTS["grid"],
) -> tuple[Tensor, float, list[float]]:
    """The shared input scale s of ``weights`` (each (out_i, in), all reading the same input): (s, α, the
    objective for every α). Round-to-nearest on W · diag(s); the error of the scaled pair equals the original's,
    ‖(Q(W·diag(s))·diag(s)⁻¹ − W) X‖², computed as ‖(Q(W') − W') X'‖² with X' = diag(s)⁻¹ X."""
    h = hessian.float()
    errors, best = [], None
    for alpha, s in candidate_scales(abs_mean, grid):
        h_s = h / (s.unsqueeze(0) * s.unsqueeze(1))
        total = 0.0
        for w in weights:
            w_s = w.float() * s
            total += float(_error(fake_quantize_weight(w_s, bits, granularity, symmetric) - w_s, h_s))
        errors.append(total)
        if best is None or total < best[0]:
            best = (total, alpha, s)
    # NaN never compares smaller: with every error NaN the "best" would be α = 0, never searched
    if not math.isfinite(best[0]):
        raise NonFiniteError(
            f"AWQ scale search on {len(weights)} layer(s) of input size {h.shape[0]}: the output error is NaN "
            "or inf for every scale (the weights or their inputs overflow float32); cannot quantise"
        )
    return best[2], best[1], errors


def search_clip(
    weight: Tensor,
    hessian: Tensor,
    bits: int,
    granularity: Granularity,
    symmetric: bool,
    grid: int = AWQ_DEFAULTS["grid"],
) -> QParams:
    """The weight grid (qparams in the padded block-grid shape) with each (output channel, group)'s range clipped
    to the r · max|w| that minimises that group's output error (½ Δ_g H_gg Δ_gᵀ; per tensor: the whole error)."""
    w = pad_to_groups(weight.float(), granularity)
    out, cols = w.shape
    per_tensor = isinstance(granularity, PerTensor)
    g = (
        granularity.group_size
        if isinstance(granularity, PerGroup) and granularity.group_size < cols
        else cols
    )
    n_groups = cols // g
    h = torch.zeros(cols, cols, dtype=torch.float32, device=w.device)
    n = hessian.shape[0]
    h[:n, :n] = hessian.float()
    hb = torch.stack([h[i * g : (i + 1) * g, i * g : (i + 1) * g] for i in range(n_groups)])  # (G, g, g)
    blocks = w.view(out, n_groups, g)
    if per_tensor:
        blocks = w.view(1, 1, out * cols)  # one range for the whole matrix
    lo, hi = blocks.amin(-1, keepdim=True), blocks.amax(-1, keepdim=True)
    peak = torch.maximum(hi, -lo)
    best_err = best_lo = best_hi = None
    qmin, qmax = qrange(bits, symmetric)
    for i in range(int(MAX_SHRINK * grid)):
        r = 1 - i / grid
        c_lo, c_hi = torch.maximum(lo, -r * peak), torch.minimum(hi, r * peak)
        scale, zero = qparams_from_stats((c_lo, c_hi), bits, symmetric)
        q = torch.round(blocks / scale) + (0 if zero is None else zero)
        deq = (q.clamp(qmin, qmax) - (0 if zero is None else zero)) * scale
        delta = (deq - blocks).reshape(out, n_groups, g)
        if per_tensor:
            err = _error(delta.reshape(out, cols), h).reshape(1, 1, 1)
        else:
            err = 0.5 * torch.einsum("ogi,gij,ogj->og", delta, hb, delta).unsqueeze(-1)
        if best_err is None:
            best_err, best_lo, best_hi = err, c_lo, c_hi
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_lo, best_hi = torch.where(better, c_lo, best_lo), torch.where(better, c_hi, best_hi)
    if not bool(torch.isfinite(best_err).all()):
        raise NonFiniteError(
            f"AWQ clipping search on a {weight.shape[0]}x{weight.shape[1]} weight: the output error is NaN or inf "
            "(the weights or their inputs overflow float32); cannot quantise"
        )
    scale, zero = qparams_from_stats((best_lo, best_hi), bits, symmetric)
    grid_shape = (1, 1) if per_tensor else (out, n_groups)
    return QParams(
        scale.reshape(grid_shape).contiguous(),
        None if zero is None else zero.reshape(grid_shape).to(torch.int32).contiguous(),
    )


def clipped(name: str) -> bool:
    """Whether the clipping search runs on layer ``name`` (not on queries and keys: module docstring)."""
    leaf = name.rsplit(".", 1)[-1]
    return not any(part in leaf for part in NO_CLIP)
