/* The dense part of one decode step in C, on pinfer's thread pool: a layer's attention and the
 * head, for one token. ONNX Runtime runs the same graphs (formats/onnx_graph.py, the converter's
 * layer and head graphs); for a single token its fixed cost per session and per node outweighed
 * the bytes (SmolLM2: ~110 us per layer session for ~0.5 MB of weights), so decode takes these
 * calls where runtime/native.py says the layer is of a kind they cover, and prompts still run
 * through ONNX Runtime, which fills the same KV cache.
 *
 * A layer (pinfer_attn_call), as the layer graph computes it:
 *   r1 = resid + delta;  x = RMSNorm(r1) * attn_norm
 *   qkv = W_qkv x (+ bias); RoPE on q and k (rotate-half, or adjacent pairs when interleaved) over
 *   the first `rot` dims of each head, with the cos/sin tables' row for the position
 *   k, v -> the cache at the position; each head attends over positions 0..pos of its kv head
 *   (scale, optional softcap c tanh(s / c)), softmax in float
 *   r2 = r1 + W_out att (+ bias);  x_out = RMSNorm(r2) * ffn_norm;  resid_out = r2 (+ down bias)
 * The head (pinfer_head_call): logits = W RMSNorm(resid + delta) * norm, optional softcap.
 *
 * Weights (linear_t) are row-major (rows, k) in a block format of formats/schema.py: q4 and q5
 * (the FFN kernel's row dots, x quantized to int8 per group of 32 as MatMulNBits does), q8 (u8 q +
 * 128 with int8 x per group), f16 and f32 (float x). Each output row is one thread's, so no result
 * depends on the thread count.
 *
 * A prompt's tokens take one call each, in order (`back` says which); every layer's attention is
 * then the same computation as a single token's.
 *
 * Layouts: the KV cache (n_kv, n_ctx, hd) f32 per layer, as GroupQueryAttention keeps it; cos/sin
 * (n_ctx, rot/2) f32. `work`: pinfer_attn_work / pinfer_head_work floats of scratch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "dots.h"
#include "half.h"
#include "pool.h"


enum { FMT_Q8 = 0, FMT_F16 = 3, FMT_F32 = 4, FMT_Q4 = 5, FMT_Q5 = 6 };  /* as in ffn_sparse.c */

typedef struct {
    int fmt;
    const void *q;                  /* q bytes (q4, q5, q8), or the weights (f16, f32) */
    const uint16_t *scale, *min;    /* f16 (rows, k/G); min: q4/q5 only, or NULL */
    const uint8_t *qh;              /* q5's fifth bits (rows, k/8), else NULL */
    const float *bias;              /* (rows), or NULL */
    int64_t rows, k;
} linear_t;

typedef struct {
    linear_t qkv, out;
    const float *attn_norm, *ffn_norm;  /* RMSNorm weights (d) */
    const float *down_bias;             /* (d) added to resid_out, or NULL */
    float eps, scale, softcap;          /* softcap 0: none */
    int64_t d, n_head, n_kv, hd, rot, n_ctx;
    int interleaved;
    float *k_cache, *v_cache;
    const float *cos, *sin;
    const int32_t *total;               /* the cached length once the call's tokens are in */
    int64_t back;                       /* tokens of the call after this one: pos = *total - 1 - back */
    const float *resid, *delta;
    float *resid_out, *x_out;
    float *work;
    int threads;
} attn_call_t;

typedef struct {
    linear_t w;
    const float *norm;
    float eps, softcap;
    int64_t d;
    const float *resid, *delta;
    float *logits;
    float *work;
    int threads;
} head_call_t;

/* -- q8 rows with int8 x in natural order ------------------------------------------------------ */

/* x quantized per group of 32 in element order (qx_t's lanes unused): q8 rows read it. */
static void quantize_natural(const float *x, int64_t d, qx_t *o) {
    for (int64_t g = 0; g < d / G; g++) {
        float amax = 0.0f;
        for (int64_t e = 0; e < G; e++) amax = fmaxf(amax, fabsf(x[g * G + e]));
        const float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        int32_t total = 0;
        for (int64_t e = 0; e < G; e++) {
            const int v = (int)lrintf(x[g * G + e] * inv);
            o->q[g * G + e] = (int8_t)v;
            total += v;
        }
        o->scale[g] = s;
        o->sum[g] = s * (float)total;
    }
}

