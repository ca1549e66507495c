"""Fake-quantised linear layer and the input transforms some methods put in front of it.

``FakeQuantLinear(weight, bias, scheme, input_scale=s, rotation=R)`` computes, for x of shape (..., in)::

    x' = R(x / s)                                    # SmoothQuant scaling, Hadamard rotation (each optional)
    W' = R(W · diag(s))  fake-quantised once          # the same transforms on the weight's rows
    y  = Q_out( Q_act(x') · W'ᵀ + b )                 # Q_* = fake quantisation, activations per sequence

which in float equals x · Wᵀ + b exactly: (x/s) · diag(s) · Wᵀ = x · Wᵀ, and R(u) = u · Rᵀ with R orthogonal,
so R(x) · R(W)ᵀ = x · Rᵀ · R · Wᵀ = x · Wᵀ. Keeping the SmoothQuant scale and the rotation inside the layer (rather
than folding 1/s into the previous LayerNorm and R into the residual stream, as the original methods do) costs an
elementwise division and a transform per call but works on any architecture; the quantisation error is the same.
The real-kernel backend (``kernels.make_real_linear``) takes the same arguments and must compute the same function,
using :func:`transform_weight` and :func:`transform_input` so that both sides quantise identical tensors.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qbench.quant.granularity import Granularity, PerAxis, PerGroup
from qbench.quant.ops import fake_quantize, fake_quantize_activation
from qbench.quant.schemes import QuantScheme

_MIN_HADAMARD_BLOCK = 64  # below this a block-diagonal Hadamard mixes too few channels: use a dense rotation
_MAX_DENSE_DIM = 8192  # a dense fallback rotation costs dim² floats


def _fwht(x: Tensor) -> Tensor:
    """Unnormalised fast Walsh–Hadamard transform over the last dim (a power of two): x ↦ x · H (Sylvester H)."""
    n = x.shape[-1]
    h = 1
    while h < n:
        x = x.unflatten(-1, (n // (2 * h), 2, h))  # pairs (i, i + h) inside each run of 2h
        x = torch.stack((x[..., 0, :] + x[..., 1, :], x[..., 0, :] - x[..., 1, :]), dim=-2).flatten(-3)
        h *= 2
    return x


def hadamard_block_size(dim: int) -> int:
    """Largest power of two dividing ``dim`` (768 -> 256, 3072 -> 1024, 11008 -> 256)."""
    return dim & -dim


class HadamardRotation(nn.Module):
    """x ↦ x · Rᵀ for a seeded random orthogonal R of size ``dim`` (QuaRot-style randomised Hadamard).

    R = (I ⊗ H_b / √b) · diag(d): d a random ±1 vector (``torch.Generator`` seeded with ``seed``), H_b the Sylvester
    Hadamard matrix of the largest power of two b dividing ``dim``, repeated block-diagonally (b = dim when ``dim`` is
    a power of two). Applied by a fast Walsh–Hadamard transform: O(dim) memory, O(dim log b) time per row.
    When b < 64 (and dim ≤ 8192) the blocks would mix too few channels, so R is instead a dense Haar-random
    orthogonal matrix (QR of a seeded Gaussian matrix), stored as a dim × dim buffer.
    Computed in float32, returned in the input dtype.
    """

    def __init__(self, dim: int, seed: int = 0) -> None:
        super().__init__()
        self.dim, self.seed = dim, seed
        gen = torch.Generator().manual_seed(seed)
        block = hadamard_block_size(dim)
        self.block = block if block >= min(_MIN_HADAMARD_BLOCK, dim) or dim > _MAX_DENSE_DIM else 0
        if self.block:
            signs = torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1
            self.register_buffer("signs", signs)
            self.matrix = None
        else:
            q, r = torch.linalg.qr(torch.randn(dim, dim, generator=gen, dtype=torch.float64))
            haar = q * torch.sign(torch.diagonal(r))  # fixing QR's column signs makes Q Haar-distributed
            self.register_buffer("matrix", haar.float())
            self.signs = None

    def forward(self, x: Tensor) -> Tensor:
        u = x.float()
        if self.matrix is not None:
            return (u @ self.matrix.T).to(x.dtype)
        u = _fwht((u * self.signs).unflatten(-1, (-1, self.block))).flatten(-2)
        return (u * (1.0 / math.sqrt(self.block))).to(x.dtype)

    def extra_repr(self) -> str:
        kind = f"block {self.block}" if self.block else "dense Haar"
        return f"dim={self.dim}, {kind}, seed={self.seed}"


def transform_weight(weight: Tensor, input_scale: Tensor | None, rotation: nn.Module | None) -> Tensor:
    """W' = R(W · diag(s)) for an (out, in) weight, in float32 (the weight that gets quantised)."""
    w = weight.detach().float()
    if input_scale is not None:
        w = w * input_scale.float()
    return rotation(w) if rotation is not None else w


