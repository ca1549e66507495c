/* qbench's real-kernel CPU routines, compiled on first use by native.py (see its docstring for the why).

   Files (the ggml-quants layering): native_ref.c holds the portable scalar loops and is always compiled — it is
   the definition, what a CPU without AVX2 runs and what the vector loops are tested against; native_avx2.c
   holds one function per AVX2 + FMA loop and compiles to nothing unless the build targets AVX2 (build.py's
   -march=native); native_avx512.c (the W8A8 and W4A8 GEMMs and the W4A8 GEMV on vpdpbusd, the 2/3-bit GEMV on 16 lanes)
   compiles to nothing unless the target has AVX-512 VNNI; native.c exports the entry points and picks among
   them at build time, from the compile flags (the -march=native build is for the machine that runs it, so
   nothing is left to choose at run time).
   Shared here: the scalar pieces all three use (epilogues, tails), so they compute them identically, and the
   packed-code GEMV's channel loop and 8-code step that the AVX2 and AVX-512 loops share.

   Layouts (all row-major, no padding; K need not be a multiple of anything: tails run scalar code):
     x   float32 (M, K) activations         q   int8 (M, K) activation codes, sx float32 (M,) their scales
     w8  int8 (N, K) weight codes           sw  float32 (N,) per output channel, or (1,) per tensor
     w4  uint8 (N, ceil(K/2)): code of k = 2j in the low nibble of byte j, k = 2j + 1 in the high nibble
     scale float32 (N, G), zero uint8 (N, G): one (scale, zero) per group of g = K / G input channels

   Exactness: integer dot products are exact (int32; |q| <= 127 keeps every int16 partial below 2^15);
   float arithmetic is IEEE float32 without contraction (-ffp-contract=off), in the order the torch reference
   uses wherever the result must equal it bit for bit (quantisation, epilogue, dequantisation). */
#ifndef QK_NATIVE_H
#define QK_NATIVE_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#define QK_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QK_AVX512VNNI 1 /* native_avx512.c: int8 dot products four to a lane (vpdpbusd) */
#endif
#endif

/* between the files of one library, never looked up by native.py */
#define QK_HIDDEN __attribute__((visibility("hidden")))

#define GEMV_ROWS 16 /* up to this many activation rows: the decode loop (paths.DECODE_ROWS mirrors it) */

/* y = (acc * sx[m]) * sw[n] + bias[n]: int8.py's epilogue, same operation order. */
static inline float epilogue(int32_t acc, float sx, const float *sw, int per_channel, const float *bias,
                             int64_t n) {
    float y = ((float)acc * sx) * sw[per_channel ? n : 0];
    return bias ? y + bias[n] : y;
}

