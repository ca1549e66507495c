/* The AVX2 + FMA loops of native.h, one function per loop; native.c calls them when the build targets AVX2
   (-march=native on such a CPU). Integer results equal native_ref.c's bit for bit; scalar tails call the
   shared pieces of native.h, so a vector loop and its tail can never disagree with the reference. */
#include "native.h"

#ifdef QK_AVX2
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------------------------------ activation quantiser */

float qk_avx2_absmax_f32(const float *x, int64_t n) {
    float m = 0.0f;
    int64_t i = 0;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
    return qk_ref_absmax_f32(x, i, n, m);
}

void qk_avx2_quantize_row(const float *x, int64_t n, float s, int8_t *q) {
    int64_t i = 0;
    const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    for (; i + 32 <= n; i += 32) {
        __m256i v[4];
        for (int j = 0; j < 4; ++j) {
            __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8 * j), vs),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            v[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        __m256i p16 = _mm256_packs_epi32(v[0], v[1]), p16b = _mm256_packs_epi32(v[2], v[3]);
        __m256i p8 = _mm256_packs_epi16(p16, p16b); /* lane-interleaved: fix the order with one permute */
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(q + i), p8);
    }
    qk_ref_quantize_row(x, i, n, s, q);
}

/* ------------------------------------------------------------------------------------------------ W8A8 */

/* Decode (1-16 rows) is bound by the weight bytes, so each weight row is read from memory exactly once and
   every activation row is multiplied against it while it sits in L1. Measured on a 2-core AMD EPYC (Zen 3,
   2048x8192): one row streamed with a software prefetch 8 KiB ahead reads 12 GB/s from DRAM (the machine's
   single-core ceiling) and 28 GB/s from L3, against 6-10 GB/s for four interleaved rows with a 1 KiB prefetch.
   maddubs multiplies unsigned by signed bytes with int16 saturation, so |x| (computed once per call) goes in
   as the unsigned operand and x's sign moves onto w (sign_epi8); |x|, |w| <= 127 keep each pair sum <= 32258
   < 2^15: exact. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8192
#endif

static inline __m256i hsum4_epi32(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    return _mm256_castsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}

/* out[i] = Σ_k q[i, k] w[k] over the whole 32-byte steps (k < kv), for mb <= 4 rows (a constant after
   inlining, so the row loop unrolls); the first pass over a weight row prefetches ahead in the stream. */
static inline __attribute__((always_inline)) void gemv_pass(const int8_t *q, const int8_t *qa, int64_t ldq,
                                                             const int mb, const int8_t *wr, int64_t kv,
                                                             int prefetch, int32_t out[4]) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t c = 0; c < kv; c += 32) {
        if (prefetch && (c & 63) == 0) _mm_prefetch((const char *)(wr + c + PREFETCH_AHEAD), _MM_HINT_T0);
        __m256i wv = _mm256_loadu_si256((const __m256i *)(wr + c));
        for (int i = 0; i < mb; ++i) {
            __m256i x = _mm256_loadu_si256((const __m256i *)(q + i * ldq + c));
            __m256i ax = _mm256_loadu_si256((const __m256i *)(qa + i * ldq + c));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, x)),
                                                                ones));
        }
    }
    int32_t r[8];
    _mm256_storeu_si256((__m256i *)r, hsum4_epi32(acc[0], acc[1], acc[2], acc[3]));
    for (int i = 0; i < mb; ++i) out[i] = r[i];
}

/* batch 1: one activation row against four consecutive weight rows, the activation loaded once for the four
   and the four sums reduced together (the reduction otherwise costs as much as the products at K = 384:
   1.5× faster there), each of the four rows prefetched. Only for short rows: from 512-byte rows on, one stream
   per row is faster — measured on AMD Zen 4, one thread, 1 row, weights cold: W8A8 K = 384 0.021 ms four rows
   at a time / 0.032 one at a time, K = 512 0.126 / 0.092, K = 1024 0.52 / 0.27; W4A8 (K/2-byte rows) K = 768
   0.108 / 0.149, K = 1024 0.30 / 0.19, K = 2048 1.10 / 0.46 (the limit was 1 KiB before: W4A8 2048 → 8192 ran
   at 3.8× fp32, now 11×). */
#define ROWS4_MAX_BYTES 384

static inline __m256i gemv_rows4(const int8_t *q, const int8_t *qa, const int8_t *w0, int64_t ldw, int64_t kv) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t c = 0; c < kv; c += 32) {
        if ((c & 63) == 0)
            for (int r = 0; r < 4; ++r) _mm_prefetch((const char *)(w0 + r * ldw + c + PREFETCH_AHEAD), _MM_HINT_T0);
        __m256i x = _mm256_loadu_si256((const __m256i *)(q + c)), ax = _mm256_loadu_si256((const __m256i *)(qa + c));
        for (int r = 0; r < 4; ++r) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w0 + r * ldw + c));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, x)), ones));
        }
    }
    return hsum4_epi32(acc[0], acc[1], acc[2], acc[3]);
}

void qk_avx2_w8a8_gemv(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w, const float *sw,
                       int per_channel, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int8_t *qa = malloc((size_t)(m_rows * k));
    for (int64_t i = 0; i < m_rows * k; ++i) qa[i] = (int8_t)(q[i] < 0 ? -q[i] : q[i]); /* |q| <= 127 */
    int64_t kv = k & ~(int64_t)31, n4 = m_rows == 1 && k <= ROWS4_MAX_BYTES ? n_out & ~(int64_t)3 : 0;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n4; n += 4) {
        int32_t r[8];
        _mm256_storeu_si256((__m256i *)r, gemv_rows4(q, qa, w + n * k, k, kv));
        for (int j = 0; j < 4; ++j)
            y[n + j] = epilogue(r[j] + dot_tail_i8(q, w + (n + j) * k, kv, k), sx[0], sw, per_channel, bias, n + j);
    }
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = n4; n < n_out; ++n) {
        const int8_t *wr = w + n * k;
        for (int64_t m = 0; m < m_rows; m += 4) {
            int32_t acc[4];
            int64_t mb = m_rows - m < 4 ? m_rows - m : 4;
            const int8_t *qm = q + m * k, *am = qa + m * k;
            switch (mb) {
            case 1: gemv_pass(qm, am, k, 1, wr, kv, m == 0, acc); break;
            case 2: gemv_pass(qm, am, k, 2, wr, kv, m == 0, acc); break;
            case 3: gemv_pass(qm, am, k, 3, wr, kv, m == 0, acc); break;
            default: gemv_pass(qm, am, k, 4, wr, kv, m == 0, acc); break;
            }
            for (int i = 0; i < mb; ++i)
                y[(m + i) * n_out + n] =
                    epilogue(acc[i] + dot_tail_i8(qm + i * k, wr, kv, k), sx[m + i], sw, per_channel, bias, n);
        }
    }
    free(qa);
}

