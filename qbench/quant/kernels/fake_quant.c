/* Fused fake quantisation of fp32 rows: the CPU kernel of qbench::fake_quantize (qbench/quant/ops.py).

   The arithmetic is primitives.fake_quantize's, in the same order, in IEEE float32: x / s is a true division,
   rintf rounds half to even like torch.round, no FMA contraction (-ffp-contract=off) — so results equal the torch
   primitive as values (-ffinite-math-only -fno-signed-zeros let the compiler vectorise the min/max reductions
   and may turn a -0 into +0). NaN/inf are detected from the bit patterns and reported to the caller. */
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

/* rows split across `threads` OpenMP threads (one: no parallel region); returns nonzero when any row held a NaN
   or an infinity */
int fake_quantize_rows_f32(const float *x, float *out, int64_t rows, int64_t n, int bits, int symmetric,
                           int threads) {
    const float tiny = 1.17549435082228750797e-38f; /* FLT_MIN, the primitive's TINY */
    const float qmax = symmetric ? (float)((1 << (bits - 1)) - 1) : (float)((1 << bits) - 1);
    int bad = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) reduction(| : bad) schedule(static) if (threads > 1)
#endif
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