static float dot_q8_portable(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k) {
    float acc = 0.0f;
    for (int64_t g = 0; g < k / G; g++) {
        int32_t s = 0;
        for (int64_t e = 0; e < G; e++) s += ((int)q[g * G + e] - 128) * x->q[g * G + e];
        acc += HALF(((const half_t *)scale)[g]) * x->scale[g] * (float)s;
    }
    return acc;
}

#ifdef PINFER_X86
/* u8 q against int8 x by vpdpbusd, two groups per 512 bits; the offset of 128 comes off through
   the groups' sums of x: sum(scale_w * (scale_x * sum(q * xq) - 128 * sum_x)). */
__attribute__((target("avx512f,avx512bw,avx512vnni,avx512vl,f16c,fma")))
static float dot_q8_avx512(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k) {
    const int64_t ng = k / G;
    const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc = _mm512_setzero_ps();
    __m128 macc = _mm_setzero_ps();
    for (int64_t g = 0; g < ng; g += 2) {
        const int two = ng - g >= 2;
        const __mmask64 m = two ? ~0ULL : 0xffffffffULL;
        const __mmask8 m2 = two ? 3 : 1;
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_maskz_loadu_epi8(m, q + g * G),
                                              _mm512_maskz_loadu_epi8(m, x->q + g * G));
        const __m128 sw = _mm_cvtph_ps(_mm_maskz_loadu_epi16(m2, scale + g));
        const __m128 sx = _mm_maskz_loadu_ps(m2, x->scale + g), sm = _mm_maskz_loadu_ps(m2, x->sum + g);
        const __m512 f = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(sw, sx)));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), f, acc);
        macc = _mm_fmadd_ps(sw, sm, macc);
    }
    return _mm512_reduce_add_ps(acc) - 128.0f * (_mm_cvtss_f32(macc) + _mm_cvtss_f32(_mm_shuffle_ps(macc, macc, 1)));
}

/* (q - 128) as int8 against int8 x by pmaddubsw on |w| and x with w's sign: the pair sums stay
   under 2 * 128 * 127, inside int16. */
__attribute__((target("avx2,fma,f16c")))
static float dot_q8_avx2(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k) {
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t g = 0; g < k / G; g++) {
        const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + g * G)), flip);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + g * G));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w));
        const float f = HALF(((const half_t *)scale)[g]) * x->scale[g];
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_set1_ps(f), acc);
    }
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}
#endif

static float dot_q8(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, int isa) {
#ifdef PINFER_X86
    if (isa == ISA_AVX512) return dot_q8_avx512(q, scale, x, k);
    if (isa == ISA_AVX2) return dot_q8_avx2(q, scale, x, k);
#endif
    (void)isa;
    return dot_q8_portable(q, scale, x, k);
}

/* -- a linear layer: y = W x (+ bias) over threads, each a range of rows ----------------------- */

/* Rows this far on are prefetched while a block of four short rows is read. */
#define ROWS_AHEAD 32

typedef struct {
    const linear_t *w;
    const qx_t *qx;
    const float *x;
    float *y;
    int isa;
} lin_t;

