/* The portable loops of native.h: plain scalar C, always compiled. They define what every vector loop in
   native_avx2.c must compute (bit for bit, except where native.c says otherwise), and run on CPUs without
   AVX2. Loops without divisions in the inner body, so the compiler still vectorises what it can. */
#include "native.h"

#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------------------------------ activation quantiser */

float qk_ref_absmax_f32(const float *x, int64_t from, int64_t n, float m) {
    for (int64_t i = from; i < n; ++i) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

void qk_ref_quantize_row(const float *x, int64_t from, int64_t n, float s, int8_t *q) {
    for (int64_t i = from; i < n; ++i) {
        float r = rintf(x[i] / s); /* round half to even, like torch.round */
        r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
        q[i] = (int8_t)(r == r ? r : 0.0f);
    }
}

/* ------------------------------------------------------------------------------------------- epilogue */

/* y may be acc itself (the eager int-mm path writes the floats over the int32 accumulator: no fresh 8 MB output
   whose page faults cost as much as the epilogue — 1.6 ms of a 512 × 4096 call): each element is read before
   its own bytes are written, and the store goes through memcpy, so the int32 / float aliasing is defined. */
void qk_scale_output(const int32_t *acc, int64_t rows, int64_t n_out, const float *sx, const float *sw,
                     int per_channel, const float *bias, void *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t m = 0; m < rows; ++m) {
        const int32_t *a = acc + m * n_out;
        char *out = (char *)y + (size_t)(m * n_out) * sizeof(float);
        for (int64_t n = 0; n < n_out; ++n) {
            float v = epilogue(a[n], sx[m], sw, per_channel, bias, n);
            memcpy(out + n * sizeof(float), &v, sizeof(float));
        }
    }
}

/* ------------------------------------------------------------------------------------------------ W8A8 */

/* one loop for every row count: exact int32 dot products, then the epilogue */
void qk_ref_w8a8_linear(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w, const float *sw,
                        int per_channel, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n_out; ++n)
        for (int64_t m = 0; m < m_rows; ++m)
            y[m * n_out + n] = epilogue(dot_tail_i8(q + m * k, w + n * k, 0, k), sx[m], sw, per_channel, bias, n);
}

/* ------------------------------------------------------------------------------------------------ W4A8 */

/* exact integer sums per group, then w4a8_epilogue: Σ_g s_g · A_g in group order */
void qk_ref_w4a8_linear(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w, const float *scale,
                        int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t g = k / groups, ldw = (k + 1) / 2;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
        const uint8_t *wr = w + n * ldw;
        int32_t acc[64], *big = groups > 64 ? malloc((size_t)groups * sizeof(int32_t)) : NULL;
        int32_t *a = big ? big : acc;
        for (int64_t m = 0; m < m_rows; ++m) {
            for (int64_t grp = 0; grp < groups; ++grp) a[grp] = w4a8_tail(q + m * k, wr, grp * g, grp * g + g);
            y[m * n_out + n] = w4a8_epilogue(a, groups, sx[m], scale + n * groups, bias, n);
        }
        free(big);
    }}

/* ------------------------------------------------------------------------ weight-only, float32 input */

/* No portable loop reads the codes: a scalar one is slower than dequantising once and calling torch's sgemm,
   so this declines (0) and the caller takes that path (paths.py's c-dequant). */
int qk_ref_weight_only_linear(const float *x, int64_t m_rows, const uint8_t *w, int bits4, int signed_codes,
                              const float *scale, const uint8_t *zero, int64_t groups, const float *bias, float *y,
                              int64_t n_out, int64_t k, int nthreads) {
    (void)x, (void)m_rows, (void)w, (void)bits4, (void)signed_codes, (void)scale, (void)zero;
    (void)groups, (void)bias, (void)y, (void)n_out, (void)k, (void)nthreads;
    return 0;
}