static inline int32_t dot_tail_i8(const int8_t *a, const int8_t *b, int64_t from, int64_t k) {
    int32_t s = 0;
    for (int64_t i = from; i < k; ++i) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

/* the int4 code of channel i in a W4A8 row (nibbles hold code + 8) */
static inline int w4_code(const uint8_t *wr, int64_t i) { return ((wr[i >> 1] >> ((i & 1) * 4)) & 15) - 8; }

/* W4A8 group sizes with a loop: g = K, 32 or a multiple of 64 (w4a8.kernel_group_ok mirrors it) */
static inline int w4a8_groups_ok(int64_t k, int64_t groups) {
    int64_t g = k / groups;
    return groups == 1 || (k % groups == 0 && (g == 32 || g % 64 == 0));
}

/* Σ_{i in [from, to)} c_i q_i for one weight row: exact integer sums */
static inline int32_t w4a8_tail(const int8_t *q, const uint8_t *wr, int64_t from, int64_t to) {
    int32_t s = 0;
    for (int64_t i = from; i < to; ++i) s += w4_code(wr, i) * (int32_t)q[i];
    return s;
}

/* y[m, n] from the group sums: per channel W8A8's epilogue; per group s_x · Σ_g s_g · A_g + b */
static inline float w4a8_epilogue(const int32_t *acc, int64_t groups, float sx, const float *sr,
                                  const float *bias, int64_t n) {
    if (groups == 1) return epilogue(acc[0], sx, sr, 0, bias, n);
    float t = 0.0f;
    for (int64_t grp = 0; grp < groups; ++grp) t += sr[grp] * (float)acc[grp];
    t = t * sx;
    return bias ? t + bias[n] : t;
}

static inline float code_at(const uint8_t *wr, int bits4, int signed_codes, int64_t i) {
    if (bits4) return (float)((wr[i >> 1] >> ((i & 1) * 4)) & 15);
    return signed_codes ? (float)(int8_t)wr[i] : (float)wr[i];
}

/* scalar reference for one (row m, output n), channels [from, k): Σ_g s_g Σ_k (q − z_g) x */
static inline float wo_tail(const float *x, const uint8_t *wr, int bits4, int signed_codes, const float *sr,
                            const uint8_t *zr, int64_t g, int64_t from, int64_t k) {
    float total = 0.0f;
    for (int64_t i = from; i < k; ++i) {
        float z = zr ? (float)zr[i / g] : 0.0f;
        total += (code_at(wr, bits4, signed_codes, i) - z) * sr[i / g] * x[i];
    }
    return total;
}


/* ---------------------------------------------------------------- packed 2/3/4-bit codes (lowbit.py's layout)
   Unsigned codes u in [0, 2^b − 1] packed along the input dim, little-endian within a unit: b = 2: 4 codes a
   byte (code i at bits 2i); b = 3: 8 codes in 3 bytes (a 24-bit word, code i at bits 3i); b = 4: 2 codes a
   byte (low nibble first). A row of K codes (K = groups · g, LowBitLinear's zero-padded row) takes
   lowbit_row_bytes(b, K) bytes. Ŵ = (u − z) · s with one (s, z) per group; symmetric codes have no zero
   tensor and one zero point for all (zconst = qmax). */
static inline int64_t lowbit_row_bytes(int bits, int64_t k) {
    int64_t per = bits == 3 ? 8 : 8 / bits, bytes = bits == 3 ? 3 : 1;
    return (k + per - 1) / per * bytes;
}

static inline int lowbit_code(const uint8_t *wr, int bits, int64_t i) {
    if (bits == 2) return (wr[i >> 2] >> ((i & 3) * 2)) & 3;
    if (bits == 4) return (wr[i >> 1] >> ((i & 1) * 4)) & 15;
    const uint8_t *u = wr + 3 * (i >> 3);
    uint32_t word = (uint32_t)u[0] | (uint32_t)u[1] << 8 | (uint32_t)u[2] << 16;
    return (int)(word >> (3 * (i & 7))) & 7;
}

static inline float lowbit_zero(const uint8_t *zr, int zconst, int64_t grp) {
    return zr ? (float)zr[grp] : (float)zconst;
}

/* The packed-code GEMV's channel loop, shared by native_avx2.c and native_avx512.c so both visit channels, row
   blocks and threads alike: ROWS(x, ldx, mb, wr, bits, sr, zr, zconst, groups, k, ldw, out) is the build's
   always-inline row-block loop, called with a constant block of 1 … LOWBIT_MB rows (the rows that share each
   unpacked vector) and the constant code width BITS, so each (width, block) pair is compiled on its own: a loop
   that tests the width per step and divides a signed channel index to find its byte spent about as many
   instructions on that as on the codes (splitting the widths made the AVX2 loop 1.5–1.7× faster at 2048 → 8192,
   one row, AMD Zen 4). The caller's parameters are qk_lowbit_linear's; ``bits`` must equal BITS. Dynamic chunks
   of 64 channels: a thread that loses its core (a busy machine) holds up only its chunk. */
#define LOWBIT_MB 4
#define LOWBIT_CHANNELS(ROWS, BITS)                                                                                 \
    int64_t ldw = lowbit_row_bytes(BITS, k);                                                                        \
    _Pragma("omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(dynamic, 64)")                       \
    for (int64_t n = 0; n < n_out; ++n) {                                                                           \
        const uint8_t *wr = w + n * ldw, *zr = zero ? zero + n * groups : NULL;                                     \
        const float *sr = scale + n * groups;                                                                       \
        if (n + 4 < n_out) _mm_prefetch((const char *)(wr + 4 * ldw), _MM_HINT_T0);                                 \
        for (int64_t m = 0; m < m_rows; m += LOWBIT_MB) {                                                           \
            float out[LOWBIT_MB];                                                                                   \
            int64_t mb = m_rows - m < LOWBIT_MB ? m_rows - m : LOWBIT_MB;                                           \
            const float *xm = x + m * k;                                                                            \
            switch (mb) {                                                                                           \
            case 1: ROWS(xm, k, 1, wr, BITS, sr, zr, zconst, groups, k, ldw, out); break;                           \
            case 2: ROWS(xm, k, 2, wr, BITS, sr, zr, zconst, groups, k, ldw, out); break;                           \
            case 3: ROWS(xm, k, 3, wr, BITS, sr, zr, zconst, groups, k, ldw, out); break;                           \
            default: ROWS(xm, k, 4, wr, BITS, sr, zr, zconst, groups, k, ldw, out); break;                          \
            }                                                                                                       \
            for (int64_t i = 0; i < mb; ++i) y[(m + i) * n_out + n] = bias ? out[i] + bias[n] : out[i];             \
        }                                                                                                           \
    }

/* The byte of packed codes that holds channel c (c ≥ 0, c % 8 == 0 for 3-bit): unsigned arithmetic, so a shift
   rather than a signed division's sign fix-up in the inner loops */
static inline const uint8_t *lowbit_at(const uint8_t *wr, int bits, int64_t c) {
    const uint64_t u = (uint64_t)c;
    return wr + (bits == 2 ? u >> 2 : bits == 4 ? u >> 1 : 3 * (u >> 3));
}

/* Σ_{i in [from, to)} ŵ_i x_i with ŵ_i = (u_i − z) · s (fake mode's weight, bit for bit), in channel order */
static inline float lowbit_span(const float *x, const uint8_t *wr, int bits, float z, float s, int64_t from,
                                int64_t to) {
    float t = 0.0f;
    for (int64_t i = from; i < to; ++i) t += (((float)lowbit_code(wr, bits, i) - z) * s) * x[i];
    return t;
}

/* ------------------------------------------------------------------ native_ref.c: portable, always built */
/* The row helpers continue a vector loop: they start at element `from` (a running max `m` for absmax). */
QK_HIDDEN float qk_ref_absmax_f32(const float *x, int64_t from, int64_t n, float m);
QK_HIDDEN void qk_ref_quantize_row(const float *x, int64_t from, int64_t n, float s, int8_t *q);
QK_HIDDEN void qk_ref_w8a8_linear(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w,
                                  const float *sw, int per_channel, const float *bias, float *y, int64_t n_out,
                                  int64_t k, int nthreads);
QK_HIDDEN void qk_ref_w4a8_linear(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w,
                                  const float *scale, int64_t groups, const float *bias, float *y,
                                  int64_t n_out, int64_t k, int nthreads);
QK_HIDDEN int qk_ref_weight_only_linear(const float *x, int64_t m_rows, const uint8_t *w, int bits4,
                                        int signed_codes, const float *scale, const uint8_t *zero,
                                        int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k,
                                        int nthreads);
void qk_w4_permute_x(const float *x, int64_t m_rows, int64_t k, float *xp);
QK_HIDDEN void qk_ref_lowbit_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *w, int bits,
                                    const float *scale, const uint8_t *zero, int zconst, int64_t groups,
                                    const float *bias, float *y, int64_t n_out, int nthreads);