/* Prefill (more rows) is bound by arithmetic. AVX2 has no int8 instruction that keeps our symmetric codes
   exact at full rate (maddubs needs an unsigned operand; the sign trick costs one more op per product), so
   codes go in as int16 and madd_epi16 does 16 exact products per instruction, summed in pairs into int32 —
   twice the multiply rate of float32 FMA. The weight is repacked per panel of 32 output channels (each int32
   lane holds channels n's codes k = 2p, 2p + 1; 128 bytes per pair p, L2-resident), the activations once per
   call; a 3-row × 32-column tile of accumulators stays in registers across the whole K, and every activation
   pair is broadcast against four panel vectors. Measured on the same EPYC, 512x1024x4096: 66 G int8 MAC/s,
   against 27 G MAC/s for torch's float32 GEMM (MKL) and 37 G MAC/s for torch.ao's fbgemm. */
#define GM_MR 3
#define GM_NC 32


/* dst[p · stride + i] = r[i] lane p for an 8 × 8 block of int32 (rows r[0..7] → columns): the panel's layout */
static inline void transpose8_store(__m256i r[8], int32_t *dst, int64_t stride) {
    __m256i a[8], b[8];
    for (int i = 0; i < 8; i += 2) {
        a[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        a[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        b[i] = _mm256_unpacklo_epi64(a[i], a[i + 2]);
        b[i + 1] = _mm256_unpackhi_epi64(a[i], a[i + 2]);
        b[i + 2] = _mm256_unpacklo_epi64(a[i + 1], a[i + 3]);
        b[i + 3] = _mm256_unpackhi_epi64(a[i + 1], a[i + 3]);
    }
    for (int i = 0; i < 4; ++i) {
        _mm256_storeu_si256((__m256i *)(dst + i * stride), _mm256_permute2x128_si256(b[i], b[i + 4], 0x20));
        _mm256_storeu_si256((__m256i *)(dst + (i + 4) * stride), _mm256_permute2x128_si256(b[i], b[i + 4], 0x31));
    }
}

static inline int32_t pair_i16(int16_t lo, int16_t hi) {
    return (int32_t)(uint16_t)lo | (int32_t)((uint32_t)(uint16_t)hi << 16);
}

/* The panel of output channels n0 … n0 + 31, pairs p0 … p1 − 1: panel[(p − p0) · 32 + j] holds codes k = 2p,
   2p + 1 of channel n0 + j as two int16 (zero past the last channel or K). Blocks of 8 channels × 8 pairs
   are sign-extended and transposed in registers (the scalar loop costs as much as a 17-row GEMM); the rest
   runs scalar. ``nibbles``: w holds int4 codes + 8 (the W4A8 layout), else int8 codes. */
static void pack_panel_range(const void *w, int nibbles, int64_t n_out, int64_t k, int64_t n0, int64_t p0,
                             int64_t p1, int32_t *panel) {
    int64_t ldw = nibbles ? (k + 1) / 2 : k, full = n_out - n0 >= GM_NC ? GM_NC : 0;
    int64_t pv = p0 + ((k / 2 - p0) > 0 ? ((k / 2 < p1 ? k / 2 : p1) - p0) & ~(int64_t)7 : 0); /* whole blocks */
    for (int64_t j0 = 0; j0 < full; j0 += 8)
        for (int64_t p = p0; p < pv; p += 8) {
            __m256i r[8];
            for (int i = 0; i < 8; ++i) {
                __m128i codes;
                if (nibbles) {
                    const uint8_t *src = (const uint8_t *)w + (n0 + j0 + i) * ldw + p;
                    __m128i b = _mm_loadl_epi64((const __m128i *)src); /* 8 bytes = 16 codes */
                    __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F));
                    __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
                    codes = _mm_sub_epi8(_mm_unpacklo_epi8(lo, hi), _mm_set1_epi8(8));
                } else {
                    codes = _mm_loadu_si128((const __m128i *)((const int8_t *)w + (n0 + j0 + i) * ldw + 2 * p));
                }
                r[i] = _mm256_cvtepi8_epi16(codes); /* int32 lane q = the int16 pair (2q, 2q + 1) */
            }
            transpose8_store(r, panel + (p - p0) * GM_NC + j0, GM_NC);
        }
    for (int64_t j = 0; j < GM_NC; ++j) {
        int64_t n = n0 + j;
        for (int64_t p = (j < full ? pv : p0); p < p1; ++p) {
            int16_t lo = 0, hi = 0;
            if (n < n_out && nibbles) {
                const uint8_t *wr = (const uint8_t *)w + n * ldw;
                lo = (int16_t)w4_code(wr, 2 * p);
                hi = 2 * p + 1 < k ? (int16_t)w4_code(wr, 2 * p + 1) : 0;
            } else if (n < n_out) {
                const int8_t *wr = (const int8_t *)w + n * ldw;
                lo = wr[2 * p];
                hi = 2 * p + 1 < k ? wr[2 * p + 1] : 0;
            }
            panel[(p - p0) * GM_NC + j] = pair_i16(lo, hi);
        }
    }
}

static void pack_panel(const int8_t *w, int64_t n_out, int64_t k, int64_t n0, int64_t pairs, int32_t *panel) {
    pack_panel_range(w, 0, n_out, k, n0, 0, pairs, panel);
}

static inline __attribute__((always_inline)) void gemm_tile(const int16_t *a, int64_t lda, const int mr,
                                                             const int32_t *panel, int64_t pairs,
                                                             int32_t out[GM_MR][GM_NC]) {
    __m256i acc[GM_MR][4];
    for (int i = 0; i < GM_MR; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_si256();
    for (int64_t p = 0; p < pairs; ++p) {
        __m256i b[4];
        for (int j = 0; j < 4; ++j) b[j] = _mm256_load_si256((const __m256i *)(panel + p * GM_NC + 8 * j));
        for (int i = 0; i < mr; ++i) {
            int32_t pair;
            memcpy(&pair, a + i * lda + 2 * p, 4);
            __m256i av = _mm256_set1_epi32(pair);
            for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_add_epi32(acc[i][j], _mm256_madd_epi16(av, b[j]));
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < 4; ++j) _mm256_storeu_si256((__m256i *)(out[i] + 8 * j), acc[i][j]);
}

/* y[0 … nc) = (acc · sx) · sw[n0 …] + b[n0 …] for one row of a tile: epilogue()'s operations and order, eight
   lanes at a time when the tile is whole (the scalar form costs ~10 % of a 512-row GEMM) */
static inline void tile_epilogue(const int32_t *acc, int64_t nc, float sx, const float *sw, int per_channel,
                                 const float *bias, int64_t n0, float *y) {
    if (nc == GM_NC) {
        const __m256 vsx = _mm256_set1_ps(sx), vsw0 = _mm256_set1_ps(sw[0]);
        for (int64_t j = 0; j < GM_NC; j += 8) {
            __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(acc + j))), vsx);
            v = _mm256_mul_ps(v, per_channel ? _mm256_loadu_ps(sw + n0 + j) : vsw0);
            if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + n0 + j));
            _mm256_storeu_ps(y + j, v);
        }
        return;
    }
    for (int64_t j = 0; j < nc; ++j) y[j] = epilogue(acc[j], sx, sw, per_channel, bias, n0 + j);
}

