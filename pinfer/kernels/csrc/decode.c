/* The dense part of one decode step in C, on pinfer's thread pool: a layer's attention and the
 * head, for one token. ONNX Runtime runs the same graphs (formats/onnx_graph.py, the converter's
 * layer and head graphs); for a single token its fixed cost per session and per node outweighed
 * the bytes (SmolLM2: ~110 us per layer session for ~0.5 MB of weights), so decode takes these
 * calls where runtime/native.py says the layer is of a kind they cover, and prompts still run
 * through ONNX Runtime, which fills the same KV cache.
 *
 * A layer (pinfer_attn_call), as the layer graph computes it (runtime/graphs.py):
 *   r1 = resid + delta (delta RMSNormed by delta_norm first: the previous layer's post-FFN norm, Gemma)
 *   x = RMSNorm(r1) * attn_norm;  qkv = W_qkv x (+ bias)
 *   q and k per head RMSNormed by q_norm, k_norm where given (Qwen3, Gemma 3); RoPE on q and k
 *   (rotate-half, or adjacent pairs when interleaved) over the first `rot` dims of each head, with
 *   the cos/sin tables' row for the position
 *   k, v -> the cache at the position; each head attends over positions 0..pos of its kv head, or
 *   the last `window` of them (scale, optional softcap c tanh(s / c)), softmax in float
 *   o = W_out att (+ bias), RMSNormed by post_norm where given (Gemma)
 *   r2 = r1 + o;  x_out = RMSNorm(r2) * ffn_norm;  resid_out = r2 (+ down bias)
 * The head (pinfer_head_call): logits = W RMSNorm(resid + delta) * norm (delta RMSNormed by
 * delta_norm first where given), optional softcap.
 *
 * Weights (linear_t) are row-major (rows, k) in a block format of formats/schema.py: q4 and q5
 * (the FFN kernel's row dots, x quantized to int8 per group of 32 as MatMulNBits does), q8 (u8 q +
 * 128 with int8 x per group), f16 and f32 (float x). Each output row is one thread's, so no result
 * depends on the thread count.
 *
 * A prompt's tokens take one call of up to MAX_BATCH tokens (pinfer_attn_batch): each weight row is
 * read once for all of them, and each token's result is the one a call of its own gives.
 *
 * Layouts: the KV cache (n_kv, n_ctx, hd) f32 or f16 (kv_f16) per layer, as GroupQueryAttention keeps
 * it; cos/sin (n_ctx, rot/2) f32. `work`: pinfer_attn_work / pinfer_head_work floats of scratch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "codes.h"
#include "dots.h"
#include "half.h"
#include "pool.h"


/* linear_t: dots.h */

typedef struct {
    linear_t qkv, out;
    const float *attn_norm, *ffn_norm;  /* RMSNorm weights (d) */
    const float *down_bias;             /* (d) added to resid_out, or NULL */
    float eps, scale, softcap;          /* softcap 0: none */
    int64_t d, n_head, n_kv, hd, rot, n_ctx;
    int interleaved;
    void *k_cache, *v_cache;            /* f32, or f16 where kv_f16 */
    const float *cos, *sin;
    const int32_t *total;               /* the cached length once the call's tokens are in */
    int64_t back;                       /* tokens of the call after this one: pos = *total - 1 - back */
    const float *resid, *delta;
    float *resid_out, *x_out;
    float *work;
    int threads;
    int kv_f16;                         /* the KV cache holds f16 values (rounded to nearest even) */
    const float *q_norm, *k_norm;       /* (hd) per-head RMSNorm weights of q and k, or NULL */
    const float *post_norm;             /* (d) RMSNorm weights of the attention's output, or NULL */
    const float *delta_norm;            /* (d) RMSNorm weights of delta before it joins resid, or NULL */
    int64_t window;                     /* attend to the last `window` positions at most; 0: all */
    /* activation sparsity: the q/k/v and output projections by columns (their inputs under thr
       dropped), in place of qkv's and out's rows (whose bias, rows and k still count); q NULL: rows */
    cols_t qkv_c, out_c;
    int64_t *kept;                      /* NULL, or kept[0] += q/k/v's inputs kept, kept[1] += the output's */
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
    const float *delta_norm;            /* (d) RMSNorm weights of delta before it joins resid, or NULL */
} head_call_t;

