"""Compiled CPU kernels for the real layers (``native.c``): decode-shape int8 GEMV, W8A8 GEMM, weight-only int4/int8.

Why: at decode (1–16 rows) a linear is bound by the bytes of its weight, and torch has no kernel that reads int8
or int4 weights at memory speed while keeping our numerics: ``torch._int_mm`` is slow at one row (and, on CPUs
without AVX-512 VNNI, slow at any size), and the int4 kernels want bf16 activations. The library's entry points
(``native.c``; the loops are in ``native_ref.c``, portable, and ``native_avx2.c``, see Build) are:

- ``quantize_rows``: per-token (or per-sequence) absmax int8 quantisation of float32 activations, the same
  arithmetic as ``int8.quantize_activation`` (true division, round half to even) — equal codes, equal scales;
- ``w8a8_linear``: int8 (M, K) · int8 (N, K)ᵀ accumulated exactly in int32, then the epilogue
  (acc · s_x) · s_w + b in int8.py's operation order, in one call. Up to 16 rows (decode) an AVX2 GEMV that
  streams each weight row once (``maddubs`` with x's sign moved onto w); more rows an AVX2 GEMM on int16 codes
  (``madd_epi16`` on repacked weight panels, twice float32's multiply rate); portable C without AVX2;
- ``qk_w8a8_forward`` (bound per layer in ``paths.py``): ``quantize_rows`` + ``w8a8_linear`` in one foreign call;
- ``w4a8_forward``: the same for int4 weights (nibbles, per channel or per group, absmax or zero-point codes) ×
  int8 activations — exact integer group sums (``maddubs`` of the nibble with the code at decode, the int16 panel GEMM above 16 rows);
- ``w4a8_int_mm``: the W4A8 prefill through ``torch._int_mm`` — the nibbles unpacked to an int8 (N, K) panel once
  per call (``qk_w4_unpack_i8``), one ``_int_mm`` per channel or per group (``qk_w4a8_fold`` folds each group's
  exact sums in the C loops' order): bit for bit the C GEMM;
- ``scale_output``: that epilogue alone, after ``torch._int_mm`` (the prefill path on CPUs where oneDNN's
  int8 GEMM is faster);
- ``qk_weight_only_linear`` (bound per layer in ``paths.py``): x (float32) · Ŵᵀ with Ŵ = s · (q − z) from int4
  nibbles or int8 codes, per output channel or per group, without building Ŵ (sums are reassociated: equal to
  fake mode to float rounding);
- ``lowbit_linear``: the same for LowBitLinear's packed 2-, 3- and 4-bit codes (any group size, a scalar loop in
  the portable build); ``lowbit_dequantize``: their Ŵ, bit-identical to ``LowBitLinear.dequantized_weight``;
- ``dequantize``: Ŵ as float32, bit-identical to ``primitives.dequantize`` (the prefill path: one pass, then
  torch's sgemm, so prefill equals fake mode exactly).
- ``decode_norm`` and ``decode_attention`` (``native_decode.c``): the float work between a decode step's linears
  for ``qbench.eval.decode``'s runtime — the residual add and a LayerNorm / RMSNorm in one pass; RoPE, the KV
  cache write and single-query softmax / softmax-1 / sink attention in one call (plain C that each target
  vectorises, equal to torch to float rounding).

Build: on first use, like every kernel of qbench (``build.py``: one compiler lookup, ``-O3 -march=native
-fopenmp`` and fallbacks, cached on disk per CPU, compiler and source, so a binary built for one CPU never runs
on another), the files
of :data:`NATIVE_SOURCES` into one library. ``-march=native`` decides the instruction set at build time, on the
machine that runs it: with AVX2 + FMA ``native.c`` calls the loops of ``native_avx2.c``, else those of
``native_ref.c`` (the ggml-quants layering: one portable reference, one file per instruction set, no ISA test
inside a function); :func:`isa` says which. With AVX-512 VNNI the W8A8 and W4A8 GEMMs, the W4A8 GEMV and the
packed 2/3-bit GEMV come from ``native_avx512.c`` (:func:`vnni`). The torch custom ops over these wrappers are in ``_ops.py``.
Without a compiler, or with ``QBENCH_NATIVE=0`` in the environment (the older ``QBENCH_NATIVE_KERNELS=0`` too; or
:func:`set_enabled(False) <set_enabled>`), :func:`available` is False and the layers use their torch paths
(``torch._int_mm``, dequantise + ``F.linear``).
Threads: OpenMP over output channels with ``torch.get_num_threads()`` threads (one thread: no parallel region).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

import torch
from torch import Tensor

from qbench.quant.kernels import build as kernel_build

ENV = kernel_build.ENV  # QBENCH_NATIVE=0 switches the compiled kernels off
LEGACY_ENV = "QBENCH_NATIVE_KERNELS"
ISA_NAMES = {0: "C", 1: "AVX2"}
GEMV_ROWS = 16  # native.h: the default split between the decode loop and the GEMM
_STATE = {"enabled": kernel_build.switched_on(LEGACY_ENV)}
_I64, _INT, _PTR, _F32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
_SIGNATURES = {
    "qk_isa": ([], _INT),
    "qk_openmp": ([], _INT),
    "qk_avx512_vnni": ([], _INT),
    "qk_quantize_rows": ([_PTR, _I64, _I64, _I64, _PTR, _PTR], None),
    "qk_scale_output": ([_PTR, _I64, _I64, _PTR, _PTR, _INT, _PTR, _PTR, _INT], None),
    "qk_w8a8_linear": ([_PTR, _PTR, _I64, _PTR, _PTR, _INT, _PTR, _PTR, _I64, _I64, _INT], None),
    "qk_w8a8_forward": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT, _PTR, _PTR, _I64, _INT], None),
    "qk_w4a8_forward": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _INT], _INT),
    # the same two forwards with the loop chosen by the caller (a trailing int: 1 the GEMV, 0 the GEMM)
    "qk_w8a8_forward_path": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _INT, _PTR, _PTR, _I64, _INT, _INT], None),
    "qk_w4a8_forward_path": ([_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT], _INT),
    # zero-point W4A8: forward_path with the (G, N) float32 term s · (8 − z) after the scales; the correction
    # alone (the int-mm path)
    "qk_w4a8_forward_zp": (
        [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _INT, _INT],
        _INT,
    ),
    "qk_w4a8_zero_correct": ([_PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT], None),
    "qk_dequantize": ([_PTR, _INT, _INT, _PTR, _PTR, _I64, _I64, _I64, _PTR, _INT], None),
    "qk_w4_permute_x": ([_PTR, _I64, _I64, _PTR], None),
    # packed 2/3/4-bit codes (LowBitLinear): x (M, K), codes, bits, scale, zero, zconst, groups, bias, y, N
    "qk_lowbit_linear": (
        [_PTR, _I64, _I64, _PTR, _INT, _PTR, _PTR, _INT, _I64, _PTR, _PTR, _I64, _INT],
        None,
    ),
    "qk_lowbit_dequantize": ([_PTR, _INT, _PTR, _PTR, _INT, _I64, _I64, _I64, _I64, _PTR, _INT], None),
    "qk_w4_unpack_i8": ([_PTR, _I64, _I64, _PTR, _INT], None),
    "qk_w4a8_fold": ([_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _INT, _INT], None),
    "qk_weight_only_linear": (
        [_PTR, _I64, _PTR, _INT, _INT, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _INT],
        _INT,
    ),
    # native_decode.c, the float work between a decode step's linears (qbench.eval.decode): x, delta, n, w, w_len,
    # b, eps, rms, out; q, k, v, nh, nkv, hs, kcache, vcache, head_stride, pos, cos, sin, extra, extra_k,
    # extra_v, scale, out, threads
    "qk_decode_norm": ([_PTR, _PTR, _I64, _PTR, _I64, _PTR, _F32, _INT, _PTR], None),
    "qk_decode_attention": (
        [
            _PTR,
            _PTR,
            _PTR,
            _I64,
            _I64,
            _I64,
            _PTR,
            _PTR,
            _I64,
            _I64,
            _PTR,
            _PTR,
            _INT,
            _PTR,
            _PTR,
            _F32,
            _PTR,
            _INT,
        ],
        None,
    ),
}


# one library: the entry points (dispatch), the portable loops, the AVX2 loops (empty unless the target has AVX2)
NATIVE_SOURCES = ("native.c", "native_ref.c", "native_avx2.c", "native_avx512.c", "native_decode.c")


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The loaded library, or None when no compiler builds it (then every caller takes its torch path); built for
    ``QBENCH_NATIVE_ISA``'s target where one is named (``build.flag_cascade``: an error if it does not compile)."""
    return kernel_build.first_built(build)


