"""Real W8A8 absmax linear: int8 weights, activations quantised on the fly, integer GEMM (``torch._int_mm``).

For an input x (…, in) and an (out, in) float weight W:

    W:   s_w = max|W| / 127 per output channel (or per tensor),  q_w = round(W / s_w)       (once, at build)
    x:   s_x = max|x| / 127 per token (row) or per tensor,       q_x = round(x / s_x)       (every call)
    y  = (q_x · q_wᵀ) · s_x · s_w + b            (q_x · q_wᵀ exact in int32: ``torch._int_mm``)

with the primitives' arithmetic (scale = max(amax / 127, TINY), round half to even, clamp to ±127), so the codes
equal those of ``fake_quantize`` and y equals the fake path ``fake_quantize(x) @ fake_quantize(W)ᵀ + b`` up to the
float32 rounding of the fake path's dot products. "Per tensor" for activations means **one scale per sequence**:
per leading batch element of a (B, T, in) input, one scale for a 2-D (T, in) input (``per_sequence`` in
``granularity.py``), so results do not depend on how sequences are batched.

Options, in the order they act on x: ``input_scale`` (SmoothQuant: x / s per input channel) and ``rotation`` (a
module x ↦ x · Rᵀ, e.g. ``fake.HadamardRotation``; a plain (in, in) matrix is wrapped). The weight that gets
quantised is ``fake.transform_weight(W, s, R)`` = R(W · diag(s)) and the input ``fake.transform_input(x, s, R)``
— the very functions ``FakeQuantLinear`` uses, so both backends quantise identical tensors. ``out_quant``
fake-quantises the output per sequence after the bias (absmax-coarse).

Speed: ``fused="auto"`` (the default) runs float32 CPU input through the compiled C kernels of ``paths.py``:
one C call quantises the activations (the same codes and scales), accumulates the int8 products exactly in int32
(AVX2: a streaming GEMV up to 16 rows, an int16 panel GEMM above — except on CPUs with AVX-512 VNNI or AMX,
where oneDNN's ``torch._int_mm`` takes the rows above 16) and applies the epilogue in the same operation order
— so the result equals the torch path bit for bit (tested). Without a C compiler (or with ``QBENCH_NATIVE=0``) "auto" falls back to the torch path below.
In torch, quantising activations eagerly costs several passes over x and the epilogue several passes over the
(M, out) result — together about as much as the int8 GEMM saves. ``fused=True`` runs the whole forward as one
``torch.compile``'d function (one pass to quantise, one fused epilogue); "auto" without the C kernels does that
only for large inputs, where a one-off compile (~10–20 s cold, cached on disk afterwards) pays back; ``False``
is plain eager torch. All give the same codes (tested). Compiled CPU kernels fix their OpenMP thread count when
first compiled.

CUDA: the same code runs on CUDA tensors. cuBLAS int8 GEMM needs M > 16 and K, N multiples of 8 (torch's
checks) and a row-major (K, N) second operand, and cuBLASLt still refuses some legal shapes (M = 17 on an H200,
CUDA 13); :func:`int_mm` pads with zeros to M a multiple of 32, K and N of 8 (exact), slices the result, and where
cuBLAS refuses a shape anyway — or a device has no ``torch._int_mm`` — computes the same int32 result with
float32 matmuls over K-chunks of 1024, exact for every K (:data:`EXACT_FLOAT_K`).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.weak import WeakIdKeyDictionary

from models.errors import UserError
from qbench.quant.fake import transform_input, transform_weight
from qbench.quant.granularity import Granularity, PerAxis, PerTensor, PerToken, check_granularity, unit
from qbench.quant.kernels import paths
from qbench.quant.kernels.base import LayerInputs, RealLinear, as_rotation, check_input_scale
from qbench.quant.primitives import TINY, QParams, given_or_chosen, quantize, true_div
from qbench.quant.schemes import QuantScheme

QMAX = 127
PER_CHANNEL, PER_TOKEN = PerAxis(0), PerToken()
# activations: per token, or PerTensor = one scale per sequence (``granularity.per_sequence``)
ACT_GRANULARITIES: tuple[Granularity, ...] = (PER_TOKEN, PerTensor())
# weights (out, in): per output channel (axis 0, also spelt −2) or per tensor
WEIGHT_GRANULARITIES: tuple[Granularity, ...] = (PER_CHANNEL, PerAxis(-2), PerTensor())
# fused="auto" compiles once M·K·N reaches this (~67 M multiply-adds, e.g. 128 tokens × 768 × 768): below, the
# compiled call's fixed overhead eats most of what fusion saves
FUSE_MIN_ELEMENTS = 1 << 26
Fused = bool | Literal["auto"]


# ------------------------------------------------------------------------------------------ integer GEMM


# cuBLAS int8 shapes: torch checks M > 16 and K, N multiples of 8, but cuBLASLt on an H200 with CUDA 13 refused
# M = 17, 40 and 80 at K = 64 and 72 (CUBLAS_STATUS_NOT_SUPPORTED) while M = 32 and 1024 ran at every K tried;
# torch's own fix pads M < 32 to 32. So M is padded to a multiple of 32, K and N to multiples of 8.
CUBLAS_M_MULTIPLE, CUBLAS_MULTIPLE = 32, 8
# float32 holds every integer up to 2^24 exactly, and 1024 products of int8 codes sum to at most 1024 · 128² = 2^24:
# a float matmul over K-chunks of 1024 is exact in any summation order (also under TF32, whose 10-bit mantissa
# holds every int8 code and whose products accumulate in float32)
EXACT_FLOAT_K = 1024
# (device, padded M, K, N) that cuBLAS refused in this process: later calls go straight to the float path
_cublas_refused: set[tuple[str, int, int, int]] = set()
_padded_weights = WeakIdKeyDictionary()  # b -> (b._version, padded contiguous copy)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_for_cublas(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    """Zero-pad a (M, K) and b (K, N) to cuBLAS int8 shapes (M a multiple of 32, K and N of 8). Exact.

    b is returned row-major contiguous: a transposed (column-major) b silently gave wrong results on some cuBLAS
    paths. b is normally a layer's stored weight (the same tensor every call), so its padded contiguous copy is
    kept (keyed by identity, invalidated when the tensor is written to) instead of being rebuilt per call."""
    (m, k), n = a.shape, b.shape[1]
    pad_m = _round_up(max(m, 1), CUBLAS_M_MULTIPLE) - m
    pad_k, pad_n = -k % CUBLAS_MULTIPLE, -n % CUBLAS_MULTIPLE
    if pad_m or pad_k:
        a = F.pad(a, (0, pad_k, 0, pad_m))
    if torch.compiler.is_compiling():  # no identity cache inside a traced graph
        return a, F.pad(b, (0, pad_n, 0, pad_k)).contiguous()
    if not (pad_k or pad_n) and b.is_contiguous():
        return a, b
    cached = _padded_weights.get(b)  # one extra int8 copy of such a weight on the device
    if cached is None or cached[0] != b._version:
        cached = (b._version, F.pad(b, (0, pad_n, 0, pad_k)).contiguous())
        _padded_weights[b] = cached
    return a, cached[1]


def float_int_mm(a: Tensor, b: Tensor) -> Tensor:
    """Exact int8 (M, K) × (K, N) → int32 by float32 matmuls over K-chunks of ``EXACT_FLOAT_K`` (see there)."""
    acc = None
    for k0 in range(0, a.shape[1], EXACT_FLOAT_K):
        part = (a[:, k0 : k0 + EXACT_FLOAT_K].float() @ b[k0 : k0 + EXACT_FLOAT_K].float()).to(torch.int32)
        acc = part if acc is None else acc.add_(part)
    return acc if acc is not None else torch.zeros(a.shape[0], b.shape[1], dtype=torch.int32, device=a.device)


def int_mm(a: Tensor, b: Tensor) -> Tensor:
    """Exact int8 (M, K) × int8 (K, N) → int32 (M, N) on any device (see the module docstring for CUDA)."""
    if a.device.type == "cpu":
        return torch._int_mm(a, b)  # any shape on CPU
    if a.device.type != "cuda":
        return float_int_mm(a, b)  # mps, xpu, …: no integer GEMM in torch
    m, n = a.shape[0], b.shape[1]
    pa, pb = pad_for_cublas(a, b)
    if torch.compiler.is_compiling():
        return torch._int_mm(pa, pb)[:m, :n]
    key = (str(a.device), pa.shape[0], pa.shape[1], pb.shape[1])
    if key not in _cublas_refused:
        try:
            return torch._int_mm(pa, pb)[:m, :n]
        except RuntimeError as err:
            # a shape cuBLASLt has no int8 kernel for: the error is not sticky, the CUDA context lives on
            if "CUBLAS_STATUS_NOT_SUPPORTED" not in str(err):
                raise
            _cublas_refused.add(key)
    return float_int_mm(a, b)


# ------------------------------------------------------------------------------------ activation quantiser


def absmax_scale(x: Tensor, per_token: bool) -> Tensor:
    """s = max(amax / 127, TINY): per row (…, T, 1) when ``per_token``, else per sequence (B, 1, 1) of (B, T, K)."""
    amax = x.abs().amax(dim=-1 if per_token else (-2, -1), keepdim=True)
    return true_div(amax, QMAX).clamp_min(TINY)


def quantize_activation(x: Tensor, per_token: bool) -> tuple[Tensor, Tensor]:
    """(int8 codes, float32 scale) of a float32 (B, T, K) activation; scale is (B, T, 1) or (B, 1, 1)."""
    scale = absmax_scale(x, per_token)
    return torch.clamp(torch.round(x / scale), -QMAX, QMAX).to(torch.int8), scale


def fake_quantize_per_sequence(y: Tensor) -> Tensor:
    """Absmax 8-bit fake quantisation with one scale per sequence of a (B, T, N) tensor (the coarse output quant)."""
    scale = absmax_scale(y, per_token=False)
    return torch.clamp(torch.round(y / scale), -QMAX, QMAX) * scale


def int8_linear_forward(
    x: Tensor,
    qweight_t: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    per_token: bool,
    out_quant: bool,
    input_scale: Tensor | None,
) -> Tensor:
    """The W8A8 forward on a float32 (B, T, in) input; returns float32 (B, T, out). Pure, compile-able.

    ``input_scale`` divides x here, where compile fuses it into the quantiser; a rotation is applied by the caller.
    """
    B, T, K = x.shape
    if input_scale is not None:
        x = x / input_scale
    q, s_x = quantize_activation(x, per_token)
    acc = int_mm(q.reshape(B * T, K), qweight_t)  # (B·T, out) int32, exact
    s_rows = s_x.expand(B, T, 1).reshape(B * T, 1)
    y = acc.to(torch.float32) * s_rows * w_scale  # s_x · s_w per (row, column)
    if bias is not None:
        y = y + bias
    y = y.reshape(B, T, -1)
    return fake_quantize_per_sequence(y) if out_quant else y


_compiled: dict[tuple[bool, bool, bool, bool], Callable[..., Tensor]] = {}
_compile_failed = False


def _compiled_forward(per_token: bool, out_quant: bool, smooth: bool, bias: bool) -> Callable[..., Tensor]:
    """``int8_linear_forward`` compiled for one static configuration (the bools and which tensors are None).

    Dynamo keeps compiled variants per *code object*, at most 8 (``recompile_limit``), and every configuration
    compiles a B = 1 and a B > 1 variant (0/1 shape specialisation), so one shared function runs out after four
    configurations and silently turns eager. Each configuration therefore gets its own copy of the code object.
    """
    key = (per_token, out_quant, smooth, bias)
    if key not in _compiled:
        code = int8_linear_forward.__code__.replace(
            co_name=f"int8_linear_forward_{'_'.join(map(str, map(int, key)))}"
        )
        fn = types.FunctionType(code, int8_linear_forward.__globals__, code.co_name)
        _compiled[key] = torch.compile(fn, dynamic=True)
    return _compiled[key]


def _run_forward(
    fused: Fused,
    x: Tensor,
    qweight_t: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    per_token: bool,
    out_quant: bool,
    input_scale: Tensor | None,
) -> Tensor:
    """Eager or compiled (see ``fused`` in the module docstring); inside an outer torch.compile always eager ops,
    which the outer graph then fuses."""
    global _compile_failed
    args = (x, qweight_t, w_scale, bias, per_token, out_quant, input_scale)
    numel = x.numel() * qweight_t.shape[1]
    want = fused is True or (fused == "auto" and numel >= FUSE_MIN_ELEMENTS)
    if not want or _compile_failed or torch.compiler.is_compiling():
        return int8_linear_forward(*args)
    try:
        return _compiled_forward(per_token, out_quant, input_scale is not None, bias is not None)(*args)
    except Exception as err:  # no C++ compiler, unsupported platform: fall back once, loudly
        _compile_failed = True
        warnings.warn(
            f"torch.compile of the int8 forward failed ({type(err).__name__}: {err}); using eager ops",
            stacklevel=3,
        )
        return int8_linear_forward(*args)


# ----------------------------------------------------------------------------------------------- module


class Int8Linear(RealLinear):
    """W8A8 absmax linear with an integer GEMM; see the module docstring for the exact definition.

    Scales and bias stay float32 through casts (``base.RealLinear``): the C kernels read them as float32."""

    def __init__(
        self,
        qweight_t: Tensor,
        w_scale: Tensor,
        bias: Tensor | None,
        *,
        act: Granularity = PER_TOKEN,
        out_quant: bool = False,
        input_scale: Tensor | None = None,
        rotation: nn.Module | None = None,
        fused: Fused = "auto",
        static_act_scale: Tensor | None = None,
        static_out_scale: Tensor | None = None,
    ) -> None:
        super().__init__()
        check_granularity("Int8Linear activation granularity", act, ACT_GRANULARITIES)
        self.in_features, self.out_features = qweight_t.shape
        self.act, self.out_quant, self.fused = act, out_quant, fused
        # (in, out) int8 for _int_mm; from_float stores it as the transpose of a contiguous (out, in) tensor,
        # the layout of the compiled kernels (``paths.int8_forward``), so both read the same bytes
        if qweight_t.dtype != torch.int8 or (qweight_t.numel() and int(qweight_t.min()) < -QMAX):
            # −128 has no place in absmax codes (±127), and the C GEMV's sign trick relies on |code| ≤ 127
            raise UserError(
                f"Int8Linear needs int8 weight codes in [−{QMAX}, {QMAX}] (absmax), got {qweight_t.dtype} "
                f"with minimum {int(qweight_t.min()) if qweight_t.numel() else 'n/a'}"
            )
        # w_scale: (out,) per channel or () per tensor
        self.store(
            {"qweight_t": qweight_t},
            {"w_scale": w_scale, "bias": bias},
            input_scale=input_scale,
            rotation=rotation,
        )
        # static (calibrated) scales: see the end of the class
        self._init_static(static_act_scale, static_out_scale)

    @classmethod
    def from_float(
        cls,
        weight: Tensor,
        bias: Tensor | None = None,
        *,
        weight_granularity: Granularity = PER_CHANNEL,
        act: Granularity = PER_TOKEN,
        out_quant: bool = False,
        input_scale: Tensor | None = None,
        rotation: nn.Module | Tensor | None = None,
        fused: Fused = "auto",
        static_act_scale: Tensor | None = None,
        static_out_scale: Tensor | None = None,
        weight_qparams: QParams | None = None,
    ) -> Int8Linear:
        """Quantise R(W · diag(s)) of an (out, in) float weight (``fake.transform_weight``) with the scheme's
        ``weight_granularity`` (the quantiser takes it as is: one codebook with fake mode) and ``act``."""
        check_granularity("Int8Linear weight granularity", weight_granularity, WEIGHT_GRANULARITIES)
        rotation = as_rotation(rotation, weight.shape[1])
        w = transform_weight(weight, check_input_scale(input_scale, weight.shape[1]), rotation)
        qp = given_or_chosen(w, 8, weight_granularity, True, weight_qparams)
        codes = quantize(w, qp, 8, weight_granularity, symmetric=True)  # (out, in) int8
        per_channel = isinstance(weight_granularity, PerAxis)
        w_scale = qp.scale.reshape(-1) if per_channel else qp.scale.reshape(())
        b = None if bias is None else bias.detach().float().clone()
        return cls(
            codes.contiguous().t(),
            w_scale.contiguous(),
            b,
            act=act,
            out_quant=out_quant,
            input_scale=input_scale,
            rotation=rotation,
            fused=fused,
            static_act_scale=static_act_scale,
            static_out_scale=static_out_scale,
        )

    def _forward(self, x: Tensor) -> Tensor:
        if self.static_act_scale is not None:
            return self._static_forward(x)
        lead = x.shape[:-1]
        # (B, T, K): per-tensor scales are per leading batch element; ≤ 2-d input is one sequence
        x3 = x.float().reshape(1 if x.dim() <= 2 else x.shape[0], -1, self.in_features)
        input_scale, per_token = self.input_scale, isinstance(self.act, PerToken)
        # the rotation runs eagerly, outside the compiled function: a module argument would recompile per layer
        if self.rotation is not None:
            x3, input_scale = transform_input(x3, input_scale, self.rotation), None
        y = None
        if self.fused == "auto":  # the compiled CPU kernels where they apply (paths.py), else the torch path
            y = paths.int8_forward(self, x3, self.qweight_t, self.w_scale, self.bias, per_token, input_scale)
            y = y if y is None or not self.out_quant else fake_quantize_per_sequence(y)
        if y is None:
            y = _run_forward(
                self.fused,
                x3,
                self.qweight_t,
                self.w_scale,
                self.bias,
                per_token,
                self.out_quant,
                input_scale,
            )
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def fast_direct(self) -> bool:
        return (
            self.fused == "auto"
            and self.static_act_scale is None
            and self.rotation is None
            and self.input_scale is None
            and not self.out_quant
        )

    # ------------------------------------------------ static (calibrated) scales — SCHEME's part, kept apart
    # A static per-tensor activation scale s_a (and output scale s_o) from calibration (``qbench.quant.static``):
    # q_x = clamp(round(x' / s_a), ±127) — values beyond the calibrated range saturate —, then the same integer
    # GEMM and epilogue; the output, when quantised, uses s_o instead of a per-sequence scale. Eager torch: the
    # fused/compiled dynamic path above is untouched.

    def _init_static(self, act_scale: Tensor | None, out_scale: Tensor | None) -> None:
        for name, scale in (("static_act_scale", act_scale), ("static_out_scale", out_scale)):
            if scale is not None and scale.numel() != 1:
                raise UserError(
                    f"Int8Linear: {name} must be one per-tensor scale, got shape {tuple(scale.shape)}"
                )
            self.register_buffer(name, None if scale is None else scale.detach().float().reshape(()).clone())
        if out_scale is not None and not self.out_quant:
            raise UserError("Int8Linear: static_out_scale needs out_quant=True")

    def _static_forward(self, x: Tensor) -> Tensor:
        x2 = transform_input(x.float(), self.input_scale, self.rotation).reshape(-1, self.in_features)
        q = torch.clamp(torch.round(x2 / self.static_act_scale), -QMAX, QMAX).to(torch.int8)
        y = int_mm(q, self.qweight_t).to(torch.float32) * (self.static_act_scale * self.w_scale)
        if self.bias is not None:
            y = y + self.bias
        if self.out_quant:
            if self.static_out_scale is not None:
                y = torch.clamp(torch.round(y / self.static_out_scale), -QMAX, QMAX) * self.static_out_scale
            else:
                y = fake_quantize_per_sequence(
                    y.reshape(1 if x.dim() <= 2 else x.shape[0], -1, self.out_features)
                )
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized_weight(self) -> Tensor:
        """s_w · q_w as (out, in) float32: the (transformed) weight the integer GEMM effectively uses."""
        scale = self.w_scale.reshape(-1, 1) if self.w_scale.dim() else self.w_scale
        return self.qweight_t.t().float() * scale

    def extra_repr(self) -> str:
        w = "per channel" if self.w_scale.dim() else "per tensor"
        a = f"per {unit(self.act, 'act')}"  # token or sequence
        parts = [
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}",
            f"W int8 absmax {w}, A int8 absmax {a}",
            f"out_quant={self.out_quant}",
        ]
        if self.input_scale is not None:
            parts.append("SmoothQuant input scale")
        parts.append(f"fused={self.fused}, {self.nbytes() / 2**20:.2f} MiB")
        return ", ".join(parts)


def int_mm_available(device: str = "cpu") -> bool:
    """Whether ``torch._int_mm`` runs on ``device`` (tried on a tiny cuBLAS-legal problem)."""
    if device == "cuda" and not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(32, 32, dtype=torch.int8, device=device)
        return bool((torch._int_mm(a, a) == 32).all())
    except (RuntimeError, NotImplementedError):
        return False


def build_w8a8(
    weight: Tensor,
    bias: Tensor | None,
    scheme: QuantScheme,
    inputs: LayerInputs,
) -> nn.Module:
    """The registry's builder for W8A8 schemes (``registry.REAL_KERNELS``): the scheme's granularities go to
    the layer as they are."""
    return Int8Linear.from_float(
        weight,
        bias,
        weight_granularity=scheme.weight_granularity,
        act=scheme.act_granularity,
        out_quant=scheme.out_bits is not None,
        input_scale=inputs.input_scale,
        rotation=inputs.rotation,
        static_act_scale=None if inputs.act_static is None else inputs.act_static.scale,
        static_out_scale=None if inputs.out_static is None else inputs.out_static.scale,
        weight_qparams=inputs.weight_qparams,
    )