/* -- q8 rows with int8 x in natural order ------------------------------------------------------ */

/* x quantized per group of 32 in element order (qx_t's corr unused): q8 rows read it. */
PINFER_CLONES
static void quantize_natural(const float *x, int64_t d, qx_t *o) {
    for (int64_t g = 0; g < d / G; g++) {
        float amax = 0.0f;
        for (int64_t e = 0; e < G; e++) {
            const float a = fabsf(x[g * G + e]);
            amax = a > amax ? a : amax;
        }
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
#define Q8_AVX512 "avx512f,avx512bw,avx512vnni,avx512vl,f16c,fma"

/* kg groups from g (16 but at the row's end) of a q8 row: steps of two groups (64 bytes) by
   vpdpbusd, u8 q against int8 x; the block's 16 scales converted once and multiplied by x's. The
   offset of 128 comes off through the groups' sums of x: sum(scale_w * (scale_x * sum(q * xq) -
   128 * sum_x)). */
__attribute__((target(Q8_AVX512), always_inline))
static inline void block_q8_avx512(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t g, const int64_t kg,
                                   __m512 *acc, __m512 *macc, const uint8_t *next) {
    if (next)
        for (int64_t c = 0; c < kg; c += 2) _mm_prefetch((const char *)(next + (g + c) * G), _MM_HINT_T0);
    const __mmask16 mg = kg == 16 ? 0xffff : (__mmask16)((1u << kg) - 1);
    const __m512 sw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mg, scale + g));
    const __m512 ws = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(mg, x->scale + g));
    *macc = _mm512_fmadd_ps(sw, _mm512_maskz_loadu_ps(mg, x->sum + g), *macc);
#pragma GCC unroll 8
    for (int64_t c = 0; c < kg; c += 2) {
        const __mmask64 m = kg - c >= 2 ? ~0ULL : 0xffffffffULL;
        const __m512i spread = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
                                                _mm512_set1_epi32((int)c));
        const __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_maskz_loadu_epi8(m, q + (g + c) * G),
                                              _mm512_maskz_loadu_epi8(m, x->q + (g + c) * G));
        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(spread, ws), *acc);
    }
}

__attribute__((target(Q8_AVX512)))
static float dot_q8_avx512(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, const uint8_t *next) {
    const int64_t ng = k / G;
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) block_q8_avx512(q, scale, x, g, 16, &acc, &macc, next);
    if (g < ng) block_q8_avx512(q, scale, x, g, ng - g, &acc, &macc, next);
    return _mm512_reduce_add_ps(_mm512_fnmadd_ps(macc, _mm512_set1_ps(128.0f), acc));
}

/* (q - 128) as int8 against int8 x by pmaddubsw on |w| and x with w's sign (the pair sums stay
   under 2 * 128 * 127, inside int16), kg groups from g (8 but at the row's end); the block's 8
   scales converted once and multiplied by x's. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void block_q8_avx2(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t g, const int64_t kg,
                                 __m256 *acc, const uint8_t *next) {
    if (next)
        for (int64_t c = 0; c < kg; c += 2) _mm_prefetch((const char *)(next + (g + c) * G), _MM_HINT_T0);
    const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
    const __m256 ws = _mm256_mul_ps(pinfer_load8_ph(scale + g, kg), pinfer_load8_ps(x->scale + g, kg));
#pragma GCC unroll 8
    for (int64_t c = 0; c < kg; c++) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(q + (g + c) * G)), flip);
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + (g + c) * G));
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xv, v));
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                               _mm256_permutevar8x32_ps(ws, _mm256_set1_epi32((int)c)), *acc);
    }
}

__attribute__((target("avx2,fma,f16c")))
static float dot_q8_avx2(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, const uint8_t *next) {
    const int64_t ng = k / G;
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) block_q8_avx2(q, scale, x, g, 8, &acc, next);
    if (g < ng) block_q8_avx2(q, scale, x, g, ng - g, &acc, next);
    return pinfer_hsum8(acc);
}
#endif

/* One q8 row's dot with x quantized in element order; `next`: the row to prefetch meanwhile
   (dots.h: AHEAD_BYTES), or NULL. Rows are read one at a time: over SmolLM2's head shape (49152 x
   576), AVX2, one thread of a 2-core EPYC, alternating in one process (a throwaway timing of
   HeadStep), one at a time read 22 GB/s, four at a time sharing the loads of x 10 GB/s. */
