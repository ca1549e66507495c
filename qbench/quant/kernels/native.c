/* The exported entry points of qbench's real-kernel CPU library (native.py binds them; native.h describes the
   layouts and the file split). Each one picks its loops here, once, from the build's instruction set: the
   AVX2 functions of native_avx2.c when the compiler targets AVX2 + FMA (and the W8A8 and W4A8 GEMMs and the W4A8
   GEMV of native_avx512.c when it targets AVX-512 VNNI too), else the portable ones of native_ref.c. The choice is made by the compile flags (-march=native on the machine that runs it), so the
   tables below are the only place that knows which ISA exists; the functions hold no ISA conditionals. */
#include "native.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(QK_AVX2)
#define QK_ISA 1 /* native.py's ISA_NAMES */
#define ABSMAX_F32(x, n) qk_avx2_absmax_f32(x, n)
#define QUANTIZE_ROW(x, n, s, q) qk_avx2_quantize_row(x, n, s, q)
#define W8A8_GEMV qk_avx2_w8a8_gemv
/* the W8A8 and W4A8 prefill and the W4A8 decode at VNNI's int8 rate, the packed 2/3-bit GEMV on 16 lanes
   (native_avx512.c);
   every other loop stays AVX2 */
#if defined(QK_AVX512VNNI)
#define W8A8_GEMM qk_avx512_w8a8_gemm
#define W4A8_GEMM qk_avx512_w4a8_gemm
#define W4A8_GEMV qk_avx512_w4a8_gemv /* four rows a step, the reference's float order (g = 64·odd: AVX2's) */
#define LOWBIT_LINEAR qk_avx512_lowbit_linear /* 2/3-bit codes 16 to a zmm; 4-bit the AVX2 loop */
#define QK_VNNI 1
#else
#define W8A8_GEMM qk_avx2_w8a8_gemm
#define W4A8_GEMM qk_avx2_w4a8_gemm
#define W4A8_GEMV qk_avx2_w4a8_gemv
#define LOWBIT_LINEAR qk_avx2_lowbit_linear
#define QK_VNNI 0
#endif
#define WEIGHT_ONLY_LINEAR qk_avx2_weight_only_linear
#define LOWBIT_DEQUANTIZE qk_avx2_lowbit_dequantize
#else
/* the portable build has one loop per family, for every row count */
#define QK_ISA 0
#define QK_VNNI 0
#define ABSMAX_F32(x, n) qk_ref_absmax_f32(x, 0, n, 0.0f)
#define QUANTIZE_ROW(x, n, s, q) qk_ref_quantize_row(x, 0, n, s, q)
#define W8A8_GEMV qk_ref_w8a8_linear
#define W8A8_GEMM qk_ref_w8a8_linear
#define W4A8_GEMV qk_ref_w4a8_linear
#define W4A8_GEMM qk_ref_w4a8_linear
#define WEIGHT_ONLY_LINEAR qk_ref_weight_only_linear
#define LOWBIT_LINEAR qk_ref_lowbit_linear
#define LOWBIT_DEQUANTIZE qk_ref_lowbit_dequantize
#endif

#ifdef _OPENMP
#define QK_OPENMP 1
#else
#define QK_OPENMP 0
#endif

int qk_isa(void) { return QK_ISA; } /* 1: AVX2 + FMA, 0: portable C */

int qk_openmp(void) { return QK_OPENMP; }

int qk_avx512_vnni(void) { return QK_VNNI; } /* 1: the W8A8/W4A8 GEMMs and 2/3-bit GEMV are native_avx512.c's */

/* Per block of `rows_per_scale` consecutive rows (1: per token; T: per sequence):
   s = max(max|x| / 127, FLT_MIN), q = clamp(round(x / s), -127, 127) — int8.py's quantize_activation. */
void qk_quantize_rows(const float *x, int64_t rows, int64_t k, int64_t rows_per_scale, int8_t *q, float *sx) {
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_scale) {
        int64_t r1 = r0 + rows_per_scale < rows ? r0 + rows_per_scale : rows;
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) {
            float a = ABSMAX_F32(x + r * k, k);
            amax = a > amax ? a : amax;
        }
        float s = amax / 127.0f;
        s = s > FLT_MIN ? s : FLT_MIN;
        for (int64_t r = r0; r < r1; ++r) {
            sx[r] = s;
            QUANTIZE_ROW(x + r * k, k, s, q + r * k);
        }
    }
}

/* y (M, N) float32 = epilogue(q (M, K) · w (N, K)ᵀ): the W8A8 linear in one call, threads split by output
   channel (a row's sums never depend on the thread count). Up to GEMV_ROWS rows the decode loop. */
