/* The AVX-512 loops of native.h: native.c calls them instead of the AVX2 ones where the build targets
   AVX-512 VNNI (-march=native on such a CPU). The W4A8/W8A8 GEMMs' and the W4A8 GEMV's integer sums equal
   native_ref.c's exactly and the float epilogue runs in the same operations and order, so results are
   bit-identical to the portable build (and to the AVX2 build, except its g = 32 decode loop); the packed
   2/3-bit GEMV adds its products in the AVX2 loop's lanes and order, so it is bit-identical to that loop. */
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
   Panel: 64 output channels × all of K, int32 element (s, j) = the four nibbles of channel j at k = 4s…4s+3;
   per channel a tile of V_MR rows × 64 channels (24 zmm) stays in registers over all of K; per group see
   vnni_group_rows. */
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

/* The channels of the panel at n0 that the packers' vector blocks cover: whole blocks of 4 inside N. The packers
   run step-major — for each block of steps, every channel block — so each 64-byte line of a panel row is written
   whole while the weight rows' lines stay in L1 across steps; channel-major, each line was written in four
   16-byte pieces at four different times (the W8A8 GEMM at 512 × 1024 → 4096 gained 2–3 %: 0.94 → 0.97 of
   torch._int_mm, AMD Zen 4). */
static inline int64_t blocked_channels(int64_t n_out, int64_t n0) {
    int64_t left = n_out - n0 < V_NC ? n_out - n0 : V_NC;
    return left / 4 * 4;
}

/* the panel of channels n0 … n0 + 63 for channels [k0, k1) (k1 − k0 a multiple of 4; zero past N or K). Unpacked
   on every call from the shared int4 layout (a second, int8 copy would double the bytes W4A8 exists to halve):
   the vector path does it in ~1/15 of the GEMM's time at 512 rows. */