QK_HIDDEN void qk_ref_lowbit_dequantize(const uint8_t *w, int bits, const float *scale, const uint8_t *zero,
                                        int zconst, int64_t n_out, int64_t k, int64_t groups, int64_t k_out,
                                        float *out, int nthreads);

/* --------------------------------------------------------- native_avx2.c: built when the target has AVX2 */
#ifdef QK_AVX2
#include <immintrin.h>

/* table[u] for the 8 codes at channel c (c % 8 == 0) of a packed row (2/3-bit), or (u − z) as float (4-bit):
   the packed-code GEMVs' 8-channel step (native_avx2.c's loop, and native_avx512.c's tail steps with the low half
   of its table). 2-bit reads 2 bytes, 3-bit 4 bytes (one past the unit: the caller keeps the row's last unit for
   the scalar tail), 4-bit 4 bytes */
static inline __m256 lowbit8(const uint8_t *wr, int bits, int64_t c, __m256 table, __m256i zv) {
    if (bits == 2) {
        uint16_t v;
        memcpy(&v, lowbit_at(wr, 2, c), 2);
        __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32(v), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14));
        return _mm256_permutevar8x32_ps(table, idx);
    }
    uint32_t v;
    memcpy(&v, lowbit_at(wr, bits, c), 4);
    if (bits == 3) {
        __m256i idx = _mm256_srlv_epi32(_mm256_set1_epi32((int)v), _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21));
        return _mm256_permutevar8x32_ps(table, idx);
    }
    __m256i u = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)v), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
                                 _mm256_set1_epi32(15));
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(u, zv));
}