/* Every row of y for one packed panel (channels n0 … n0 + nc − 1): integer tiles of GM_MR rows over all pairs, then
   tile_epilogue — the W8A8 GEMM's body, shared by the per-channel W4A8 GEMM (same panel layout). */
static void gemm_panel_rows(const int16_t *a, int64_t lda, int64_t m_rows, const int32_t *panel, int64_t pairs,
                            const float *sx, const float *sw, int per_channel, const float *bias, int64_t n0,
                            int64_t nc, float *y, int64_t n_out) {
    for (int64_t m = 0; m < m_rows; m += GM_MR) {
        int32_t acc[GM_MR][GM_NC];
        int64_t mr = m_rows - m < GM_MR ? m_rows - m : GM_MR;
        const int16_t *am = a + m * lda;
        switch (mr) {
        case 1: gemm_tile(am, lda, 1, panel, pairs, acc); break;
        case 2: gemm_tile(am, lda, 2, panel, pairs, acc); break;
        default: gemm_tile(am, lda, 3, panel, pairs, acc); break;
        }
        for (int64_t i = 0; i < mr; ++i)
            tile_epilogue(acc[i], nc, sx[m + i], sw, per_channel, bias, n0, y + (m + i) * n_out + n0);
    }
}

void qk_avx2_w8a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w, const float *sw,
                       int per_channel, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t pairs = (k + 1) / 2, lda = 2 * pairs, n_panels = (n_out + GM_NC - 1) / GM_NC;
    int16_t *a = malloc((size_t)(m_rows * lda) * sizeof(int16_t));
    for (int64_t m = 0; m < m_rows; ++m) {
        for (int64_t i = 0; i < k; ++i) a[m * lda + i] = q[m * k + i];
        if (lda > k) a[m * lda + k] = 0; /* odd K: the last pair's high half multiplies a zero weight anyway */
    }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int32_t *panel = aligned_alloc(32, (size_t)pairs * GM_NC * sizeof(int32_t));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_panels; ++t) {
            int64_t n0 = t * GM_NC, nc = n_out - n0 < GM_NC ? n_out - n0 : GM_NC;
            pack_panel(w, n_out, k, n0, pairs, panel);
            gemm_panel_rows(a, lda, m_rows, panel, pairs, sx, sw, per_channel, bias, n0, nc, y, n_out);
        }
        free(panel);
    }
    free(a);
}

/* ------------------------------------------------------------- W4A8: int4 weights x int8 activations */


/* Weights: symmetric int4 codes c in [-7, 7] stored as nibbles c + 8 (the w4 layout), one float32 scale per
   group of g input channels (g = K: per output channel). Activations: the int8 codes of qk_quantize_rows.
   y = s_x · Σ_g s_g · Σ_{k in g} c_k q_k + b, the integer sums exact (int32); per output channel the epilogue
   is W8A8's, (acc · s_x) · s_w + b. This is what int4 CPU inference deploys (llama.cpp's Q4 × Q8 dot
   products): it keeps int8's integer rate where int4 weight-only with float activations is bound by turning
   nibbles into floats.

   Decode (AVX2): maddubs takes the nibble itself (0-15) as the unsigned operand and the activation code as the
   signed one — no saturation (pairs ≤ 2 · 15 · 127) and no sign trick —, and Σ c q = Σ (c + 8) q − 8 Σ q with
   Σ q per row and group computed once per call. The nibbles of a 32-byte step hold channels 2j (low) and
   2j + 1 (high) of byte j, so the activation codes are deinterleaved once per call to match (even channels,
   then odd, per 64-channel step); bytes 0-15 of a step are channels 0-31 of it and bytes 16-31 channels 32-63,
   so g = 32 is one group per 128-bit lane. Prefill: the int16 panel GEMM above, with c unpacked into the panel
   and one integer tile per group folded into float. */

/* Σ over steps [c0, c1) of nibble · code for mb <= 4 activation rows (int32 lanes; lanes 0-3 are the step's
   channels 0-31, lanes 4-7 channels 32-63). xd: deinterleaved codes, row stride ldx. */
static inline __attribute__((always_inline)) void w4a8_span(const int8_t *xd, int64_t ldx, const int mb,
                                                             const uint8_t *wr, int64_t c0, int64_t c1,
                                                             int prefetch, __m256i acc[4]) {
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_si256();
    for (int64_t c = c0; c < c1; c += 64) {
        if (prefetch) _mm_prefetch((const char *)(wr + c / 2 + PREFETCH_AHEAD), _MM_HINT_T0);
        __m256i b = _mm256_loadu_si256((const __m256i *)(wr + c / 2));
        __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
        for (int i = 0; i < mb; ++i) {
            const int8_t *xr = xd + i * ldx + c;
            __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xr)),
                                           _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(xr + 32))));
            acc[i] = _mm256_add_epi32(acc[i], _mm256_madd_epi16(s16, ones)); /* |s16| <= 4 · 15 · 127 */
        }
    }
}

/* One activation row against four consecutive weight rows (decode, batch 1): the activation bytes are loaded
   once for all four and the four sums reduce together — at K = 384 (the small preset) the per-row reduction
   and loads otherwise cost as much as the products. Returns the four int32 sums over steps [c0, c1). */
static inline __m256i w4a8_span_rows4(const int8_t *xd, const uint8_t *w0, int64_t ldw, int64_t c0, int64_t c1) {
    const __m256i nib = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256i acc[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
    for (int64_t c = c0; c < c1; c += 64) {
        for (int r = 0; r < 4; ++r) _mm_prefetch((const char *)(w0 + r * ldw + c / 2 + PREFETCH_AHEAD), _MM_HINT_T0);
        __m256i xe = _mm256_loadu_si256((const __m256i *)(xd + c)), xo = _mm256_loadu_si256((const __m256i *)(xd + c + 32));
        for (int r = 0; r < 4; ++r) {
            __m256i b = _mm256_loadu_si256((const __m256i *)(w0 + r * ldw + c / 2));
            __m256i lo = _mm256_and_si256(b, nib), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), nib);
            __m256i s16 = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
            acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(s16, ones));
        }
    }
    return hsum4_epi32(acc[0], acc[1], acc[2], acc[3]);
}

static inline int32_t hsum_epi32(__m256i a) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