static float dot_q8(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, int isa, const uint8_t *next) {
#ifdef PINFER_X86
    if (isa == ISA_AVX512) return dot_q8_avx512(q, scale, x, k, next);
    if (isa == ISA_AVX2) return dot_q8_avx2(q, scale, x, k, next);
#endif
    (void)isa, (void)next;
    return dot_q8_portable(q, scale, x, k);
}

void pinfer_quantize_natural(const float *x, int64_t d, qx_t *o) { quantize_natural(x, d, o); }

float pinfer_dot_q8(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, int isa, const uint8_t *next) {
    return dot_q8(q, scale, x, k, isa, next);
}

/* -- a linear layer: y = W x (+ bias) over threads, each a range of rows ----------------------- */

typedef struct {
    const linear_t *w;
    const qx_t *qx;                     /* nt tokens' x quantized (q4, q5, q8) */
    const float *x;                     /* nt tokens' x, w->k apart (f16, f32) */
    float *y;                           /* nt tokens' y, w->rows apart */
    int64_t nt;
    int isa;
} lin_t;

/* Rows 4 * b0 .. 4 * b1 (the last range ends at the matrix's end) against every token: the ranges
   hold whole blocks of four, so a matrix's rows go in the same blocks on any number of threads, and
   the rows left over at its end alone (a row read alone sums in another order: dots.h). Each row
   meets every token while in cache, and a token's dot is the same whatever nt is. */
static void lin_rows(void *p, int64_t b0, int64_t b1) {
    const lin_t *l = p;
    const linear_t *w = l->w;
    const int64_t k = w->k, ng = k / G, n = w->rows, r0 = 4 * b0, r1 = 4 * b1 < n ? 4 * b1 : n;
    int64_t r = r0;
    if (w->fmt == FMT_Q4 || w->fmt == FMT_Q5) {
        pinfer_q4_rows(w, l->qx, l->nt, l->y, n, b0, b1);
        r = r1;
    }
    const int64_t ahead8 = rows_ahead(k);
    for (; r < r1; r++)
        for (int64_t t = 0; t < l->nt; t++) {
            float v;
            switch (w->fmt) {
            case FMT_Q8: {
                const uint8_t *q = (const uint8_t *)w->q + r * k;
                v = dot_q8(q, w->scale + r * ng, &l->qx[t], k, l->isa,
                           t == 0 && r + ahead8 < n ? q + ahead8 * k : NULL);
                break;
            }
            case FMT_F16:
                v = pinfer_dot_f16((const uint16_t *)w->q + r * k, l->x + t * k, k);
                break;
            default:
                v = pinfer_dot_f32((const float *)w->q + r * k, l->x + t * k, k);
            }
            l->y[t * n + r] = v;
        }
    if (w->bias)
        for (int64_t t = 0; t < l->nt; t++)
            for (r = r0; r < r1; r++) l->y[t * n + r] += w->bias[r];
}

/* Floats of scratch for x quantized at length k. */
static int64_t qx_floats(int64_t k) { return (pinfer_qx_bytes(k) + 3) / 4; }

/* y (nt, rows) = x (nt, k) W^T (+ bias), each weight row read once for the nt tokens; qbuf holds nt
   quantized x of qx_floats(k) floats each. */
static void linear(const linear_t *w, const float *x, float *y, int64_t nt, float *qbuf, int threads, int isa) {
    qx_t qx[MAX_BATCH];
    for (int64_t t = 0; t < nt; t++) {
        qx[t] = pinfer_qx_at(qbuf + t * qx_floats(w->k), w->k);
        if (w->fmt == FMT_Q4 || w->fmt == FMT_Q5) pinfer_quantize_x(x + t * w->k, w->k, &qx[t]);
        else if (w->fmt == FMT_Q8) quantize_natural(x + t * w->k, w->k, &qx[t]);
    }
    lin_t l = {w, qx, x, y, nt, isa};
    pinfer_parallel(nt * w->rows * w->k >= PARALLEL_WORK ? threads : 1, (w->rows + 3) / 4, lin_rows, &l);
}