static void vnni_pack(const uint8_t *w, int64_t n_out, int64_t k, int64_t n0, int64_t k0, int64_t k1,
                      uint32_t *panel) {
    int64_t ldw = (k + 1) / 2, steps = (k1 - k0) / 4;
    /* whole blocks: 4 channels inside N, 8 steps (32 codes) inside K, k0 even (whole bytes) */
    int64_t vec_steps = (k0 % 2 == 0) ? (k1 <= k ? steps : (k - k0) / 4) / 8 * 8 : 0;
    int64_t j = vec_steps > 0 ? blocked_channels(n_out, n0) : 0;
    for (int64_t s = 0; s < vec_steps; s += 8) /* step-major, as vnni_pack_i8 */
        for (int64_t jb = 0; jb < j; jb += 4) {
            const uint8_t *wr[4] = {w + (n0 + jb) * ldw, w + (n0 + jb + 1) * ldw, w + (n0 + jb + 2) * ldw,
                                    w + (n0 + jb + 3) * ldw};
            vnni_pack_4x8(wr, (k0 + 4 * s) / 2, panel + s * V_NC + jb);
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

/* The activation codes in row tiles (the GEMM's A packing): ap[(tile · steps + s) · rows + i] = the four codes of
   row tile · rows + i at k = 4s … 4s + 3, zero past M and K, so a tile's broadcasts at step s read one contiguous
   run (with rows in separate streams the addresses of six rows took six registers and GCC spilled a pointer in
   the inner loop); xs[m · groups + grp] = Σ q of row m over group grp (zero past M), the correction's operand. */
static void vnni_pack_rows(const int8_t *q, int64_t m_rows, int64_t k, int64_t groups, int64_t rows, int32_t *ap,
                           int32_t *xs) {
    int64_t steps = (k + 3) / 4, tiles = (m_rows + rows - 1) / rows, g = k / groups;
    for (int64_t t = 0; t < tiles; ++t)
        for (int64_t i = 0; i < rows; ++i) {
            int64_t m = t * rows + i;
            int32_t *dst = ap + t * steps * rows + i;
            if (m >= m_rows) {
                for (int64_t s = 0; s < steps; ++s) dst[s * rows] = 0;
                for (int64_t grp = 0; grp < groups; ++grp) xs[m * groups + grp] = 0;
                continue;
            }
            const int8_t *qr = q + m * k;
            int64_t s = 0;
            for (; 4 * s + 4 <= k; ++s) memcpy(dst + s * rows, qr + 4 * s, 4);
            if (s < steps) {
                int8_t four[4] = {0, 0, 0, 0};
                memcpy(four, qr + 4 * s, (size_t)(k - 4 * s));
                memcpy(dst + s * rows, four, 4);
            }
            for (int64_t grp = 0; grp < groups; ++grp) {
                int32_t sum = 0;
                for (int64_t c = grp * g; c < grp * g + g; ++c) sum += qr[c];
                xs[m * groups + grp] = sum;
            }
        }
}

/* One V_MR × 64 integer tile over `steps` steps of packed rows (vnni_pack_rows with rows = V_MR) */
static inline void vnni_tile(const int32_t *ap, const uint32_t *panel, int64_t steps, int32_t out[V_MR][V_NC]) {
    __m512i acc[V_MR][4];
    for (int i = 0; i < V_MR; ++i)
        for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_setzero_si512();
    for (int64_t s = 0; s < steps; ++s) {
        __m512i b[4];
        for (int v = 0; v < 4; ++v) b[v] = _mm512_load_si512((const void *)(panel + s * V_NC + 16 * v));
        for (int i = 0; i < V_MR; ++i) {
            __m512i x = _mm512_set1_epi32(ap[s * V_MR + i]);
            for (int v = 0; v < 4; ++v) acc[i][v] = _mm512_dpbusd_epi32(acc[i][v], b[v], x);
        }
    }
    for (int i = 0; i < V_MR; ++i)
        for (int v = 0; v < 4; ++v) _mm512_store_si512((void *)(out[i] + 16 * v), acc[i][v]);
}

/* tail[v]: the lanes of zmm v (channels 16v … 16v + 15 of a 64-channel panel) below nc */
static inline void tail_masks(int64_t nc, __mmask16 tail[4]) {
    for (int v = 0; v < 4; ++v) {
        int64_t left = nc - 16 * v;
        tail[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    }
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
        const __m512i x = _mm512_set1_epi32(ag[s * VG_ROWS + (i)]);                                                \
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

static void vnni_group_rows(const int32_t *ap, int64_t mr, const uint32_t *panel, int64_t groups,
                            int64_t gsteps, const int32_t *xs, const float *sct, const float *sx, const float *bias,
                            int64_t n0, int64_t nc, float *y, int64_t ldy) {
    float t[VG_ROWS][V_NC] __attribute__((aligned(64)));
    VG_T(0) VG_T(1) VG_T(2)
    for (int64_t grp = 0; grp < groups; ++grp) {
        VG_INIT(0) VG_INIT(1) VG_INIT(2)
        const uint32_t *pg = panel + grp * gsteps * V_NC;
        const int32_t *ag = ap + grp * gsteps * VG_ROWS;
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
    tail_masks(nc, tail);
    for (int64_t i = 0; i < mr; ++i) {
        const __m512 s = _mm512_set1_ps(sx[i]);
        for (int v = 0; v < 4; ++v) {
            __m512 o = _mm512_mul_ps(_mm512_load_ps(t[i] + 16 * v), s);
            if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(tail[v], bias + n0 + 16 * v));
            _mm512_mask_storeu_ps(y + i * ldy + n0 + 16 * v, tail[v], o);
        }
    }
}

/* The tile's rows of the output: y[i, n0 …] for i < mr, from the tile's exact sums minus 128·Σq (W8A8) or
   8·Σq (W4A8 per channel), epilogue()'s operations and order ((float)acc · s_x) · s_w + b, 16 lanes at a time */
static inline void vnni_store_rows(int32_t acc[V_MR][V_NC], int64_t mr, const int32_t *xs, uint32_t offset,
                                   const float *sx, const float *sw, int per_channel, const float *bias, int64_t n0,
                                   int64_t nc, float *y, int64_t ldy) {
    __mmask16 tail[4];
    tail_masks(nc, tail);
    for (int64_t i = 0; i < mr; ++i) { /* int32 wraps like vpdpbusd: exact whenever the true sum fits */
        const __m512i corr = _mm512_set1_epi32((int32_t)(offset * (uint32_t)xs[i]));
        const __m512 vsx = _mm512_set1_ps(sx[i]), vsw0 = _mm512_set1_ps(sw[0]);
        for (int v = 0; v < 4; ++v) {
            __m512i c = _mm512_sub_epi32(_mm512_load_si512((const void *)(acc[i] + 16 * v)), corr);
            __m512 o = _mm512_mul_ps(_mm512_cvtepi32_ps(c), vsx);
            o = _mm512_mul_ps(o, per_channel ? _mm512_maskz_loadu_ps(tail[v], sw + n0 + 16 * v) : vsw0);
            if (bias) o = _mm512_add_ps(o, _mm512_maskz_loadu_ps(tail[v], bias + n0 + 16 * v));
            _mm512_mask_storeu_ps(y + i * ldy + n0 + 16 * v, tail[v], o);
        }
    }
}

void qk_avx512_w4a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w, const float *scale,
                         int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    /* g: K, 32 or 64·n (then K = groups · g, a multiple of 32); per channel K may be anything (steps: ⌈K/4⌉) */
    int64_t g = k / groups, steps = (k + 3) / 4, n_panels = (n_out + V_NC - 1) / V_NC;
    int64_t rows = groups > 1 ? VG_ROWS : V_MR, m_pad = (m_rows + rows - 1) / rows * rows;
    int32_t *ap = malloc((size_t)(m_pad * steps) * sizeof(int32_t));
    int32_t *xs = malloc((size_t)(m_pad * groups) * sizeof(int32_t));
    vnni_pack_rows(q, m_rows, k, groups, rows, ap, xs);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        uint32_t *panel = aligned_alloc(64, (size_t)steps * V_NC * sizeof(uint32_t));
        float *sct = groups > 1 ? malloc((size_t)(groups * V_NC) * sizeof(float)) : NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_panels; ++t) {
            int64_t n0 = t * V_NC, nc = n_out - n0 < V_NC ? n_out - n0 : V_NC;
            vnni_pack(w, n_out, k, n0, 0, 4 * steps, panel);
            if (groups > 1) { /* sct: the panel's scales, group-major */
                for (int64_t grp = 0; grp < groups; ++grp)
                    for (int64_t j = 0; j < V_NC; ++j) sct[grp * V_NC + j] = j < nc ? scale[(n0 + j) * groups + grp] : 0.0f;
                for (int64_t m = 0; m < m_rows; m += VG_ROWS)
                    vnni_group_rows(ap + m * steps, m_rows - m < VG_ROWS ? m_rows - m : VG_ROWS, panel, groups,
                                    g / 4, xs + m * groups, sct, sx + m, bias, n0, nc, y + m * n_out, n_out);
            } else { /* per output channel: one integer tile over all of K, then W8A8's epilogue */
                for (int64_t m = 0; m < m_rows; m += V_MR) {
                    int32_t acc[V_MR][V_NC] __attribute__((aligned(64)));
                    vnni_tile(ap + m * steps, panel, steps, acc);
                    vnni_store_rows(acc, m_rows - m < V_MR ? m_rows - m : V_MR, xs + m, 8, sx + m, scale, 1, bias,
                                    n0, nc, y + m * n_out, n_out);
                }
            }
        }
        free(panel);
        free(sct);
    }
    free(ap);
    free(xs);
}

/* ------------------------------------------------------------------------ W4A8 decode (GEMV), vpdpbusd

   Blocks of four weight rows, 128 channels a step: one 64-byte load holds four 32-channel groups of a row, its
   low nibbles (even channels) and high nibbles (odd) each meet their activation codes in one vpdpbusd, and int32
   lane L sums channels 8L … 8L + 7, so 128-bit lane l is group l of the step. Each row is read start to end (one
   sequential stream, which the hardware prefetcher follows: four rows read step by step ran at half the AVX2
   loop's speed from DRAM, and a software prefetch 1-16 KB ahead measured no better than none here) and its steps'
   partial sums are kept in L1; then sum4x4 folds the four rows' partials so that
   lane 4l + r is row r's exact sum of group l, and the float epilogue runs vectorised across the four rows in the
   reference's order (t = t + s_g · A_g group by group, then t · s_x + b): bit-identical to native_ref.c, where the
   AVX2 decode loop (native_avx2.c) adds g = 32 groups in another order. Per channel and for g a multiple of 128 a
   row's partials accumulate over each group and fold once per group. Other groups (g = 64·odd) take the AVX2
   loop. Σ c·q = Σ (c + 8)·q − 8·Σ q, as in the GEMM. Masked loads end each row at its last byte: K need only be
   whole groups (per channel: anything). */
#define VD_ROWS 4

/* One row's activation codes in the order the nibbles meet them: per 128-channel step, the even channels of its
   two 64-channel halves (32 + 32 bytes, what the low nibbles of the step's 64 weight bytes hold), then the odd
   ones; channels at or beyond k are 0, so a partial last step multiplies zeros. */
static void vd_codes(const int8_t *q, int64_t k, int8_t *xv) {
    for (int64_t c = 0; c < k; c += 128)
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 32; ++j) {
                int64_t e = c + 64 * h + 2 * j;
                xv[c + 32 * h + j] = e < k ? q[e] : 0;
                xv[c + 64 + 32 * h + j] = e + 1 < k ? q[e + 1] : 0;
            }
}