static inline int32_t hsum_epi32_128(__m128i s) {
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

/* acc_g (mb rows × G groups, row stride G) = Σ_{k in g} c_k q_k over the whole row, exact */
static inline __attribute__((always_inline)) void w4a8_row_sums(const int8_t *q, const int8_t *xd,
                                                                 const int32_t *xsum, int64_t k, int64_t kv,
                                                                 const int mb, const uint8_t *wr, int64_t groups,
                                                                 int prefetch, int32_t *acc) {
    int64_t g = k / groups;
    __m256i v[4];
    if (g == 32 && groups > 1) { /* two groups per step, one per 128-bit lane */
        for (int64_t c = 0; c < kv; c += 64) {
            w4a8_span(xd, kv, mb, wr, c, c + 64, prefetch && (c & 127) == 0, v);
            for (int i = 0; i < mb; ++i) {
                acc[i * groups + c / 32] = hsum_epi32_128(_mm256_castsi256_si128(v[i]));
                acc[i * groups + c / 32 + 1] = hsum_epi32_128(_mm256_extracti128_si256(v[i], 1));
            }
        }
    } else {
        int64_t gs = groups == 1 ? kv : g;
        for (int64_t c0 = 0, grp = 0; c0 < kv; c0 += gs, ++grp) {
            w4a8_span(xd, kv, mb, wr, c0, c0 + gs < kv ? c0 + gs : kv, prefetch, v);
            for (int i = 0; i < mb; ++i) acc[i * groups + grp] = hsum_epi32(v[i]);
        }
    }
    for (int i = 0; i < mb; ++i) { /* − 8 Σ q over the vector part; the scalar tail uses c directly */
        for (int64_t grp = 0; grp * g < kv; ++grp) acc[i * groups + grp] -= 8 * xsum[i * groups + grp];
        for (int64_t grp = kv / g; grp < groups; ++grp) {
            int64_t from = grp * g > kv ? grp * g : kv, to = groups == 1 ? k : grp * g + g;
            if (grp * g >= kv) acc[i * groups + grp] = 0;
            acc[i * groups + grp] += w4a8_tail(q + i * k, wr, from, to);
        }
    }
}
/* g = 32, batch of mb <= 4 rows: Σ_g s_g · A_g straight into float. Each step holds two groups, one per 128-bit
   lane: two hadds reduce a lane's four partials to its exact group sum, 8 Σ q of the group comes off in integers,
   and s_g · A_g accumulates in float lanes 0 (even groups) and 4 (odd groups) — instead of storing every group
   sum and scaling them one at a time (decode 2048→8192 went from 2.6× to 4.4× fp32 here). A group in the K tail (K % 64 = 32)
   is added last. Float order: even groups, then odd groups, each in step order (the GEMM's is group order). */
static inline __attribute__((always_inline)) void w4a8_g32_rows(const int8_t *q, const int8_t *xd,
                                                                 const int32_t *xsum, int64_t k, int64_t kv,
                                                                 const int mb, const uint8_t *wr, const float *sr,
                                                                 int64_t groups, int prefetch, float out[4]) {
    const __m256i lanes2 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 facc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t c = 0; c < kv; c += 64) {
        __m256i v[4];
        w4a8_span(xd, kv, mb, wr, c, c + 64, prefetch && (c & 127) == 0, v);
        __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(sr + c / 32)));
        __m256 sv = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), lanes2);
        for (int i = 0; i < mb; ++i) {
            __m256i h = _mm256_hadd_epi32(v[i], v[i]);
            h = _mm256_hadd_epi32(h, h); /* lanes 0-3: the step's first group, 4-7: its second */
            __m128i s2 = _mm_slli_epi32(_mm_loadl_epi64((const __m128i *)(xsum + i * groups + c / 32)), 3);
            __m256i corr = _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(s2), lanes2);
            facc[i] = _mm256_add_ps(facc[i], _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(h, corr)), sv));
        }
    }
    for (int i = 0; i < mb; ++i) {
        float lanes[8];
        _mm256_storeu_ps(lanes, facc[i]);
        float t = lanes[0] + lanes[4];
        if (kv < k) t += sr[kv / 32] * (float)w4a8_tail(q + i * k, wr, kv, k);
        out[i] = t;
    }
}

void qk_avx2_w4a8_gemv(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w, const float *scale,
                       int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t g = k / groups, ldw = (k + 1) / 2;
    int64_t kv = k & ~(int64_t)63;
    int8_t *xd = malloc((size_t)(m_rows * (kv > 0 ? kv : 1)));
    int32_t *xsum = calloc((size_t)(m_rows * groups), sizeof(int32_t));
    for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t c = 0; c < kv; c += 64)
            for (int j = 0; j < 32; ++j) {
                int8_t even = q[m * k + c + 2 * j], odd = q[m * k + c + 2 * j + 1];
                xd[m * kv + c + j] = even, xd[m * kv + c + 32 + j] = odd;
                xsum[m * groups + (c + 2 * j) / g] += even;
                xsum[m * groups + (c + 2 * j + 1) / g] += odd;
            }
    /* batch 1, per channel or groups of 64·n: four weight rows per pass (all but the last n_out % 4 rows) */
    int64_t n4 = (m_rows == 1 && ldw <= ROWS4_MAX_BYTES && (groups == 1 || g % 64 == 0)) ? n_out & ~(int64_t)3 : 0;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n4; n += 4) {
        const uint8_t *w0 = w + n * ldw;
        int32_t acc[4][64], *big = groups > 64 ? malloc((size_t)(4 * groups) * sizeof(int32_t)) : NULL;
        int64_t gs = groups == 1 ? kv : g;
        for (int64_t c0 = 0, grp = 0; c0 < kv; c0 += gs, ++grp) {
            int32_t r[8];
            _mm256_storeu_si256((__m256i *)r, w4a8_span_rows4(xd, w0, ldw, c0, c0 + gs < kv ? c0 + gs : kv));
            for (int j = 0; j < 4; ++j) (big ? big + j * groups : acc[j])[grp] = r[j] - 8 * xsum[grp];
        }
        for (int j = 0; j < 4; ++j) {
            int32_t *a = big ? big + j * groups : acc[j];
            if (kv < k) /* per channel only (g = 64·n tiles K): the scalar tail */
                a[0] = (kv > 0 ? a[0] : 0) + w4a8_tail(q, w0 + j * ldw, kv, k);
            y[n + j] = w4a8_epilogue(a, groups, sx[0], scale + (n + j) * groups, bias, n + j);
        }
        free(big);
    }
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = n4; n < n_out; ++n) {
        const uint8_t *wr = w + n * ldw;
        int32_t acc[4 * 64], *big = groups > 64 ? malloc((size_t)(4 * groups) * sizeof(int32_t)) : NULL;
        int32_t *a = big ? big : acc;
        for (int64_t m = 0; m < m_rows; m += 4) {
            int64_t mb = m_rows - m < 4 ? m_rows - m : 4;
            const int8_t *qm = q + m * k, *xm = xd + m * kv;
            const int32_t *sm = xsum + m * groups;
            if (g == 32 && groups > 1) {
                float t[4];
                const float *sr = scale + n * groups;
                switch (mb) {
                case 1: w4a8_g32_rows(qm, xm, sm, k, kv, 1, wr, sr, groups, m == 0, t); break;
                case 2: w4a8_g32_rows(qm, xm, sm, k, kv, 2, wr, sr, groups, m == 0, t); break;
                case 3: w4a8_g32_rows(qm, xm, sm, k, kv, 3, wr, sr, groups, m == 0, t); break;
                default: w4a8_g32_rows(qm, xm, sm, k, kv, 4, wr, sr, groups, m == 0, t); break;
                }
                for (int64_t i = 0; i < mb; ++i) {
                    float v = t[i] * sx[m + i];
                    y[(m + i) * n_out + n] = bias ? v + bias[n] : v;
                }
                continue;
            }
            switch (mb) {
            case 1: w4a8_row_sums(qm, xm, sm, k, kv, 1, wr, groups, m == 0, a); break;
            case 2: w4a8_row_sums(qm, xm, sm, k, kv, 2, wr, groups, m == 0, a); break;
            case 3: w4a8_row_sums(qm, xm, sm, k, kv, 3, wr, groups, m == 0, a); break;
            default: w4a8_row_sums(qm, xm, sm, k, kv, 4, wr, groups, m == 0, a); break;
            }
            for (int64_t i = 0; i < mb; ++i)
                y[(m + i) * n_out + n] = w4a8_epilogue(a + i * groups, groups, sx[m + i], scale + n * groups, bias, n);
        }
        free(big);
    }
    free(xd);
    free(xsum);
}

