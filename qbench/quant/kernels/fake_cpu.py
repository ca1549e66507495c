"""The CPU kernel of ``qbench::fake_quantize`` (``fake_quant.c``) for an fp32 (R, L) rows view.

Why: the torch primitive makes five passes over memory (min, max, divide, round, multiply); inductor fuses them
into one loop per row but its reduction and its rounding run one after the other per row (~65 % of a plain copy's
bandwidth measured here). This kernel does the same per row — min/max sweep, then quantise — with loops the C
compiler vectorises, at ≥ 80 % of a plain copy's bandwidth (4096×4096 fp32, one thread; see the tests' report).

Exactness: the arithmetic is the primitive's, in the same order (``fake_quant.c`` says how), so results equal
``primitives.fake_quantize`` as values. NaN/inf are detected from the bit patterns, and the caller raises.

Built like every kernel of qbench (``build.py``: one compiler lookup, one disk cache keyed by CPU and source,
``QBENCH_NATIVE=0`` switches it off); without a compiler the op keeps the torch path. Rows are split across ``torch.get_num_threads()`` OpenMP
threads, at least 16 rows each (fewer rows: one thread).
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from qbench.quant.kernels import build

# build.BASE_FLAGS plus what lets the min/max reductions vectorise: no NaN/inf in the arithmetic (they are caught
# from the bit patterns first) and no signed zeros (a -0 may come back as +0, equal as a value).
FLAGS = (*build.BASE_FLAGS, "-ffinite-math-only", "-fno-signed-zeros")
MIN_ROWS_PER_THREAD = 16


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    """The compiled function, or None when no compiler builds it (then the torch path runs)."""
    lib = build.load("fake_quant.c", FLAGS)
    if lib is None:
        return None
    fn = lib.fake_quantize_rows_f32
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int]  # fmt: skip
    fn.restype = ctypes.c_int
    return fn


def available() -> bool:
    return _kernel() is not None


def fake_quantize_rows(rows: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, bool] | None:
    """(result, any non-finite input) for a contiguous fp32 CPU (R, L) tensor; None when no kernel is built."""
    fn = _kernel()
    if fn is None:
        return None
    R, L = rows.shape
    out = torch.empty_like(rows)
    threads = max(1, min(torch.get_num_threads(), R // MIN_ROWS_PER_THREAD))
    bad = fn(rows.data_ptr(), out.data_ptr(), R, L, bits, int(symmetric), threads)
    return out, bool(bad)