/* lane 4l + r of the result = Σ_p a_r[4l + p]: each row's four partial sums of 128-bit lane l, rows side by side */
static inline __m512i sum4x4(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    __m512i u0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    __m512i u1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(u0, u1), _mm512_unpackhi_epi64(u0, u1));
}

/* one row's Σ (nibble · code) over the step at channel c, added to acc (its bytes from c / 2 on, ldw in all) */
static inline __attribute__((always_inline)) __m512i vd_step(const uint8_t *wr, int64_t c, int64_t ldw,
                                                             const int8_t *xv, __m512i acc) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    int64_t left = ldw - c / 2;
    __mmask64 m = left >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << left) - 1);
    __m512i b = _mm512_maskz_loadu_epi8(m, wr + c / 2);
    acc = _mm512_dpbusd_epi32(acc, _mm512_and_si512(b, nib), _mm512_loadu_si512(xv + c));
    return _mm512_dpbusd_epi32(acc, _mm512_and_si512(_mm512_srli_epi16(b, 4), nib), _mm512_loadu_si512(xv + c + 64));
}

/* the four rows' exact sums of a whole group (or row) from their accumulators: lanes 0–3 = rows 0–3 */
static inline __m128i vd_fold(__m512i a0, __m512i a1, __m512i a2, __m512i a3) {
    __m512i s = sum4x4(a0, a1, a2, a3);
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

/* y[n + r] (r < nr) for one activation row: xv its codes (vd_codes), xsum its Σ q per group, weights of rows
   n … n + 3 (rows past nr are not read: their partials are zero and not stored). part: VD_ROWS × (steps or
   groups) vectors of scratch. */
static void vd_rows(const int8_t *xv, const int32_t *xsum, float sx, const uint8_t *w, int64_t ldw,
                    const float *scale, int64_t groups, const float *bias, int64_t n, int nr, int64_t k, float *y,
                    __m512i *part) {
    int64_t g = k / groups, steps = (k + 127) / 128;
    const float *sr[VD_ROWS];
    for (int r = 0; r < VD_ROWS; ++r) sr[r] = scale + (n + (r < nr ? r : 0)) * groups;
    float out[VD_ROWS];
    __m128 t = _mm_setzero_ps();
    if (g == 32 && groups > 1) {
        /* pass 1, row by row: each step's 16 partials (four groups × four lanes) into part[r · steps + step] */
        for (int r = 0; r < VD_ROWS; ++r) {
            const uint8_t *wr = w + (n + r) * ldw;
            for (int64_t i = 0; i < steps; ++i)
                part[r * steps + i] = r < nr ? vd_step(wr, 128 * i, ldw, xv, _mm512_setzero_si512())
                                             : _mm512_setzero_si512();
        }
        /* pass 2, step by step: exact group sums of the four rows, then the fold in group order */
        const __m512i tr = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
        const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
        for (int64_t i = 0; i < steps; ++i) {
            int64_t g0 = 4 * i, ng = groups - g0 < 4 ? groups - g0 : 4;
            __mmask16 m4 = (__mmask16)((1u << ng) - 1);
            __m512i corr = _mm512_permutexvar_epi32(spread, _mm512_castsi128_si512(_mm_maskz_loadu_epi32(m4, xsum + g0)));
            __m512i a = _mm512_sub_epi32(sum4x4(part[i], part[steps + i], part[2 * steps + i], part[3 * steps + i]),
                                         _mm512_slli_epi32(corr, 3));
            __m512 sc = _mm512_castps128_ps512(_mm_maskz_loadu_ps(m4, sr[0] + g0));
            sc = _mm512_insertf32x4(sc, _mm_maskz_loadu_ps(m4, sr[1] + g0), 1);
            sc = _mm512_insertf32x4(sc, _mm_maskz_loadu_ps(m4, sr[2] + g0), 2);
            sc = _mm512_insertf32x4(sc, _mm_maskz_loadu_ps(m4, sr[3] + g0), 3);
            __m512 p = _mm512_mul_ps(_mm512_permutexvar_ps(tr, sc), _mm512_cvtepi32_ps(a)); /* s_g · A_g, 4l + r */
            t = _mm_add_ps(t, _mm512_castps512_ps128(p)); /* groups in order: the reference's sum */
            if (ng > 1) t = _mm_add_ps(t, _mm512_extractf32x4_ps(p, 1));
            if (ng > 2) t = _mm_add_ps(t, _mm512_extractf32x4_ps(p, 2));
            if (ng > 3) t = _mm_add_ps(t, _mm512_extractf32x4_ps(p, 3));
        }
    } else {
        /* per channel (one group: K) or g = 128·j: a row's partials summed over each group, row by row */
        for (int r = 0; r < VD_ROWS; ++r) {
            const uint8_t *wr = w + (n + r) * ldw;
            for (int64_t grp = 0; grp < groups; ++grp) {
                __m512i acc = _mm512_setzero_si512();
                if (r < nr)
                    for (int64_t c = grp * g; c < grp * g + g; c += 128) acc = vd_step(wr, c, ldw, xv, acc);
                part[r * groups + grp] = acc;
            }
        }
        if (groups == 1) { /* W8A8's epilogue on each row's exact sum */
            int32_t a[VD_ROWS];
            _mm_storeu_si128((__m128i *)a, _mm_sub_epi32(vd_fold(part[0], part[1], part[2], part[3]),
                                                         _mm_set1_epi32(8 * xsum[0])));
            for (int r = 0; r < nr; ++r) y[n + r] = epilogue(a[r], sx, sr[r], 0, bias, n + r);
            return;
        }
        for (int64_t grp = 0; grp < groups; ++grp) {
            __m128i a = _mm_sub_epi32(
                vd_fold(part[grp], part[groups + grp], part[2 * groups + grp], part[3 * groups + grp]),
                _mm_set1_epi32(8 * xsum[grp]));
            __m128 sc = _mm_setr_ps(sr[0][grp], sr[1][grp], sr[2][grp], sr[3][grp]);
            t = _mm_add_ps(t, _mm_mul_ps(sc, _mm_cvtepi32_ps(a)));
        }
    }
    _mm_storeu_ps(out, _mm_mul_ps(t, _mm_set1_ps(sx)));
    for (int r = 0; r < nr; ++r) y[n + r] = bias ? out[r] + bias[n + r] : out[r];
}

void qk_avx512_w4a8_gemv(const int8_t *q, const float *sx, int64_t m_rows, const uint8_t *w, const float *scale,
                         int64_t groups, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t g = k / groups, ldw = (k + 1) / 2, kb = (k + 127) / 128 * 128, steps = kb / 128;
    if (groups > 1 && g != 32 && g % 128 != 0) { /* g = 64·odd: the AVX2 loop */
        qk_avx2_w4a8_gemv(q, sx, m_rows, w, scale, groups, bias, y, n_out, k, nthreads);
        return;
    }
    int8_t *xv = malloc((size_t)(m_rows * kb)); /* each row's codes in vd_codes' order, kb bytes */
    int32_t *xsum = calloc((size_t)(m_rows * groups), sizeof(int32_t));
    for (int64_t m = 0; m < m_rows; ++m) {
        vd_codes(q + m * k, k, xv + m * kb);
        for (int64_t i = 0; i < k; ++i) xsum[m * groups + i / g] += q[m * k + i];
    }
    int64_t blocks = (n_out + VD_ROWS - 1) / VD_ROWS, per_row = g == 32 && groups > 1 ? steps : groups;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        __m512i *part = aligned_alloc(64, (size_t)(VD_ROWS * per_row) * sizeof(__m512i));
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            int64_t n = b * VD_ROWS;
            int nr = n_out - n < VD_ROWS ? (int)(n_out - n) : VD_ROWS;
            for (int64_t m = 0; m < m_rows; ++m)
                vd_rows(xv + m * kb, xsum + m * groups, sx[m], w, ldw, scale, groups, bias, n, nr, k,
                        y + m * n_out, part);
        }
        free(part);
    }
    free(xv);
    free(xsum);
}