/* linear() by columns: each token's kept inputs times their rows of c (shape and bias w's);
   scratch: w->k int32 and w->k floats. */
static void cols_linear(const cols_t *c, const linear_t *w, const float *x, float *y, int64_t nt, float *scratch,
                        int threads, int64_t *kept) {
    for (int64_t t = 0; t < nt; t++) {
        const int64_t s = pinfer_cols_run(c, w->k, w->rows, x + t * w->k, y + t * w->rows, (int32_t *)scratch,
                                          scratch + w->k, threads);
        if (kept && s > 0) *kept += s;
        if (w->bias)
            for (int64_t r = 0; r < w->rows; r++) y[t * w->rows + r] += w->bias[r];
    }
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
    int isa;
} heads_t;

/* Element i of a K or V cache of f32 (f16 0) or f16 (f16 1) values. */
static inline float kv_at(const void *p, int64_t i, int f16) {
    return f16 ? HALF(((const half_t *)p)[i]) : ((const float *)p)[i];
}

/* One head over positions 0..n-1: scores s = scale q.K_j (softcapped), their softmax, o = sum p_j V_j.
   Every ISA sums in the same order within its own lanes; the ISAs differ by float rounding only. */
static void head_portable(const float *q, const void *K, const void *V, int64_t n, int64_t hd, float scale,
                          float softcap, float *s, float *o, int f16) {
    float top = -INFINITY, total = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        float v = 0.0f;
        for (int64_t i = 0; i < hd; i++) v += kv_at(K, j * hd + i, f16) * q[i];
        v *= scale;
        if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
        s[j] = v;
        top = v > top ? v : top;
    }
    for (int64_t j = 0; j < n; j++) total += s[j] = expf(s[j] - top);
    memset(o, 0, (size_t)hd * sizeof(float));
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < hd; i++) o[i] += s[j] * kv_at(V, j * hd + i, f16);
    const float inv = 1.0f / total;
    for (int64_t i = 0; i < hd; i++) o[i] *= inv;
}

