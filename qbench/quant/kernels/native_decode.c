/* The float work of one decode step between a model's linear layers, for qbench.eval.decode's runtime: a norm
   (optionally after the residual add) and single-query attention over a float KV cache (RoPE on the new query
   and key, the new key/value written to the cache, softmax / softmax-1 / a learned sink key).

   Why in C: at one token these are tiny (a 768-wide norm, 12 heads × a few hundred keys) and torch spends most
   of their time dispatching — a norm is 5 aten ops (9 µs for 576 channels on Zen 4), attention ~15 ops
   (chunk, views, RoPE's cat, the cache slices, SDPA's flash kernel with its block buffers) — which adds up to a
   third of a gpt2-130m decode step with W4A8 linears. One foreign call each removes that.

   Written as plain C that -O3 -march=native vectorises (no intrinsics, no ISA test): every reduction is split
   into QK_LANES independent partial sums, the written order, so it vectorises without -ffast-math's
   reassociation; exp is Cephes' expf polynomial (range reduction by ln 2, degree-5 polynomial, 2^n from the
   exponent bits: ~1 ulp), branch-free so it vectorises too. Results equal torch's to float rounding (the sums'
   order differs), not bit for bit; the runtime's tests hold them to that. RoPE is the exception: the same
   products and sum as the model's x·cos + rotate_half(x)·sin, each rounded once (-ffp-contract=off), so the keys
   written to the cache equal the model's bit for bit. */
#include "native.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#define QK_LANES 16

static inline float sum_lanes(const float *acc) {
    float s = 0.0f;
    for (int i = 0; i < QK_LANES; ++i) s += acc[i];
    return s;
}