/* Per group (groups > 1): GM_MR rows × 32 channels over every group of K, the whole-K panel packed once per call
   and panel. The integer tile of one group (12 registers) is folded straight from its registers into a float
   tile t of 3 × 32 that stays in L1 (t += s_g · A_g, the reference's order, then y = t · s_x + b); AVX2's 16
   registers hold no more. Before, each group's tile went through an int32 array and the float accumulators of
   every row through an M × 32 array in L2, group by group: at g = 32 0.69–0.75 of the W8A8 C GEMM's speed
   (512 × 1024 → 4096, one thread, an AVX2 build on AMD Zen 4), now 0.85–0.99. The empty asm statement keeps
   GCC from spilling the tile (it did in native_avx512.c's twin). */
#define GA_ACC(i) __m256i c##i##0 = _mm256_setzero_si256(), c##i##1 = c##i##0, c##i##2 = c##i##0, c##i##3 = c##i##0;
#define GA_DOT(i)                                                                                                  \
    {                                                                                                              \
        int32_t pair;                                                                                              \
        memcpy(&pair, a + (i) * lda + 2 * p, 4);                                                                   \
        const __m256i av = _mm256_set1_epi32(pair);                                                                \
        c##i##0 = _mm256_add_epi32(c##i##0, _mm256_madd_epi16(av, _mm256_load_si256((const __m256i *)(pp))));      \
        c##i##1 = _mm256_add_epi32(c##i##1, _mm256_madd_epi16(av, _mm256_load_si256((const __m256i *)(pp + 8))));  \
        c##i##2 = _mm256_add_epi32(c##i##2, _mm256_madd_epi16(av, _mm256_load_si256((const __m256i *)(pp + 16)))); \
        c##i##3 = _mm256_add_epi32(c##i##3, _mm256_madd_epi16(av, _mm256_load_si256((const __m256i *)(pp + 24)))); \
    }
#define GA_FOLD1(i, v)                                                                                             \
    _mm256_store_ps(t[i] + 8 * (v), _mm256_add_ps(_mm256_load_ps(t[i] + 8 * (v)),                                  \
                                                  _mm256_mul_ps(_mm256_loadu_ps(sg + 8 * (v)), _mm256_cvtepi32_ps(c##i##v))));
#define GA_FOLD(i) GA_FOLD1(i, 0) GA_FOLD1(i, 1) GA_FOLD1(i, 2) GA_FOLD1(i, 3)
#define GA_KEEP(i) "+x"(c##i##0), "+x"(c##i##1), "+x"(c##i##2), "+x"(c##i##3)

static void w4a8_group_rows(const int16_t *a0, int64_t lda, int64_t mr, const int32_t *panel, int64_t groups,
                            int64_t gp, const float *sct, const float *sx, const float *bias, int64_t n0, int64_t nc,
                            float *y, int64_t ldy) {
    float t[GM_MR][GM_NC] __attribute__((aligned(32)));
    memset(t, 0, sizeof t);
    for (int64_t grp = 0; grp < groups; ++grp) {
        GA_ACC(0) GA_ACC(1) GA_ACC(2)
        const int16_t *a = a0 + 2 * grp * gp;
        for (int64_t p = 0; p < gp; ++p) {
            const int32_t *pp = panel + (grp * gp + p) * GM_NC;
            GA_DOT(0) GA_DOT(1) GA_DOT(2)
        }
        __asm__("" : GA_KEEP(0), GA_KEEP(1), GA_KEEP(2));
        const float *sg = sct + grp * GM_NC;
        GA_FOLD(0) GA_FOLD(1) GA_FOLD(2)
    }
    for (int64_t i = 0; i < mr; ++i)
        for (int64_t j = 0; j < nc; ++j) {
            float v = t[i][j] * sx[i];
            y[i * ldy + n0 + j] = bias ? v + bias[n0 + j] : v;
        }
}

void qk_avx2_w4a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w, const float *scale,
                       int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t pairs = (k + 1) / 2, lda = 2 * pairs, n_panels = (n_out + GM_NC - 1) / GM_NC;
    int64_t gp = groups == 1 ? pairs : (k / groups) / 2; /* pairs per group (g is even) */
    int64_t m_pad = (m_rows + GM_MR - 1) / GM_MR * GM_MR; /* zero rows complete the last row tile (per group) */
    int16_t *a = calloc((size_t)(m_pad * lda), sizeof(int16_t));
    for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t i = 0; i < k; ++i) a[m * lda + i] = q[m * k + i];
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int32_t *panel = aligned_alloc(32, (size_t)pairs * GM_NC * sizeof(int32_t));
        float *sct = groups > 1 ? malloc((size_t)(groups * GM_NC) * sizeof(float)) : NULL;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_panels; ++t) {
            int64_t n0 = t * GM_NC, nc = n_out - n0 < GM_NC ? n_out - n0 : GM_NC;
            pack_panel_range(w, 1, n_out, k, n0, 0, pairs, panel);
            if (sct) { /* the panel's scales, group-major */
                for (int64_t grp = 0; grp < groups; ++grp)
                    for (int64_t j = 0; j < GM_NC; ++j) sct[grp * GM_NC + j] = j < nc ? scale[(n0 + j) * groups + grp] : 0.0f;
                for (int64_t m = 0; m < m_rows; m += GM_MR)
                    w4a8_group_rows(a + m * lda, lda, m_rows - m < GM_MR ? m_rows - m : GM_MR, panel, groups, gp, sct,
                                    sx + m, bias, n0, nc, y + m * n_out, n_out);
                continue;
            }
            /* per channel: W8A8's tile and epilogue */
            gemm_panel_rows(a, lda, m_rows, panel, pairs, sx, scale, 1, bias, n0, nc, y, n_out);
        }
        free(panel);
        free(sct);
    }
    free(a);
}

