"""softmax-1 attention on fused (flash / memory-efficient) kernels, through the row logsumexp.

Why it works. For one query row with (scaled, causally masked) scores s_j and values v_j, write
Z = Σ_j exp(s_j) and lse = log Z. Ordinary softmax attention gives o = Σ_j exp(s_j) v_j / Z. softmax-1 adds 1 to
the denominator (docs/metrics.md):

    o1 = Σ_j exp(s_j) v_j / (1 + Z) = o · Z / (1 + Z) = o · e^lse / (1 + e^lse) = o · sigmoid(lse).

So softmax-1 is plain causal attention, scaled per (batch, head, query) by sigmoid(lse) — and every fused
attention kernel already computes lse (it needs it for its own backward). ``sigmoid(lse) = 1 / (1 + e^-lse)``
is computed stably by ``torch.sigmoid`` for any lse, including lse → −∞ (no visible key; cannot happen
causally, since a query always sees itself).

Backward. The kernels' lse output is not differentiable (autograd through the op alone drops the
d lse / d scores = P term — tested), so a custom ``autograd.Function`` supplies the gradient. With g = dL/do1
and σ = sigmoid(lse), the chain rule gives dL/do = σ g and dL/dlse = σ(1 − σ) ⟨g, o⟩; d lse / d s_j = P_j
(the softmax probabilities). A flash-style backward computes dS_j = P_j (dP_j − D) with dP_j = ⟨dO, v_j⟩ and
D = ⟨dO, O⟩ from the (grad_out, out) it is given; the lse term adds c P_j with c = σ(1 − σ)⟨g, o⟩, i.e. replaces
D by D − c. Feeding the kernel's own backward grad_out = σ g and out = o1 = σ o gives
D' = ⟨σ g, σ o⟩ = σ²⟨g, o⟩ = σ⟨g, o⟩ − c = D − c, exactly the gradient needed; dV = Pᵀ(σ g) is right as is.
So the backward is one call of the kernel's backward with (σ·g, o1) — no extra pass, no materialised scores.

Kernels: the CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``); on CUDA the flash kernel for
fp16/bf16 and the memory-efficient one otherwise. Anything else (another device, a kernel that refuses the
shapes) returns None and the caller falls back to SDPA with one extra zero key (``models.attention``).
"""

from __future__ import annotations

import torch
from torch import Tensor

_aten = torch.ops.aten


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, tuple]:
    out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    return out, lse, ()


def _cpu_backward(g: Tensor, q, k, v, out, lse, extra) -> tuple[Tensor, Tensor, Tensor]:
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(g, q, k, v, out, lse, 0.0, True)


def _cuda_flash_forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, tuple]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = _aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True, False
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cuda_flash_backward(g: Tensor, q, k, v, out, lse, extra) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = extra
    return _aten._scaled_dot_product_flash_attention_backward(
        g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset
    )


def _cuda_efficient_forward(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, tuple]:
    out, lse, seed, offset = _aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)
    return out, lse, (seed, offset)


def _cuda_efficient_backward(g: Tensor, q, k, v, out, lse, extra) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset = extra
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        g, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], True
    )
    return dq, dk, dv


KERNELS = {
    "cpu-flash": (_cpu_forward, _cpu_backward),
    "cuda-flash": (_cuda_flash_forward, _cuda_flash_backward),
    "cuda-efficient": (_cuda_efficient_forward, _cuda_efficient_backward),
}


def kernel_for(q: Tensor) -> str | None:
    """The fused kernel that serves ``q``'s device and dtype, or None (then use the fallback path)."""
    if q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return "cpu-flash"
    if q.device.type == "cuda":
        return "cuda-flash" if q.dtype in (torch.float16, torch.bfloat16) else "cuda-efficient"
    return None


def _row_gate(lse: Tensor, T: int, dtype: torch.dtype) -> Tensor:
    """sigmoid(lse) as (B, nh, T, 1); the efficient kernel pads lse's last axis to a multiple of 32."""
    lse = lse[..., :T]
    return torch.sigmoid(lse.to(torch.promote_types(lse.dtype, torch.float32))).unsqueeze(-1).to(dtype)


class Softmax1Attention(torch.autograd.Function):
    """Causal softmax-1 attention = fused causal attention × sigmoid(row logsumexp); see the module docstring."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, kernel: str) -> Tensor:
        fwd, _ = KERNELS[kernel]
        out, lse, extra = fwd(q, k, v)
        y = out * _row_gate(lse, q.size(2), out.dtype)
        ctx.kernel, ctx.extra = kernel, extra
        ctx.save_for_backward(q, k, v, y, lse)
        return y

    @staticmethod
    def backward(ctx, g: Tensor):
        q, k, v, y, lse = ctx.saved_tensors
        _, bwd = KERNELS[ctx.kernel]
        g_scaled = (g * _row_gate(lse, q.size(2), g.dtype)).contiguous()
        dq, dk, dv = bwd(g_scaled, q, k, v, y, lse, ctx.extra)
        return dq, dk, dv, None


def softmax1_flash(q: Tensor, k: Tensor, v: Tensor, kernel: str | None = None) -> Tensor | None:
    """Causal softmax-1 attention of (B, nh, T, hs) q, k, v on a fused kernel; None when none serves them."""
    kernel = kernel or kernel_for(q)
    if kernel is None:
        return None
    k, v = k.to(q.dtype), v.to(q.dtype)
    try:
        return Softmax1Attention.apply(q, k, v, kernel)
    except (RuntimeError, NotImplementedError):  # e.g. a CUDA kernel that refuses this head size or GPU
        return None