/* ------------------------------------------------------------------------ W8A8 prefill, int8 dot products

   The same tile as W4A8's per-channel GEMM (vnni_tile: 6 rows × 64 channels in 24 registers), on int8 weights:
   vpdpbusd takes its unsigned operand from the weight, stored +128 (w ^ 0x80 = w + 128 in [0, 255] for any int8
   code), so Σ w·q = Σ (w + 128)·q − 128·Σ q with Σ q per row once per call; int32 arithmetic wraps
   exactly, so the result is exact whenever the true sum fits in int32, as for every other path. The epilogue
   runs on the tile while it is in cache — epilogue()'s operations and order, 16 lanes at a time — where
   torch._int_mm writes an (M, N) int32 matrix that a second pass reads back. Per call the weight is transposed
   into 64-channel panels (4 channels × 4 steps of 4 bytes a block), ~5 % of the GEMM at 512 rows. */
static void vnni_pack_i8(const int8_t *w, int64_t n_out, int64_t k, int64_t n0, int64_t steps, uint32_t *panel) {
    const __m128i flip = _mm_set1_epi8((char)0x80);
    int64_t vec_steps = k / 16 * 4, j = blocked_channels(n_out, n0); /* whole 16-byte loads inside every row */
    for (int64_t s = 0; s < vec_steps; s += 4) /* step-major: each 64-byte panel line is written whole */
        for (int64_t jb = 0; jb < j; jb += 4) {
            const int8_t *r0 = w + (n0 + jb) * k, *r1 = r0 + k, *r2 = r1 + k, *r3 = r2 + k;
            __m128i v0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(r0 + 4 * s)), flip);
            __m128i v1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(r1 + 4 * s)), flip);
            __m128i v2 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(r2 + 4 * s)), flip);
            __m128i v3 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(r3 + 4 * s)), flip);
            __m128i t0 = _mm_unpacklo_epi32(v0, v1), t1 = _mm_unpacklo_epi32(v2, v3);
            __m128i t2 = _mm_unpackhi_epi32(v0, v1), t3 = _mm_unpackhi_epi32(v2, v3);
            uint32_t *d = panel + s * V_NC + jb;
            _mm_storeu_si128((__m128i *)d, _mm_unpacklo_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(d + V_NC), _mm_unpackhi_epi64(t0, t1));
            _mm_storeu_si128((__m128i *)(d + 2 * V_NC), _mm_unpacklo_epi64(t2, t3));
            _mm_storeu_si128((__m128i *)(d + 3 * V_NC), _mm_unpackhi_epi64(t2, t3));
        }
    for (int64_t jj = 0; jj < V_NC; ++jj) { /* the channels and steps the blocks left: byte by byte */
        int64_t n = n0 + jj;
        for (int64_t s = jj < j ? vec_steps : 0; s < steps; ++s) {
            uint32_t v = 0;
            for (int e = 0; e < 4 && n < n_out; ++e) {
                int64_t i = 4 * s + e;
                v |= (uint32_t)(i < k ? (uint8_t)(w[n * k + i] ^ 0x80) : 0x80) << (8 * e);
            }
            panel[s * V_NC + jj] = v;
        }
    }
}