#ifdef PINFER_X86
#define HEAD_AVX512 "avx512f,fma"
/* head_portable with hd in 16-wide lanes (the last ones masked). */
__attribute__((target(HEAD_AVX512)))
static void head_avx512(const float *q, const float *K, const float *V, int64_t n, int64_t hd, float scale,
                        float softcap, float *s, float *o) {
    const int64_t nv = (hd + 15) / 16;
    if (nv > 16) {
        head_portable(q, K, V, n, hd, scale, softcap, s, o, 0);
        return;
    }
    __m512 qv[16], ov[16];
    __mmask16 mk[16];
    for (int64_t c = 0; c < nv; c++) {
        mk[c] = hd - 16 * c >= 16 ? 0xffff : (__mmask16)((1u << (hd - 16 * c)) - 1);
        qv[c] = _mm512_maskz_loadu_ps(mk[c], q + 16 * c);
        ov[c] = _mm512_setzero_ps();
    }
    float top = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t c = 0; c < nv; c++) a = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mk[c], K + j * hd + 16 * c), qv[c], a);
        float v = scale * _mm512_reduce_add_ps(a);
        if (softcap > 0.0f) v = softcap * tanhf(v / softcap);
        s[j] = v;
        top = v > top ? v : top;
    }
    __m512 tv = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j < n; j += 16) {
        const __mmask16 m = n - j >= 16 ? 0xffff : (__mmask16)((1u << (n - j)) - 1);
        const __m512 e = pinfer_exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(s + j, m, e);
        tv = _mm512_mask_add_ps(tv, m, tv, e);
    }
    for (j = 0; j < n; j++) {
        const __m512 p = _mm512_set1_ps(s[j]);
        for (int64_t c = 0; c < nv; c++) ov[c] = _mm512_fmadd_ps(p, _mm512_maskz_loadu_ps(mk[c], V + j * hd + 16 * c), ov[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(tv));
    for (int64_t c = 0; c < nv; c++) _mm512_mask_storeu_ps(o + 16 * c, mk[c], _mm512_mul_ps(ov[c], inv));
}

/* head_portable with hd = 8 * NV, in 8-wide lanes. NV is a constant where the common widths inline
   it, so that q and the output stay in registers (with NV a variable they lived on the stack, and
   each position's score was a chain of NV dependent FMAs and a horizontal sum of its own: about 54
   cycles a head and position for SmolLM2's 64-wide heads, 7% of its decode token); other widths
   take it as a variable. Scores are made four positions at a time and summed across lanes by one
   tree (hadd) per position, whatever four it is in, so that a score's bits do not depend on n (the
   last block's missing positions repeat its first and are dropped); the exps are masked in the
   last lanes, so that a position's weight is the same bits wherever it is; the sum over V goes in
   position order. Compiled for AVX-512 (head8_*_avx512) it has 32 vector registers for the
   16-register spills of NV = 16. SmolLM2 Q4_0, 128 tokens after 5, 1 thread, the heads' time per
   token (rdtsc around them, a throwaway build alternating both in one process): AVX2 367 -> 304
   us, AVX-512 371 -> 327 us. What is left is mostly the K/V rows' reads from memory: prefetching
   them while the qkv rows are read took them to 223 us but cost as much again in the prefetches,
   so it is not done. */
#define HEAD8_MAX 32
/* Eight values of a K or V cache from element i: f32, or f16 (F16 a constant where head8 inlines). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline __m256 kv8(const void *p, int64_t i, const int F16) {
    return F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const half_t *)p + i)))
               : _mm256_loadu_ps((const float *)p + i);
}

__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void head8(const int NV, const int F16, const float *q, const void *K, const void *V, int64_t n,
                         float scale, float softcap, float *s, float *o) {
    const int64_t hd = 8 * NV;
    __m256 qv[HEAD8_MAX], ov[HEAD8_MAX];
#pragma GCC unroll 16
    for (int c = 0; c < NV; c++) {
        qv[c] = _mm256_loadu_ps(q + 8 * c);
        ov[c] = _mm256_setzero_ps();
    }
    __m128 top4 = _mm_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 4) {
        const int64_t k0 = j * hd, k1 = j + 1 < n ? k0 + hd : k0, k2 = j + 2 < n ? k0 + 2 * hd : k0,
                      k3 = j + 3 < n ? k0 + 3 * hd : k0;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) {
            a0 = _mm256_fmadd_ps(kv8(K, k0 + 8 * c, F16), qv[c], a0);
            a1 = _mm256_fmadd_ps(kv8(K, k1 + 8 * c, F16), qv[c], a1);
            a2 = _mm256_fmadd_ps(kv8(K, k2 + 8 * c, F16), qv[c], a2);
            a3 = _mm256_fmadd_ps(kv8(K, k3 + 8 * c, F16), qv[c], a3);
        }
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m128 v = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)), _mm_set1_ps(scale));
        if (softcap > 0.0f) {
            float t[4];
            _mm_storeu_ps(t, v);
            for (int i = 0; i < 4; i++) t[i] = softcap * tanhf(t[i] / softcap);
            v = _mm_loadu_ps(t);
        }
        if (j + 4 <= n) {
            _mm_storeu_ps(s + j, v);
            top4 = _mm_max_ps(v, top4);     /* a NaN score leaves the running top as it is, as below */
        } else {
            float t[4];
            _mm_storeu_ps(t, v);
            for (int64_t i = 0; i < n - j; i++) s[j + i] = t[i];
        }
    }
    float top4s[4], top = -INFINITY;
    _mm_storeu_ps(top4s, top4);
    for (int i = 0; i < 4; i++) top = top4s[i] > top ? top4s[i] : top;
    for (int64_t j = n / 4 * 4; j < n; j++) top = s[j] > top ? s[j] : top;
    __m256 tv = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j < 8 ? n - j : 8)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 e = _mm256_and_ps(pinfer_exp256(_mm256_sub_ps(_mm256_maskload_ps(s + j, m), _mm256_set1_ps(top))),
                                       _mm256_castsi256_ps(m));
        _mm256_maskstore_ps(s + j, m, e);
        tv = _mm256_add_ps(tv, e);
    }
    for (int64_t j = 0; j < n; j++) {
        const __m256 p = _mm256_set1_ps(s[j]);
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) ov[c] = _mm256_fmadd_ps(p, kv8(V, j * hd + 8 * c, F16), ov[c]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / pinfer_hsum8(tv));
#pragma GCC unroll 16
    for (int c = 0; c < NV; c++) _mm256_storeu_ps(o + 8 * c, _mm256_mul_ps(ov[c], inv));
}