/* ------------------------------------------------------------------------ weight-only, float32 input */

/* int4: 32 bytes = 64 codes per step. Nibbles are turned into float32 without any int→float conversion: a
   float holding an integer in [−15, 15] has zero low 16 bits, so two byte shuffles (pshufb through a 16-entry
   table of the top two bytes of float(v − z)) and three unpacks build 8 floats. The unpacks reorder channels:
   output vector i of the low (high) nibbles holds bytes j = 4i..4i+3 and 16+4i..16+4i+3, i.e. channels 2j
   (2j + 1). qk_w4_permute_x applies that order to x once per call, so each product pairs the right channel.
   (Replacing the last unpacks by a 32-bit shift and a mask measured no faster on Zen 3.)
   Group sizes: any multiple of 64 (one group per step), 32 (lane 0 and lane 1 of a step are two groups), or
   one group per row (any K); channels past the last full step run the scalar tail. */

/* FLOAT_TOP[z][0 / 1][v] = byte 3 / byte 2 of float(v − z), built once (qk_init_tables) */
static uint8_t FLOAT_TOP[16][2][16];

static void init_tables(void) {
    static int done = 0;
    if (done) return;
    for (int z = 0; z < 16; ++z)
        for (int v = 0; v < 16; ++v) {
            float f = (float)(v - z);
            uint32_t bits;
            memcpy(&bits, &f, 4);
            FLOAT_TOP[z][0][v] = (uint8_t)(bits >> 24);
            FLOAT_TOP[z][1][v] = (uint8_t)(bits >> 16);
        }
    done = 1;
}

static inline __m256i table2(int za, int zb, int which) { /* lane 0 for zero point za, lane 1 for zb */
    return _mm256_loadu2_m128i((const __m128i *)FLOAT_TOP[zb][which], (const __m128i *)FLOAT_TOP[za][which]);
}

#define W4_MB 2 /* activation rows per pass over a weight row (the row stays in L1 for the next pass) */
#define NACC 4   /* independent accumulators per row: FMA latency, not throughput, bounds a single chain */

static inline __m256 sum4(const __m256 *a) {
    return _mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]));
}

/* one 64-code step of one weight row against mb activation rows: acc[i][v] += (q − z) · x (unscaled) */
static inline void w4_step(const uint8_t *wb, __m256i t3, __m256i t2, const float *xp, int64_t ldp, int64_t mb,
                           __m256 acc[W4_MB][NACC]) {
    const __m256i nib = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
    __m256i b = _mm256_loadu_si256((const __m256i *)wb);
    __m256i nibs[2] = {_mm256_and_si256(b, nib), _mm256_and_si256(_mm256_srli_epi16(b, 4), nib)};
    for (int h = 0; h < 2; ++h) {
        __m256i hi = _mm256_shuffle_epi8(t3, nibs[h]), lo = _mm256_shuffle_epi8(t2, nibs[h]);
        __m256i u0 = _mm256_unpacklo_epi8(lo, hi), u1 = _mm256_unpackhi_epi8(lo, hi);
        __m256 f[4] = {_mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, u0)),
                       _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, u0)),
                       _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, u1)),
                       _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, u1))};
        for (int i = 0; i < W4_MB; ++i) {
            if (i >= mb) break;
            const float *xr = xp + i * ldp + h * 32;
            for (int v = 0; v < 4; ++v)
                acc[i][v] = _mm256_fmadd_ps(f[v], _mm256_loadu_ps(xr + 8 * v), acc[i][v]);
        }
    }
}

/* rows m..m+mb of y[:, n] for one weight row: float accumulation per group, scaled once per group (gs = codes
   per scaling step: 64 for g = 32 — two groups, one per 128-bit lane —, g for multiples of 64, kv per row) */
static void w4_row(const float *xp, const float *x, int64_t mb, int64_t ldx, int64_t kv, const uint8_t *wr,
                   const float *sr, const uint8_t *zr, int64_t g, int64_t k, float *out) {
    __m256 acc[W4_MB][NACC], tot[W4_MB];
    for (int i = 0; i < W4_MB; ++i) {
        tot[i] = _mm256_setzero_ps();
        for (int v = 0; v < NACC; ++v) acc[i][v] = _mm256_setzero_ps();
    }
    const __m256i lanes2 = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    int64_t gs = g == 32 ? 64 : (g >= k ? kv : g);
    for (int64_t c0 = 0, grp = 0; c0 < kv; c0 += gs, grp += (g == 32 ? 2 : 1)) {
        __m256 svec;
        __m256i t3, t2;
        if (g == 32) { /* lane 0 of the step is group grp, lane 1 group grp + 1 */
            int za = zr ? zr[grp] : 0, zb = zr ? zr[grp + 1] : 0;
            t3 = table2(za, zb, 0), t2 = table2(za, zb, 1);
            __m128 two = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(sr + grp)));
            svec = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), lanes2);
        } else {
            int z = zr ? zr[grp] : 0;
            t3 = table2(z, z, 0), t2 = table2(z, z, 1);
            svec = _mm256_set1_ps(sr[grp]);
        }
        int64_t c1 = c0 + gs < kv ? c0 + gs : kv;
        for (int64_t c = c0; c < c1; c += 64) w4_step(wr + c / 2, t3, t2, xp + c, kv, mb, acc);
        for (int i = 0; i < W4_MB && i < mb; ++i) {
            tot[i] = _mm256_fmadd_ps(sum4(acc[i]), svec, tot[i]);
            for (int v = 0; v < NACC; ++v) acc[i][v] = _mm256_setzero_ps();
        }
    }
    for (int i = 0; i < W4_MB && i < mb; ++i) {
        float lanes[8], s = 0.0f;
        _mm256_storeu_ps(lanes, tot[i]);
        for (int j = 0; j < 8; ++j) s += lanes[j];
        out[i] = s + wo_tail(x + i * ldx, wr, 1, 0, sr, zr, g, kv, k);
    }
}

static inline __m256 w8_codes(const uint8_t *p, int signed_codes, __m256i zv) {
    __m128i raw = _mm_loadl_epi64((const __m128i *)p);
    __m256i codes = signed_codes ? _mm256_cvtepi8_epi32(raw) : _mm256_cvtepu8_epi32(raw);
    return _mm256_cvtepi32_ps(_mm256_sub_epi32(codes, zv));
}