void qk_avx512_w8a8_gemm(const int8_t *q, const float *sx, int64_t m_rows, const int8_t *w, const float *sw,
                         int per_channel, const float *bias, float *y, int64_t n_out, int64_t k, int nthreads) {
    int64_t steps = (k + 3) / 4, n_panels = (n_out + V_NC - 1) / V_NC, m_pad = (m_rows + V_MR - 1) / V_MR * V_MR;
    int32_t *ap = malloc((size_t)(m_pad * steps) * sizeof(int32_t));
    int32_t *xs = malloc((size_t)m_pad * sizeof(int32_t));
    vnni_pack_rows(q, m_rows, k, 1, V_MR, ap, xs);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        uint32_t *panel = aligned_alloc(64, (size_t)steps * V_NC * sizeof(uint32_t));
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < n_panels; ++t) {
            int64_t n0 = t * V_NC, nc = n_out - n0 < V_NC ? n_out - n0 : V_NC;
            vnni_pack_i8(w, n_out, k, n0, steps, panel);
            for (int64_t m = 0; m < m_rows; m += V_MR) {
                int32_t acc[V_MR][V_NC] __attribute__((aligned(64)));
                vnni_tile(ap + m * steps, panel, steps, acc);
                vnni_store_rows(acc, m_rows - m < V_MR ? m_rows - m : V_MR, xs + m, 128, sx + m, sw, per_channel,
                                bias, n0, nc, y + m * n_out, n_out);
            }
        }
        free(panel);
    }
    free(ap);
    free(xs);
}