/* head8 for one width, one KV type (F16) and one ISA; `hd` is read only by the variable-width ones
   (head8_any*). */
typedef void (*head_fn)(const float *, const void *, const void *, int64_t, int64_t, float, float, float *, float *);
#define PINFER_HEAD8(NAME, NV, F16)                                                                             \
    __attribute__((target("avx2,fma,f16c"))) static void NAME(const float *q, const void *K, const void *V,     \
                                                             int64_t n, int64_t hd, float scale, float softcap, \
                                                             float *s, float *o) {                              \
        (void)hd;                                                                                               \
        head8(NV, F16, q, K, V, n, scale, softcap, s, o);                                                       \
    }                                                                                                           \
    __attribute__((target("avx512f,avx512vl,fma,f16c"))) static void NAME##_avx512(                               \
        const float *q, const void *K, const void *V, int64_t n, int64_t hd, float scale, float softcap,        \
        float *s, float *o) {                                                                                   \
        (void)hd;                                                                                               \
        head8(NV, F16, q, K, V, n, scale, softcap, s, o);                                                       \
    }
PINFER_HEAD8(head8_4, 4, 0) PINFER_HEAD8(head8_8, 8, 0) PINFER_HEAD8(head8_12, 12, 0) PINFER_HEAD8(head8_16, 16, 0)
PINFER_HEAD8(head8_any, (int)(hd / 8), 0)
PINFER_HEAD8(head8_4_h, 4, 1) PINFER_HEAD8(head8_8_h, 8, 1) PINFER_HEAD8(head8_12_h, 12, 1)
PINFER_HEAD8(head8_16_h, 16, 1) PINFER_HEAD8(head8_any_h, (int)(hd / 8), 1)

/* The head8 for head width hd, KV type (f16) and ISA (AVX2 or AVX-512), or NULL where hd is not a
   multiple of 8 up to 8 * HEAD8_MAX. */
static head_fn head8_for(int64_t hd, int f16, int isa) {
    const int w = isa == ISA_AVX512;
    if (hd % 8 || hd > 8 * HEAD8_MAX) return NULL;
    static const head_fn fns[2][2][5] = {
        {{head8_4, head8_8, head8_12, head8_16, head8_any},
         {head8_4_avx512, head8_8_avx512, head8_12_avx512, head8_16_avx512, head8_any_avx512}},
        {{head8_4_h, head8_8_h, head8_12_h, head8_16_h, head8_any_h},
         {head8_4_h_avx512, head8_8_h_avx512, head8_12_h_avx512, head8_16_h_avx512, head8_any_h_avx512}}};
    const int which = hd == 32 ? 0 : hd == 64 ? 1 : hd == 96 ? 2 : hd == 128 ? 3 : 4;
    return fns[f16 != 0][w][which];
}
#endif

static void heads(void *p, int64_t h0, int64_t h1) {
    const heads_t *t = p;
    const attn_call_t *a = t->a;
    const int64_t hd = a->hd, group = a->n_head / a->n_kv;
    const int f16 = a->kv_f16;
    const size_t width = f16 ? sizeof(half_t) : sizeof(float);
#ifdef PINFER_X86
    const head_fn f = t->isa == ISA_PORTABLE ? NULL : head8_for(hd, f16, t->isa);
#endif
    const int64_t first = a->window > 0 && t->n > a->window ? t->n - a->window : 0, n = t->n - first;
    for (int64_t h = h0; h < h1; h++) {
        const size_t at = (size_t)((h / group) * a->n_ctx * hd + first * hd) * width;
        const void *K = (const char *)a->k_cache + at, *V = (const char *)a->v_cache + at;
        const float *q = t->q + h * hd;
        float *s = t->scores + h * a->n_ctx, *o = t->out + h * hd;
#ifdef PINFER_X86
        if (f) {
            f(q, K, V, n, hd, a->scale, a->softcap, s, o);
            continue;
        }
        if (t->isa == ISA_AVX512 && !f16) {     /* widths not a multiple of 8 */
            head_avx512(q, K, V, n, hd, a->scale, a->softcap, s, o);
            continue;
        }
#endif
        head_portable(q, K, V, n, hd, a->scale, a->softcap, s, o, f16);
    }
}

