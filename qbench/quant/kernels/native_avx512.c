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

/* the panel of channels n0 … n0 + 63 for channels [k0, k1) (k1 − k0 a multiple of 4; zero past N or K) */
static void vnni_pack(const uint8_t *w, int64_t n_out, int64_t k, int64_t n0, int64_t k0, int64_t k1,
                      uint32_t *panel) {
    int64_t ldw = (k + 1) / 2, steps = (k1 - k0) / 4;
    for (int64_t j = 0; j < V_NC; ++j) {
        int64_t n = n0 + j, s = 0;
        if (n >= n_out) {
            for (; s < steps; ++s) panel[s * V_NC + j] = 0;
            continue;
        }
        const uint8_t *wr = w + n * ldw;
        /* 16 codes (8 bytes) at a time: nibbles split and interleaved into code order, 4 codes per int32 */
        for (; s + 4 <= steps && k0 + 4 * s + 16 <= k; s += 4) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(wr + (k0 + 4 * s) / 2));
            __m128i lo = _mm_and_si128(b, _mm_set1_epi8(0x0F)), hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F));
            uint32_t c4[4];
            _mm_storeu_si128((__m128i *)c4, _mm_unpacklo_epi8(lo, hi));
            for (int e = 0; e < 4; ++e) panel[(s + e) * V_NC + j] = c4[e];
        }
        for (; s < steps; ++s) {
            uint32_t v = 0;
            for (int e = 0; e < 4; ++e) {
                int64_t i = k0 + 4 * s + e;
                uint32_t nib = i < k ? (uint32_t)((wr[i >> 1] >> ((i & 1) * 4)) & 15) : 0;
                v |= nib << (8 * e);
            }
            panel[s * V_NC + j] = v;
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

/* Per group (groups > 1): V_GR rows × 64 channels over every group of K, the integer tile of one group in
   registers, then corrected (− 8·Σ q), converted and folded into float accumulators that also stay in registers
   (t += s_g · A_g, the reference's order) — a fold through memory per group cost as much as the products at
   g = 32. sct: the panel's scales group-major (sct[grp · 64 + j]); y = t · s_x + b at the end. */
#define V_GR 3

static inline __attribute__((always_inline)) void vnni_group_rows(const int8_t *a, int64_t lda, const int mr,
                                                                   const uint32_t *panel, int64_t groups,
                                                                   int64_t gsteps, const int32_t *xs,
                                                                   const float *sct, const float *sx,
                                                                   const float *bias, int64_t n0, int64_t nc,
                                                                   float *y, int64_t ldy) {
    __m512 t[V_GR][4];
    for (int i = 0; i < V_GR; ++i)
        for (int v = 0; v < 4; ++v) t[i][v] = _mm512_setzero_ps();
    for (int64_t grp = 0; grp < groups; ++grp) {
        __m512i acc[V_GR][4];
        for (int i = 0; i < V_GR; ++i)
            for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_si512();
        const uint32_t *pg = panel + grp * gsteps * V_NC;
        const int8_t *ag = a + grp * gsteps * 4;
        for (int64_t s = 0; s < gsteps; ++s) {
            __m512i b[4];
            for (int v = 0; v < 4; ++v) b[v] = _mm512_loadu_si512((const void *)(pg + s * V_NC + 16 * v));
            for (int i = 0; i < mr; ++i) {
                int32_t four;
                memcpy(&four, ag + i * lda + 4 * s, 4);
                __m512i x = _mm512_set1_epi32(four);
                for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], b[v], x);
            }
        }
        for (int i = 0; i < mr; ++i) {
            const __m512i corr = _mm512_set1_epi32(8 * xs[i * groups + grp]);
            for (int v = 0; v < 4; ++v) {
                __m512 p = _mm512_mul_ps(_mm512_loadu_ps(sct + grp * V_NC + 16 * v),
                                         _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][v], corr)));
                t[i][v] = _mm512_add_ps(t[i][v], p);
            }
        }
    }
    for (int i = 0; i < mr; ++i) {
        float out[V_NC];
        const __m512 s = _mm512_set1_ps(sx[i]);
        for (int v = 0; v < 4; ++v) _mm512_storeu_ps(out + 16 * v, _mm512_mul_ps(t[i][v], s));
        for (int64_t j = 0; j < nc; ++j) y[i * ldy + n0 + j] = bias ? out[j] + bias[n0 + j] : out[j];
    }
}

