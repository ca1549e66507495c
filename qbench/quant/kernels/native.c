/* qbench's real-kernel CPU routines, compiled on first use by native.py (see its docstring for the why).

   Layouts (all row-major, no padding; K need not be a multiple of anything: tails run scalar code):
     x   float32 (M, K) activations         q   int8 (M, K) activation codes, sx float32 (M,) their scales
     w8  int8 (N, K) weight codes           sw  float32 (N,) per output channel, or (1,) per tensor
     w4  uint8 (N, ceil(K/2)): code of k = 2j in the low nibble of byte j, k = 2j + 1 in the high nibble
     scale float32 (N, G), zero uint8 (N, G): one (scale, zero) per group of g = K / G input channels

   Exactness: integer dot products are exact (int32; |q| <= 127 keeps every int16 partial below 2^15);
   float arithmetic is IEEE float32 without contraction (-ffp-contract=off), in the order the torch reference
   uses wherever the result must equal it bit for bit (quantisation, epilogue, dequantisation). */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QK_AVX2 1
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define QK_VNNI 1
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

int qk_isa(void) { /* 2: AVX-512 VNNI int8 dot products, 1: AVX2 + FMA, 0: portable C */
#if defined(QK_VNNI)
    return 2;
#elif defined(QK_AVX2)
    return 1;
#else
    return 0;
#endif
}

int qk_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* ------------------------------------------------------------------------------ activation quantiser */

static float absmax_f32(const float *x, int64_t n) {
    float m = 0.0f;
    int64_t i = 0;
#ifdef QK_AVX2
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(acc, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i)));
    float lanes[8];
    _mm256_storeu_ps(lanes, acc);
    for (int j = 0; j < 8; ++j) m = lanes[j] > m ? lanes[j] : m;
#endif
    for (; i < n; ++i) {
        float a = fabsf(x[i]);
        m = a > m ? a : m;
    }
    return m;
}

static void quantize_row(const float *x, int64_t n, float s, int8_t *q) {
    int64_t i = 0;
#ifdef QK_AVX2
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
#endif
    for (; i < n; ++i) {
        float r = rintf(x[i] / s); /* round half to even, like torch.round */
        r = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r);
        q[i] = (int8_t)(r == r ? r : 0.0f);
    }
}

/* Per block of `rows_per_scale` consecutive rows (1: per token; T: per sequence):
   s = max(max|x| / 127, FLT_MIN), q = clamp(round(x / s), -127, 127) — int8.py's quantize_activation. */
void qk_quantize_rows(const float *x, int64_t rows, int64_t k, int64_t rows_per_scale, int8_t *q, float *sx) {
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_scale) {
        int64_t r1 = r0 + rows_per_scale < rows ? r0 + rows_per_scale : rows;
        float amax = 0.0f;
        for (int64_t r = r0; r < r1; ++r) {
            float a = absmax_f32(x + r * k, k);
            amax = a > amax ? a : amax;
        }
        float s = amax / 127.0f;
        s = s > FLT_MIN ? s : FLT_MIN;
        for (int64_t r = r0; r < r1; ++r) {
            sx[r] = s;
            quantize_row(x + r * k, k, s, q + r * k);
        }
    }
}

/* y = (acc * sx[m]) * sw[n] + bias[n]: int8.py's epilogue, same operation order. */
static inline float epilogue(int32_t acc, float sx, const float *sw, int per_channel, const float *bias,
                             int64_t n) {
    float y = ((float)acc * sx) * sw[per_channel ? n : 0];
    return bias ? y + bias[n] : y;
}

void qk_scale_output(const int32_t *acc, int64_t rows, int64_t n_out, const float *sx, const float *sw,
                     int per_channel, const float *bias, float *y, int nthreads) {
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
    for (int64_t m = 0; m < rows; ++m)
        for (int64_t n = 0; n < n_out; ++n)
            y[m * n_out + n] = epilogue(acc[m * n_out + n], sx[m], sw, per_channel, bias, n);
}

/* ------------------------------------------------------------------------------ int8 x int8 -> int32 */

static inline int32_t dot_tail_i8(const int8_t *a, const int8_t *b, int64_t from, int64_t k) {
    int32_t s = 0;
    for (int64_t i = from; i < k; ++i) s += (int32_t)a[i] * (int32_t)b[i];
    return s;
}

#define NB 4 /* weight rows per tile */

#if defined(QK_VNNI)
/* AVX-512 VNNI: dpbusd multiplies unsigned by signed bytes, so x + 128 (unsigned) goes in and 128 · Σ_k w[n, k]
   comes off afterwards (wsum). Tail bytes are masked to zero on both sides, so padding adds nothing. */