/* -- the calls ------------------------------------------------------------------------------------- */

static int64_t kmax(const attn_call_t *a) { return a->d > a->out.k ? a->d : a->out.k; }

/* Floats of scratch a layer's call over nt tokens takes: per token x, qkv, the heads' output and
   quantized x; the scores of one token's heads. */
int64_t pinfer_attn_work(const attn_call_t *a, int64_t nt) {
    return nt * (kmax(a) + a->qkv.rows + a->out.k + qx_floats(kmax(a))) + a->n_head * a->n_ctx + 2 * kmax(a);
}

/* Floats of scratch the head's call over nt rows takes: per row the sum, its norm and quantized x. */
int64_t pinfer_head_work(const head_call_t *a, int64_t nt) { return nt * (2 * a->d + qx_floats(a->d)); }

/* RoPE on one token's q and k (qkv: its row), and its k and v into the cache at pos. */
static void rope_store(const attn_call_t *a, float *qkv, int64_t pos) {
    const int64_t hd = a->hd, half = a->rot / 2;
    float *q = qkv, *k = qkv + a->n_head * hd, *v = k + a->n_kv * hd;
    const float *c = a->cos + pos * half, *s = a->sin + pos * half;
    for (int64_t h = 0; h < a->n_head; h++) {
        if (a->q_norm) rms_norm(q + h * hd, a->q_norm, a->eps, hd, q + h * hd);
        rope(q + h * hd, c, s, a->rot, a->interleaved);
    }
    for (int64_t h = 0; h < a->n_kv; h++) {
        if (a->k_norm) rms_norm(k + h * hd, a->k_norm, a->eps, hd, k + h * hd);
        rope(k + h * hd, c, s, a->rot, a->interleaved);
        const int64_t at = (h * a->n_ctx + pos) * hd;
        if (a->kv_f16) {
            half_t *kc = (half_t *)a->k_cache + at, *vc = (half_t *)a->v_cache + at;
            for (int64_t i = 0; i < hd; i++) {
                kc[i] = to_half(k[h * hd + i]);
                vc[i] = to_half(v[h * hd + i]);
            }
        } else {
            memcpy((float *)a->k_cache + at, k + h * hd, (size_t)hd * sizeof(float));
            memcpy((float *)a->v_cache + at, v + h * hd, (size_t)hd * sizeof(float));
        }
    }
}

/* The layer over nt consecutive tokens from position pos0 (resid ... x_out: nt rows of d): each
   token's result is the one its own call gives (the linear layers' dots do not depend on nt, and a
   token's heads read the cache up to its own position, which the batch has written before). */
static void attn_tokens(const attn_call_t *a, int64_t nt, int64_t pos0, int threads, int isa) {
    const int64_t d = a->d, hd = a->hd, km = kmax(a);
    float *x = a->work, *qkv = x + nt * km, *att = qkv + nt * a->qkv.rows, *scores = att + nt * a->out.k;
    float *qbuf = scores + a->n_head * a->n_ctx, *cbuf = qbuf + nt * qx_floats(km);
    for (int64_t t = 0; t < nt; t++) {
        float *r = a->resid_out + t * d;
        const float *dt = a->delta + t * d;
        if (a->delta_norm) {        /* x's row as the normed delta's scratch until the norm below */
            rms_norm(dt, a->delta_norm, a->eps, d, x + t * d);
            dt = x + t * d;
        }
        for (int64_t i = 0; i < d; i++) r[i] = a->resid[t * d + i] + dt[i];
        rms_norm(r, a->attn_norm, a->eps, d, x + t * d);
    }
    if (a->qkv_c.q) cols_linear(&a->qkv_c, &a->qkv, x, qkv, nt, cbuf, threads, a->kept);
    else linear(&a->qkv, x, qkv, nt, qbuf, threads, isa);
    for (int64_t t = 0; t < nt; t++) rope_store(a, qkv + t * a->qkv.rows, pos0 + t);
    for (int64_t t = 0; t < nt; t++) {
        const int64_t pos = pos0 + t;
        heads_t h = {a, qkv + t * a->qkv.rows, att + t * a->out.k, scores, pos + 1, isa};
        pinfer_parallel(a->n_head * (pos + 1) * hd >= PARALLEL_WORK / 4 ? threads : 1, a->n_head, heads, &h);
    }
    if (a->out_c.q) cols_linear(&a->out_c, &a->out, att, x, nt, cbuf, threads, a->kept ? a->kept + 1 : NULL);
    else linear(&a->out, att, x, nt, qbuf, threads, isa);
    for (int64_t t = 0; t < nt; t++) {
        float *r = a->resid_out + t * d;
        if (a->post_norm) rms_norm(x + t * d, a->post_norm, a->eps, d, x + t * d);
        for (int64_t i = 0; i < d; i++) r[i] += x[t * d + i];
        rms_norm(r, a->ffn_norm, a->eps, d, a->x_out + t * d);
        if (a->down_bias)
            for (int64_t i = 0; i < d; i++) r[i] += a->down_bias[i];
    }
}