void qk_avx512_w4a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w, const float *scale,
                         int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t g = k / groups, k4 = (k + 3) & ~(int64_t)3, gs = groups == 1 ? k4 : g; /* g: 32 or 64·n (× 4) */
    int64_t n_panels = (n_out + V_NC - 1) / V_NC;
    int8_t *a = malloc((size_t)(m_rows * k4));
    int32_t *xs = malloc((size_t)(m_rows * groups) * sizeof(int32_t)); /* Σ q per row and group */
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
                for (int64_t m = 0; m < m_rows; m += V_GR) {
                    int64_t mr = m_rows - m < V_GR ? m_rows - m : V_GR;
                    const int8_t *am = a + m * k4;
                    const int32_t *xm = xs + m * groups;
                    float *ym = y + m * n_out;
                    switch (mr) {
                    case 1: vnni_group_rows(am, k4, 1, panel, groups, g / 4, xm, sct, sx + m, bias, n0, nc, ym, n_out); break;
                    case 2: vnni_group_rows(am, k4, 2, panel, groups, g / 4, xm, sct, sx + m, bias, n0, nc, ym, n_out); break;
                    default: vnni_group_rows(am, k4, 3, panel, groups, g / 4, xm, sct, sx + m, bias, n0, nc, ym, n_out); break;
                    }
                }
            }
            free(panel);
            free(sct);
        }
        free(a);
        free(xs);
        return;
    }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        uint32_t *panel = aligned_alloc(64, (size_t)(gs / 4) * V_NC * sizeof(uint32_t));
        float *facc = groups > 1 ? malloc((size_t)(m_rows * V_NC) * sizeof(float)) : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_panels; ++t) {
            int64_t n0 = t * V_NC, nc = n_out - n0 < V_NC ? n_out - n0 : V_NC;
            if (facc) memset(facc, 0, (size_t)(m_rows * V_NC) * sizeof(float));
            for (int64_t grp = 0; grp < groups; ++grp) {
                int64_t k0 = grp * gs, steps = gs / 4;
                vnni_pack(w, n_out, k, n0, k0, k0 + gs, panel);
                float sg[V_NC];
                for (int64_t j = 0; j < V_NC; ++j) sg[j] = j < nc ? scale[(n0 + j) * groups + grp] : 0.0f;
                for (int64_t m = 0; m < m_rows; m += V_MR) {
                    int32_t acc[V_MR][V_NC];
                    int64_t mr = m_rows - m < V_MR ? m_rows - m : V_MR;
                    const int8_t *am = a + m * k4 + k0;
                    switch (mr) {
                    case 1: vnni_tile(am, k4, 1, panel, steps, acc); break;
                    case 2: vnni_tile(am, k4, 2, panel, steps, acc); break;
                    case 3: vnni_tile(am, k4, 3, panel, steps, acc); break;
                    case 4: vnni_tile(am, k4, 4, panel, steps, acc); break;
                    case 5: vnni_tile(am, k4, 5, panel, steps, acc); break;
                    default: vnni_tile(am, k4, 6, panel, steps, acc); break;
                    }
                    for (int64_t i = 0; i < mr; ++i) {
                        const __m512i corr = _mm512_set1_epi32(8 * xs[(m + i) * groups + grp]);
                        for (int v = 0; v < 4; ++v) {
                            __m512i s = _mm512_sub_epi32(_mm512_loadu_si512((const void *)(acc[i] + 16 * v)), corr);
                            _mm512_storeu_si512((void *)(acc[i] + 16 * v), s);
                        }
                        if (facc) { /* the reference's order: t += s_g · A_g, group by group */
                            float *fr = facc + (m + i) * V_NC;
                            for (int v = 0; v < 4; ++v) {
                                __m512 p = _mm512_mul_ps(_mm512_loadu_ps(sg + 16 * v),
                                                         _mm512_cvtepi32_ps(_mm512_loadu_si512((const void *)(acc[i] + 16 * v))));
                                _mm512_storeu_ps(fr + 16 * v, _mm512_add_ps(_mm512_loadu_ps(fr + 16 * v), p));
                            }
                        } else { /* per channel: W8A8's epilogue, (acc · s_x) · s_n + b */
                            for (int64_t j = 0; j < nc; ++j)
                                y[(m + i) * n_out + n0 + j] = epilogue(acc[i][j], sx[m + i], scale, 1, bias, n0 + j);
                        }
                    }
                }
            }
            if (facc)
                for (int64_t m = 0; m < m_rows; ++m)
                    for (int64_t j = 0; j < nc; ++j) {
                        float v = facc[m * V_NC + j] * sx[m];
                        y[m * n_out + n0 + j] = bias ? v + bias[n0 + j] : v;
                    }
        }
        free(panel);
        free(facc);
    }
    free(a);
    free(xs);
}

#endif