static void tile_i8(const int8_t *q, int64_t mb, const int8_t *w, int64_t nb, int64_t k, const int32_t *wsum,
                    int64_t ldq, int64_t ldw, int32_t out[2][NB]) {
    __m512i acc[2][NB];
    const __m512i off = _mm512_set1_epi8((char)0x80);
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_setzero_si512();
    for (int64_t c = 0; c < k; c += 64) {
        __mmask64 mask = k - c >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (k - c)) - 1);
        __m512i wv[NB];
        for (int j = 0; j < NB; ++j)
            wv[j] = j < nb ? _mm512_maskz_loadu_epi8(mask, w + j * ldw + c) : _mm512_setzero_si512();
        for (int i = 0; i < 2; ++i) {
            if (i >= mb) break;
            __m512i xv = _mm512_maskz_loadu_epi8(mask, q + i * ldq + c);
            __m512i u = _mm512_maskz_mov_epi8(mask, _mm512_xor_si512(xv, off)); /* x + 128, padding 0 */
            for (int j = 0; j < NB; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], u, wv[j]);
        }
    }
    for (int i = 0; i < 2 && i < mb; ++i)
        for (int j = 0; j < nb; ++j) out[i][j] = _mm512_reduce_add_epi32(acc[i][j]) - 128 * wsum[j];
}
#define MB 2
#elif defined(QK_AVX2)
/* AVX2: maddubs multiplies unsigned by signed bytes with int16 saturation, so |x| goes in as the unsigned
   operand and x's sign moves onto w (sign_epi8); |x|, |w| <= 127 keep each pair sum <= 32258 < 2^15: exact. */
static inline __m256i hsum4_epi32(__m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    __m256i t = _mm256_hadd_epi32(_mm256_hadd_epi32(a0, a1), _mm256_hadd_epi32(a2, a3));
    return _mm256_castsi128_si256(_mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1)));
}

static void tile_i8(const int8_t *q, int64_t mb, const int8_t *w, int64_t nb, int64_t k, const int32_t *wsum,
                    int64_t ldq, int64_t ldw, int32_t out[2][NB]) {
    (void)wsum;
    __m256i acc[2][NB];
    const __m256i ones = _mm256_set1_epi16(1);
    for (int i = 0; i < 2; ++i)
        for (int j = 0; j < NB; ++j) acc[i][j] = _mm256_setzero_si256();
    int64_t kv = k & ~(int64_t)31;
    const int8_t *wr[NB];
    for (int j = 0; j < NB; ++j) wr[j] = w + (j < nb ? j : 0) * ldw; /* missing rows repeat row 0, unused */
    if (mb == 2) {
        for (int64_t c = 0; c < kv; c += 32) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(q + c));
            __m256i x1 = _mm256_loadu_si256((const __m256i *)(q + ldq + c));
            __m256i a0 = _mm256_abs_epi8(x0), a1 = _mm256_abs_epi8(x1);
            for (int j = 0; j < NB; ++j) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(wr[j] + c));
                acc[0][j] = _mm256_add_epi32(
                    acc[0][j], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(wv, x0)), ones));
                acc[1][j] = _mm256_add_epi32(
                    acc[1][j], _mm256_madd_epi16(_mm256_maddubs_epi16(a1, _mm256_sign_epi8(wv, x1)), ones));
            }
        }
    } else {
        for (int64_t c = 0; c < kv; c += 32) {
            __m256i x0 = _mm256_loadu_si256((const __m256i *)(q + c));
            __m256i a0 = _mm256_abs_epi8(x0);
            if ((c & 63) == 0) /* one row read at a time per tile: help the prefetcher with 4 streams */
                for (int j = 0; j < NB; ++j) _mm_prefetch((const char *)(wr[j] + c + 1024), _MM_HINT_T0);
            for (int j = 0; j < NB; ++j) {
                __m256i wv = _mm256_loadu_si256((const __m256i *)(wr[j] + c));
                acc[0][j] = _mm256_add_epi32(
                    acc[0][j], _mm256_madd_epi16(_mm256_maddubs_epi16(a0, _mm256_sign_epi8(wv, x0)), ones));
            }
        }
    }
    for (int i = 0; i < 2 && i < mb; ++i) {
        int32_t r[8];
        _mm256_storeu_si256((__m256i *)r, hsum4_epi32(acc[i][0], acc[i][1], acc[i][2], acc[i][3]));
        for (int j = 0; j < nb; ++j) out[i][j] = r[j] + dot_tail_i8(q + i * ldq, wr[j], kv, k);
    }
}
#define MB 2
#else
static void tile_i8(const int8_t *q, int64_t mb, const int8_t *w, int64_t nb, int64_t k, const int32_t *wsum,
                    int64_t ldq, int64_t ldw, int32_t out[2][NB]) {
    (void)wsum;
    for (int i = 0; i < 2 && i < mb; ++i)
        for (int j = 0; j < nb; ++j) out[i][j] = dot_tail_i8(q + i * ldq, w + j * ldw, 0, k);
}
#define MB 2
#endif