def build(extra_flags: list[str]) -> ctypes.CDLL | None:
    """:data:`NATIVE_SOURCES` compiled with the base flags plus ``extra_flags`` and loaded, or None when the
    compiler is missing or refuses (tests build the portable loops with ``[]`` — no ``-march=native``, so
    ``native.c`` picks ``native_ref.c`` — to compare them with the vector ones)."""
    dll = kernel_build.compile_source(NATIVE_SOURCES, extra_flags)
    if dll is None:
        return None
    for name, (args, res) in _SIGNATURES.items():
        fn = getattr(dll, name)
        fn.argtypes, fn.restype = args, res
    return dll


def available() -> bool:
    """Whether the compiled kernels are switched on and built here."""
    return _STATE["enabled"] and _library() is not None


def set_enabled(enabled: bool) -> None:
    """Switch the compiled kernels on or off for this process (off: every layer takes its torch path)."""
    _STATE["enabled"] = bool(enabled)


@contextlib.contextmanager
def enabled(flag: bool) -> Iterator[None]:
    """:func:`set_enabled` for the duration of a block."""
    previous = _STATE["enabled"]
    set_enabled(flag)
    try:
        yield
    finally:
        set_enabled(previous)


def isa() -> str | None:
    """The instruction set the loops were compiled for ("AVX2" or "C"), None when not built."""
    lib = _library()
    return None if lib is None else _isa_of(lib)


