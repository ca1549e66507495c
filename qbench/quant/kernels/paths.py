"""Which kernel a real layer runs, by device and row count — the dispatch of the compiled CPU kernels (``native``).

Rows = the tokens of one forward call (batch × sequence). On CPU, with the compiled kernels available:

- W8A8 (``Int8Linear``): activations quantised per token / per sequence in C (same codes as the torch path);
  one C call quantises and multiplies: ≤ ``DECODE_ROWS`` rows the streaming GEMV, more rows the int16 panel
  GEMM (``native.c``); on CPUs with AVX-512 VNNI or AMX, rows above ``DECODE_ROWS`` go to ``torch._int_mm``
  (oneDNN's int8 GEMM, faster there) between the C quantiser and the C epilogue. AVX2-only CPUs have no fast
  ``_int_mm`` (0.01–0.07× float32 measured on AMD EPYC Zen 3).
- weight-only int4 / int8 (``Int4Linear``, ``Int8WeightOnlyLinear``), float32 activations:
  ≤ ``DECODE_ROWS`` rows: the C kernel that reads packed codes and never builds Ŵ (equal to fake mode to
  float rounding); more rows: Ŵ dequantised in one C pass, then torch's float32 GEMM (equal to fake mode
  bit for bit — the same Ŵ and the same ``F.linear``).

Everything else (CUDA, bf16 input, autograd, inside ``torch.compile``, the kernels switched off with
``QBENCH_NATIVE_KERNELS=0``) returns None here and the layer runs its torch path.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

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
    return input_ok(x) and all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in stored)


def input_ok(x: Tensor) -> bool:
    """The compiled kernels apply to this input: float32 on the CPU, outside autograd and ``torch.compile``."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and not (x.requires_grad and torch.is_grad_enabled())
        and not torch.compiler.is_compiling()
        and native.available()
    )


class _Bound:
    """A layer's kernel call with the layer's constant arguments (pointers, shapes) bound, cached on the layer.

    Why: at decode a small layer's forward is dominated by Python (checks, attribute lookups, argument
    conversion), not by the kernel. ``key`` holds the stored tensors' data pointers, so replacing or moving a
    buffer rebuilds the call. Never copied or pickled with its layer (a copy rebuilds it on first use)."""

    __slots__ = ("call", "key")

    def __init__(self, key: tuple, call: Callable[..., Tensor] | None) -> None:
        self.key, self.call = key, call

    def __deepcopy__(self, memo: dict) -> None:
        return None

    def __reduce__(self) -> tuple:
        return (type(None), ())


def _bound(owner: object, stored: tuple[Tensor | None, ...], make: Callable[[], Callable[..., Tensor]]):
    """The cached call for ``owner`` (None when a stored tensor is not a contiguous CPU tensor)."""
    key = tuple(None if t is None else t.data_ptr() for t in stored)
    cached = owner.__dict__.get("_native_call")
    if cached is None or cached.key != key:
        usable = all(t is None or (t.device.type == "cpu" and t.is_contiguous()) for t in stored)
        cached = _Bound(key, make() if usable else None)
        owner.__dict__["_native_call"] = cached
    return cached.call


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _int8_call(w: Tensor, w_scale: Tensor, bias: Tensor | None) -> Callable[[Tensor, int], Tensor]:
    fn = native.library().qk_w8a8_forward
    sw = w_scale.reshape(-1).contiguous()
    n, k = w.shape
    args = (w.data_ptr(), sw.data_ptr(), int(sw.numel() > 1), _ptr(bias))

    def call(x2: Tensor, rows_per_scale: int) -> Tensor:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        fn(x2.data_ptr(), x2.shape[0], k, rows_per_scale, *args, y.data_ptr(), n, native.threads())
        return y

    call.keep = (w, sw, bias)  # the bound pointers stay valid while the call lives
    return call


def int8_forward(
    owner: object,
    x3: Tensor,
    w_t: Tensor,
    w_scale: Tensor,
    bias: Tensor | None,
    per_token: bool,
    input_scale: Tensor | None,
) -> Tensor | None:
    """float32 (B, T, N) of the W8A8 linear before any output quantisation, or None (use the torch path).

    ``w_t`` is the (K, N) int8 weight, the transpose of a contiguous (N, K) tensor; ``owner`` is the layer,
    which caches the bound kernel call.
    """
    if not input_ok(x3):
        return None
    B, T, K = x3.shape
    if input_scale is not None:
        x3 = x3 / input_scale
    x2 = x3.reshape(B * T, K).contiguous()
    rows_per_scale = 1 if per_token else T
    if B * T > DECODE_ROWS and int_mm_preferred():
        if not native_ok(x3, w_t.t(), w_scale, bias):
            return None
        q, sx = native.quantize_rows(x2, rows_per_scale)
        b = None if bias is None else bias.contiguous()
        acc = torch._int_mm(q, w_t)
        return native.scale_output(acc, sx, w_scale.reshape(-1).contiguous(), b).reshape(B, T, -1)
    w = w_t.t()  # (N, K): the C kernels' row-major layout — a contiguous (K, N) w_t is not (torch path then)
    call = _bound(owner, (w, w_scale, bias), lambda: _int8_call(w, w_scale, bias))
    return None if call is None else call(x2, rows_per_scale).reshape(B, T, -1)