static void lin_rows(void *p, int64_t r0, int64_t r1) {
    const lin_t *l = p;
    const linear_t *w = l->w;
    const int64_t k = w->k, ng = k / G;
    int64_t r = r0;
    if (w->fmt == FMT_Q4 || w->fmt == FMT_Q5)   /* short rows four at a time: they share the loads of x */
        for (; r < r1; r += 4) {
            const int R = r1 - r >= 4 && k <= SHORT_ROW ? 4 : 1;
            rows4_t rows;
            for (int i = 0; i < R; i++) {
                rows.q[i] = (const uint8_t *)w->q + (r + i) * (k / 2);
                rows.qh[i] = w->qh ? w->qh + (r + i) * (k / 8) : NULL;
                rows.scale[i] = w->scale + (r + i) * ng;
                rows.min[i] = w->min ? w->min + (r + i) * ng : NULL;
            }
            const uint8_t *next = R == 4 && r + 4 + ROWS_AHEAD <= w->rows ? rows.q[0] + ROWS_AHEAD * (k / 2) : NULL;
            pinfer_dot_rows_ahead(R, &rows, l->qx, k, l->y + r, next, k / 2);
            if (R == 1) r -= 3;
        }
    for (; r < r1; r++) {
        float v;
        switch (w->fmt) {
        case FMT_Q8:
            v = dot_q8((const uint8_t *)w->q + r * k, w->scale + r * ng, l->qx, k, l->isa);
            break;
        case FMT_F16:
            v = pinfer_dot_f16((const uint16_t *)w->q + r * k, l->x, k);
            break;
        default:
            v = pinfer_dot_f32((const float *)w->q + r * k, l->x, k);
        }
        l->y[r] = v;
    }
    if (w->bias)
        for (r = r0; r < r1; r++) l->y[r] += w->bias[r];
}

/* Floats of scratch for x quantized at length k. */
static int64_t qx_floats(int64_t k) { return (pinfer_qx_bytes(k) + 3) / 4; }

static void linear(const linear_t *w, const float *x, float *y, float *qbuf, int threads, int isa) {
    qx_t qx = pinfer_qx_at(qbuf, w->k);
    if (w->fmt == FMT_Q4 || w->fmt == FMT_Q5) pinfer_quantize_x(x, w->k, &qx);
    else if (w->fmt == FMT_Q8) quantize_natural(x, w->k, &qx);
    lin_t l = {w, &qx, x, y, isa};
    pinfer_parallel(w->rows * w->k >= PARALLEL_WORK ? threads : 1, w->rows, lin_rows, &l);
}

/* -- norms, RoPE, attention ---------------------------------------------------------------------- */

static void rms_norm(const float *r, const float *gamma, float eps, int64_t d, float *out) {
    float ss = 0.0f;
    for (int64_t i = 0; i < d; i++) ss += r[i] * r[i];
    const float inv = 1.0f / sqrtf(ss / (float)d + eps);
    for (int64_t i = 0; i < d; i++) out[i] = r[i] * inv * gamma[i];
}

static void rope(float *v, const float *c, const float *s, int64_t rot, int interleaved) {
    const int64_t half = rot / 2;
    for (int64_t i = 0; i < half; i++) {
        const int64_t a = interleaved ? 2 * i : i, b = interleaved ? 2 * i + 1 : i + half;
        const float x1 = v[a], x2 = v[b];
        v[a] = x1 * c[i] - x2 * s[i];
        v[b] = x2 * c[i] + x1 * s[i];
    }
}

typedef struct {
    const attn_call_t *a;
    const float *q;
    float *out, *scores;
    int64_t n;          /* positions attended: 0..n-1 */
} heads_t;

PINFER_CLONES
static void heads(void *p, int64_t h0, int64_t h1) {
    const heads_t *t = p;
    const attn_call_t *a = t->a;
    const int64_t hd = a->hd, n = t->n, group = a->n_head / a->n_kv;
    for (int64_t h = h0; h < h1; h++) {
        const float *q = t->q + h * hd;
        const float *K = a->k_cache + (h / group) * a->n_ctx * hd, *V = a->v_cache + (h / group) * a->n_ctx * hd;
        float *s = t->scores + h * a->n_ctx, *o = t->out + h * hd, top = -INFINITY;
        for (int64_t j = 0; j < n; j++) {
            float v = a->scale * pinfer_dot_f32(K + j * hd, q, hd);
            if (a->softcap > 0.0f) v = a->softcap * tanhf(v / a->softcap);
            s[j] = v;
            top = v > top ? v : top;
        }
        float total = 0.0f;
        for (int64_t j = 0; j < n; j++) total += s[j] = expf(s[j] - top);
        memset(o, 0, (size_t)hd * sizeof(float));
        for (int64_t j = 0; j < n; j++) {
            const float pj = s[j];
            const float *vj = V + j * hd;
            for (int64_t i = 0; i < hd; i++) o[i] += pj * vj[i];
        }
        const float inv = 1.0f / total;
        for (int64_t i = 0; i < hd; i++) o[i] *= inv;
    }
}

