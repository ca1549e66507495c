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
``weight_qparams`` (both sides): the grid an algorithm fixed for W' (GPTQ's scales and zero points, ``gptq.py``),
used instead of the round-to-nearest choice; the weight passed is then already on that grid after the transforms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.errors import UserError
from qbench.quant.clip import clipped_fake_quantize
from qbench.quant.float32 import Float32Buffers
from qbench.quant.formats import INT, fake_quantize_format
from qbench.quant.granularity import Granularity, PerGroup, per_sequence, unit
from qbench.quant.hadamard import apply_kron, odd_factor
from qbench.quant.ops import fake_quantize, fake_quantize_activation
from qbench.quant.primitives import QParams, dequantize, given_or_chosen, quantize
from qbench.quant.schemes import QuantScheme


class HadamardRotation(Float32Buffers):
    """x ↦ x · Rᵀ for a seeded orthogonal R of the full size ``dim`` (QuaRot-style; ``qbench.quant.hadamard``).

    R = (F ⊗ H_b / √b) · diag(s): s a seeded ±1 vector, H_b Sylvester's Hadamard matrix of a power of two b
    (applied by a fast Walsh–Hadamard transform), F an explicit orthonormal factor of the rest — a Paley Hadamard
    matrix when one of that order exists (then R is a Hadamard matrix: 768 = 12 · 64), else a seeded Haar matrix
    (688 = 43 · 16); an odd part above 4096 uses OrthoAdam's windowed randomised Hadamard. Every output channel
    mixes every input channel, for every ``dim`` (the old block-diagonal form mixed 256-wide blocks at d = 768
    and only flipped signs at an odd d). Buffers stay float32 through casts; the input is rotated in float32 and
    returned in its own dtype.
    """

    _float32_buffers = ("signs", "factor")

    def __init__(self, dim: int, seed: int = 0) -> None:
        super().__init__()
        self.dim, self.seed = dim, seed
        gen = torch.Generator().manual_seed(seed)
        factor, self.kind = odd_factor(dim, gen)
        self._windowed = None
        if self.kind == "windowed":  # an odd part > MAX_EXPLICIT: O(dim) memory, built on the CPU in float32
            from trainers.optim.rotations import build_hadamard

            self._windowed = build_hadamard(dim, gen).to(torch.device("cpu"), torch.float32)
            self.register_buffer("factor", None)
            self.register_buffer("signs", None)
            return
        self.register_buffer("factor", None if factor is None else factor.float())
        self.register_buffer("signs", torch.randint(0, 2, (dim,), generator=gen).float() * 2 - 1)

    def forward(self, x: Tensor) -> Tensor:
        u = x.float()
        if self._windowed is not None:
            if self._windowed.device() != u.device:
                self._windowed = self._windowed.to(u.device, torch.float32)
            rows = u.reshape(-1, self.dim, 1)
            return self._windowed.apply(rows).reshape(x.shape).to(x.dtype)
        return apply_kron(u * self.signs, self.factor).to(x.dtype)

    def matrix(self) -> Tensor:
        """R itself (dim × dim, float32), for tests and small dims."""
        return self(torch.eye(self.dim, device=self.signs.device if self.signs is not None else None)).T

    def extra_repr(self) -> str:
        return f"dim={self.dim}, {self.kind}, seed={self.seed}"


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


def pad_to_groups(w: Tensor, granularity: Granularity) -> Tensor:
    """Zero-pad the last dim to a multiple of a ``PerGroup`` size (else ``w`` itself): a ragged row's last group is
    then shorter, with its own scale. Exact: absmax's max|x| and zeropoint's [min(x, 0), max(x, 0)] ignore zeros."""
    if isinstance(granularity, PerGroup) and w.shape[-1] % granularity.group_size:
        return F.pad(w, (0, -w.shape[-1] % granularity.group_size))
    return w


def fake_quantize_weight(
    w: Tensor, bits: int, granularity: Granularity, symmetric: bool, qparams: QParams | None = None
) -> Tensor:
    """``ops.fake_quantize`` of a weight, allowing a group size that does not divide the row (:func:`pad_to_groups`).
    ``qparams``: the grid an algorithm fixed (GPTQ), in the padded block-grid shape; the weight is rounded onto it."""
    padded = pad_to_groups(w, granularity)
    if qparams is None:
        y = fake_quantize(padded, bits, granularity, symmetric)
    else:
        qp = given_or_chosen(padded, bits, granularity, symmetric, qparams)
        y = dequantize(quantize(padded, qp, bits, granularity, symmetric), qp, granularity, w.dtype)
    return y if padded is w else y[..., : w.shape[-1]].contiguous()


