"""Fake-quantised linear layer and the input transforms some methods put in front of it.

``FakeQuantLinear(weight, bias, scheme, input_scale=s, rotation=R)`` computes, for x of shape (..., in)::

    x' = R(x / s)                                    # SmoothQuant scaling, Hadamard rotation (each optional)
    W' = R(W · diag(s))  fake-quantised (Ŵ)           # the same transforms on the weight's rows
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


# Consecutive calls of fewer tokens than this (decode steps) keep the Ŵ they derived: generation then holds one Ŵ
# per layer, as a stored Ŵ would, instead of re-quantising every weight for every token. Scoring windows (hundreds
# of tokens a call) derive Ŵ per call and hold none; so does a single short call (the KV cache's probe).
KEEP_BELOW_TOKENS = 16


class FakeQuantLinear(Float32Buffers):
    """y = Q_out(Q_act(R(x / s)) · Ŵᵀ + b), Ŵ = Q_w(R(W · diag(s))) (see the module docstring).

    ``weight`` is (out, in) — a transformers GPT-2 ``Conv1D`` weight must be transposed first. How Ŵ is held
    (``storage``), so that a quantised copy of a model costs the model once, not twice:

    - ``"shared"`` (``share_weight=True`` and no input scale or rotation: round-to-nearest, and QuaRot's searched
      grid on an unchanged weight): the float weight itself, by reference, fake-quantised again in every forward
      — one layer's Ŵ alive at a time, no weight memory of its own.
    - ``"codes"`` (an integer format whose weight a transform or an algorithm changed): the integer codes (int8 /
      uint8, one byte a weight) and the float32 scales and zero points; Ŵ = s · (q − z) in every forward.
    - ``"float"`` (a float format under a transform, or float weights under a transform): Ŵ as a frozen parameter.

    Decoding (consecutive calls of fewer than :data:`KEEP_BELOW_TOKENS` tokens) keeps the Ŵ it derived.

    All three give the same Ŵ bit for bit (``dequantize(quantize(w))`` equals ``fake_quantize(w)``), so a cell's
    numbers do not depend on the storage. ``layer.weight`` reads Ŵ in every case (a fresh tensor unless
    ``"float"``). The bias is the float model's own tensor, frozen; gradients reach the input through the ops'
    straight-through estimator. A cast (``model.to(torch.bfloat16)``) casts Ŵ like any model's weight, but keeps
    the SmoothQuant scale, the weight scales and the rotation in float32 (``qbench.quant.float32``).
    """

    _float32_buffers = ("input_scale", "weight_scale")
    # the shared float weight keeps its dtype through a cast, so Ŵ stays bf16(Q(W)), never Q(bf16(W))
    _dtype_kept_buffers = ("weight_source",)

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
        share_weight: bool = False,
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.scheme = scheme
        self._weight_dtype = weight.dtype
        self._granularity: Granularity | None = None  # the weight's integer grid (integer formats)
        integer = scheme.weight_bits is not None and scheme.format == INT
        if integer:  # a group as wide as the row or wider is per channel
            self._granularity = scheme.weight_granularity_for(self.in_features)
        self.register_buffer("weight_scale", None)
        self.register_buffer("weight_zero_point", None)
        if share_weight and input_scale is None and rotation is None:
            # Ŵ derived from the float model's own tensor in every forward: the layer adds no weight memory
            self.storage = "shared"
            self.register_buffer("weight_source", weight.detach())
            if weight_qparams is not None:  # a searched grid (QuaRot's wclip=mse) on the unchanged weight
                self.weight_scale, self.weight_zero_point = weight_qparams.scale, weight_qparams.zero_point
            if (
                not weight.is_meta
            ):  # an offloaded weight (qbench.quant.offload) is checked in its first forward
                self.dequantized_weight()  # fails now, as a stored Ŵ would, on NaN or a grid that does not fit
        elif integer:
            self.storage = "codes"
            w = pad_to_groups(transform_weight(weight, input_scale, rotation), self._granularity)
            bits, symmetric = scheme.weight_bits, scheme.weight_symmetric
            qparams = given_or_chosen(w, bits, self._granularity, symmetric, weight_qparams)
            self.register_buffer("weight_codes", quantize(w, qparams, bits, self._granularity, symmetric))
            self.weight_scale, self.weight_zero_point = qparams.scale, qparams.zero_point
        else:  # float weights or a float format, transformed: Ŵ itself
            self.storage = "float"
            w = transform_weight(weight, input_scale, rotation)
            if scheme.weight_bits is not None:  # a float format (formats.py)
                w = fake_quantize_format(w, scheme.format, scheme.weight_granularity, activation=False)
            self.weight = nn.Parameter(w.to(weight.dtype), requires_grad=False)
        # the bias is the float model's own tensor: no quantiser changes it, and evaluation never writes it
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
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
        y = F.linear(x, self._forward_weight(x), self.bias)
        if self.out_static is not None:
            y = self.out_static(y)
        elif s.out_bits is not None:
            y = fake_quantize_activation(y, s.out_bits, s.out_granularity, s.out_symmetric)
        return y

    def _forward_weight(self, x: Tensor) -> Tensor:
        """Ŵ for this call. Derived now, except while decoding: from the second consecutive call of fewer than
        :data:`KEEP_BELOW_TOKENS` tokens on, Ŵ is kept (re-deriving every weight for one token would cost more than
        the token's forward) until a larger call, a cast or an edit of what it was derived from. A single short
        call (the KV cache's probe) keeps nothing; nor does a traced or inference-mode call."""
        if self.storage == "float":
            return self._parameters["weight"]
        if x.numel() >= KEEP_BELOW_TOKENS * self.in_features:  # scoring windows: hold no Ŵ
            self.__dict__.pop("_kept", None)
            self._short_calls = 0
            return self.dequantized_weight()
        if (
            torch.compiler.is_compiling()
            or torch.is_inference_mode_enabled()
            or not self.__dict__.get("keep_decoded", True)  # offloaded: one layer's weight resident at a time
        ):
            return self.dequantized_weight()
        source = self._buffers.get("weight_source" if self.storage == "shared" else "weight_codes")
        key = (source.data_ptr(), source.device, None if source.is_inference() else source._version)
        kept = self.__dict__.get("_kept")
        if kept is not None and kept[0] == key:
            return kept[1]
        w = self.dequantized_weight()
        self._short_calls = self.__dict__.get("_short_calls", 0) + 1
        if self._short_calls >= 2:
            self._kept = (key, w)  # a plain attribute, not state
        return w

    def dequantized_weight(self) -> Tensor:
        """Ŵ (out, in) in the layer's weight dtype — the stored Ŵ, s · (q − z) of the stored codes, or the shared
        float weight fake-quantised now; the same tensor in all three (``storage``: the class docstring)."""
        if self.storage == "float":
            return self._parameters["weight"]
        qparams = None if self.weight_scale is None else QParams(self.weight_scale, self.weight_zero_point)
        if self.storage == "codes":
            w = dequantize(self.weight_codes, qparams, self._granularity, self._weight_dtype)
            # ragged rows: drop the padding, contiguous as a stored Ŵ was (a GEMM may pick its kernel by stride)
            return w[..., : self.in_features].contiguous() if w.shape[-1] != self.in_features else w
        source, s = self.weight_source, self.scheme
        if s.weight_bits is None:
            return source.to(self._weight_dtype)
        if self._granularity is None:  # a float format
            w = fake_quantize_format(source.float(), s.format, s.weight_granularity, activation=False)
        else:
            w = fake_quantize_weight(
                source.float(), s.weight_bits, self._granularity, s.weight_symmetric, qparams
            )
        return w.to(self._weight_dtype)

    def __getattr__(self, name: str) -> Tensor | nn.Module:
        # ``layer.weight`` reads Ŵ however it is stored (a fresh tensor when the layer holds codes: writing to it
        # changes nothing)
        if name == "weight" and self.__dict__.get("storage", "float") != "float":
            w = self.dequantized_weight().detach()
            source = self._buffers.get("weight_source")
            # never the float model's own tensor (a float weight returned as it is): a write must not reach it
            return w.clone() if source is not None and w.data_ptr() == source.data_ptr() else w
        return super().__getattr__(name)

    def _apply(self, fn, recurse=True):
        # a cast (``.to(torch.bfloat16)``) moves the dtype Ŵ comes out in, as it would cast a stored Ŵ
        super()._apply(fn, recurse)
        self.__dict__.pop("_kept", None)
        self._weight_dtype = fn(torch.empty(0, dtype=self._weight_dtype)).dtype
        return self

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