def vnni() -> bool:
    """Whether the W8A8 and W4A8 GEMMs and the 2/3-bit GEMV were built for AVX-512 VNNI (``native_avx512.c``);
    the rest stays AVX2."""
    lib = _library()
    return lib is not None and bool(lib.qk_avx512_vnni())


@functools.cache
def _isa_of(lib: ctypes.CDLL) -> str:
    return ISA_NAMES[lib.qk_isa()]  # a foreign call: layers ask on every forward (paths.choose)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def library() -> ctypes.CDLL:
    """The loaded library (call only when :func:`available`): for layers that bind its entry points once."""
    return _library()


def threads() -> int:
    """Threads the kernels use: torch's intra-op setting."""
    return max(1, torch.get_num_threads())


def _check(*tensors: Tensor | None) -> None:
    for t in tensors:
        if t is not None and (t.device.type != "cpu" or not t.is_contiguous()):
            raise ValueError("native kernels need contiguous CPU tensors")


def quantize_rows(x: Tensor, rows_per_scale: int = 1) -> tuple[Tensor, Tensor]:
    """(int8 codes (M, K), float32 scales (M,)) of a float32 (M, K) tensor; one scale per ``rows_per_scale``."""
    _check(x)
    m, k = x.shape
    q = torch.empty(m, k, dtype=torch.int8)
    s = torch.empty(m, dtype=torch.float32)
    _library().qk_quantize_rows(x.data_ptr(), m, k, max(1, rows_per_scale), q.data_ptr(), s.data_ptr())
    return q, s


def w8a8_linear(q: Tensor, sx: Tensor, w: Tensor, sw: Tensor, bias: Tensor | None) -> Tensor:
    """float32 (M, N) = ((q · wᵀ) · s_x) · s_w + b for int8 q (M, K), w (N, K); ``sw`` (N,) or a scalar."""
    _check(q, sx, w, sw, bias)
    m, k = q.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _library().qk_w8a8_linear(
        q.data_ptr(), sx.data_ptr(), m, w.data_ptr(), sw.data_ptr(), int(sw.numel() > 1), _ptr(bias),
        y.data_ptr(), n, k, threads(),
    )  # fmt: skip
    return y


