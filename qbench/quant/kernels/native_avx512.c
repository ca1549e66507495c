/* The AVX-512 VNNI loops of native.h: native.c calls them instead of the AVX2 ones where the build targets
   AVX-512 VNNI (-march=native on such a CPU). Integer sums equal native_ref.c's exactly and the float epilogue
   runs in the same operations and order, so results are bit-identical to both other builds. */
#include "native.h"

#ifdef QK_AVX512VNNI
#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ------------------------------------------------------------------------ W4A8 prefill, int8 dot products

   The AVX2 GEMM multiplies int16 pairs (madd_epi16: 16 products per instruction); VNNI's vpdpbusd multiplies
   unsigned by signed bytes, four per int32 lane, 64 per instruction, and adds them exactly into int32. The
   nibble itself (c + 8, 0–15) is the unsigned operand and the activation code the signed one, so
   Σ c·q = Σ (c + 8)·q − 8·Σ q with Σ q per row and group computed once per call (W4A8's decode trick).
   Per group of weights the whole integer tile is finished before its scale is applied, as in the reference, so
   per-group W4A8 keeps exact integer group sums at VNNI's rate — what one torch._int_mm per group cannot
   (32- to 128-wide GEMMs run at a fraction of oneDNN's speed).
   Panel: 64 output channels × one group, int32 element (s, j) = the four nibbles of channel j at k = 4s…4s+3;
   a tile of MR rows × 64 channels (4 zmm) stays in registers over the group. */
#define V_MR 6
#define V_NC 64

/* Nibbles of 4 channels × 8 steps (16 bytes a channel) into the panel: each channel's 32 codes split into bytes
   in code order (two xmm of 4 steps), then 4 × 4 transposes of int32 (step-major), 16 bytes stored per step. */
static inline void vnni_pack_4x8(const uint8_t *const wr[4], int64_t byte0, uint32_t *dst) {
    const __m128i low = _mm_set1_epi8(0x0F);
    __m128i v[2][4];
    for (int c = 0; c < 4; ++c) {
        __m128i b = _mm_loadu_si128((const __m128i *)(wr[c] + byte0));
        __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        v[0][c] = _mm_unpacklo_epi8(lo, hi); /* steps 0–3 */
        v[1][c] = _mm_unpackhi_epi8(lo, hi); /* steps 4–7 */
    }
    for (int h = 0; h < 2; ++h) {
        __m128i t0 = _mm_unpacklo_epi32(v[h][0], v[h][1]), t1 = _mm_unpacklo_epi32(v[h][2], v[h][3]);
        __m128i t2 = _mm_unpackhi_epi32(v[h][0], v[h][1]), t3 = _mm_unpackhi_epi32(v[h][2], v[h][3]);
        _mm_storeu_si128((__m128i *)(dst + (4 * h + 0) * V_NC), _mm_unpacklo_epi64(t0, t1));
        _mm_storeu_si128((__m128i *)(dst + (4 * h + 1) * V_NC), _mm_unpackhi_epi64(t0, t1));
        _mm_storeu_si128((__m128i *)(dst + (4 * h + 2) * V_NC), _mm_unpacklo_epi64(t2, t3));
        _mm_storeu_si128((__m128i *)(dst + (4 * h + 3) * V_NC), _mm_unpackhi_epi64(t2, t3));
    }
}

/* the panel of channels n0 … n0 + 63 for channels [k0, k1) (k1 − k0 a multiple of 4; zero past N or K). Unpacked
   on every call from the shared int4 layout (a second, int8 copy would double the bytes W4A8 exists to halve):
   the vector path does it in ~1/15 of the GEMM's time at 512 rows. */
static void vnni_pack(const uint8_t *w, int64_t n_out, int64_t k, int64_t n0, int64_t k0, int64_t k1,
                      uint32_t *panel) {
    int64_t ldw = (k + 1) / 2, steps = (k1 - k0) / 4;
    /* whole blocks: 4 channels inside N, 8 steps (32 codes) inside K, k0 even (whole bytes) */
    int64_t vec_steps = (k0 % 2 == 0) ? (k1 <= k ? steps : (k - k0) / 4) / 8 * 8 : 0;
    int64_t j = 0;
    for (; j + 4 <= V_NC && n0 + j + 4 <= n_out && vec_steps > 0; j += 4) {
        const uint8_t *wr[4] = {w + (n0 + j) * ldw, w + (n0 + j + 1) * ldw, w + (n0 + j + 2) * ldw,
                                w + (n0 + j + 3) * ldw};
        for (int64_t s = 0; s < vec_steps; s += 8) vnni_pack_4x8(wr, (k0 + 4 * s) / 2, panel + s * V_NC + j);
    }
    for (int64_t jj = 0; jj < V_NC; ++jj) {
        int64_t n = n0 + jj, s = jj < j ? vec_steps : 0;
        const uint8_t *wr = w + n * ldw;
        for (; s < steps; ++s) {
            uint32_t v = 0;
            for (int e = 0; e < 4 && n < n_out; ++e) {
                int64_t i = k0 + 4 * s + e;
                uint32_t nib = i < k ? (uint32_t)((wr[i >> 1] >> ((i & 1) * 4)) & 15) : 0;
                v |= nib << (8 * e);
            }
            panel[s * V_NC + jj] = v;
        }
    }
}

static inline __attribute__((always_inline)) void vnni_tile(const int8_t *a, int64_t lda, const int mr,
                                                             const uint32_t *panel, int64_t steps,
                                                             int32_t out[V_MR][V_NC]) {
    __m512i acc[V_MR][4];
    for (int i = 0; i < V_MR; ++i)
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_si512();
    for (int64_t s = 0; s < steps; ++s) {
        __m512i b[4];
        for (int v = 0; v < 4; ++v) b[v] = _mm512_loadu_si512((const void *)(panel + s * V_NC + 16 * v));
        for (int i = 0; i < mr; ++i) {
            int32_t four;
            memcpy(&four, a + i * lda + 4 * s, 4);
            __m512i x = _mm512_set1_epi32(four);
            for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], b[v], x);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int v = 0; v < 4; ++v) _mm512_storeu_si512((void *)(out[i] + 16 * v), acc[i][v]);
}

/* Per group (groups > 1): VG_ROWS rows × 64 channels over every group of K. The integer tile of one group (12
   registers) starts at the correction −8·Σq of its row and group instead of zero (integer sums are exact in any
   order; it saves a subtraction per group), then is converted and folded into float accumulators t (12 more
   registers) in the reference's order, t += s_g · A_g group by group from 0, so results stay bit-identical;
   y = t · s_x + b at the end. Why this shape: the fold (convert, multiply, add per output and group) is the cost
   one int8 GEMM does not pay — at g = 32 one fold per 8 vpdpbusd — so t must not go through memory: a 6-row
   tile with t in an L1 stack tile ran 14–17 ms at 512 × 1024 → 4096 (g = 32), this one 13–14 ms. Named
   registers and the empty asm statements pin the tile in registers: GCC 12 otherwise kept both arrays in
   memory and reloaded them every step (the previous loop ran at 60 % of this one). The caller pads the rows to
   a multiple of VG_ROWS (zero codes) and only the first `mr` are stored. sct: the panel's scales group-major
   (sct[grp · 64 + j]). */
#define VG_ROWS 3
#define VG_INIT(i)                                                                                                 \
    const __m512i k##i = _mm512_set1_epi32(-8 * xs[(i) * groups + grp]);                                           \
    __m512i c##i##0 = k##i, c##i##1 = k##i, c##i##2 = k##i, c##i##3 = k##i;
#define VG_DOT(i)                                                                                                  \
    {                                                                                                              \
        int32_t four;                                                                                              \
        memcpy(&four, ag + (i) * lda + 4 * s, 4);                                                                  \
        const __m512i x = _mm512_set1_epi32(four);                                                                 \
        c##i##0 = _mm512_dpbusd_epi32(c##i##0, b0, x);                                                             \
        c##i##1 = _mm512_dpbusd_epi32(c##i##1, b1, x);                                                             \
        c##i##2 = _mm512_dpbusd_epi32(c##i##2, b2, x);                                                             \
        c##i##3 = _mm512_dpbusd_epi32(c##i##3, b3, x);                                                             \
    }
#define VG_FOLD1(i, v) t##i##v = _mm512_add_ps(t##i##v, _mm512_mul_ps(s##v, _mm512_cvtepi32_ps(c##i##v)));
#define VG_FOLD(v) { const __m512 s##v = _mm512_loadu_ps(sct + grp * V_NC + 16 * (v)); VG_FOLD1(0, v) VG_FOLD1(1, v) VG_FOLD1(2, v) }
#define VG_KEEP(i) "+v"(c##i##0), "+v"(c##i##1), "+v"(c##i##2), "+v"(c##i##3)
#define VG_KEEPT(i) "+v"(t##i##0), "+v"(t##i##1), "+v"(t##i##2), "+v"(t##i##3)
#define VG_T(i) __m512 t##i##0 = _mm512_setzero_ps(), t##i##1 = t##i##0, t##i##2 = t##i##0, t##i##3 = t##i##0;
#define VG_OUT(i) _mm512_store_ps(t[i], t##i##0); _mm512_store_ps(t[i] + 16, t##i##1); _mm512_store_ps(t[i] + 32, t##i##2); _mm512_store_ps(t[i] + 48, t##i##3);

static void vnni_group_rows(const int8_t *a, int64_t lda, int64_t mr, const uint32_t *panel, int64_t groups,
                            int64_t gsteps, const int32_t *xs, const float *sct, const float *sx, const float *bias,
                            int64_t n0, int64_t nc, float *y, int64_t ldy) {
    float t[VG_ROWS][V_NC] __attribute__((aligned(64)));
    VG_T(0) VG_T(1) VG_T(2)
    for (int64_t grp = 0; grp < groups; ++grp) {
        VG_INIT(0) VG_INIT(1) VG_INIT(2)
        const uint32_t *pg = panel + grp * gsteps * V_NC;
        const int8_t *ag = a + grp * gsteps * 4;
#pragma GCC unroll 8
        for (int64_t s = 0; s < gsteps; ++s) {
            const __m512i b0 = _mm512_load_si512((const void *)(pg + s * V_NC)),
                          b1 = _mm512_load_si512((const void *)(pg + s * V_NC + 16)),
                          b2 = _mm512_load_si512((const void *)(pg + s * V_NC + 32)),
                          b3 = _mm512_load_si512((const void *)(pg + s * V_NC + 48));
            VG_DOT(0) VG_DOT(1) VG_DOT(2)
        }
        __asm__("" : VG_KEEP(0), VG_KEEP(1), VG_KEEP(2));
        VG_FOLD(0) VG_FOLD(1) VG_FOLD(2) VG_FOLD(3)
        __asm__("" : VG_KEEPT(0), VG_KEEPT(1), VG_KEEPT(2));
    }
    VG_OUT(0) VG_OUT(1) VG_OUT(2)
    __mmask16 tail[4];
    for (int v = 0; v < 4; ++v) {
        int64_t left = nc - 16 * v;
        tail[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    }
    for (int64_t i = 0; i < mr; ++i) {
        const __m512 s = _mm512_set1_ps(sx[i]);
        for (int v = 0; v < 4; ++v) {
            __m512 o = _mm512_mul_ps(_mm512_load_ps(t[i] + 16 * v), s);
            if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(tail[v], bias + n0 + 16 * v));
            _mm512_mask_storeu_ps(y + i * ldy + n0 + 16 * v, tail[v], o);
        }
    }
}

void qk_avx512_w4a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w, const float *scale,
                         int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t g = k / groups, k4 = (k + 3) & ~(int64_t)3; /* g: K, 32 or 64·n (then K = groups · g, × 32) */
    int64_t n_panels = (n_out + V_NC - 1) / V_NC;
    int64_t m_pad = (m_rows + VG_ROWS - 1) / VG_ROWS * VG_ROWS; /* zero rows complete the last row tile */
    int8_t *a = malloc((size_t)(m_pad * k4));
    int32_t *xs = malloc((size_t)(m_pad * groups) * sizeof(int32_t)); /* Σ q per row and group */
    memset(a + m_rows * k4, 0, (size_t)((m_pad - m_rows) * k4));
    memset(xs + m_rows * groups, 0, (size_t)((m_pad - m_rows) * groups) * sizeof(int32_t));
    for (int64_t m = 0; m < m_rows; ++m) {
        memcpy(a + m * k4, q + m * k, (size_t)k);
        memset(a + m * k4 + k, 0, (size_t)(k4 - k));
        for (int64_t grp = 0; grp < groups; ++grp) {
            int32_t t = 0;
            for (int64_t i = grp * g; i < grp * g + g; ++i) t += q[m * k + i];
            xs[m * groups + grp] = t;
        }
    }
    if (groups > 1) {
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            uint32_t *panel = aligned_alloc(64, (size_t)(k / 4) * V_NC * sizeof(uint32_t));
            float *sct = malloc((size_t)(groups * V_NC) * sizeof(float));
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < n_panels; ++t) {
                int64_t n0 = t * V_NC, nc = n_out - n0 < V_NC ? n_out - n0 : V_NC;
                vnni_pack(w, n_out, k, n0, 0, k, panel); /* k = groups · g, a multiple of 32 */
                for (int64_t grp = 0; grp < groups; ++grp)
                    for (int64_t j = 0; j < V_NC; ++j) sct[grp * V_NC + j] = j < nc ? scale[(n0 + j) * groups + grp] : 0.0f;
                for (int64_t m = 0; m < m_rows; m += VG_ROWS)
                    vnni_group_rows(a + m * k4, k4, m_rows - m < VG_ROWS ? m_rows - m : VG_ROWS, panel, groups,
                                    g / 4, xs + m * groups, sct, sx + m, bias, n0, nc, y + m * n_out, n_out);
            }
            free(panel);
            free(sct);
        }
    } else { /* per output channel: one integer tile over all of K, then W8A8's epilogue, (acc · s_x) · s_n + b */
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
        {
            uint32_t *panel = aligned_alloc(64, (size_t)(k4 / 4) * V_NC * sizeof(uint32_t));
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < n_panels; ++t) {
                int64_t n0 = t * V_NC, nc = n_out - n0 < V_NC ? n_out - n0 : V_NC, steps = k4 / 4;
                vnni_pack(w, n_out, k, n0, 0, k4, panel);
                for (int64_t m = 0; m < m_rows; m += V_MR) {
                    int32_t acc[V_MR][V_NC];
                    int64_t mr = m_rows - m < V_MR ? m_rows - m : V_MR;
                    const int8_t *am = a + m * k4;
                    switch (mr) {
                    case 1: vnni_tile(am, k4, 1, panel, steps, acc); break;
                    case 2: vnni_tile(am, k4, 2, panel, steps, acc); break;
                    case 3: vnni_tile(am, k4, 3, panel, steps, acc); break;
                    case 4: vnni_tile(am, k4, 4, panel, steps, acc); break;
                    case 5: vnni_tile(am, k4, 5, panel, steps, acc); break;
                    default: vnni_tile(am, k4, 6, panel, steps, acc); break;
                    }
                    for (int64_t i = 0; i < mr; ++i) {
                        const int32_t corr = 8 * xs[m + i];
                        for (int64_t j = 0; j < nc; ++j)
                            y[(m + i) * n_out + n0 + j] = epilogue(acc[i][j] - corr, sx[m + i], scale, 1, bias, n0 + j);
                    }
                }
            }
            free(panel);
        }
    }
    free(a);
    free(xs);
}

#endif