/* ------------------------------------------------------------------ packed 2/3-bit weight-only GEMV

   native_avx2.c's loop (lowbit_rows: one variable shift brings each lane's code to its low bits, one permute looks
   it up in a table of ŵ = (t − z) · s, then the FMA) on 16 lanes: vpermps on a zmm reads an index's low four
   bits, so the table is 16 entries — the 4 (2-bit) or 8 (3-bit) values repeated — and 16 codes take one
   shift, one permute and one FMA, where the AVX2 loop needs two of each. Decode of packed codes is bound by
   these operations, not by memory (int2 reads 1/16 of fp32's bytes): at 2048 → 8192, one row, one thread, AMD
   Zen 4, int2-g64 ran 1.5× and int3-g128 1.3× the AVX2 loop. Accumulator zmm v holds the AVX2 loop's ymm
   accumulators 2v and 2v + 1 (channels c + 16v … c + 16v + 15 of each 32-channel step), its 8-channel steps go
   to the low half of zmm 0 and the reduction adds the halves in the AVX2 loop's order, so every sum is the
   AVX2 loop's, bit for bit (tested). 4-bit codes (16 values: no repeat fits) take the AVX2 loop. */

/* the ŵ of 16 codes at channel c (c % 8 == 0): 2-bit from one 32-bit word, 3-bit from two 3-byte units (each
   read as 4 bytes, as the AVX2 loop reads them: the caller leaves the row's last unit to the scalar tail) */