def w8a8_forward(
    x: Tensor, rows_per_scale: int, w: Tensor, sw: Tensor, bias: Tensor | None, gemv: bool
) -> Tensor:
    """float32 (M, N) of the W8A8 linear from float32 x (M, K): quantise per ``rows_per_scale`` rows, then the
    GEMV (``gemv``) or the GEMM, in one foreign call."""
    _check(x, w, sw, bias)
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    _library().qk_w8a8_forward_path(
        x.data_ptr(), m, k, max(1, rows_per_scale), w.data_ptr(), sw.data_ptr(), int(sw.numel() > 1),
        _ptr(bias), y.data_ptr(), n, threads(), int(gemv),
    )  # fmt: skip
    return y


def w4a8_forward(
    x: Tensor,
    rows_per_scale: int,
    w4: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    gemv: bool | None = None,
    zero_term: Tensor | None = None,
) -> Tensor | None:
    """float32 (M, N) of the W4A8 linear: x float32 (M, K) quantised per ``rows_per_scale`` rows, ``w4`` uint8
    nibbles (N, ⌈K/2⌉), ``scale`` float32 (N, G). ``zero_term`` None: absmax codes, nibble = c + 8; else
    zero-point codes, nibble = u and ŵ = s · (u − z), with ``zero_term`` float32 (G, N) = (s · (8 − z))ᵀ
    (:func:`zero_term`). ``gemv``: the loop (None: the GEMV up to 16 rows). None when the group size has no loop
    (g must be K, 32 or a multiple of 64)."""
    _check(x, w4, scale, zero_term, bias)
    m, k = x.shape
    n, groups = scale.shape
    y = torch.empty(m, n, dtype=torch.float32)
    ok = _library().qk_w4a8_forward_zp(
        x.data_ptr(), m, k, max(1, rows_per_scale), w4.data_ptr(), scale.data_ptr(), _ptr(zero_term), groups,
        _ptr(bias), y.data_ptr(), n, threads(), int(m <= GEMV_ROWS if gemv is None else gemv),
    )  # fmt: skip
    return y if ok else None


def weight_only_linear(
    x: Tensor, codes: Tensor, bits4: bool, scale: Tensor, zero: Tensor | None, bias: Tensor | None
) -> Tensor | None:
    """x (M, K) · Ŵᵀ + b from int4 nibbles (``bits4``) or int8 codes without building Ŵ, or None when this
    build or group size has no loop (then dequantise)."""
    _check(x, codes, scale, zero, bias)
    m, k = x.shape
    n, groups = scale.shape
    y = torch.empty(m, n, dtype=torch.float32)
    ok = _library().qk_weight_only_linear(
        x.data_ptr(), m, codes.data_ptr(), int(bits4), int(codes.dtype == torch.int8), scale.data_ptr(),
        _ptr(zero), groups, _ptr(bias), y.data_ptr(), n, k, threads(),
    )  # fmt: skip
    return y if ok else None


def scale_output(
    acc: Tensor, sx: Tensor, sw: Tensor, bias: Tensor | None, *, in_place: bool = False
) -> Tensor:
    """float32 ((acc · s_x) · s_w + b) of an int32 (M, N) accumulator, in one pass; ``in_place``: written over
    ``acc``'s bytes and returned as a float32 view of them (acc is consumed: no new output to fault in)."""
    _check(acc, sx, sw, bias)
    m, n = acc.shape
    y = acc.view(torch.float32) if in_place else torch.empty(m, n, dtype=torch.float32)
    _library().qk_scale_output(
        acc.data_ptr(), m, n, sx.data_ptr(), sw.data_ptr(), int(sw.numel() > 1), _ptr(bias), y.data_ptr(),
        threads(),
    )  # fmt: skip
    return y


def dequantize(codes: Tensor, bits4: bool, scale: Tensor, zero: Tensor | None, in_features: int) -> Tensor:
    """Ŵ = (q − z) · s, float32 (N, K), equal to ``primitives.dequantize`` bit for bit.

    ``codes``: uint8 nibbles (N, ⌈K/2⌉) when ``bits4``, else int8 (symmetric) or uint8 (N, K); ``scale`` float32
    and ``zero`` uint8 (or None) are (N, G).
    """
    _check(codes, scale, zero)
    n, groups = scale.shape
    out = torch.empty(n, in_features, dtype=torch.float32)
    _library().qk_dequantize(
        codes.data_ptr(), int(bits4), int(codes.dtype == torch.int8), scale.data_ptr(), _ptr(zero), n,
        in_features, groups, out.data_ptr(), threads(),
    )  # fmt: skip
    return out