/* -- the calls ------------------------------------------------------------------------------------- */

static int64_t kmax(const attn_call_t *a) { return a->d > a->out.k ? a->d : a->out.k; }

/* Floats of scratch a layer's call takes: x, qkv, the heads' output, scores, quantized x. */
int64_t pinfer_attn_work(const attn_call_t *a) {
    return a->d + a->qkv.rows + a->out.k + a->n_head * a->n_ctx + qx_floats(kmax(a));
}

int64_t pinfer_head_work(const head_call_t *a) { return 2 * a->d + qx_floats(a->d); }

static void attn_token(const attn_call_t *a, int threads, int isa) {
    const int64_t d = a->d, hd = a->hd, pos = *a->total - 1 - a->back, half = a->rot / 2;
    float *x = a->work, *qkv = x + d, *att = qkv + a->qkv.rows, *scores = att + a->out.k, *qbuf = scores + a->n_head * a->n_ctx;
    float *r = a->resid_out;
    for (int64_t i = 0; i < d; i++) r[i] = a->resid[i] + a->delta[i];
    rms_norm(r, a->attn_norm, a->eps, d, x);
    linear(&a->qkv, x, qkv, qbuf, threads, isa);

    float *q = qkv, *k = qkv + a->n_head * hd, *v = k + a->n_kv * hd;
    const float *c = a->cos + pos * half, *s = a->sin + pos * half;
    for (int64_t h = 0; h < a->n_head; h++) rope(q + h * hd, c, s, a->rot, a->interleaved);
    for (int64_t h = 0; h < a->n_kv; h++) {
        rope(k + h * hd, c, s, a->rot, a->interleaved);
        memcpy(a->k_cache + (h * a->n_ctx + pos) * hd, k + h * hd, (size_t)hd * sizeof(float));
        memcpy(a->v_cache + (h * a->n_ctx + pos) * hd, v + h * hd, (size_t)hd * sizeof(float));
    }
    heads_t t = {a, q, att, scores, pos + 1};
    pinfer_parallel(a->n_head * (pos + 1) * hd >= PARALLEL_WORK / 4 ? threads : 1, a->n_head, heads, &t);

    linear(&a->out, att, x, qbuf, threads, isa);
    for (int64_t i = 0; i < d; i++) r[i] += x[i];
    rms_norm(r, a->ffn_norm, a->eps, d, a->x_out);
    if (a->down_bias)
        for (int64_t i = 0; i < d; i++) r[i] += a->down_bias[i];
}

/* Returns 0, or -1 when the position is outside the cache. */
int pinfer_attn_call(const attn_call_t *a) {
    const int64_t pos = *a->total - 1 - a->back;
    if (pos < 0 || pos >= a->n_ctx) return -1;
    const int isa = pinfer_sparse_isa(-1);
    const int threads = pinfer_pool_enter(a->threads);
    attn_token(a, threads, isa);
    pinfer_pool_leave(a->threads);
    return 0;
}

int pinfer_head_call(const head_call_t *a) {
    const int64_t d = a->d;
    float *r = a->work, *x = r + d;
    const int isa = pinfer_sparse_isa(-1);
    const int threads = pinfer_pool_enter(a->threads);
    for (int64_t i = 0; i < d; i++) r[i] = a->resid[i] + a->delta[i];
    rms_norm(r, a->norm, a->eps, d, x);
    linear(&a->w, x, a->logits, x + d, threads, isa);
    pinfer_pool_leave(a->threads);
    if (a->softcap > 0.0f)
        for (int64_t i = 0; i < a->w.rows; i++) a->logits[i] = a->softcap * tanhf(a->logits[i] / a->softcap);
    return 0;
}