#define M_BLOCK 64 /* activation rows kept in cache while all weight rows stream past */

/* y (M, N) float32 = epilogue(q (M, K) · w (N, K)ᵀ): the W8A8 linear in one call (rows split over threads by
   output channel). wsum (N,) = Σ_k w[n, k] is read only by the VNNI path (may be NULL otherwise). */
void qk_w8a8_linear(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w, const int32_t *wsum,
                    const float *sw, int per_channel, const float *bias, float *y, int64_t n_out, int64_t k,
                    int nthreads) {
    int64_t n_tiles = (n_out + NB - 1) / NB;
    for (int64_t m0 = 0; m0 < m_rows; m0 += M_BLOCK) {
        int64_t m1 = m0 + M_BLOCK < m_rows ? m0 + M_BLOCK : m_rows;
#pragma omp parallel for num_threads(nthreads) if (nthreads > 1) schedule(static)
        for (int64_t t = 0; t < n_tiles; ++t) {
            int64_t n = t * NB, nb = n_out - n < NB ? n_out - n : NB;
            for (int64_t m = m0; m < m1; m += MB) {
                int64_t mb = m1 - m < MB ? m1 - m : MB;
                int32_t acc[2][NB];
                tile_i8(q + m * k, mb, w + n * k, nb, k, wsum ? wsum + n : NULL, k, k, acc);
                for (int i = 0; i < mb; ++i)
                    for (int j = 0; j < nb; ++j)
                        y[(m + i) * n_out + n + j] = epilogue(acc[i][j], sx[m + i], sw, per_channel, bias, n + j);
            }
        }
    }
}

/* ------------------------------------------------------------------------ weight-only, float32 input */

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

static inline float code_at(const uint8_t *wr, int bits4, int signed_codes, int64_t i) {
    if (bits4) return (float)((wr[i >> 1] >> ((i & 1) * 4)) & 15);
    return signed_codes ? (float)(int8_t)wr[i] : (float)wr[i];
}

/* scalar reference for one (row m, output n), channels [from, k): Σ_g s_g Σ_k (q − z_g) x */
static float wo_tail(const float *x, const uint8_t *wr, int bits4, int signed_codes, const float *sr,
                     const uint8_t *zr, int64_t g, int64_t from, int64_t k) {
    float total = 0.0f;
    for (int64_t i = from; i < k; ++i) {
        float z = zr ? (float)zr[i / g] : 0.0f;
        total += (code_at(wr, bits4, signed_codes, i) - z) * sr[i / g] * x[i];
    }
    return total;
}

#ifdef QK_AVX2
/* int4: 32 bytes = 64 codes per step. Nibbles are turned into float32 without any int→float conversion: a
   float holding an integer in [−15, 15] has zero low 16 bits, so two byte shuffles (pshufb through a 16-entry
   table of the top two bytes of float(v − z)) and three unpacks build 8 floats. The unpacks reorder channels:
   output vector i of the low (high) nibbles holds bytes j = 4i..4i+3 and 16+4i..16+4i+3, i.e. channels 2j
   (2j + 1). qk_w4_permute_x applies that order to x once per call, so each product pairs the right channel.
   Group sizes: any multiple of 64 (one group per step), 32 (lane 0 and lane 1 of a step are two groups), or
   one group per row (any K); channels past the last full step run the scalar tail. */
#endif

/* xp (M, K64) = x with each 64-channel step reordered as the int4 kernel consumes it (see above). */
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

#ifdef QK_AVX2
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
#endif

/* y (M, N) = x (M, K) · Ŵᵀ + bias with Ŵ = (q − z) · s from int4 (bits4) or int8 codes, without building Ŵ.
   xp: qk_w4_permute_x(x) for int4 (ignored for int8). Returns 0 when this build or group size has no fast
   loop (the caller then dequantises); the float sums are reassociated, so results equal fake mode to float
   rounding, not bit for bit. */
int qk_weight_only_linear(const float *x, const float *xp, int64_t m_rows, const uint8_t *w, int bits4,
                          int signed_codes, const float *scale, const uint8_t *zero, int64_t groups,
                          const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
#ifdef QK_AVX2
    int64_t g = k / groups;
    int64_t kv = k & ~(int64_t)63;
    if (bits4 && !(groups == 1 || g % 64 == 0 || g == 32)) return 0;
    int64_t ldw = bits4 ? (k + 1) / 2 : k;
    init_tables();
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
    return 1;
#else
    (void)x, (void)xp, (void)m_rows, (void)w, (void)bits4, (void)signed_codes, (void)scale, (void)zero;
    (void)groups, (void)bias, (void)y, (void)n_out, (void)k, (void)nthreads;
    return 0;
#endif
}