def describe(bits: int | None, granularity: Granularity, symmetric: bool, role: str) -> str:
    """``W8 per-channel``, ``A8 per-token``, ``W4 zp per-g32``, ``O8 per-sequence`` (the words of
    ``granularity.unit``); '' when float."""
    if bits is None:
        return ""
    words = unit(granularity, {"W": "weight", "A": "act", "O": "out"}[role])
    return f"{role}{bits}{'' if symmetric else ' zp'} per-{words}"


class FakeQuantLinear(Float32Buffers):
    """y = Q_out(Q_act(R(x / s)) · Ŵᵀ + b), Ŵ = Q_w(R(W · diag(s))) precomputed (see the module docstring).

    ``weight`` is (out, in) — a transformers GPT-2 ``Conv1D`` weight must be transposed first. The fake-quantised
    weight and the bias are frozen parameters (``requires_grad=False``); gradients reach the input through the
    ops' straight-through estimator. A cast (``model.to(torch.bfloat16)``) casts the weight like any model's, but
    keeps the SmoothQuant scale and the rotation in float32 (``qbench.quant.float32``).
    """

    _float32_buffers = ("input_scale",)

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        scheme: QuantScheme,
        *,
        input_scale: Tensor | None = None,
        rotation: nn.Module | None = None,
        act_static: nn.Module | None = None,
        out_static: nn.Module | None = None,
        weight_qparams: QParams | None = None,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = scheme
        w = transform_weight(weight, input_scale, rotation)
        if scheme.weight_bits is not None and scheme.format != INT:  # a float format (formats.py)
            w = fake_quantize_format(w, scheme.format, scheme.weight_granularity, activation=False)
        elif scheme.weight_bits is not None:
            granularity = scheme.weight_granularity_for(self.in_features)  # a group ≥ the row: per channel
            w = fake_quantize_weight(
                w, scheme.weight_bits, granularity, scheme.weight_symmetric, weight_qparams
            )
        self.weight = nn.Parameter(w.to(weight.dtype), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.register_buffer(
            "input_scale", None if input_scale is None else input_scale.detach().float().clone()
        )
        self.rotation = rotation
        # static (calibrated) scales, ``static.StaticQuantizer``; None: dynamic scales per sequence
        mismatched = (act_static is None) != (scheme.act_bits is None) or (out_static is None) != (
            scheme.out_bits is None
        )
        if scheme.static and mismatched:
            raise UserError(
                f"scheme {scheme.name!r} uses static scales: build it with quantize(..., calibration=windows)"
            )
        self.act_static, self.out_static = act_static, out_static

    def forward(self, x: Tensor) -> Tensor:
        s = self.scheme
        x = transform_input(x, self.input_scale, self.rotation)
        if self.act_static is not None:
            x = self.act_static(x)
        elif s.act_bits is not None and s.format != INT:
            x = fake_quantize_format(x, s.format, s.act_granularity, activation=True)
        elif s.act_bits is not None and s.act_clip_ratio != 1.0:  # QuaRot's clip ratio (qbench.quant.clip)
            gran = per_sequence(s.act_granularity, x.ndim)
            x = clipped_fake_quantize(x, s.act_bits, gran, s.act_symmetric, s.act_clip_ratio)
        elif s.act_bits is not None:
            x = fake_quantize_activation(x, s.act_bits, s.act_granularity, s.act_symmetric)
        y = F.linear(x, self.weight, self.bias)
        if self.out_static is not None:
            y = self.out_static(y)
        elif s.out_bits is not None:
            y = fake_quantize_activation(y, s.out_bits, s.out_granularity, s.out_symmetric)
        return y

    def extra_repr(self) -> str:
        s = self.scheme
        parts = [
            f"{self.in_features}→{self.out_features}",
            "" if s.format == INT else s.format,
            describe(s.weight_bits, s.weight_granularity, s.weight_symmetric, "W") or "W float",
            describe(s.act_bits, s.act_granularity, s.act_symmetric, "A") or "A float",
            describe(s.out_bits, s.out_granularity, s.out_symmetric, "O"),
        ]
        if self.input_scale is not None:
            parts.append(f"smooth α={s.params['alpha']:g}" if "alpha" in s.params else "smooth")
        if self.bias is None:
            parts.append("bias=False")
        return ", ".join(p for p in parts if p)