/* int8 weight-only: 8 codes per vector, sign- or zero-extended to int32, minus z, to float, FMA */
static void w8_row(const float *x, int64_t mb, int64_t ldx, const uint8_t *wr, int signed_codes,
                   const float *sr, const uint8_t *zr, int64_t g, int64_t k, float *out) {
    int64_t kv = (g == k || g % 8 == 0) ? k & ~(int64_t)7 : 0; /* per channel: any K; groups: whole steps */
    int64_t gs = g >= k ? kv : g;
    __m256 acc[W4_MB][NACC], tot[W4_MB];
    for (int i = 0; i < W4_MB; ++i) {
        tot[i] = _mm256_setzero_ps();
        for (int v = 0; v < NACC; ++v) acc[i][v] = _mm256_setzero_ps();
    }
    for (int64_t c0 = 0, grp = 0; c0 < kv; c0 += gs, ++grp) {
        const __m256i zv = _mm256_set1_epi32(zr ? zr[grp] : 0);
        int64_t c1 = c0 + gs < kv ? c0 + gs : kv, c = c0;
        for (; c + 32 <= c1; c += 32) {
            __m256 f[NACC];
            for (int v = 0; v < NACC; ++v) f[v] = w8_codes(wr + c + 8 * v, signed_codes, zv);
            for (int i = 0; i < W4_MB; ++i) {
                if (i >= mb) break;
                for (int v = 0; v < NACC; ++v)
                    acc[i][v] = _mm256_fmadd_ps(f[v], _mm256_loadu_ps(x + i * ldx + c + 8 * v), acc[i][v]);
            }
        }
        for (; c < c1; c += 8) {
            __m256 f = w8_codes(wr + c, signed_codes, zv);
            for (int i = 0; i < W4_MB; ++i) {
                if (i >= mb) break;
                acc[i][0] = _mm256_fmadd_ps(f, _mm256_loadu_ps(x + i * ldx + c), acc[i][0]);
            }
        }
        const __m256 svec = _mm256_set1_ps(sr[grp]);
        for (int i = 0; i < W4_MB && i < mb; ++i) {
            tot[i] = _mm256_fmadd_ps(sum4(acc[i]), svec, tot[i]);
            for (int v = 0; v < NACC; ++v) acc[i][v] = _mm256_setzero_ps();
        }
    }
    for (int i = 0; i < W4_MB && i < mb; ++i) {
        float lanes[8], s = 0.0f;
        _mm256_storeu_ps(lanes, tot[i]);
        for (int j = 0; j < 8; ++j) s += lanes[j];
        out[i] = s + wo_tail(x + i * ldx, wr, 0, signed_codes, sr, zr, g, kv, k);
    }
}

/* y (M, N) = x (M, K) · Ŵᵀ + bias with Ŵ = (q − z) · s from int4 (bits4) or int8 codes, without building Ŵ.
   Returns 0 when the group size has no loop (the caller then dequantises); the float sums are reassociated, so
   results equal fake mode to float rounding, not bit for bit. */
int qk_avx2_weight_only_linear(const float *x, int64_t m_rows, const uint8_t *w, int bits4, int signed_codes,
                               const float *scale, const uint8_t *zero, int64_t groups, const float *bias,
                               float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t g = k / groups;
    int64_t kv = k & ~(int64_t)63;
    if (bits4 && !(groups == 1 || g % 64 == 0 || g == 32)) return 0;
    int64_t ldw = bits4 ? (k + 1) / 2 : k;
    init_tables();
    float *xp = NULL; /* int4: x in the order the nibble loop consumes it, built once per call */
    if (bits4) {
        xp = malloc((size_t)(m_rows * (kv > 0 ? kv : 1)) * sizeof(float));
        qk_w4_permute_x(x, m_rows, k, xp);
    }
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
        const uint8_t *wr = w + n * ldw;
        const float *sr = scale + n * groups;
        const uint8_t *zr = zero ? zero + n * groups : NULL;
        for (int64_t m = 0; m < m_rows; m += W4_MB) {
            int64_t mb = m_rows - m < W4_MB ? m_rows - m : W4_MB;
            float out[W4_MB];
            if (bits4)
                w4_row(xp + m * kv, x + m * k, mb, k, kv, wr, sr, zr, groups == 1 ? k : g, k, out);
            else
                w8_row(x + m * k, mb, k, wr, signed_codes, sr, zr, g, k, out);
            for (int i = 0; i < mb; ++i) y[(m + i) * n_out + n] = bias ? out[i] + bias[n] : out[i];
        }
    }
    free(xp);
    return 1;
}

/* ------------------------------------------------------------------- packed 2/3/4-bit weight-only */

/* Decode with fp32 activations reads 1/16 (int2) or 3/32 (int3) of fp32's weight bytes, so the loop is bound by
   turning codes into floats, not by memory: a 32-bit word of codes is broadcast to eight lanes, one variable
   shift (srlv) brings code e of each lane to its low bits, and one permute (vpermps: it reads only an index's
   low three bits, so no mask) looks the code up in an 8-entry table of float(t − z), built once per group —
   three vector ops per eight weights before the FMA, exact (u − z is a small integer). 4-bit codes have 16
   values, too many for one permute: mask, subtract z, convert. Channel order is kept, so x needs no
   reordering. Up to LOWBIT_MB activation rows share each unpacked vector; each group's sum is scaled once. */

/* ŵ of the 32 codes at channel c (c % 8 == 0) into f[0..3], channels c + 8v … c + 8v + 7 in f[v]. bits is a
   constant at every call (LOWBIT_CHANNELS), so each width is its own straight-line code: 2-bit, two words of 16
   codes, each broadcast once (a load) and shifted twice; 3-bit, four 3-byte units read as 4 bytes; 4-bit,
   lowbit8's convert (16 values: no 8-entry table). The shifts come in registers (sh0/sh1), set once per row. */
static inline __attribute__((always_inline)) void lowbit32(const uint8_t *wr, const int bits, int64_t c, __m256 table,
                                                           __m256 svec, __m256i zv, __m256i sh0, __m256i sh1,
                                                           __m256 f[4]) {
    const uint8_t *p = lowbit_at(wr, bits, c);
    if (bits == 2) {
        uint32_t v0, v1;
        memcpy(&v0, p, 4);
        memcpy(&v1, p + 4, 4);
        const __m256i b0 = _mm256_set1_epi32((int)v0), b1 = _mm256_set1_epi32((int)v1);
        f[0] = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(b0, sh0));
        f[1] = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(b0, sh1));
        f[2] = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(b1, sh0));
        f[3] = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(b1, sh1));
    } else if (bits == 3) {
        for (int v = 0; v < 4; ++v) {
            uint32_t u;
            memcpy(&u, p + 3 * v, 4);
            f[v] = _mm256_permutevar8x32_ps(table, _mm256_srlv_epi32(_mm256_set1_epi32((int)u), sh0));
        }
    } else {
        for (int v = 0; v < 4; ++v) f[v] = _mm256_mul_ps(lowbit8(wr, bits, c + 8 * v, table, zv), svec);
    }
}