QK_HIDDEN float qk_avx2_absmax_f32(const float *x, int64_t n);
QK_HIDDEN void qk_avx2_quantize_row(const float *x, int64_t n, float s, int8_t *q);
QK_HIDDEN void qk_avx2_w8a8_gemv(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w,
                                 const float *sw, int per_channel, const float *bias, float *y, int64_t n_out,
                                 int64_t k, int nthreads);
QK_HIDDEN void qk_avx2_w8a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w,
                                 const float *sw, int per_channel, const float *bias, float *y, int64_t n_out,
                                 int64_t k, int nthreads);
QK_HIDDEN void qk_avx2_w4a8_gemv(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w,
                                 const float *scale, int64_t groups, const float *bias, float *y,
                                 int64_t n_out, int64_t k, int nthreads);
QK_HIDDEN void qk_avx2_w4a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w,
                                 const float *scale, int64_t groups, const float *bias, float *y,
                                 int64_t n_out, int64_t k, int nthreads);
QK_HIDDEN int qk_avx2_weight_only_linear(const float *x, int64_t m_rows, const uint8_t *w, int bits4,
                                         int signed_codes, const float *scale, const uint8_t *zero,
                                         int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k,
                                         int nthreads);
QK_HIDDEN void qk_avx2_lowbit_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *w, int bits,
                                     const float *scale, const uint8_t *zero, int zconst, int64_t groups,
                                     const float *bias, float *y, int64_t n_out, int nthreads);
QK_HIDDEN void qk_avx2_lowbit_dequantize(const uint8_t *w, int bits, const float *scale, const uint8_t *zero,
                                         int zconst, int64_t n_out, int64_t k, int64_t groups, int64_t k_out,
                                         float *out, int nthreads);
#endif

/* ------------------------------------------------- native_avx512.c: built when the target has AVX-512 VNNI */
#ifdef QK_AVX512VNNI
QK_HIDDEN void qk_avx512_w8a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w,
                                  const float *sw, int per_channel, const float *bias, float *y, int64_t n_out,
                                  int64_t k, int nthreads);
QK_HIDDEN void qk_avx512_w4a8_gemv(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w,
                                   const float *scale, int64_t groups, const float *bias, float *y,
                                   int64_t n_out, int64_t k, int nthreads);
QK_HIDDEN void qk_avx512_w4a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w,
                                   const float *scale, int64_t groups, const float *bias, float *y,
                                   int64_t n_out, int64_t k, int nthreads);
QK_HIDDEN void qk_avx512_lowbit_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *w, int bits,
                                       const float *scale, const uint8_t *zero, int zconst, int64_t groups,
                                       const float *bias, float *y, int64_t n_out, int nthreads);
#endif

#endif