def lowbit_linear(
    x: Tensor, codes: Tensor, bits: int, scale: Tensor, zero: Tensor | None, zconst: int, bias: Tensor | None
) -> Tensor:
    """x (M, K) · Ŵᵀ + b from packed ``bits``-bit codes (``lowbit.pack_bits`` of rows of K = G · g, x zero-padded
    to K), ``scale`` float32 (N, G), ``zero`` uint8 (N, G) or None (then ``zconst`` for every group)."""
    _check(x, codes, scale, zero, bias)
    m, k = x.shape
    n, groups = scale.shape
    y = torch.empty(m, n, dtype=torch.float32)
    _library().qk_lowbit_linear(
        x.data_ptr(), m, k, codes.data_ptr(), bits, scale.data_ptr(), _ptr(zero), zconst, groups, _ptr(bias),
        y.data_ptr(), n, threads(),
    )  # fmt: skip
    return y


def lowbit_dequantize(
    codes: Tensor, bits: int, scale: Tensor, zero: Tensor | None, zconst: int, padded: int, in_features: int
) -> Tensor:
    """Ŵ float32 (N, in_features) of packed codes of rows of ``padded`` = G · g channels: equal to
    ``LowBitLinear.dequantized_weight`` bit for bit."""
    _check(codes, scale, zero)
    n, groups = scale.shape
    out = torch.empty(n, in_features, dtype=torch.float32)
    _library().qk_lowbit_dequantize(
        codes.data_ptr(), bits, scale.data_ptr(), _ptr(zero), zconst, n, padded, groups, in_features,
        out.data_ptr(), threads(),
    )  # fmt: skip
    return out


def zero_term(scale: Tensor, zero: Tensor) -> Tensor:
    """The zero-point W4A8 kernels' (G, N) float32 term (s · (8 − z))ᵀ of (N, G) scales and uint8 zero points."""
    return (scale.float() * (8 - zero.float())).t().contiguous()


def w4a8_int_mm(
    x: Tensor,
    rows_per_scale: int,
    w4: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    zero_term: Tensor | None = None,
) -> Tensor:
    """The W4A8 linear (as :func:`w4a8_forward`) with oneDNN's int8 GEMM: float32 (M, N), bit for bit the C loops.

    Per output channel one ``_int_mm`` over all of K and W8A8's epilogue; per group one ``_int_mm`` per group
    (folding groups into one GEMM would mix scales inside an int32 sum) and the scaled sums added in group order;
    zero-point codes then get the C loops' own correction (``qk_w4a8_zero_correct``)."""
    _check(x, w4, scale, zero_term, bias)
    m, k = x.shape
    n, groups = scale.shape
    q, sx = quantize_rows(x, rows_per_scale)
    w8 = torch.empty(n, k, dtype=torch.int8)
    lib = _library()
    lib.qk_w4_unpack_i8(w4.data_ptr(), n, k, w8.data_ptr(), threads())
    if groups == 1:
        t = scale_output(torch._int_mm(q, w8.t()), sx, scale.reshape(-1), bias, in_place=True)
    else:
        g = k // groups
        t = torch.empty(m, n, dtype=torch.float32)
        for grp in range(groups):
            acc = torch._int_mm(q[:, grp * g : grp * g + g].contiguous(), w8[:, grp * g : grp * g + g].t())
            lib.qk_w4a8_fold(
                acc.data_ptr(), m, n, scale.data_ptr(), groups, grp, sx.data_ptr(), _ptr(bias), t.data_ptr(),
                int(grp == groups - 1), threads(),
            )  # fmt: skip
    if zero_term is not None:
        lib.qk_w4a8_zero_correct(
            q.data_ptr(), sx.data_ptr(), m, k, zero_term.data_ptr(), groups, t.data_ptr(), n, threads()
        )
    return t