void qk_w8a8_linear(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w, const float *sw,
                    int per_channel, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    if (m_rows <= GEMV_ROWS)
        W8A8_GEMV(q, sx, m_rows, w, sw, per_channel, bias, y, n_out, k, nthreads);
    else
        W8A8_GEMM(q, sx, m_rows, w, sw, per_channel, bias, y, n_out, k, nthreads);
}

/* As qk_w8a8_forward, the loop chosen by the caller (paths.choose): gemv != 0 the streaming GEMV, else the GEMM
   (AVX2 builds: int16 panels; AVX-512 VNNI builds: vpdpbusd tiles; the portable build has one loop). Both loops
   take any row count, so a test can run each at every shape. */
void qk_w8a8_forward_path(const float *x, int64_t m_rows, int64_t k, int64_t rows_per_scale, const int8_t *w,
                          const float *sw, int per_channel, const float *bias, float *y, int64_t n_out,
                          int nthreads, int gemv) {
    int8_t *q = malloc((size_t)(m_rows * k));
    float *sx = malloc((size_t)m_rows * sizeof(float));
    qk_quantize_rows(x, m_rows, k, rows_per_scale, q, sx);
    if (gemv)
        W8A8_GEMV(q, sx, m_rows, w, sw, per_channel, bias, y, n_out, k, nthreads);
    else
        W8A8_GEMM(q, sx, m_rows, w, sw, per_channel, bias, y, n_out, k, nthreads);
    free(q);
    free(sx);
}

/* x float32 (M, K) -> y float32 (M, N): quantise the activations (qk_quantize_rows) and run qk_w8a8_linear in
   one call — the layer's whole CPU forward, so decode pays one foreign call and no tensor allocations. */
void qk_w8a8_forward(const float *x, int64_t m_rows, int64_t k, int64_t rows_per_scale, const int8_t *w,
                     const float *sw, int per_channel, const float *bias, float *y, int64_t n_out, int nthreads) {
    qk_w8a8_forward_path(x, m_rows, k, rows_per_scale, w, sw, per_channel, bias, y, n_out, nthreads,
                         m_rows <= GEMV_ROWS);
}

/* Zero-point (asymmetric) W4A8: ŵ = s_g · (u − z_g) with codes u ∈ [0, 15] stored as the nibbles. Every W4A8
   loop reads a nibble as c = u − 8 (the symmetric layout), so after it
       y_true = y + s_x · Σ_g m_g · Q_g,     m_g = s_g · (8 − z_g),  Q_g = Σ_{k ∈ g} q_k (exact in int32 and float),
   llama.cpp's Q4_1 "min" term (its dot product adds m · Σ q the same way). `zt` holds m transposed, (G, N) float32
   (w4a8.py derives it once per layer), so the sum runs along contiguous rows of m, 16 outputs a vector; each
   output's sum is in group order, then times s_x and added — one fixed order without contraction, so every build
   and every path (the GEMV, the GEMM, the _int_mm prefill in native.py) adds the same float. */
void qk_w4a8_zero_correct(const int8_t *q, const float *sx, int64_t m_rows, int64_t k, const float *zt,
                          int64_t groups, float *y, int64_t n_out, int nthreads) {
    const int64_t g = k / groups, nb = 256;
    float *qf = malloc((size_t)(m_rows * groups) * sizeof(float));
    for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t grp = 0; grp < groups; ++grp) {
            int32_t t = 0;
            for (int64_t i = grp * g; i < grp * g + g; ++i) t += q[m * k + i];
            qf[m * groups + grp] = (float)t; /* |Q_g| ≤ 127 · g < 2^24 for g < 132,000: exact */
        }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *c = malloc((size_t)(m_rows * nb) * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t n0 = 0; n0 < n_out; n0 += nb) {
            const int64_t w = n_out - n0 < nb ? n_out - n0 : nb;
            memset(c, 0, (size_t)(m_rows * nb) * sizeof(float));
            for (int64_t grp = 0; grp < groups; ++grp) {
                const float *zr = zt + grp * n_out + n0;
                for (int64_t m = 0; m < m_rows; ++m) {
                    const float qg = qf[m * groups + grp];
                    float *cm = c + m * nb;
                    for (int64_t j = 0; j < w; ++j) cm[j] += zr[j] * qg;
                }
            }
            for (int64_t m = 0; m < m_rows; ++m)
                for (int64_t j = 0; j < w; ++j) y[m * n_out + n0 + j] += c[m * nb + j] * sx[m];
        }
        free(c);
    }
    free(qf);
}