static inline float dot_f32(const float *a, const float *b, int64_t n) {
    float acc[QK_LANES] = {0};
    int64_t i = 0;
    for (; i + QK_LANES <= n; i += QK_LANES)
        for (int l = 0; l < QK_LANES; ++l) acc[l] += a[i + l] * b[i + l];
    float s = sum_lanes(acc);
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* Cephes expf (S. Moshier, expf.c): e^x = 2^n · e^r with n = round(x / ln 2), r = x − n·ln 2 in two parts. Valid
   for x ≤ 0 (the softmax's shifted logits); below −87.3 it returns 2^−126·e^r ≈ 1e−38 instead of 0 (a weight
   that cannot move a float32 sum whose largest term is 1). */
static inline float qk_expf(float x) {
    x = x < -87.3f ? -87.3f : x;
    float n = (float)(int32_t)(x * 1.44269504088896341f + (x < 0 ? -0.5f : 0.5f));
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * (r * r) + r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return e * scale;
}

/* x += delta (when delta is given: the residual add), then out = norm(x):
     rms = 0: LayerNorm, (x − mean) · (1 / sqrt(var + eps)) · w + b, biased variance (w, b may be NULL);
     rms = 1: RMSNorm as models.transformer.RMSNorm, w · (x · (1 / sqrt(mean(x²) + eps))), w of n or 1 gains.
   Moments are accumulated in double: closer to the exact value than any float order, so the difference from
   torch's is torch's own rounding. */
void qk_decode_norm(float *x, const float *delta, int64_t n, const float *w, int64_t w_len, const float *b,
                    float eps, int rms, float *out) {
    if (delta)
        for (int64_t i = 0; i < n; ++i) x[i] += delta[i];
    double s = 0.0, ss = 0.0;
    for (int64_t i = 0; i < n; ++i) {
        s += x[i];
        ss += (double)x[i] * x[i];
    }
    if (rms) {
        float r = (float)(1.0 / sqrt(ss / (double)n + (double)eps));
        for (int64_t i = 0; i < n; ++i) {
            float normed = x[i] * r;
            out[i] = w ? w[w_len == 1 ? 0 : i] * normed : normed;
        }
        return;
    }
    double mean = s / (double)n;
    double var = 0.0;
    for (int64_t i = 0; i < n; ++i) var += ((double)x[i] - mean) * ((double)x[i] - mean);
    float r = (float)(1.0 / sqrt(var / (double)n + (double)eps));
    float m = (float)mean;
    for (int64_t i = 0; i < n; ++i) {
        float y = (x[i] - m) * r;
        if (w) y = y * w[i];
        out[i] = b ? y + b[i] : y;
    }
}

/* Llama's half-split RoPE of one head: out = x·cos + rotate_half(x)·sin, rotate_half(x) = (−x2, x1). */
static inline void rope_head(const float *x, const float *cos_, const float *sin_, int64_t hs, float *out) {
    int64_t half = hs / 2;
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos_[i] + (-x[i + half]) * sin_[i];
    for (int64_t i = half; i < hs; ++i) out[i] = x[i] * cos_[i] + x[i - half] * sin_[i];
}

/* One decode step's attention, batch 1.
     q (nh·hs), k and v (nkv·hs): the new token's projections; head h of q reads key/value head h / (nh / nkv);
     kcache, vcache: (nkv, context, hs) float32 buffers, head_stride = context·hs; positions 0 … pos − 1 hold the
       past, the new key (after RoPE) and value are written at pos and attended to;
     cos, sin (hs,): this position's RoPE row, or NULL (no rotation);
     extra: 0 softmax; 1 softmax-1 (a zero key and value every query sees: +1 in the denominator); 2 a learned
       sink, extra_k / extra_v (nh, hs) per query head;
     out (nh·hs): each head's output, heads concatenated (what the output projection reads).
   Scores are (q·k)·scale; the softmax subtracts the row's maximum (with the extra logit, as softmax-1 does). */
void qk_decode_attention(const float *q, const float *k, const float *v, int64_t nh, int64_t nkv, int64_t hs,
                         float *kcache, float *vcache, int64_t head_stride, int64_t pos, const float *cos_,
                         const float *sin_, int extra, const float *extra_k, const float *extra_v, float scale,
                         float *out, int threads) {
    int64_t L = pos + 1, group = nh / nkv;
    for (int64_t h = 0; h < nkv; ++h) {
        float *kd = kcache + h * head_stride + pos * hs, *vd = vcache + h * head_stride + pos * hs;
        if (cos_)
            rope_head(k + h * hs, cos_, sin_, hs, kd);
        else
            memcpy(kd, k + h * hs, (size_t)hs * sizeof(float));
        memcpy(vd, v + h * hs, (size_t)hs * sizeof(float));
    }
    (void)threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
#endif
    for (int64_t h = 0; h < nh; ++h) {
        const float *K = kcache + (h / group) * head_stride, *V = vcache + (h / group) * head_stride;
        float *y = out + h * hs;
        float *p = malloc((size_t)(L + hs) * sizeof(float)), *qh = p + L; /* scores, then the rotated query */
        if (cos_)
            rope_head(q + h * hs, cos_, sin_, hs, qh);
        else
            memcpy(qh, q + h * hs, (size_t)hs * sizeof(float));
        float m = -INFINITY, e0 = 0.0f;
        for (int64_t j = 0; j < L; ++j) {
            p[j] = dot_f32(qh, K + j * hs, hs) * scale;
            m = p[j] > m ? p[j] : m;
        }
        if (extra == 2) e0 = dot_f32(qh, extra_k + h * hs, hs) * scale;
        if (extra) m = e0 > m ? e0 : m;
        for (int64_t j = 0; j < L; ++j) p[j] = qk_expf(p[j] - m);
        float acc[QK_LANES] = {0};
        int64_t j = 0;
        for (; j + QK_LANES <= L; j += QK_LANES)
            for (int l = 0; l < QK_LANES; ++l) acc[l] += p[j + l];
        float den = sum_lanes(acc);
        for (; j < L; ++j) den += p[j];
        float pe = extra ? qk_expf(e0 - m) : 0.0f;
        den += pe;
        for (int64_t d = 0; d < hs; ++d) y[d] = extra == 2 ? pe * extra_v[h * hs + d] : 0.0f;
        for (j = 0; j < L; ++j) {
            const float *vj = V + j * hs;
            float pj = p[j];
            for (int64_t d = 0; d < hs; ++d) y[d] += pj * vj[d];
        }
        float inv = 1.0f / den;
        for (int64_t d = 0; d < hs; ++d) y[d] *= inv;
        free(p);
    }
}