/* one 32-channel step of mb rows: acc[i][v] += ŵ · x over channels c + 8v … c + 8v + 7 (both group loops) */
static inline __attribute__((always_inline)) void lowbit_fma32(const float *x, int64_t ldx, const int mb,
                                                                const uint8_t *wr, const int bits, int64_t c,
                                                                __m256 table, __m256 svec, __m256i zv, __m256i sh0,
                                                                __m256i sh1, __m256 acc[LOWBIT_MB][4]) {
    __m256 f[4];
    lowbit32(wr, bits, c, table, svec, zv, sh0, sh1, f);
    for (int i = 0; i < mb; ++i)
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_fmadd_ps(f[v], _mm256_loadu_ps(x + i * ldx + c + 8 * v), acc[i][v]);
}

static inline __attribute__((always_inline)) void lowbit_rows(const float *x, int64_t ldx, const int mb,
                                                               const uint8_t *wr, const int bits, const float *sr,
                                                               const uint8_t *zr, int zconst, int64_t groups,
                                                               int64_t k, int64_t ldw, float *out) {
    int64_t g = k / groups;
    /* the last whole vector step: 3-bit loads 4 bytes per 3-byte unit, so the row's last unit runs scalar */
    int64_t vend = bits == 3 ? (ldw / 3 - 1) * 8 : k & ~(int64_t)7;
    const __m256 iota = bits == 2 ? _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3) : _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i sh0 = bits == 2   ? _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)
                        : bits == 3 ? _mm256_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21)
                                    : _mm256_setzero_si256();
    const __m256i sh1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30); /* 2-bit: the word's upper 8 codes */
    __m256 acc[LOWBIT_MB][4];
    float extra[LOWBIT_MB];
    for (int i = 0; i < LOWBIT_MB; ++i) {
        extra[i] = 0.0f;
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm256_setzero_ps();
    }
    /* groups of whole 32-channel steps inside the vector range (every group of the formats qbench names but the
       3-bit row's last): a loop without the tail tests, the same steps in the same order as the general one */
    const int64_t whole = g > 0 && g % 32 == 0 ? (vend / g < groups ? vend / g : groups) : 0;
    for (int64_t grp = 0; grp < whole; ++grp) {
        const float z = lowbit_zero(zr, zconst, grp), s = sr[grp];
        const __m256 svec = _mm256_set1_ps(s), table = _mm256_mul_ps(_mm256_sub_ps(iota, _mm256_set1_ps(z)), svec);
        const __m256i zv = _mm256_set1_epi32((int)z);
        for (int64_t c = grp * g; c < grp * g + g; c += 32) {
            lowbit_fma32(x, ldx, mb, wr, bits, c, table, svec, zv, sh0, sh1, acc);
        }
    }
    for (int64_t grp = whole; grp < groups; ++grp) {
        const float z = lowbit_zero(zr, zconst, grp), s = sr[grp];
        /* the table holds ŵ = (t − z) · s itself (fake mode's weights, bit for bit), so no group needs its own
           accumulators or a reduction: at g = 64 those cost as much as the products */
        const __m256 svec = _mm256_set1_ps(s), table = _mm256_mul_ps(_mm256_sub_ps(iota, _mm256_set1_ps(z)), svec);
        const __m256i zv = _mm256_set1_epi32((int)z);
        int64_t i0 = grp * g, i1 = i0 + g, c = i0;
        if (i0 % 8 == 0) { /* groups that start on a vector step (all but odd group sizes) */
            int64_t c1 = i1 < vend ? i1 : vend;
            for (; c + 32 <= c1; c += 32) {
                lowbit_fma32(x, ldx, mb, wr, bits, c, table, svec, zv, sh0, sh1, acc);
            }
            for (; c + 8 <= c1; c += 8) {
                __m256 f = lowbit8(wr, bits, c, table, zv);
                f = bits == 4 ? _mm256_mul_ps(f, svec) : f;
                for (int i = 0; i < mb; ++i) acc[i][0] = _mm256_fmadd_ps(f, _mm256_loadu_ps(x + i * ldx + c), acc[i][0]);
            }
        }
        for (int i = 0; i < mb && c < i1; ++i) extra[i] += lowbit_span(x + i * ldx, wr, bits, z, s, c, i1);
    }
    for (int i = 0; i < mb; ++i) {
        float lanes[8], t = 0.0f;
        __m256 a = _mm256_add_ps(_mm256_add_ps(acc[i][0], acc[i][1]), _mm256_add_ps(acc[i][2], acc[i][3]));
        _mm256_storeu_ps(lanes, a);
        for (int j = 0; j < 8; ++j) t += lanes[j];
        out[i] = t + extra[i];
    }
}

void qk_avx2_lowbit_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *w, int bits, const float *scale,
                           const uint8_t *zero, int zconst, int64_t groups, const float *bias, float *y,
                           int64_t n_out, int nthreads) {
    if (bits == 2) {
        LOWBIT_CHANNELS(lowbit_rows, 2);
    } else if (bits == 3) {
        LOWBIT_CHANNELS(lowbit_rows, 3);
    } else {
        LOWBIT_CHANNELS(lowbit_rows, 4);
    }
}

/* Ŵ[:, :k_out] = (u − z) · s, qk_lowbit_dequantize's operations (the table holds float(t) − z, then one multiply:
   bit for bit the scalar loop), eight weights per shift + permute + multiply; the prefill path's one pass over
   the codes (the scalar unpack took ~100 ms for 2048 × 8192, a quarter of a 512-row sgemm) */
void qk_avx2_lowbit_dequantize(const uint8_t *w, int bits, const float *scale, const uint8_t *zero, int zconst,
                               int64_t n_out, int64_t k, int64_t groups, int64_t k_out, float *out, int nthreads) {
    int64_t g = k / groups, ldw = lowbit_row_bytes(bits, k);
    int64_t vend = bits == 3 ? (ldw / 3 - 1) * 8 : k & ~(int64_t)7;
    vend = vend < k_out ? vend : k_out;
    const __m256 iota = bits == 2 ? _mm256_setr_ps(0, 1, 2, 3, 0, 1, 2, 3) : _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t n = 0; n < n_out; ++n) {
        const uint8_t *wr = w + n * ldw, *zr = zero ? zero + n * groups : NULL;
        float *o = out + n * k_out;
        for (int64_t grp = 0; grp < groups; ++grp) {
            const float s = scale[n * groups + grp], z = lowbit_zero(zr, zconst, grp);
            const __m256 table = _mm256_sub_ps(iota, _mm256_set1_ps(z)), svec = _mm256_set1_ps(s);
            const __m256i zv = _mm256_set1_epi32((int)z);
            int64_t i0 = grp * g, i1 = i0 + g < k_out ? i0 + g : k_out, c = i0;
            if (i0 % 8 == 0)
                for (int64_t c1 = i1 < vend ? i1 : vend; c + 8 <= c1; c += 8)
                    _mm256_storeu_ps(o + c, _mm256_mul_ps(lowbit8(wr, bits, c, table, zv), svec));
            for (; c < i1; ++c) o[c] = ((float)lowbit_code(wr, bits, c) - z) * s;
        }
    }
}

#endif