/* Ŵ = (q − z) · s as float32 (N, K) — primitives.dequantize's order, so F.linear on it equals fake mode exactly.
   bits4: codes packed two per byte (w4 layout), else one byte per code (signed when `signed_codes`). */
void qk_dequantize(const uint8_t *w, int bits4, int signed_codes, const float *scale, const uint8_t *zero,
                   int64_t n_out, int64_t k, int64_t groups, float *out, int nthreads) {
    int64_t g = k / groups, ldw = bits4 ? (k + 1) / 2 : k;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
        const uint8_t *wr = w + n * ldw;
        float *o = out + n * k;
        for (int64_t grp = 0; grp < groups; ++grp) { /* loops without divisions, so the compiler vectorises */
            const float s = scale[n * groups + grp], z = zero ? (float)zero[n * groups + grp] : 0.0f;
            int64_t i0 = grp * g, i1 = i0 + g;
            if (bits4 && i0 % 2 == 0) {
                int64_t pairs = (i1 - i0) / 2;
                const uint8_t *b = wr + i0 / 2;
                for (int64_t j = 0; j < pairs; ++j) {
                    o[i0 + 2 * j] = ((float)(b[j] & 15) - z) * s;
                    o[i0 + 2 * j + 1] = ((float)(b[j] >> 4) - z) * s;
                }
                if ((i1 - i0) % 2) o[i1 - 1] = ((float)(wr[(i1 - 1) >> 1] & 15) - z) * s;
            } else if (bits4) {
                for (int64_t i = i0; i < i1; ++i) o[i] = ((float)((wr[i >> 1] >> ((i & 1) * 4)) & 15) - z) * s;
            } else if (signed_codes) {
                const int8_t *c = (const int8_t *)wr;
                for (int64_t i = i0; i < i1; ++i) o[i] = ((float)c[i] - z) * s;
            } else {
                for (int64_t i = i0; i < i1; ++i) o[i] = ((float)wr[i] - z) * s;
            }
        }
    }
}

/* xp (M, K64) = x with each 64-channel step reordered as native_avx2.c's int4 loop consumes it (see
   the comment there); a plain permutation, so it lives here. */
void qk_w4_permute_x(const float *x, int64_t m_rows, int64_t k, float *xp) {
    int64_t kv = k & ~(int64_t)63;
    for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t c = 0; c < kv; c += 64)
            for (int h = 0; h < 2; ++h) /* low nibbles (even channels), then high (odd) */
                for (int i = 0; i < 4; ++i)
                    for (int e = 0; e < 8; ++e) {
                        int j = (e < 4 ? 4 * i + e : 16 + 4 * i + e - 4);
                        xp[m * kv + c + h * 32 + i * 8 + e] = x[m * k + c + 2 * j + h];
                    }
}

/* ------------------------------------------------------------------- packed 2/3/4-bit weight-only */

/* y (M, N) = x (M, K) · Ŵᵀ + bias from packed codes (native.h), K = groups · g the padded row (x zero beyond
   the layer's inputs): per output channel and row, Σ_i ŵ_i x_i in channel order with ŵ_i = (u_i − z_g) · s_g
   (fake mode's weights bit for bit), then + bias. The sum's order is not F.linear's: equal to fake mode to
   float rounding. */
void qk_ref_lowbit_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *w, int bits, const float *scale,
                          const uint8_t *zero, int zconst, int64_t groups, const float *bias, float *y,
                          int64_t n_out, int nthreads) {
    int64_t g = k / groups, ldw = lowbit_row_bytes(bits, k);
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
        const uint8_t *wr = w + n * ldw, *zr = zero ? zero + n * groups : NULL;
        for (int64_t m = 0; m < m_rows; ++m) {
            float total = 0.0f;
            for (int64_t grp = 0; grp < groups; ++grp)
                total += lowbit_span(x + m * k, wr, bits, lowbit_zero(zr, zconst, grp), scale[n * groups + grp],
                                     grp * g, grp * g + g);
            y[m * n_out + n] = bias ? total + bias[n] : total;
        }
    }
}