def transform_input(x: Tensor, input_scale: Tensor | None, rotation: nn.Module | None) -> Tensor:
    """x' = R(x / s): the input transform matching :func:`transform_weight`."""
    if input_scale is not None:
        x = x / input_scale.to(x.dtype)
    return rotation(x) if rotation is not None else x


def describe(bits: int | None, granularity: Granularity, symmetric: bool, role: str) -> str:
    """``W8 per-channel``, ``A8 per-token``, ``W4 zp per-channel``, ``O8 per-sequence``; '' when float."""
    if bits is None:
        return ""
    if isinstance(granularity, PerAxis) and granularity.axis == (0 if role == "W" else -1):
        words = "per-channel"
    elif isinstance(granularity, PerGroup):
        words = f"per-group{granularity.group_size}"
    elif role != "W" and granularity.label == "tensor":
        words = "per-sequence"  # a per-tensor activation scale is computed per sequence (granularity.per_sequence)
    else:
        words = "per-" + granularity.label
    return f"{role}{bits}{'' if symmetric else ' zp'} {words}"


class FakeQuantLinear(nn.Module):
    """y = Q_out(Q_act(R(x / s)) · Ŵᵀ + b), Ŵ = Q_w(R(W · diag(s))) precomputed (see the module docstring).

    ``weight`` is (out, in) — a transformers GPT-2 ``Conv1D`` weight must be transposed first. The fake-quantised
    weight and the bias are frozen parameters (``requires_grad=False``); gradients reach the input through the
    ops' straight-through estimator.
    """

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        scheme: QuantScheme,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = scheme
        w = transform_weight(weight, input_scale, rotation)
        if scheme.weight_bits is not None:
            w = fake_quantize(w, scheme.weight_bits, scheme.weight_granularity, scheme.weight_symmetric)
        self.weight = nn.Parameter(w.to(weight.dtype), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer(
            "input_scale", None if input_scale is None else input_scale.detach().float().clone()
        )
        self.rotation = rotation

    def forward(self, x: Tensor) -> Tensor:
        s = self.scheme
        x = transform_input(x, self.input_scale, self.rotation)
        if s.act_bits is not None:
            x = fake_quantize_activation(x, s.act_bits, s.act_granularity, s.act_symmetric)
        y = F.linear(x, self.weight, self.bias)
        if s.out_bits is not None:
            y = fake_quantize_activation(y, s.out_bits, s.out_granularity, s.out_symmetric)
        return y

    def extra_repr(self) -> str:
        s = self.scheme
        parts = [
            f"{self.in_features}→{self.out_features}",
            describe(s.weight_bits, s.weight_granularity, s.weight_symmetric, "W") or "W float",
            describe(s.act_bits, s.act_granularity, s.act_symmetric, "A") or "A float",
            describe(s.out_bits, s.out_granularity, s.out_symmetric, "O"),
        ]
        if self.input_scale is not None:
            parts.append(f"smooth α={s.params['alpha']:g}" if "alpha" in s.params else "smooth")
        if self.bias is None:
            parts.append("bias=False")
        return ", ".join(p for p in parts if p)
