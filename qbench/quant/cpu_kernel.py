"""A fused C kernel for the CPU path of ``qbench::fake_quantize`` on an fp32 (R, L) rows view.

Why: the torch primitive makes five passes over memory (min, max, divide, round, multiply); inductor fuses them
into one loop per row but its reduction and its rounding run one after the other per row (~65 % of a plain copy's
bandwidth measured here). This kernel does the same per row — min/max sweep, then quantise — with loops the C
compiler vectorises, at ≥ 80 % of a plain copy's bandwidth (4096×4096 fp32, one thread; see the tests' report).

Exactness: the arithmetic is the primitive's, in the same order, in IEEE float32 (``x / s`` is a true division,
``rintf`` rounds half to even like ``torch.round``, no FMA contraction), so results equal
``primitives.fake_quantize`` (as values: ``-ffinite-math-only -fno-signed-zeros`` let the compiler vectorise the
min/max reductions and may turn a −0 into +0). NaN/inf are detected from the bit patterns, and the caller raises.

Built on first use with the system C compiler (``$CC``, else ``cc``/``gcc``) into a temporary file that is deleted
once loaded (never cached, so a binary built for one CPU is never run on another); without a compiler the op
keeps the torch path. Rows are split across ``torch.get_num_threads()`` threads (ctypes releases the GIL).
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

static uint32_t non_finite(float v) { /* by the bits: -ffinite-math-only may fold isinf/isnan away */
    uint32_t b;
    memcpy(&b, &v, 4);
    return (b & 0x7f800000u) == 0x7f800000u;
}

/* one row: (lo, hi) = (min(x, 0), max(x, 0)); returns 1 when the row holds a NaN or an infinity */
static int row_range(const float *x, int64_t n, float *lo, float *hi) {
    float mn = 0.0f, mx = 0.0f;
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; ++i) {
        float v = x[i];
        bad |= non_finite(v);
        mn = v < mn ? v : mn;
        mx = v > mx ? v : mx;
    }
    *lo = mn;
    *hi = mx;
    return bad != 0;
}

int fake_quantize_rows_f32(const float *x, float *out, int64_t rows, int64_t n, int bits, int symmetric) {
    const float tiny = 1.17549435082228750797e-38f; /* FLT_MIN, the primitive's TINY */
    const float qmax = symmetric ? (float)((1 << (bits - 1)) - 1) : (float)((1 << bits) - 1);
    int bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * n;
        float *o = out + r * n;
        float lo, hi, s, z;
        bad |= row_range(xr, n, &lo, &hi);
        if (symmetric) {
            float m = hi > -lo ? hi : -lo;
            s = m / qmax;
            s = s > tiny ? s : tiny;
            for (int64_t i = 0; i < n; ++i) o[i] = rintf(xr[i] / s) * s; /* |x/s| <= qmax: no clamp */
        } else {
            s = (hi - lo) / qmax;
            s = s > tiny ? s : tiny;
            bad |= non_finite(s); /* the range overflowed float32 */
            z = rintf(-lo / s);
            z = z < 0.0f ? 0.0f : (z > qmax ? qmax : z);
            for (int64_t i = 0; i < n; ++i) {
                float q = rintf(xr[i] / s) + z;
                q = q < 0.0f ? 0.0f : q;
                q = q > qmax ? qmax : q;
                o[i] = (q - z) * s;
            }
        }
    }
    return bad;
}
"""
_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-ffinite-math-only", "-fno-signed-zeros",
          "-ffp-contract=off", "-shared", "-fPIC"]  # fmt: skip
_MIN_ROWS_PER_THREAD = 16


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc") if c and shutil.which(c)), None)


@functools.cache
def _kernel() -> ctypes._CFuncPtr | None:
    """The compiled function, or None when no compiler works (then the torch path runs)."""
    cc = _compiler()
    if cc is None:
        return None
    with tempfile.TemporaryDirectory(prefix="qbench-fq-") as tmp:
        src, lib = os.path.join(tmp, "fq.c"), os.path.join(tmp, "fq.so")
        with open(src, "w") as f:
            f.write(_SOURCE)
        for arch in (["-march=native"], []):  # some compilers or CPUs reject -march=native
            build = subprocess.run([cc, *_FLAGS, *arch, "-o", lib, src], capture_output=True, timeout=120)
            if build.returncode == 0:
                fn = ctypes.CDLL(lib).fake_quantize_rows_f32  # loaded: the file may go
                fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                               ctypes.c_int]  # fmt: skip
                fn.restype = ctypes.c_int
                return fn
    return None


def available() -> bool:
    return _kernel() is not None


@functools.cache
def _pool(workers: int, pid: int) -> ThreadPoolExecutor:
    """One pool per process (``pid``): a forked child inherits the pool object but none of its threads."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix="qbench-fq")


def fake_quantize_rows(rows: Tensor, bits: int, symmetric: bool) -> tuple[Tensor, bool] | None:
    """(result, any non-finite input) for a contiguous fp32 CPU (R, L) tensor; None when no kernel is built."""
    fn = _kernel()
    if fn is None:
        return None
    R, L = rows.shape
    out = torch.empty_like(rows)
    workers = max(1, min(torch.get_num_threads(), R // _MIN_ROWS_PER_THREAD))
    bounds = [R * i // workers for i in range(workers + 1)]

    def run(i: int) -> int:
        start, stop = bounds[i], bounds[i + 1]
        x_ptr, o_ptr = rows.data_ptr() + 4 * start * L, out.data_ptr() + 4 * start * L
        return fn(x_ptr, o_ptr, stop - start, L, bits, int(symmetric))

    bad = run(0) if workers == 1 else sum(_pool(workers, os.getpid()).map(run, range(workers)))
    return out, bool(bad)