def _w4a8_call(w4: Tensor, scales: Tensor, bias: Tensor | None) -> Callable[[Tensor, int], Tensor | None]:
    fn = native.library().qk_w4a8_forward
    n, groups = scales.shape
    args = (w4.data_ptr(), scales.data_ptr(), groups, _ptr(bias))

    def call(x2: Tensor, rows_per_scale: int) -> Tensor | None:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        ok = fn(
            x2.data_ptr(), x2.shape[0], x2.shape[1], rows_per_scale, *args, y.data_ptr(), n, native.threads()
        )
        return y if ok else None

    call.keep = (w4, scales, bias)
    return call


def w4a8_forward(
    owner: object, x: Tensor, w4: Tensor, scales: Tensor, bias: Tensor | None, per_token: bool
) -> Tensor | None:
    """float32 (…, N) of the W4A8 linear (int4 nibbles × int8 activations) from the C kernel, or None (use the
    torch path). Per-tensor activation scales are per leading batch element, as in ``Int8Linear``."""
    if not input_ok(x) or x.numel() == 0:
        return None
    k = x.shape[-1]
    rows = x.numel() // k
    rows_per_scale = 1 if per_token else (rows if x.dim() <= 2 else rows // x.shape[0])
    call = _bound(owner, (w4, scales, bias), lambda: _w4a8_call(w4, scales, bias))
    y = None if call is None else call(x.reshape(rows, k).contiguous(), rows_per_scale)
    return None if y is None else y.reshape(*x.shape[:-1], -1)


def _weight_only_call(
    codes: Tensor, bits4: bool, scales: Tensor, zeros: Tensor | None, bias: Tensor | None
) -> Callable[[Tensor], Tensor | None]:
    fn = native.library().qk_weight_only_linear
    n, groups = scales.shape
    signed = int(codes.dtype == torch.int8)
    args = (codes.data_ptr(), int(bits4), signed, scales.data_ptr(), _ptr(zeros), groups, _ptr(bias))

    def call(x2: Tensor) -> Tensor | None:
        y = torch.empty(x2.shape[0], n, dtype=torch.float32)
        ok = fn(x2.data_ptr(), x2.shape[0], *args, y.data_ptr(), n, x2.shape[1], native.threads())
        return y if ok else None

    call.keep = (codes, scales, zeros, bias)
    return call


def weight_only_forward(
    owner: object,
    x: Tensor,
    codes: Tensor,
    bits4: bool,
    scales: Tensor,
    zeros: Tensor | None,
    bias: Tensor | None,
) -> Tensor | None:
    """x · Ŵᵀ + b for a float32 x (…, K) from int4 nibbles or int8 codes, or None (use the torch path).

    ``owner`` is the layer, which caches the bound kernel call."""
    if not input_ok(x):
        return None
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    y = None
    if x2.shape[0] <= DECODE_ROWS:
        call = _bound(
            owner, (codes, scales, zeros, bias), lambda: _weight_only_call(codes, bits4, scales, zeros, bias)
        )
        if call is None:
            return None
        y = call(x2)
    if y is None:
        if not native_ok(x, codes, scales, zeros, bias):
            return None
        b = None if bias is None else bias.contiguous()
        y = F.linear(x2, native.dequantize(codes, bits4, scales, zeros, k), b)
    return y.reshape(*x.shape[:-1], -1)


def backend_name(kind: str) -> str:
    """What runs for ``kind`` ("w8a8", "w4a8" or "weight-only") on CPU here, for benchmark tables."""
    if not native.available():
        return "torch"
    isa = native.isa()
    if kind in ("w8a8", "w4a8"):
        big = "torch._int_mm" if kind == "w8a8" and int_mm_preferred() else "C int16 GEMM"
        return f"C {isa} GEMV ≤{DECODE_ROWS} rows, {big} above"
    return f"C {isa} ≤{DECODE_ROWS} rows, C dequantise + sgemm above"
