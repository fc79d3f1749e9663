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
 *
 * This file holds the orchestration; the row dots, the activations' quantization and the attention
 * heads are quants.h's primitives, called through ISA_OPS (x86/ holds the SIMD ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "codes.h"
#include "pool.h"
#include "quants.h"   /* the primitives, through ISA_OPS */

/* linear_t: quants.h */

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

/* -- a linear layer: y = W x (+ bias) over threads, each a range of rows ----------------------- */

typedef struct {
    const linear_t *w;
    const qx_t *qx;                     /* nt tokens' x quantized (q4, q5, q8) */
    const float *x;                     /* nt tokens' x, w->k apart (f16, f32) */
    float *y;                           /* nt tokens' y, w->rows apart */
    int64_t nt;
} lin_t;

/* Rows 4 * b0 .. 4 * b1 (the last range ends at the matrix's end) against every token: the ranges
   hold whole blocks of four, so a matrix's rows go in the same blocks on any number of threads, and
   the rows left over at its end alone (a row read alone sums in another order: quants.h). Each row
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
    const isa_ops_t *const ops = ISA_OPS;
    const int64_t ahead8 = rows_ahead(k);
    for (; r < r1; r++)
        for (int64_t t = 0; t < l->nt; t++) {
            float v;
            switch (w->fmt) {
            case FMT_Q8: {
                const uint8_t *q = (const uint8_t *)w->q + r * k;
                v = ops->dot_q8(q, w->scale + r * ng, &l->qx[t], k, t == 0 && r + ahead8 < n ? q + ahead8 * k : NULL);
                break;
            }
            case FMT_F16:
                v = ops->dot_f16((const uint16_t *)w->q + r * k, l->x + t * k, k, NULL);
                break;
            default:
                v = ops->dot_f32((const float *)w->q + r * k, l->x + t * k, k);
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
static void linear(const linear_t *w, const float *x, float *y, int64_t nt, float *qbuf, int threads) {
    qx_t qx[MAX_BATCH];
    for (int64_t t = 0; t < nt; t++) {
        qx[t] = pinfer_qx_at(qbuf + t * qx_floats(w->k), w->k);
        if (w->fmt == FMT_Q4 || w->fmt == FMT_Q5) ISA_OPS->quantize_chunks(x + t * w->k, w->k, &qx[t]);
        else if (w->fmt == FMT_Q8) ISA_OPS->quantize_natural(x + t * w->k, w->k, &qx[t]);
    }
    lin_t l = {w, qx, x, y, nt};
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
} heads_t;

/* The set's 8-lane head kernel (x86/avx2.h's head8) for head width hd and KV type (f16), or NULL
   where it has none or hd is not a multiple of 8 up to 8 * HEAD8_MAX. */
static head_fn head8_for(const isa_ops_t *ops, int64_t hd, int f16) {
    if (hd % 8 || hd > 8 * HEAD8_MAX) return NULL;
    const int which = hd == 32 ? 0 : hd == 64 ? 1 : hd == 96 ? 2 : hd == 128 ? 3 : 4;
    return ops->head8[f16 != 0][which];
}

static void heads(void *p, int64_t h0, int64_t h1) {
    const heads_t *t = p;
    const attn_call_t *a = t->a;
    const int64_t hd = a->hd, group = a->n_head / a->n_kv;
    const int f16 = a->kv_f16;
    const size_t width = f16 ? sizeof(half_t) : sizeof(float);
    const isa_ops_t *const ops = ISA_OPS;
    const head_fn f = head8_for(ops, hd, f16);
    const int64_t first = a->window > 0 && t->n > a->window ? t->n - a->window : 0, n = t->n - first;
    for (int64_t h = h0; h < h1; h++) {
        const size_t at = (size_t)((h / group) * a->n_ctx * hd + first * hd) * width;
        const void *K = (const char *)a->k_cache + at, *V = (const char *)a->v_cache + at;
        const float *q = t->q + h * hd;
        float *s = t->scores + h * a->n_ctx, *o = t->out + h * hd;
        if (f) f(q, K, V, n, hd, a->scale, a->softcap, s, o);
        else ops->head(q, K, V, n, hd, a->scale, a->softcap, s, o, f16);
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
static void attn_tokens(const attn_call_t *a, int64_t nt, int64_t pos0, int threads) {
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
    else linear(&a->qkv, x, qkv, nt, qbuf, threads);
    for (int64_t t = 0; t < nt; t++) rope_store(a, qkv + t * a->qkv.rows, pos0 + t);
    for (int64_t t = 0; t < nt; t++) {
        const int64_t pos = pos0 + t;
        heads_t h = {a, qkv + t * a->qkv.rows, att + t * a->out.k, scores, pos + 1};
        pinfer_parallel(a->n_head * (pos + 1) * hd >= PARALLEL_WORK / 4 ? threads : 1, a->n_head, heads, &h);
    }
    if (a->out_c.q) cols_linear(&a->out_c, &a->out, att, x, nt, cbuf, threads, a->kept ? a->kept + 1 : NULL);
    else linear(&a->out, att, x, nt, qbuf, threads);
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
    const int threads = pinfer_pool_enter(a->threads);
    attn_tokens(a, 1, pos, threads);
    pinfer_pool_leave(a->threads);
    return 0;
}

/* The call's last nt tokens (back 0) in one call: every weight row read once for all of them
   (a prompt). Returns 0, or -1 when they do not fit the cache or nt is not 1..MAX_BATCH. */
int pinfer_attn_batch(const attn_call_t *a, int64_t nt) {
    const int64_t pos0 = *a->total - nt;
    if (nt < 1 || nt > MAX_BATCH || a->back || pos0 < 0 || pos0 + nt > a->n_ctx) return -1;
    const int threads = pinfer_pool_enter(a->threads);
    attn_tokens(a, nt, pos0, threads);
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
    linear(&a->w, x, a->logits, nt, x + nt * d, threads);
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
