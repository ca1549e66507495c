"""The compiled CPU kernels (``native``) as torch.library custom ops: ``torch.ops.qbench.<name>``.

Why: a ctypes call on ``data_ptr()`` is opaque to ``torch.compile`` — dynamo cannot trace it, so a quantised
model either broke its graph at every layer or ran the torch paths once compiled. As custom ops (the layering
bitsandbytes uses: schema declared once, a fake kernel for tracing, a kernel per device) the C kernels stay in
the compiled graph: the fake kernels give shapes and dtypes, the CPU kernels call the ctypes wrappers of
``native.py``. There is no CUDA kernel: the layers take their torch paths there (``paths.py`` decides).

Ops (every tensor float32 unless said; the C kernels read contiguous CPU tensors, the CPU kernels make them so):

- ``quantize_rows(Tensor x, int rows_per_scale) -> (Tensor q, Tensor sx)``: int8 codes (M, K), scales (M,);
- ``w8a8_linear(Tensor q, Tensor sx, Tensor w, Tensor sw, Tensor? bias) -> Tensor``: int8 q (M, K) × int8
  w (N, K), the epilogue included — (M, N);
- ``w8a8_forward(Tensor x, int rows_per_scale, Tensor w, Tensor sw, Tensor? bias, bool gemv) -> Tensor``: the
  W8A8 layer's whole forward (quantise + the GEMV, or the GEMM when ``gemv`` is False);
- ``w4a8_forward(Tensor x, int rows_per_scale, Tensor w4, Tensor scale, Tensor? bias, bool gemv,
  Tensor? zero_term) -> Tensor``: the same for int4 nibbles (``zero_term``: zero-point codes,
  ``native.zero_term``); the group size must have a loop (``w4a8.kernel_group_ok``), else it raises;
- ``w4a8_int_mm(Tensor x, int rows_per_scale, Tensor w4, Tensor scale, Tensor? bias, Tensor? zero_term)
  -> Tensor``: the W4A8 forward through ``torch._int_mm`` (nibbles unpacked to int8 once per call; one GEMM per
  channel or group);
- ``scale_output(Tensor acc, Tensor sx, Tensor sw, Tensor? bias) -> Tensor``: the epilogue of an int32 (M, N);
- ``weight_only_linear(Tensor x, Tensor codes, bool bits4, Tensor scale, Tensor? zero, Tensor? bias) -> Tensor``:
  x · Ŵᵀ + b reading the codes, where this build and group size have a loop (:func:`weight_only_loop`), else
  raises;
- ``dequantize(Tensor codes, bool bits4, Tensor scale, Tensor? zero, int in_features) -> Tensor``: Ŵ (N, K);
- ``lowbit_linear(Tensor x, Tensor codes, int bits, Tensor scale, Tensor? zero, int zconst, Tensor? bias)
  -> Tensor``: x · Ŵᵀ + b from LowBitLinear's packed 2/3/4-bit codes (x zero-padded to whole groups);
- ``lowbit_dequantize(Tensor codes, int bits, Tensor scale, Tensor? zero, int zconst, int padded,
  int in_features) -> Tensor``: their Ŵ (N, in_features).

Registration happens once, on the first import of this module (``paths.py`` imports it, itself imported only
when a real layer is built): nothing here is imported by ``qbench --help``. A second definition of the same op
(a reloaded module) is skipped, so importing twice is harmless.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from qbench.quant.kernels import native

NAMESPACE = "qbench"
OPS = (
    "quantize_rows",
    "w8a8_linear",
    "w8a8_forward",
    "w4a8_forward",
    "scale_output",
    "weight_only_linear",
    "dequantize",
    "lowbit_linear",
    "lowbit_dequantize",
    "w4a8_int_mm",
)


def _defined(name: str) -> bool:
    return hasattr(getattr(torch.ops, NAMESPACE), name)


def _op(fake: Callable[..., object]) -> Callable[[Callable[..., object]], object]:
    """``torch.library.custom_op`` with a CPU kernel and ``fake`` as its fake kernel — skipped when the op exists."""

    def register(fn: Callable[..., object]) -> object:
        qualname = f"{NAMESPACE}::{fn.__name__}"
        if _defined(fn.__name__):
            return getattr(getattr(torch.ops, NAMESPACE), fn.__name__)
        op = torch.library.custom_op(qualname, mutates_args=(), device_types="cpu")(fn)
        op.register_fake(fake)
        return op

    return register


def _c(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.contiguous()


def _rows_out(x: Tensor, n: int) -> Tensor:
    return x.new_empty(x.shape[0], n, dtype=torch.float32)


# ----------------------------------------------------------------------------------- activation quantiser


def _quantize_rows_fake(x: Tensor, rows_per_scale: int) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(x.shape[0], dtype=torch.float32)


@_op(_quantize_rows_fake)
def quantize_rows(x: Tensor, rows_per_scale: int) -> tuple[Tensor, Tensor]:
    return native.quantize_rows(x.contiguous(), rows_per_scale)


# ------------------------------------------------------------------------------------------------- W8A8


def _w8a8_linear_fake(q: Tensor, sx: Tensor, w: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    return _rows_out(q, w.shape[0])


@_op(_w8a8_linear_fake)
def w8a8_linear(q: Tensor, sx: Tensor, w: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    return native.w8a8_linear(q.contiguous(), sx.contiguous(), w.contiguous(), sw.contiguous(), _c(bias))


def _w8a8_forward_fake(
    x: Tensor, rows_per_scale: int, w: Tensor, sw: Tensor, bias: Tensor | None, gemv: bool
) -> Tensor:
    return _rows_out(x, w.shape[0])


@_op(_w8a8_forward_fake)
def w8a8_forward(
    x: Tensor, rows_per_scale: int, w: Tensor, sw: Tensor, bias: Tensor | None, gemv: bool
) -> Tensor:
    return native.w8a8_forward(
        x.contiguous(), rows_per_scale, w.contiguous(), sw.contiguous(), _c(bias), gemv
    )


def _scale_output_fake(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    return acc.new_empty(acc.shape, dtype=torch.float32)


@_op(_scale_output_fake)
def scale_output(acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    return native.scale_output(acc.contiguous(), sx.contiguous(), sw.contiguous(), _c(bias))


# ------------------------------------------------------------------------------------------------- W4A8


def _w4a8_forward_fake(
    x: Tensor,
    rows_per_scale: int,
    w4: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    gemv: bool,
    zero_term: Tensor | None = None,
) -> Tensor:
    return _rows_out(x, w4.shape[0])


@_op(_w4a8_forward_fake)
def w4a8_forward(
    x: Tensor,
    rows_per_scale: int,
    w4: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    gemv: bool,
    zero_term: Tensor | None = None,
) -> Tensor:
    y = native.w4a8_forward(
        x.contiguous(),
        rows_per_scale,
        w4.contiguous(),
        scale.contiguous(),
        _c(bias),
        gemv=gemv,
        zero_term=_c(zero_term),
    )
    if y is None:
        raise ValueError(f"qbench::w4a8_forward: no loop for {scale.shape[1]} groups of a {x.shape[1]}-row")
    return y


def _w4a8_int_mm_fake(
    x: Tensor,
    rows_per_scale: int,
    w4: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    zero_term: Tensor | None = None,
) -> Tensor:
    return _rows_out(x, w4.shape[0])


@_op(_w4a8_int_mm_fake)
def w4a8_int_mm(
    x: Tensor,
    rows_per_scale: int,
    w4: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    zero_term: Tensor | None = None,
) -> Tensor:
    return native.w4a8_int_mm(
        x.contiguous(), rows_per_scale, w4.contiguous(), scale.contiguous(), _c(bias), _c(zero_term)
    )


# ------------------------------------------------------------------------------------------ weight-only


def weight_only_loop(bits4: bool, in_features: int, groups: int) -> bool:
    """Whether ``weight_only_linear`` has a loop here for these codes (else: ``dequantize`` + F.linear)."""
    g = in_features // groups
    return native.isa() == "AVX2" and (not bits4 or groups == 1 or g % 64 == 0 or g == 32)


def _weight_only_linear_fake(
    x: Tensor, codes: Tensor, bits4: bool, scale: Tensor, zero: Tensor | None, bias: Tensor | None
) -> Tensor:
    return _rows_out(x, codes.shape[0])


@_op(_weight_only_linear_fake)
def weight_only_linear(
    x: Tensor, codes: Tensor, bits4: bool, scale: Tensor, zero: Tensor | None, bias: Tensor | None
) -> Tensor:
    y = native.weight_only_linear(
        x.contiguous(), codes.contiguous(), bits4, scale.contiguous(), _c(zero), _c(bias)
    )
    if y is None:
        raise ValueError("qbench::weight_only_linear: no loop for these codes in this build (dequantize)")
    return y


def _dequantize_fake(
    codes: Tensor, bits4: bool, scale: Tensor, zero: Tensor | None, in_features: int
) -> Tensor:
    return codes.new_empty(codes.shape[0], in_features, dtype=torch.float32)


@_op(_dequantize_fake)
def dequantize(codes: Tensor, bits4: bool, scale: Tensor, zero: Tensor | None, in_features: int) -> Tensor:
    return native.dequantize(codes.contiguous(), bits4, scale.contiguous(), _c(zero), in_features)


# ------------------------------------------------------------------------------- packed 2/3/4-bit codes


def _lowbit_linear_fake(
    x: Tensor, codes: Tensor, bits: int, scale: Tensor, zero: Tensor | None, zconst: int, bias: Tensor | None
) -> Tensor:
    return _rows_out(x, codes.shape[0])


@_op(_lowbit_linear_fake)
def lowbit_linear(
    x: Tensor, codes: Tensor, bits: int, scale: Tensor, zero: Tensor | None, zconst: int, bias: Tensor | None
) -> Tensor:
    return native.lowbit_linear(
        x.contiguous(), codes.contiguous(), bits, scale.contiguous(), _c(zero), zconst, _c(bias)
    )


def _lowbit_dequantize_fake(
    codes: Tensor, bits: int, scale: Tensor, zero: Tensor | None, zconst: int, padded: int, in_features: int
) -> Tensor:
    return codes.new_empty(codes.shape[0], in_features, dtype=torch.float32)


@_op(_lowbit_dequantize_fake)
def lowbit_dequantize(
    codes: Tensor, bits: int, scale: Tensor, zero: Tensor | None, zconst: int, padded: int, in_features: int
) -> Tensor:
    return native.lowbit_dequantize(
        codes.contiguous(), bits, scale.contiguous(), _c(zero), zconst, padded, in_features
    )