/* One token, `back` tokens before the end of the call. Returns 0, or -1 when the position is
   outside the cache. */
int pinfer_attn_call(const attn_call_t *a) {
    const int64_t pos = *a->total - 1 - a->back;
    if (pos < 0 || pos >= a->n_ctx) return -1;
    const int isa = pinfer_sparse_isa(-1);
    const int threads = pinfer_pool_enter(a->threads);
    attn_tokens(a, 1, pos, threads, isa);
    pinfer_pool_leave(a->threads);
    return 0;
}

/* The call's last nt tokens (back 0) in one call: every weight row read once for all of them
   (a prompt). Returns 0, or -1 when they do not fit the cache or nt is not 1..MAX_BATCH. */
int pinfer_attn_batch(const attn_call_t *a, int64_t nt) {
    const int64_t pos0 = *a->total - nt;
    if (nt < 1 || nt > MAX_BATCH || a->back || pos0 < 0 || pos0 + nt > a->n_ctx) return -1;
    const int isa = pinfer_sparse_isa(-1);
    const int threads = pinfer_pool_enter(a->threads);
    attn_tokens(a, nt, pos0, threads, isa);
    pinfer_pool_leave(a->threads);
    return 0;
}

/* Logits of nt rows (resid, delta: nt rows of d; logits: nt rows of the vocabulary), the head's
   weights read once for all of them; each row's logits are the ones a call of its own gives.
   Returns 0, or -1 where nt is not 1..MAX_BATCH. */
int pinfer_head_rows(const head_call_t *a, int64_t nt) {
    const int64_t d = a->d;
    if (nt < 1 || nt > MAX_BATCH) return -1;
    float *r = a->work, *x = r + nt * d;
    const int isa = pinfer_sparse_isa(-1);
    const int threads = pinfer_pool_enter(a->threads);
    for (int64_t t = 0; t < nt; t++) {
        const float *dt = a->delta + t * d;
        if (a->delta_norm) {        /* x's row as the normed delta's scratch until the norm below */
            rms_norm(dt, a->delta_norm, a->eps, d, x + t * d);
            dt = x + t * d;
        }
        for (int64_t i = 0; i < d; i++) r[t * d + i] = a->resid[t * d + i] + dt[i];
        rms_norm(r + t * d, a->norm, a->eps, d, x + t * d);
    }
    linear(&a->w, x, a->logits, nt, x + nt * d, threads, isa);
    pinfer_pool_leave(a->threads);
    if (a->softcap > 0.0f)
        for (int64_t i = 0; i < nt * a->w.rows; i++) a->logits[i] = a->softcap * tanhf(a->logits[i] / a->softcap);
    return 0;
}

int pinfer_head_call(const head_call_t *a) { return pinfer_head_rows(a, 1); }

int64_t pinfer_decode_abi(const char *name) {
    if (!strcmp(name, "sizeof.attn_call_t")) return sizeof(attn_call_t);
    if (!strcmp(name, "sizeof.head_call_t")) return sizeof(head_call_t);
    return -1;
}