/* Ŵ[:, :k_out] = (u − z) · s as float32 (N, k_out) from packed codes of padded rows of K = groups · g —
   LowBitLinear.dequantized_weight's operations, so F.linear on it equals the layer's torch path bit for bit.
   Each row is unpacked to bytes first (one pass of shifts), then scaled per group (a loop the compiler
   vectorises). */
void qk_ref_lowbit_dequantize(const uint8_t *w, int bits, const float *scale, const uint8_t *zero, int zconst,
                          int64_t n_out, int64_t k, int64_t groups, int64_t k_out, float *out, int nthreads) {
    int64_t g = k / groups, ldw = lowbit_row_bytes(bits, k);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        uint8_t *u = malloc((size_t)(k + 8));
#pragma omp for schedule(static)
        for (int64_t n = 0; n < n_out; ++n) {
            const uint8_t *wr = w + n * ldw;
            if (bits == 2)
                for (int64_t j = 0; j < (k + 3) / 4; ++j)
                    for (int e = 0; e < 4; ++e) u[4 * j + e] = (wr[j] >> (2 * e)) & 3;
            else if (bits == 4)
                for (int64_t j = 0; j < (k + 1) / 2; ++j) u[2 * j] = wr[j] & 15, u[2 * j + 1] = wr[j] >> 4;
            else
                for (int64_t j = 0; j < (k + 7) / 8; ++j) {
                    const uint8_t *b = wr + 3 * j;
                    uint32_t word = (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16;
                    for (int e = 0; e < 8; ++e) u[8 * j + e] = (word >> (3 * e)) & 7;
                }
            float *o = out + n * k_out;
            for (int64_t grp = 0; grp < groups; ++grp) {
                const float s = scale[n * groups + grp], z = lowbit_zero(zero ? zero + n * groups : NULL, zconst, grp);
                int64_t i1 = grp * g + g < k_out ? grp * g + g : k_out;
                for (int64_t i = grp * g; i < i1; ++i) o[i] = ((float)u[i] - z) * s;
            }
        }
        free(u);
    }
}

/* ------------------------------------------------------------------- W4A8 prefill through an int8 GEMM */

/* int8 (N, K) codes c = nibble − 8 of the w4 layout: the weight panel the int-mm path hands oneDNN's int8 GEMM,
   unpacked once per call (a byte loop the compiler vectorises) */
void qk_w4_unpack_i8(const uint8_t *w, int64_t n_out, int64_t k, int8_t *out, int nthreads) {
    int64_t ldw = (k + 1) / 2;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
        const uint8_t *wr = w + n * ldw;
        int8_t *o = out + n * k;
        for (int64_t j = 0; j < k / 2; ++j) {
            o[2 * j] = (int8_t)((wr[j] & 15) - 8);
            o[2 * j + 1] = (int8_t)((wr[j] >> 4) - 8);
        }
        if (k % 2) o[k - 1] = (int8_t)((wr[k / 2] & 15) - 8);
    }
}

/* One group's exact int32 sums A_g (M, N) folded into t (M, N) as the C loops do (w4a8_epilogue's order):
   t = 0 then t += s_g · A_g group by group; after the last group y = t · s_x + b, written into t. */
void qk_w4a8_fold(const int32_t *acc, int64_t rows, int64_t n_out, const float *scale, int64_t groups, int64_t grp,
                  const float *sx, const float *bias, float *t, int last, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t m = 0; m < rows; ++m) {
        const int32_t *a = acc + m * n_out;
        float *tr = t + m * n_out;
        for (int64_t n = 0; n < n_out; ++n) {
            float v = (grp == 0 ? 0.0f : tr[n]) + scale[n * groups + grp] * (float)a[n];
            if (last) {
                v = v * sx[m];
                v = bias ? v + bias[n] : v;
            }
            tr[n] = v;
        }
    }
}