/* x float32 (M, K) -> y float32 (M, N) for the W4A8 layer: quantise the activations, then the GEMV (gemv != 0,
   or the portable build) or the GEMM, as the caller chose (paths.choose). Returns 0 (nothing written) when the
   group size has no loop here: g must be K, 32 or a multiple of 64. The AVX2-only build's decode loop sums
   g = 32 groups in another float order than the reference (even groups, then odd: see native_avx2.c), so there
   the two builds agree to float rounding; every other W4A8 and W8A8 result, the AVX-512 VNNI decode loop's
   included, is bit-identical across builds.
   zt: zero-point codes' (G, N) m_g of qk_w4a8_zero_correct, added after the loop; NULL: absmax codes. */
int qk_w4a8_forward_zp(const float *x, int64_t m_rows, int64_t k, int64_t rows_per_scale, const uint8_t *w,
                       const float *scale, const float *zt, int64_t groups, const float *bias, float *y,
                       int64_t n_out, int nthreads, int gemv) {
    if (!w4a8_groups_ok(k, groups)) return 0;
    int8_t *q = malloc((size_t)(m_rows * k));
    float *sx = malloc((size_t)m_rows * sizeof(float));
    qk_quantize_rows(x, m_rows, k, rows_per_scale, q, sx);
    if (gemv)
        W4A8_GEMV(q, sx, m_rows, w, scale, groups, bias, y, n_out, k, nthreads);
    else
        W4A8_GEMM(q, sx, m_rows, w, scale, groups, bias, y, n_out, k, nthreads);
    if (zt) qk_w4a8_zero_correct(q, sx, m_rows, k, zt, groups, y, n_out, nthreads);
    free(q);
    free(sx);
    return 1;
}

/* qk_w4a8_forward_zp for absmax codes: the entry the tests and the portable comparisons call */
int qk_w4a8_forward_path(const float *x, int64_t m_rows, int64_t k, int64_t rows_per_scale, const uint8_t *w,
                         const float *scale, int64_t groups, const float *bias, float *y, int64_t n_out,
                         int nthreads, int gemv) {
    return qk_w4a8_forward_zp(x, m_rows, k, rows_per_scale, w, scale, NULL, groups, bias, y, n_out, nthreads,
                              gemv);
}

/* The W4A8 forward with the default split: the GEMV up to 16 rows, the GEMM above. */
int qk_w4a8_forward(const float *x, int64_t m_rows, int64_t k, int64_t rows_per_scale, const uint8_t *w,
                    const float *scale, int64_t groups, const float *bias, float *y, int64_t n_out, int nthreads) {
    return qk_w4a8_forward_path(x, m_rows, k, rows_per_scale, w, scale, groups, bias, y, n_out, nthreads,
                                m_rows <= GEMV_ROWS);
}

/* y (M, N) = x (M, K) · Ŵᵀ + bias with Ŵ = (q − z) · s from int4 (bits4) or int8 codes, without building Ŵ.
   Returns 0 when this build or group size has no loop (the caller then dequantises: qk_dequantize). */
int qk_weight_only_linear(const float *x, int64_t m_rows, const uint8_t *w, int bits4, int signed_codes,
                          const float *scale, const uint8_t *zero, int64_t groups, const float *bias, float *y,
                          int64_t n_out, int64_t k, int nthreads) {
    return WEIGHT_ONLY_LINEAR(x, m_rows, w, bits4, signed_codes, scale, zero, groups, bias, y, n_out, k,
                              nthreads);
}

/* y (M, N) = x (M, K) · Ŵᵀ + bias from packed 2-, 3- or 4-bit codes (LowBitLinear's layout, native.h), Ŵ never
   built: x is zero-padded to the codes' K = groups · g; zero NULL means one zero point zconst for every group
   (symmetric codes). Every group size and row count has a loop; sums are reassociated (equal to fake mode to
   float rounding). */
void qk_lowbit_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *w, int bits, const float *scale,
                      const uint8_t *zero, int zconst, int64_t groups, const float *bias, float *y, int64_t n_out,
                      int nthreads) {
    LOWBIT_LINEAR(x, m_rows, k, w, bits, scale, zero, zconst, groups, bias, y, n_out, nthreads);
}

/* Ŵ[:, :k_out] (N, k_out) float32 of those packed codes, bit-identical to LowBitLinear.dequantized_weight (the
   prefill path: then torch's sgemm) */
void qk_lowbit_dequantize(const uint8_t *w, int bits, const float *scale, const uint8_t *zero, int zconst,
                          int64_t n_out, int64_t k, int64_t groups, int64_t k_out, float *out, int nthreads) {
    LOWBIT_DEQUANTIZE(w, bits, scale, zero, zconst, n_out, k, groups, k_out, out, nthreads);
}
