"""Which kernel a real layer runs, by device and row count — the dispatch of the compiled CPU kernels (``native``).

Rows = the tokens of one forward call (batch × sequence). On CPU, with the compiled kernels available:

- W8A8 (``Int8Linear``): activations quantised per token / per sequence in C (same codes as the torch path);
  ≤ ``DECODE_ROWS`` rows: the fused C GEMV (quantise → int8 dot products → epilogue, nothing else);
  more rows: ``torch._int_mm`` between the C quantiser and the C epilogue where oneDNN's int8 GEMM is fast
  (CPUs with AVX-512 VNNI or AMX), else the same C kernel (AVX2: ``_int_mm`` has no fast path there).
- weight-only int4 / int8 (``Int4Linear``, ``Int8WeightOnlyLinear``), float32 activations:
  ≤ ``DECODE_ROWS`` rows: the C kernel that reads packed codes and never builds Ŵ (equal to fake mode to
  float rounding); more rows: Ŵ dequantised in one C pass, then torch's float32 GEMM (equal to fake mode
  bit for bit — the same Ŵ and the same ``F.linear``).

Everything else (CUDA, bf16 input, autograd, inside ``torch.compile``, the kernels switched off with
``QBENCH_NATIVE_KERNELS=0``) returns None here and the layer runs its torch path.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from qbench.quant.kernels import native

DECODE_ROWS = 16


@functools.cache
def int_mm_preferred() -> bool:
    """Whether ``torch._int_mm`` beats the C kernel for many rows: CPUs with AVX-512 VNNI or AMX (oneDNN)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_vnni" in flags or "amx_int8" in flags


def native_ok(x: Tensor, *stored: Tensor | None) -> bool:
    """The compiled kernels apply: float32 CPU input outside autograd and compile, contiguous stored tensors."""
    return (
        x.device.type == "cpu"
        and all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in stored)
        and x.dtype == torch.float32
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
        and native.available()
    )


def _weight_sums(owner: object, w: Tensor) -> Tensor | None:
    """Σ_k w[n, k] (int32) for the VNNI loop, cached on the layer (keyed by the weight's storage)."""
    if not native.needs_weight_sums():
        return None
    cached = getattr(owner, "_native_wsum", None)
    if cached is None or cached[0] != w.data_ptr():
        cached = (w.data_ptr(), w.sum(1, dtype=torch.int32).contiguous())
        owner._native_wsum = cached
    return cached[1]


def int8_forward(
    owner: object,
    x3: Tensor,
    w: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    per_token: bool,
    input_scale: Tensor | None,
) -> Tensor | None:
    """float32 (B, T, N) of the W8A8 linear before any output quantisation, or None (use the torch path).

    ``w`` is the (N, K) int8 weight (contiguous); ``owner`` caches the VNNI weight sums.
    """
    if not native_ok(x3, w, w_scale, bias):
        return None
    B, T, K = x3.shape
    if input_scale is not None:
        x3 = x3 / input_scale
    q, sx = native.quantize_rows(x3.reshape(B * T, K).contiguous(), 1 if per_token else T)
    sw = w_scale.reshape(-1).contiguous()
    b = None if bias is None else bias.contiguous()
    if B * T > DECODE_ROWS and int_mm_preferred():
        y = native.scale_output(torch._int_mm(q, w.t()), sx, sw, b)
    else:
        y = native.w8a8_linear(q, sx, w, _weight_sums(owner, w), sw, b)
    return y.reshape(B, T, -1)


def weight_only_forward(
    x: Tensor, codes: Tensor, bits4: bool, scales: Tensor, zeros: Tensor | None, bias: Tensor | None
) -> Tensor | None:
    """x · Ŵᵀ + b for a float32 x (…, K) from int4 nibbles or int8 codes, or None (use the torch path)."""
    if not native_ok(x, codes, scales, zeros, bias):
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    b = None if bias is None else bias.contiguous()
    y = None
    if x2.shape[0] <= DECODE_ROWS:
        y = native.weight_only_linear(x2, codes, bits4, scales, zeros, b)
    if y is None:
        y = F.linear(x2, native.dequantize(codes, bits4, scales, zeros, k), b)
    return y.reshape(*x.shape[:-1], -1)


def backend_name(kind: str) -> str:
    """What runs for ``kind`` ("w8a8" or "weight-only") on CPU here, for benchmark tables."""
    if not native.available():
        return "torch"
    isa = native.isa()
    if kind == "w8a8":
        big = "torch._int_mm" if int_mm_preferred() else f"C {isa}"
        return f"C {isa} ≤{DECODE_ROWS} rows, {big} above"
    return f"C {isa} ≤{DECODE_ROWS} rows, C dequantise + sgemm above"