static inline __attribute__((always_inline)) __m512 lowbit16(const uint8_t *wr, const int bits, int64_t c, __m512 table) {
    uint32_t v0, v1;
    if (bits == 2) {
        memcpy(&v0, lowbit_at(wr, 2, c), 4);
        const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        return _mm512_permutexvar_ps(_mm512_srlv_epi32(_mm512_set1_epi32((int)v0), sh), table);
    }
    memcpy(&v0, lowbit_at(wr, 3, c), 4);
    memcpy(&v1, lowbit_at(wr, 3, c) + 3, 4);
    const __m512i sh = _mm512_setr_epi32(0, 3, 6, 9, 12, 15, 18, 21, 0, 3, 6, 9, 12, 15, 18, 21);
    const __m512i both = _mm512_mask_set1_epi32(_mm512_set1_epi32((int)v0), 0xFF00, (int)v1);
    return _mm512_permutexvar_ps(_mm512_srlv_epi32(both, sh), table);
}

static inline __m256 half_hi(__m512 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); }

/* one 32-channel step of mb rows on two zmm accumulators (both group loops) */
static inline __attribute__((always_inline)) void lowbit_fma32x16(const float *x, int64_t ldx, const int mb,
                                                                   const uint8_t *wr, const int bits, int64_t c,
                                                                   __m512 table, __m512 acc[LOWBIT_MB][2]) {
    const __m512 f0 = lowbit16(wr, bits, c, table), f1 = lowbit16(wr, bits, c + 16, table);
    for (int i = 0; i < mb; ++i) {
        acc[i][0] = _mm512_fmadd_ps(f0, _mm512_loadu_ps(x + i * ldx + c), acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(f1, _mm512_loadu_ps(x + i * ldx + c + 16), acc[i][1]);
    }
}

static inline __attribute__((always_inline)) void lowbit_rows16(const float *x, int64_t ldx, const int mb,
                                                                 const uint8_t *wr, const int bits, const float *sr,
                                                                 const uint8_t *zr, int zconst, int64_t groups,
                                                                 int64_t k, int64_t ldw, float *out) {
    int64_t g = k / groups;
    int64_t vend = bits == 3 ? (ldw / 3 - 1) * 8 : k & ~(int64_t)7; /* as in the AVX2 loop */
    const __m512 iota = bits == 2 ? _mm512_setr_ps(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3)
                                  : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 acc[LOWBIT_MB][2];
    float extra[LOWBIT_MB];
    for (int i = 0; i < LOWBIT_MB; ++i) {
        extra[i] = 0.0f;
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    }
    /* whole-step groups first, without the tail tests (as in the AVX2 loop, the same steps in the same order) */
    const int64_t whole = g > 0 && g % 32 == 0 ? (vend / g < groups ? vend / g : groups) : 0;
    for (int64_t grp = 0; grp < whole; ++grp) {
        const float z = lowbit_zero(zr, zconst, grp), s = sr[grp];
        const __m512 table = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(z)), _mm512_set1_ps(s));
        for (int64_t c = grp * g; c < grp * g + g; c += 32) {
            lowbit_fma32x16(x, ldx, mb, wr, bits, c, table, acc);
        }
    }
    for (int64_t grp = whole; grp < groups; ++grp) {
        const float z = lowbit_zero(zr, zconst, grp), s = sr[grp];
        const __m512 table = _mm512_mul_ps(_mm512_sub_ps(iota, _mm512_set1_ps(z)), _mm512_set1_ps(s));
        int64_t i0 = grp * g, i1 = i0 + g, c = i0;
        if (i0 % 8 == 0) {
            int64_t c1 = i1 < vend ? i1 : vend;
            for (; c + 32 <= c1; c += 32) {
                lowbit_fma32x16(x, ldx, mb, wr, bits, c, table, acc);
            }
            for (; c + 8 <= c1; c += 8) { /* into the AVX2 loop's accumulator 0: the low half of zmm 0 */
                const __m256 f = lowbit8(wr, bits, c, _mm512_castps512_ps256(table), _mm256_setzero_si256());
                for (int i = 0; i < mb; ++i) {
                    __m256 lo = _mm256_fmadd_ps(f, _mm256_loadu_ps(x + i * ldx + c), _mm512_castps512_ps256(acc[i][0]));
                    acc[i][0] = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(acc[i][0]), _mm256_castps_pd(lo), 0));
                }
            }
        }
        for (int i = 0; i < mb && c < i1; ++i) extra[i] += lowbit_span(x + i * ldx, wr, bits, z, s, c, i1);
    }
    for (int i = 0; i < mb; ++i) { /* the AVX2 loop's (acc0 + acc1) + (acc2 + acc3), then lane by lane */
        float lanes[8], t = 0.0f;
        __m256 a = _mm256_add_ps(_mm256_add_ps(_mm512_castps512_ps256(acc[i][0]), half_hi(acc[i][0])),
                                 _mm256_add_ps(_mm512_castps512_ps256(acc[i][1]), half_hi(acc[i][1])));
        _mm256_storeu_ps(lanes, a);
        for (int j = 0; j < 8; ++j) t += lanes[j];
        out[i] = t + extra[i];
    }
}

void qk_avx512_lowbit_linear(const float *x, int64_t m_rows, int64_t k, const uint8_t *w, int bits,
                             const float *scale, const uint8_t *zero, int zconst, int64_t groups, const float *bias,
                             float *y, int64_t n_out, int nthreads) {
    if (bits == 4) {
        qk_avx2_lowbit_linear(x, m_rows, k, w, bits, scale, zero, zconst, groups, bias, y, n_out, nthreads);
        return;
    }
    if (bits == 2) {
        LOWBIT_CHANNELS(lowbit_rows16, 2);
    } else {
        LOWBIT_CHANNELS(lowbit_rows16, 3);
    }
}

#endif
