/* Sparse FFN of one token (decode) over the neuron bundles: predictor -> candidate list -> gather
 * GEMV over the candidates' gate/up rows -> activation and the exact rule -> axpy over the
 * survivors' down rows.
 *
 * Layouts (formats/schema.py; n = n_ff neurons, d = d_model, r = predictor rank, G = 32):
 *   x        f32 (d)                the FFN input (after the FFN norm)
 *   y        f32 (d)                output, overwritten
 *   gate_up  FMT_Q4   q u8 (n, 2, d/2), scale f16 (n, 2, d/G), min f16 (n, 2, d/G) or none;
 *                     neuron j: its gate row, then its up row; in a row, element 2k is the low
 *                     nibble of byte k and 2k+1 the high one; w = scale*q + min, or scale*(q - 8)
 *            FMT_Q5   as FMT_Q4 (the low 4 bits), plus qh u8 (n, 2, d/8): per group of 32, a
 *                     little-endian u16 of the even elements' fifth bits, then one of the odd
 *                     elements' (the nibble planes' order); w = scale*q + min, or scale*(q - 16)
 *            FMT_F16  w f16 (n, 2, d); FMT_F32  w f32 (n, 2, d)
 *   down_t   FMT_Q4   q u8 (n, d/2), scale f16 (n, d/G), min f16 (n, d/G) or none (groups along d)
 *            FMT_Q4R  q u8 (n, d/2), scale f16 (n/G, d), min f16 (n/G, d) or none (groups of
 *                     32 neurons, GGUF's layout)
 *            FMT_Q8   q u8 (n, d) (q + 128), scale f16 (n, d/G) (groups along d)
 *            FMT_F16  w f16 (n, d); FMT_F32  w f32 (n, d)
 *   predictor  w1 q8: q u8 (r, d), scale f16 (r, d/G); w2 q8: q u8 (n, r), scale f16 (n, r/G);
 *              or both q4, as gate/up's rows: q u8 (r, d/2) and (n, r/2), scale and min (or none)
 *              f16 (r, d/G) and (n, r/G); b2 f32 (n); q8 stores q + 128; scores = w2 relu(w1 x) + b2
 *   idx      i32 (n) scratch: candidates, then survivors; val f32 (n) scratch: their h
 *
 * INT4 gate/up rows meet int8 activations (x quantized per group of 32, as llama.cpp's Q8_0):
 * AVX-512 VNNI (vpdpbusd) or AVX2 (pmaddubsw) integer dot products per group, scaled once per
 * group. The activations are stored in the nibbles' order: per chunk of up to four groups, the
 * even elements of each group (16 bytes per group), then the odd ones, so that the low and high
 * nibbles of 64 weight bytes meet their activations in one load each.
 *
 * Threads split the candidates (gate/up) and the output columns (down); every output element is
 * summed by one thread in ascending neuron order, so results do not depend on the thread count.
 *
 * This file holds the kernels' orchestration (which rows, which threads, in which order); the row
 * dots, axpys and rules are quants.h's primitives, called through ISA_OPS (x86/ holds the SIMD ones).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "codes.h"   /* FMT_* (q5: gate/up only), MODE_*, ACT_* */
#include "pool.h"
#include "quants.h"   /* the primitives, through ISA_OPS */
#include <stdatomic.h>

/* Loops over fewer weights than this run on the calling thread alone. The pool's workers spin
   through a call, so a loop pays no wake-up, only the hand-out of its ranges. SmolLM2's loops
   (576 x 1536) were all under the former limit of 1M weights; from 256k they take both threads:
   benchmarks/decode_profile.py's kernel time per token on 2 threads went from 4.60 to 3.17 ms, and
   benchmarks/sparse_kernel.py --shapes smollm2 --formats int4 --fractions 1 from 14.2 to 16.7 GB/s.
   (PARALLEL_WORK is in quants.h: decode.c's loops share it.) */

/* `next`: a row of as many bytes to prefetch while this one is read (the next candidate's: a
   gather's rows are short streams the hardware prefetcher does not follow in time), or NULL. */
static float dot_q4(const uint8_t *q, const uint8_t *qh, const uint16_t *scale, const uint16_t *min, const qx_t *x,
                    int64_t d, const uint8_t *next) {
    const rows4_t w = {{q}, {qh}, {scale}, {min}};
    float out;
    pinfer_dot_rows(1, &w, x, d, &out, next, 0);
    return out;
}

/* -- the layer ------------------------------------------------------------------------------- */

typedef struct {
    int gu_fmt, down_fmt, act;
    const void *gu_q;             /* q bytes, or the f16 weights */
    const uint16_t *gu_scale, *gu_min;
    const uint8_t *gu_qh;         /* FMT_Q5's fifth bits, else NULL */
    const void *dn_q;
    const uint16_t *dn_scale, *dn_min;
    int64_t d;
} ffn_t;

/* The candidate whose gate/up rows to prefetch while candidate k's are read, or -1: the next one
   where it does not follow k (a gather's rows are short streams the hardware prefetcher does not
   pick up in time), else the one after it, so a run of consecutive rows (dense) is fetched a row
   ahead of the hardware prefetcher (+7-16% at one thread on LLaMA-7B's layer, sparse_kernel.py). */
static int64_t prefetch_row(const int32_t *idx, int64_t k, int64_t m) {
    if (k + 1 >= m) return -1;
    if (idx[k + 1] != idx[k] + 1) return idx[k + 1];
    return k + 2 < m ? idx[k + 2] : -1;
}

/* gate and up of neuron j into *gp, *up (up 0, not read, where a ReLU gate is not positive);
   `next`: the neuron whose rows to prefetch meanwhile (prefetch_row), or -1. */
static void neuron_gu(const ffn_t *f, int64_t j, const float *x, const qx_t *qx, int64_t next, float *gp, float *up) {
    const int64_t d = f->d;
    float g, u = 0.0f;
    if (f->gu_fmt == FMT_F16) {
        const uint16_t *row = (const uint16_t *)f->gu_q + j * 2 * d;
        const uint16_t *pf = next >= 0 ? (const uint16_t *)f->gu_q + next * 2 * d : NULL;
        g = ISA_OPS->dot_f16(row, x, d, pf);
        if (f->act != ACT_RELU || g > 0.0f) u = ISA_OPS->dot_f16(row + d, x, d, pf ? pf + d : NULL);
    } else if (f->gu_fmt == FMT_F32) {
        const float *row = (const float *)f->gu_q + j * 2 * d;
        g = ISA_OPS->dot_f32(row, x, d);
        if (f->act != ACT_RELU || g > 0.0f) u = ISA_OPS->dot_f32(row + d, x, d);
    } else {
        const uint8_t *q = (const uint8_t *)f->gu_q + j * d; /* 2 rows of d/2 bytes */
        const int64_t ng = d / G;
        const uint16_t *sc = f->gu_scale + j * 2 * ng, *mn = f->gu_min ? f->gu_min + j * 2 * ng : NULL;
        const uint8_t *pf = next >= 0 ? (const uint8_t *)f->gu_q + next * d : NULL;
        const uint8_t *qh = f->gu_fmt == FMT_Q5 ? f->gu_qh + j * (d / 4) : NULL;  /* 2 rows of d/8 bytes */
        if (f->act == ACT_RELU || d > SHORT_ROW) {   /* the up row only where a ReLU gate passes */
            g = dot_q4(q, qh, sc, mn, qx, d, pf);
            if (f->act != ACT_RELU || g > 0.0f)
                u = dot_q4(q + d / 2, qh ? qh + d / 8 : NULL, sc + ng, mn ? mn + ng : NULL, qx, d, pf ? pf + d / 2 : NULL);
        } else {                    /* both rows in one pass over x */
            const rows4_t w = {{q, q + d / 2}, {qh, qh ? qh + d / 8 : NULL}, {sc, sc + ng},
                               {mn, mn ? mn + ng : NULL}};
            float gu[2];
            pinfer_dot_rows(2, &w, qx, d, gu, pf, d / 2);
            g = gu[0];
            u = gu[1];
        }
    }
    *gp = g;
    *up = u;
}

/* gate and up of neurons j and j + 1 (short q4/q5 rows, no ReLU) into g[0..1], u[0..1]: their four rows, consecutive
   in the bundle, in one pass over x; the rows PAIR_AHEAD neurons on are prefetched meanwhile
   (unless past n), so that memory is read ahead of the hardware prefetcher. */
#define PAIR_AHEAD 8
static void neuron_pair(const ffn_t *f, int64_t j, int64_t n, const qx_t *qx, float *g, float *u) {
    const int64_t d = f->d, ng = d / G;
    rows4_t w;
    for (int r = 0; r < 4; r++) {
        w.q[r] = (const uint8_t *)f->gu_q + j * d + r * (d / 2);
        w.qh[r] = f->gu_fmt == FMT_Q5 ? f->gu_qh + j * (d / 4) + r * (d / 8) : NULL;
        w.scale[r] = f->gu_scale + (2 * j + r) * ng;
        w.min[r] = f->gu_min ? f->gu_min + (2 * j + r) * ng : NULL;
    }
    float gu[4];
    pinfer_dot_rows(4, &w, qx, d, gu, j + PAIR_AHEAD + 2 <= n ? w.q[0] + PAIR_AHEAD * d : NULL, d / 2);
    g[0] = gu[0], u[0] = gu[1], g[1] = gu[2], u[1] = gu[3];
}

/* p += sum over survivors k of val[k] * row idx[k] of down_t, columns [c0, c1), in ascending k:
   a run of survivors that may continue in the next call (the batch splits them in blocks of whole
   q4r groups). Rows stream whole (axpy order); q4 rows land in p in the nibbles' order (per group
   of 32 columns: the even columns, then the odd ones), their min terms in off; down_cols_finish
   puts them back in order. p, off, acc: scratch of nc, nc/G and nc floats, p and off zeroed before
   the first run. */
#define AXPY_ROWS 4     /* down_t rows per pass of an axpy (isa_ops_t's axpy_*: p loaded and stored once) */
static void down_cols_acc(const ffn_t *f, const int32_t *idx, const float *val, int64_t m, int64_t c0, int64_t c1,
                          float *restrict p, float *restrict off, float *restrict acc, float (*a)[MAX_D / G]) {
    const isa_ops_t *const ops = ISA_OPS;
    const int64_t d = f->d, nc = c1 - c0, ng = nc / G, g0 = c0 / G;
    if (f->down_fmt == FMT_F16 || f->down_fmt == FMT_F32) {
        const int wide = f->down_fmt == FMT_F32;
        for (int64_t k = 0; k < m; k += AXPY_ROWS) {
            const int R = m - k < AXPY_ROWS ? (int)(m - k) : AXPY_ROWS;
            const void *q[AXPY_ROWS];
            for (int r = 0; r < R; r++) {
                const int64_t at = (int64_t)idx[k + r] * d + c0;
                q[r] = wide ? (const void *)((const float *)f->dn_q + at)
                            : (const void *)((const uint16_t *)f->dn_q + at);
            }
            if (wide) ops->axpy_f32(p, (const float *const *)q, val + k, R, nc);
            else ops->axpy_f16(p, (const uint16_t *const *)q, val + k, R, nc);
        }
        return;
    }
    if (f->down_fmt == FMT_Q8) {
        for (int64_t k = 0; k < m; k += AXPY_ROWS) {
            const int R = m - k < AXPY_ROWS ? (int)(m - k) : AXPY_ROWS;
            const uint8_t *q[AXPY_ROWS], *next[AXPY_ROWS];
            const uint16_t *sc[AXPY_ROWS];
            for (int r = 0; r < R; r++) {
                q[r] = (const uint8_t *)f->dn_q + (int64_t)idx[k + r] * d + c0;
                sc[r] = f->dn_scale + (int64_t)idx[k + r] * (d / G) + g0;
            }
            int Rn = 0;     /* the next pass's rows, fetched meanwhile: a gather's rows are short streams */
            for (; Rn < AXPY_ROWS && k + R + Rn < m; Rn++)
                next[Rn] = (const uint8_t *)f->dn_q + (int64_t)idx[k + R + Rn] * d + c0;
            ops->axpy_q8(p, q, sc, val + k, R, ng, next, Rn);
        }
        return;
    }
    if (f->down_fmt == FMT_Q4) {
        for (int64_t k = 0; k < m; k += AXPY_ROWS) {
            const int R = m - k < AXPY_ROWS ? (int)(m - k) : AXPY_ROWS;
            const uint8_t *q[AXPY_ROWS];
            for (int r = 0; r < R; r++) {
                const int64_t j = idx[k + r];
                const uint16_t *sc = f->dn_scale + j * (d / G) + g0;
                const uint16_t *mn = f->dn_min ? f->dn_min + j * (d / G) + g0 : NULL;
                q[r] = (const uint8_t *)f->dn_q + j * (d / 2) + c0 / 2;
                ops->row_scales(a[r], off, sc, mn, val[k + r], ng);
            }
            ops->axpy_q4(p, q, (const float (*)[MAX_D / G])a, R, ng);
        }
        return;
    }
    /* FMT_Q4R: survivors of one group of 32 neurons share the per-column scale and min: sum their
       rows unscaled in acc, then scale once per group */
    for (int64_t k = 0; k < m;) {
        const int64_t grp = idx[k] / G;
        if (ops->axpy_scaled_q4r) {     /* the group's survivors in one pass */
            int64_t e = k, e2;
            while (e < m && idx[e] / G == grp) e++;
            for (e2 = e; e2 < m && idx[e2] / G == idx[e] / G; e2++) {}
            const uint8_t *q[G], *next[G];
            float v[G], vsum = 0.0f;
            for (int64_t r = 0; r < e - k; r++) {
                q[r] = (const uint8_t *)f->dn_q + (int64_t)idx[k + r] * (d / 2) + c0 / 2;
                v[r] = val[k + r];
                vsum += v[r];
            }
            for (int64_t r = 0; r < e2 - e; r++) next[r] = (const uint8_t *)f->dn_q + (int64_t)idx[e + r] * (d / 2) + c0 / 2;
            ops->axpy_scaled_q4r(p, q, v, (int)(e - k), f->dn_scale + grp * d + c0,
                                 f->dn_min ? f->dn_min + grp * d + c0 : NULL, vsum, ng, next, (int)(e2 - e));
            k = e;
            continue;
        }
        memset(acc, 0, (size_t)nc * sizeof(float));
        float vsum = 0.0f;
        int64_t k1 = k;
        while (k1 < m && idx[k1] / G == grp) {
            const uint8_t *q[AXPY_ROWS];
            int R = 0;
            for (; R < AXPY_ROWS && k1 < m && idx[k1] / G == grp; R++, k1++) {
                q[R] = (const uint8_t *)f->dn_q + (int64_t)idx[k1] * (d / 2) + c0 / 2;
                for (int64_t g = 0; g < ng; g++) a[R][g] = val[k1];
                vsum += val[k1];
            }
            ops->axpy_q4(acc, q, (const float (*)[MAX_D / G])a, R, ng);
        }
        ops->scale_group(p, acc, f->dn_scale + grp * d + c0, f->dn_min ? f->dn_min + grp * d + c0 : NULL, vsum, ng);
        k = k1;
    }
}

/* y[c0, c1) from down_cols_acc's p and off. */
static void down_cols_finish(const ffn_t *f, const float *p, const float *off, float *y, int64_t c0, int64_t c1) {
    const int64_t nc = c1 - c0, ng = nc / G;
    if (f->down_fmt != FMT_Q4 && f->down_fmt != FMT_Q4R) {
        memcpy(y + c0, p, (size_t)nc * sizeof(float));
        return;
    }
    for (int64_t g = 0; g < ng; g++)
        for (int e = 0; e < 16; e++) {
            const float o = f->down_fmt == FMT_Q4 ? off[g] : 0.0f;
            y[c0 + g * G + 2 * e] = p[g * G + e] + o;
            y[c0 + g * G + 2 * e + 1] = p[g * G + 16 + e] + o;
        }
}

/* y[c0, c1) = sum over survivors k of val[k] * row idx[k] of down_t, in ascending k. */
static void down_cols(const ffn_t *f, const int32_t *idx, const float *val, int64_t m, float *y, int64_t c0,
                      int64_t c1, float *restrict p, float *restrict off, float *restrict acc,
                      float (*a)[MAX_D / G]) {
    memset(p, 0, (size_t)(c1 - c0) * sizeof(float));
    memset(off, 0, (size_t)((c1 - c0) / G) * sizeof(float));
    down_cols_acc(f, idx, val, m, c0, c1, p, off, acc, a);
    down_cols_finish(f, p, off, y, c0, c1);
}

/* W_down itself, (d, n) with groups of 32 along n (the transpose of a q4r down_t, as MatMulNBits
   holds it), for when most neurons survive: then d row dots over the whole h read every row once
   at the gate/up rows' speed, where the axpy pays a float conversion per weight. */
typedef struct {
    int fmt;                    /* FMT_Q4: q u8 (d, n/2), scale and min (or none) f16 (d, n/G) */
    const uint8_t *q;           /* NULL: no W_down, always the axpy */
    const uint16_t *scale, *min;
    int64_t from;               /* survivors from which the row dots run */
} rows_t;

/* A call's arguments in one struct, bound once by the caller: a call through ctypes then costs
   one pointer instead of 27 conversions.
 *   mode      MODE_DENSE: every neuron, no rule; MODE_DOWN: every neuron, |h| >= thr;
 *             MODE_PREDICTED: the predictor's candidates (score >= pred_thr), |h| >= thr;
 *             MODE_RELU: the predictor's candidates, h != 0
 *             MODE_GIVEN: the counts[0] candidates the caller put in idx (ascending), |h| >= thr
 *   counts    out: [candidates, survivors] */
typedef struct {
    int mode, act, gu_fmt, down_fmt, pred_fmt;  /* pred_fmt: FMT_Q8 or FMT_Q4 (w1m, w2m its mins, or NULL) */
    const void *gu_q;
    const uint16_t *gu_scale, *gu_min;
    const uint8_t *gu_qh;
    const void *dn_q;
    const uint16_t *dn_scale, *dn_min;
    const uint8_t *w1q;
    const uint16_t *w1s, *w1m;
    const uint8_t *w2q;
    const uint16_t *w2s, *w2m;
    const float *b2;
    int64_t r;
    float thr, pred_thr;
    const float *x;
    float *y;
    int64_t n, d;
    int32_t *idx;
    float *val;
    int64_t *counts;
    int threads;
    rows_t wd;
} ffn_call_t;

/* What the parallel loops of one call share: each loop is a function over a range of its index
   (pool.h), and every output element is one range's, so no result depends on the threads. */
typedef struct {
    const ffn_call_t *a;
    const ffn_t *f;
    int64_t nt;             /* tokens: 1 for a single call */
    const qx_t *qx;         /* per token: x quantized for the gate/up rows, or h for the row dots */
    float *z, *score;       /* predictor hidden (nt, r) and scores (nt, n) */
    const qx_t *px;         /* per token: x quantized for the predictor's rows (w->qx where they agree) */
    qx_t *pz;               /* and its hidden z */
    int64_t m, s;           /* a single call's candidates and survivors */
    const int32_t *u;       /* a batch's union of candidates (mu of them) and each one's tokens */
    const uint64_t *who;
    int64_t mu;
    float *H, *U;           /* a batch's gate, then h (nt, n); its up */
    uint64_t tokens;        /* the tokens the row dots or the down columns serve */
    float *y;               /* row dots: token 0's output, tokens d apart */
    int64_t per;            /* down columns: groups of 32 columns per range */
    _Atomic int failed;     /* a range found memory short */
} work_t;

/* The predictor (docs/design.md section 2): z = relu(W1 x), score = W2 z + b2.
 * q8 (pred_fmt FMT_Q8): its rows against x and then z quantized to int8 per group of 32 in element
 * order, as the head's q8 rows meet theirs (VNNI / AVX2 dots, decode.c). The float dots this
 * replaced read the 7 MB of a LLaMA-7B layer's rank-448 predictor at 3 GB/s on one thread, more
 * time than the candidates' rows themselves (perf over benchmarks/synthetic_decode.py's trained
 * ReLU model).
 * q4 (FMT_Q4, the gate/up rows' layout, with mins or without): x and z quantized in the nibbles'
 * chunk order and the rows read as decode.c's linear layers read theirs, short rows (W2's, r
 * columns) four at a time in whole blocks of four, so no score depends on the threads. The
 * converter picks q4 where it reads fewer bytes per token at the same recall (calibrate.py).
 * The rounding of x and z moves a score by a few tenths of a percent of its spread: the thresholds,
 * chosen at conversion on the scores of the stored (rounded) weights in float, keep their recall but
 * for neurons that close to them. */
static void pred_hidden(void *p, int64_t k0, int64_t k1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const int64_t d = a->d, r = a->r;
    const int64_t ahead = rows_ahead(d);
    for (int64_t k = k0; k < k1; k++)
        for (int64_t t = 0; t < w->nt; t++) {
            const uint8_t *next = t == 0 && k + ahead < r ? a->w1q + (k + ahead) * d : NULL;
            w->z[t * r + k] = ISA_OPS->dot_q8(a->w1q + k * d, a->w1s + k * (d / G), &w->px[t], d, next);
        }
}

static void pred_scores(void *p, int64_t j0, int64_t j1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const int64_t n = a->n, r = a->r;
    const int64_t ahead = rows_ahead(r);
    for (int64_t j = j0; j < j1; j++)
        for (int64_t t = 0; t < w->nt; t++) {
            const uint8_t *next = t == 0 && j + ahead < n ? a->w2q + (j + ahead) * r : NULL;
            w->score[t * n + j] = ISA_OPS->dot_q8(a->w2q + j * r, a->w2s + j * (r / G), &w->pz[t], r, next) + a->b2[j];
        }
}

static void pred_hidden_q4(void *p, int64_t b0, int64_t b1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const linear_t w1 = {FMT_Q4, a->w1q, a->w1s, a->w1m, NULL, NULL, a->r, a->d};
    pinfer_q4_rows(&w1, w->px, w->nt, w->z, a->r, b0, b1);
}

static void pred_scores_q4(void *p, int64_t b0, int64_t b1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const int64_t n = a->n, j1 = 4 * b1 < n ? 4 * b1 : n;
    const linear_t w2 = {FMT_Q4, a->w2q, a->w2s, a->w2m, NULL, NULL, n, a->r};
    pinfer_q4_rows(&w2, w->pz, w->nt, w->score, n, b0, b1);
    for (int64_t t = 0; t < w->nt; t++)
        for (int64_t j = 4 * b0; j < j1; j++) w->score[t * n + j] += a->b2[j];
}

/* Every token's scores into w->score (nt, n); returns -1 when memory is short. A q4 predictor
   meets x quantized in chunk order, which the gate/up rows' w->qx already holds when they are q4 or
   q5; q8 rows meet x in element order. */
static int predict(const ffn_call_t *a, work_t *w, int threads) {
    const int64_t d = a->d, r = a->r, n = a->n, nt = w->nt;
    const int q4 = a->pred_fmt == FMT_Q4;
    const int have_x = q4 && (a->gu_fmt == FMT_Q4 || a->gu_fmt == FMT_Q5);
    void (*const quantize)(const float *, int64_t, qx_t *) = q4 ? ISA_OPS->quantize_chunks : ISA_OPS->quantize_natural;
    const int64_t xb = have_x ? 0 : (pinfer_qx_bytes(d) + 63) / 64 * 64, zb = (pinfer_qx_bytes(r) + 63) / 64 * 64;
    uint8_t *mem = malloc((size_t)(nt * (xb + zb)));
    qx_t *q = malloc((size_t)(2 * nt) * sizeof(qx_t));
    if (!mem || !q) {
        free(mem);
        free(q);
        return -1;
    }
    w->px = have_x ? w->qx : q;
    w->pz = q + nt;
    for (int64_t t = 0; t < nt; t++) {
        w->pz[t] = pinfer_qx_at(mem + nt * xb + t * zb, r);
        if (have_x) continue;
        q[t] = pinfer_qx_at(mem + t * xb, d);
        quantize(a->x + t * d, d, &q[t]);
    }
    pinfer_parallel(r * d * nt >= PARALLEL_WORK ? threads : 1, q4 ? (r + 3) / 4 : r, q4 ? pred_hidden_q4 : pred_hidden,
                    w);
    for (int64_t k = 0; k < nt * r; k++) w->z[k] = w->z[k] > 0.0f ? w->z[k] : 0.0f;
    for (int64_t t = 0; t < nt; t++) quantize(w->z + t * r, r, &w->pz[t]);
    pinfer_parallel(n * r * nt >= PARALLEL_WORK ? threads : 1, q4 ? (n + 3) / 4 : n, q4 ? pred_scores_q4 : pred_scores,
                    w);
    free(mem);
    free(q);
    return 0;
}

/* A single call's gate/up and rule: val[k] = h of candidate k; gate and up of RULE_BLOCK candidates
   at a time, then their rule in SIMD lanes (a libm expf per neuron took 4% of a SmolLM2 token). */
#define RULE_BLOCK 64
static void gate_up_one(void *p, int64_t k0, int64_t k1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const ffn_t *f = w->f;
    const int pairs = (f->gu_fmt == FMT_Q4 || f->gu_fmt == FMT_Q5) && f->act != ACT_RELU && f->d <= SHORT_ROW;
    float g[RULE_BLOCK], u[RULE_BLOCK];
    for (int64_t b0 = k0; b0 < k1; b0 += RULE_BLOCK) {
        const int64_t b1 = b0 + RULE_BLOCK < k1 ? b0 + RULE_BLOCK : k1;
        for (int64_t k = b0; k < b1; k++) {
            if (pairs && k + 1 < b1 && a->idx[k + 1] == a->idx[k] + 1) {
                neuron_pair(f, a->idx[k], a->n, w->qx, g + (k - b0), u + (k - b0));
                k++;
            } else {
                neuron_gu(f, a->idx[k], a->x, w->qx, prefetch_row(a->idx, k, w->m), g + (k - b0), u + (k - b0));
            }
        }
        ISA_OPS->rules(f->act, g, u, b1 - b0, a->mode, a->thr, a->val + b0);
    }
}

/* A batch's rules over tokens t0..t1: h in place of their gates. */
static void batch_rules(void *p, int64_t t0, int64_t t1) {
    work_t *w = p;
    const int64_t n = w->a->n;
    ISA_OPS->rules(w->f->act, w->H + t0 * n, w->U + t0 * n, (t1 - t0) * n, w->a->mode, w->a->thr, w->H + t0 * n);
}

/* A batch's gate/up and rule over the union: each neuron's rows for every token that computes it. */
static void gate_up_union(void *p, int64_t k0, int64_t k1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const int64_t n = a->n, d = a->d;
    for (int64_t k = k0; k < k1; k++) {
        const int64_t j = w->u[k];
        int64_t next = prefetch_row(w->u, k, w->mu);
        for (uint64_t bits = w->who[j]; bits; bits &= bits - 1) {
            const int64_t t = __builtin_ctzll(bits);
            neuron_gu(w->f, j, a->x + t * d, &w->qx[t], next, w->H + t * n + j, w->U + t * n + j);
            next = -1;
        }
    }
}

/* y[i] of each token = row i of W_down . its quantized h; the index counts blocks of four rows,
   read together where they are short (rows_by_four: they share the loads of h), one at a time
   otherwise (d is a multiple of 32). */
static void row_dots(void *p, int64_t b0, int64_t b1) {
    work_t *w = p;
    const rows_t *wd = &w->a->wd;
    const int64_t n = w->a->n, d = w->a->d, gn = n / G;
    const int R = rows_by_four(n) ? 4 : 1;
    const int64_t nt = w->nt;
    if (nt > 1 && w->tokens == (nt == 64 ? ~0ULL : (1ULL << nt) - 1)) {   /* every token: the tiles of pinfer_q4_rows */
        const linear_t m = {FMT_Q4, wd->q, wd->scale, wd->min, NULL, NULL, d, n};
        pinfer_q4_rows(&m, w->qx, nt, w->y, d, b0, b1);
        return;
    }
    const int64_t ahead = rows_ahead(n / 2);     /* quants.h */
    for (int64_t i = 4 * b0; i < 4 * b1; i += R) {
        rows4_t rows;
        for (int r = 0; r < R; r++) {
            rows.q[r] = wd->q + (i + r) * (n / 2);
            rows.qh[r] = NULL;
            rows.scale[r] = wd->scale + (i + r) * gn;
            rows.min[r] = wd->min ? wd->min + (i + r) * gn : NULL;
        }
        const uint8_t *next = ahead && i + R + ahead <= d ? wd->q + (i + ahead) * (n / 2) : NULL;
        for (uint64_t bits = w->tokens; bits; bits &= bits - 1) {
            const int64_t t = __builtin_ctzll(bits);
            pinfer_dot_rows(R, &rows, &w->qx[t], n, w->y + t * d + i, next, n / 2);
            next = NULL;
        }
    }
}

static void run_row_dots(work_t *w, int threads) { pinfer_parallel(threads, w->a->d / 4, row_dots, w); }

/* y = W_down h for a single call, h zero but for the survivors, quantized to int8 per group of 32
   neurons (as x is for the gate/up rows, and as MatMulNBits does). */
static int down_rows(work_t *w, int threads) {
    const ffn_call_t *a = w->a;
    const int64_t n = a->n, d = a->d;
    float *buf = malloc((size_t)n * sizeof(float) + (size_t)pinfer_qx_bytes(n));
    if (!buf) return -1;
    float *h = buf;
    memset(h, 0, (size_t)n * sizeof(float));
    for (int64_t k = 0; k < w->s; k++) h[a->idx[k]] = a->val[k];
    qx_t qh = pinfer_qx_at(buf + n, n);
    ISA_OPS->quantize_chunks(h, n, &qh);
    w->qx = &qh;
    w->tokens = 1;
    w->y = a->y;
    run_row_dots(w, n * d >= PARALLEL_WORK ? threads : 1);
    free(buf);
    return 0;
}

/* A single call's down projection: range t is the t-th run of w->per groups of 32 columns. */
static void down_one(void *p, int64_t t0, int64_t t1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const int64_t ng = a->d / G;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t g0 = t * w->per, g1 = g0 + w->per < ng ? g0 + w->per : ng;
        if (g0 >= g1) continue;
        const int64_t nc = (g1 - g0) * G;
        float *scratch = malloc((size_t)(2 * nc + nc / G + AXPY_ROWS * (MAX_D / G)) * sizeof(float));
        if (scratch)
            down_cols(w->f, a->idx, a->val, w->s, a->y, g0 * G, g1 * G, scratch, scratch + 2 * nc, scratch + nc,
                      (float (*)[MAX_D / G])(scratch + 2 * nc + nc / G));
        else memset(a->y + g0 * G, 0xff, (size_t)nc * sizeof(float));  /* NaN: never silently wrong */
        free(scratch);
    }
}

/* Range t of a column call: columns [t * per, (t + 1) * per) groups of 32 of y. */
typedef struct {
    const ffn_t *f;
    const int32_t *idx;
    const float *val;
    int64_t s, per;
    float *y;
} cols_work_t;

static void cols_one(void *p, int64_t t0, int64_t t1) {
    const cols_work_t *w = p;
    const ffn_t *f = w->f;
    const isa_ops_t *const ops = ISA_OPS;
    const int64_t d = f->d, ng = d / G;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t g0 = t * w->per, g1 = g0 + w->per < ng ? g0 + w->per : ng;
        if (g0 >= g1) continue;
        const int64_t c0 = g0 * G, nc = (g1 - g0) * G;
        const int fast = f->down_fmt == FMT_Q4R && ops->cols_q4r;   /* the kept inputs as int8 */
        /* the int8 paths need the sums and a zero row; a 7B gate|up's under malloc's mmap threshold */
        float *scratch = malloc(fast ? (size_t)nc * sizeof(float) + (size_t)nc / 2
                                     : (size_t)(2 * nc + nc / G + AXPY_ROWS * (MAX_D / G)) * sizeof(float));
        if (!scratch) {
            memset(w->y + c0, 0xff, (size_t)nc * sizeof(float));  /* NaN: never silently wrong */
            continue;
        }
        if (fast) {
            float *acc = scratch;
            uint8_t *zero = (uint8_t *)(scratch + nc);
            memset(acc, 0, (size_t)nc * sizeof(float));
            memset(zero, 0, (size_t)nc / 2);
            for (int64_t k = 0; k < w->s;) {
                const int64_t grp = w->idx[k] / G;
                int64_t e = k;
                float amax = 0.0f;
                for (; e < w->s && w->idx[e] / G == grp; e++) amax = fmaxf(amax, fabsf(w->val[e]));
                const float xs = amax / 127.0f, inv = xs > 0.0f ? 1.0f / xs : 0.0f;
                const uint8_t *rows[G];
                int8_t q8[G];
                int32_t quads[G / 4], isum = 0;
                int R = 0;
                for (; R < e - k; R++) {
                    rows[R] = (const uint8_t *)f->dn_q + (int64_t)w->idx[k + R] * (d / 2) + c0 / 2;
                    q8[R] = (int8_t)lrintf(w->val[k + R] * inv);
                    isum += q8[R];
                }
                for (; R % 4; R++) {
                    rows[R] = zero;
                    q8[R] = 0;
                }
                memcpy(quads, q8, (size_t)R);
                const uint8_t *next[G];     /* the next group's rows, fetched meanwhile */
                int n_next = 0;
                for (int64_t e2 = e; e2 < w->s && w->idx[e2] / G == w->idx[e] / G; e2++)
                    next[n_next++] = (const uint8_t *)f->dn_q + (int64_t)w->idx[e2] * (d / 2) + c0 / 2;
                ops->cols_q4r(acc, rows, quads, R, xs, xs * (float)isum, f->dn_scale + grp * d + c0,
                              f->dn_min ? f->dn_min + grp * d + c0 : NULL, nc / G, next, n_next);
                k = e;
            }
            if (ops->cols_q4r_nibbles) down_cols_finish(f, acc, NULL, w->y, c0, c0 + nc);
            else memcpy(w->y + c0, acc, (size_t)nc * sizeof(float));
            free(scratch);
            continue;
        }
        down_cols(f, w->idx, w->val, w->s, w->y, c0, c0 + nc, scratch, scratch + 2 * nc, scratch + nc,
                  (float (*)[MAX_D / G])(scratch + 2 * nc + nc / G));
        free(scratch);
    }
}

/* The kept inputs are summed in COL_PARTS parts by input (each a run of whole groups of 32), each
   part over the full width, and the parts' sums added in order: a thread then streams whole rows,
   where splitting the columns gave it half-rows (1 KB of a 7B down_t row on two threads, which read
   12.8 GB/s against the row dots' 24). The number of parts never depends on the threads, so
   neither do the bits; more threads than parts split each part's columns too. */
#define COL_PARTS 2

typedef struct {
    cols_work_t part[COL_PARTS];
    int64_t ranges;     /* column ranges per part */
} cols_parts_t;

static void cols_parts(void *p, int64_t r0, int64_t r1) {
    cols_parts_t *c = p;
    for (int64_t r = r0; r < r1; r++) cols_one(&c->part[r / c->ranges], r % c->ranges, r % c->ranges + 1);
}

/* The kept inputs of x (|x[j]| >= thr, nonzero; ascending) into idx/val, then y = their rows of
   f's down_t-format weight summed (COL_PARTS), inside the pool's bracket. Returns the inputs kept,
   or -1 when memory is short (y then NaN). */
static int64_t cols_run(const ffn_t *f, const float *x, int64_t n, float thr, float *y, int32_t *idx, float *val,
                        int threads) {
    const int64_t d = f->d, ng = d / G;
    int64_t s = 0, split = 0;
    for (int64_t j = 0; j < n; j++)
        if (fabsf(x[j]) >= thr && x[j] != 0.0f) {
            idx[s] = (int32_t)j;
            val[s++] = x[j];
        }
    /* the parts hold about as many kept inputs each (not as many inputs: where one half of x keeps
       more, its thread would be the other's wait), split at a group of 32's start */
    while (split < s && (split < s / 2 || (split > 0 && idx[split] / G == idx[split - 1] / G))) split++;
    float *y1 = malloc((size_t)d * sizeof(float));
    if (!y1) {
        memset(y, 0xff, (size_t)d * sizeof(float));
        return -1;
    }
    const int t = s * d >= PARALLEL_WORK ? threads : 1;
    const int64_t ranges = t > COL_PARTS ? t / COL_PARTS : 1, per = (ng + ranges - 1) / ranges;
    cols_parts_t c = {{{.f = f, .idx = idx, .val = val, .s = split, .per = per, .y = y},
                       {.f = f, .idx = idx + split, .val = val + split, .s = s - split, .per = per, .y = y1}},
                      ranges};
    pinfer_parallel(t, COL_PARTS * ranges, cols_parts, &c);
    for (int64_t i = 0; i < d; i++) y[i] += y1[i];
    free(y1);
    return s;
}

int64_t pinfer_cols_run(const cols_t *c, int64_t n, int64_t d, const float *x, float *y, int32_t *idx, float *val,
                        int threads) {
    const ffn_t f = {.down_fmt = c->fmt, .dn_q = c->q, .dn_scale = c->scale, .dn_min = c->min, .d = d};
    return cols_run(&f, x, n, c->thr, y, idx, val, threads);
}

static int cols_ok(int fmt, const void *scale, int64_t n, int64_t d) {
    return !(d % G || n % G || d <= 0 || n <= 0 || d > MAX_D || fmt == FMT_Q8R || fmt == FMT_Q5 ||
             (fmt != FMT_F16 && fmt != FMT_F32 && !scale));
}

/* Column-skipping GEMV (activation sparsity: converter/passes/activation.py): y (d) = the sum over
   the inputs j with |x[j]| >= thr, in ascending j, of x[j] * row j of w_t (n, d), w_t in one of the
   down_t formats (the transposed weight: input-major, so a dropped input skips a whole row). idx
   and val: scratch of n. Returns the inputs kept, or -1 when a size is unsupported. thr 0 keeps
   every nonzero input. Output columns are split between threads; each is summed by one. On
   AVX-512 and AVX2 q4r's kept inputs meet the rows as int8 (per group of 32 inputs, as x meets
   the row dots); elsewhere as floats. */
int64_t pinfer_cols(int fmt, const void *q, const uint16_t *scale, const uint16_t *min, int64_t n, int64_t d,
                    const float *x, float thr, float *y, int32_t *idx, float *val, int threads) {
    if (!cols_ok(fmt, scale, n, d)) return -1;
    const ffn_t f = {.down_fmt = fmt, .dn_q = q, .dn_scale = scale, .dn_min = min, .d = d};
    const int t = pinfer_pool_enter(threads);
    const int64_t s = cols_run(&f, x, n, thr, y, idx, val, t);
    pinfer_pool_leave(threads);
    return s;
}

/* One token's FFN by columns (activation sparsity): g, u = the kept inputs of x (|x| >= thr_x) times
   their rows of gate_up_t (d, 2n: neuron j's gate in column 2j, its up in 2j + 1, the transpose of
   the gate_up bundle's rows), h = act(g) * u where |h| >= thr_h, y = the kept h times their rows of
   down_t (n, d). Both weights in a down_t format. counts out: [inputs of x kept, neurons kept].
   gu (4n), h (n), idx and val (max(2n, d)): scratch. */
typedef struct {
    int act, gu_fmt, dn_fmt;
    const void *gu_q;
    const uint16_t *gu_scale, *gu_min;
    const void *dn_q;
    const uint16_t *dn_scale, *dn_min;
    int64_t n, d;
    const float *x;
    float *y;
    float thr_x, thr_h;
    float *gu, *h;
    int32_t *idx;
    float *val;
    int64_t *counts;
    int threads;
} cols_ffn_t;

int pinfer_cols_ffn(const cols_ffn_t *a) {
    if (!cols_ok(a->gu_fmt, a->gu_scale, a->d, 2 * a->n) || !cols_ok(a->dn_fmt, a->dn_scale, a->n, a->d)) return -1;
    const ffn_t gu = {.down_fmt = a->gu_fmt, .dn_q = a->gu_q, .dn_scale = a->gu_scale, .dn_min = a->gu_min,
                      .d = 2 * a->n};
    const ffn_t dn = {.down_fmt = a->dn_fmt, .dn_q = a->dn_q, .dn_scale = a->dn_scale, .dn_min = a->dn_min,
                      .d = a->d};
    const int t = pinfer_pool_enter(a->threads);
    a->counts[0] = cols_run(&gu, a->x, a->d, a->thr_x, a->gu, a->idx, a->val, t);
    float *g = a->gu + 2 * a->n, *u = g + a->n;
    for (int64_t j = 0; j < a->n; j++) {
        g[j] = a->gu[2 * j];
        u[j] = a->gu[2 * j + 1];
    }
    ISA_OPS->rules(a->act, g, u, a->n, MODE_DOWN, a->thr_h, a->h);
    a->counts[1] = cols_run(&dn, a->h, a->n, 0.0f, a->y, a->idx, a->val, t);
    pinfer_pool_leave(a->threads);
    return 0;
}

/* One token's FFN: y = down(rule(act(gate) * up)) over the neurons the mode computes. Returns 0, or
   -1 when a size is unsupported. */
static int ffn_token(const ffn_call_t *a, int threads) {
    const int64_t n = a->n, d = a->d, r = a->r, mode = a->mode;
    const ffn_t f = {a->gu_fmt, a->down_fmt, a->act, a->gu_q, a->gu_scale, a->gu_min, a->gu_qh, a->dn_q,
                     a->dn_scale, a->dn_min, d};
    /* the predictor's hidden (r), then quantized x */
    float *buf = malloc((size_t)r * sizeof(float) + (size_t)pinfer_qx_bytes(d));
    if (!buf) return -1;
    qx_t qx = pinfer_qx_at(buf + r, d);
    work_t w = {.a = a, .f = &f, .nt = 1, .qx = &qx, .z = buf, .score = a->val};
    if (a->gu_fmt == FMT_Q4 || a->gu_fmt == FMT_Q5) ISA_OPS->quantize_chunks(a->x, d, &qx);

    /* candidates (the scores use val as scratch until the survivors overwrite it) */
    int64_t m = 0;
    if (mode == MODE_PREDICTED || mode == MODE_RELU) {
        if (predict(a, &w, threads)) {
            free(buf);
            return -1;
        }
        for (int64_t j = 0; j < n; j++)
            if (w.score[j] >= a->pred_thr) a->idx[m++] = (int32_t)j;
    } else if (mode == MODE_GIVEN) {
        m = a->counts[0] < n ? a->counts[0] : n;
    } else {
        for (int64_t j = 0; j < n; j++) a->idx[j] = (int32_t)j;
        m = n;
    }
    a->counts[0] = w.m = m;

    /* gate/up and the rule, then compaction in ascending order */
    pinfer_parallel(m * d >= PARALLEL_WORK ? threads : 1, m, gate_up_one, &w);
    int64_t s = 0;
    for (int64_t k = 0; k < m; k++)
        if (a->val[k] != 0.0f) {
            a->idx[s] = a->idx[k];
            a->val[s++] = a->val[k];
        }
    a->counts[1] = w.s = s;

    int rc = 0;
    if (a->wd.q && s >= a->wd.from) {
        rc = down_rows(&w, threads);
    } else {    /* down: column runs of whole groups, one range each */
        const int t_dn = s * d >= PARALLEL_WORK ? threads : 1;
        w.per = (d / G + t_dn - 1) / t_dn;
        pinfer_parallel(t_dn, t_dn, down_one, &w);
    }
    free(buf);
    return rc;
}

/* Whether the kernels take a call's sizes and formats. */
static int call_ok(const ffn_call_t *a) {
    return !(a->wd.q && a->wd.fmt != FMT_Q4) && !(a->d % G || a->n % G || a->d > MAX_D || a->r % G) &&
           (a->pred_fmt == FMT_Q8 || a->pred_fmt == FMT_Q4);
}

int pinfer_ffn_call(const ffn_call_t *a) {
    if (!call_ok(a)) return -1;
    const int threads = pinfer_pool_enter(a->threads);
    const int rc = ffn_token(a, threads);
    pinfer_pool_leave(a->threads);
    return rc;
}

/* -- a batch of tokens (prefill) ------------------------------------------------------------- */

#define DOWN_BLOCK 128    /* neurons per block of the batch's down pass (whole q4r groups) */

/* A batch's down projection for the tokens in w->tokens: range th is the th-th run of w->per
   groups of 32 columns, over blocks of neurons every token passes through. */
static void down_batch(void *p, int64_t th0, int64_t th1) {
    work_t *w = p;
    const ffn_call_t *a = w->a;
    const int64_t n = a->n, d = a->d, ng = d / G, nt = w->nt;
    for (int64_t th = th0; th < th1; th++) {
        const int64_t g0 = th * w->per, g1 = g0 + w->per < ng ? g0 + w->per : ng;
        if (g0 >= g1) continue;
        const int64_t nc = (g1 - g0) * G;
        float *scratch = malloc((size_t)(nt * (nc + nc / G) + nc + AXPY_ROWS * (MAX_D / G)) * sizeof(float));
        if (!scratch) {
            atomic_store(&w->failed, 1);
            continue;
        }
        float *acc_p = scratch, *off = acc_p + nt * nc, *acc = off + nt * (nc / G), *ar = acc + nc;
        int64_t at[MAX_BATCH] = {0};
        memset(acc_p, 0, (size_t)(nt * (nc + nc / G)) * sizeof(float));
        for (int64_t b0 = 0; b0 < n; b0 += DOWN_BLOCK) {
            for (uint64_t bits = w->tokens; bits; bits &= bits - 1) {
                const int64_t t = __builtin_ctzll(bits), s = a->counts[2 * t + 1];
                const int32_t *idx = a->idx + t * n;
                int64_t e = at[t];
                while (e < s && idx[e] < b0 + DOWN_BLOCK) e++;
                if (e > at[t])
                    down_cols_acc(w->f, idx + at[t], a->val + t * n + at[t], e - at[t], g0 * G, g1 * G,
                                  acc_p + t * nc, off + t * (nc / G), acc, (float (*)[MAX_D / G])ar);
                at[t] = e;
            }
        }
        for (uint64_t bits = w->tokens; bits; bits &= bits - 1) {
            const int64_t t = __builtin_ctzll(bits);
            down_cols_finish(w->f, acc_p + t * nc, off + t * (nc / G), a->y + t * d, g0 * G, g1 * G);
        }
        free(scratch);
    }
}

/* Each token's candidates in its row of idx and their number in its counts[0] (the predictor's
   rows meet every token while in cache); then the union of them, ascending, in w->u with each
   neuron's tokens in w->who. Returns -1 when memory is short. */
static int batch_candidates(const ffn_call_t *a, work_t *w, int threads, int32_t *u, uint64_t *who) {
    const int64_t n = a->n, nt = w->nt;
    if (a->mode == MODE_PREDICTED || a->mode == MODE_RELU) {
        w->score = w->H;    /* scratch until the gate/up pass */
        if (predict(a, w, threads)) return -1;
        for (int64_t t = 0; t < nt; t++) {
            int64_t m = 0;
            for (int64_t j = 0; j < n; j++)
                if (w->score[t * n + j] >= a->pred_thr) a->idx[t * n + m++] = (int32_t)j;
            a->counts[2 * t] = m;
        }
        memset(w->H, 0, (size_t)(nt * n) * sizeof(float));
    } else if (a->mode != MODE_GIVEN) {
        for (int64_t t = 0; t < nt; t++) {
            for (int64_t j = 0; j < n; j++) a->idx[t * n + j] = (int32_t)j;
            a->counts[2 * t] = n;
        }
    }
    for (int64_t t = 0; t < nt; t++) {
        const int64_t m = a->counts[2 * t] < n ? a->counts[2 * t] : n;
        a->counts[2 * t] = m;
        for (int64_t k = 0; k < m; k++) who[a->idx[t * n + k]] |= 1ULL << t;
    }
    int64_t mu = 0;
    for (int64_t j = 0; j < n; j++)
        if (who[j]) u[mu++] = (int32_t)j;
    w->mu = mu;
    w->u = u;
    w->who = who;
    return 0;
}

/* The down projection of a batch whose h is in w->H and survivors in idx/val: the tokens past
   rows_from as row dots over W_down (each row of it met by all of them), the others as the axpy
   over their survivors. Returns 0, or -1 when memory is short. */
static int batch_down(const ffn_call_t *a, work_t *w, int threads, qx_t *qx) {
    const int64_t n = a->n, d = a->d, nt = w->nt;
    uint64_t by_rows = 0;
    int64_t n_rows = 0, cols_work = 0;
    for (int64_t t = 0; t < nt; t++) {
        if (a->wd.q && a->counts[2 * t + 1] >= a->wd.from) {
            by_rows |= 1ULL << t;
            n_rows++;
        } else {
            cols_work += a->counts[2 * t + 1];
        }
    }
    if (n_rows) {
        for (uint64_t bits = by_rows; bits; bits &= bits - 1) {
            const int64_t t = __builtin_ctzll(bits);
            ISA_OPS->quantize_chunks(w->H + t * n, n, &qx[t]);     /* h, quantized per group of 32 neurons */
        }
        w->qx = qx;
        w->tokens = by_rows;
        w->y = a->y;
        run_row_dots(w, n * d * n_rows >= PARALLEL_WORK ? threads : 1);
    }
    if (n_rows < nt) {
        const int t_dn = cols_work * d >= PARALLEL_WORK ? threads : 1;
        w->tokens = ~by_rows & (nt == 64 ? ~0ULL : (1ULL << nt) - 1);
        w->per = (d / G + t_dn - 1) / t_dn;
        pinfer_parallel(t_dn, t_dn, down_batch, w);
        if (atomic_load(&w->failed)) return -1;
    }
    return 0;
}

/* pinfer_q4_rows over a whole matrix, its blocks of four rows the parallel loop's index. */
typedef struct {
    const linear_t *m;
    const qx_t *qx;
    int64_t nt;
    float *out;         /* (nt, m->rows) */
} q4_rows_t;

static void q4_rows_job(void *p, int64_t b0, int64_t b1) {
    const q4_rows_t *j = p;
    pinfer_q4_rows(j->m, j->qx, j->nt, j->out, j->m->rows, b0, b1);
}

/* The FFN of nt tokens in one call, each with the result of its own pinfer_ffn_call (the same
 * bits), over the union of their candidates: every weight row any token needs is read once and
 * met by each token that needs it while it is in cache. x, y are (nt, d); idx, val (nt, n) and
 * counts (nt, 2) as a single call's, per token (MODE_GIVEN: each token's candidates in its row of
 * idx, their number in its counts[0]). Returns 0, or -1 when a size is unsupported or memory is
 * short. */
static int ffn_batch(const ffn_call_t *a, int64_t nt, int threads) {
    const int64_t n = a->n, d = a->d, r = a->r;
    const ffn_t f = {a->gu_fmt, a->down_fmt, a->act, a->gu_q, a->gu_scale, a->gu_min, a->gu_qh, a->dn_q,
                     a->dn_scale, a->dn_min, d};
    /* per token: quantized x (and later h), predictor hidden; h of every token over all neurons;
       which tokens compute each neuron */
    const int64_t qn = n > d ? n : d, qbytes = (pinfer_qx_bytes(qn) + 63) / 64 * 64;
    uint8_t *qmem = malloc((size_t)(nt * qbytes));
    float *z = malloc((size_t)(nt * (r ? r : 1)) * sizeof(float));
    float *H = calloc((size_t)(nt * n), sizeof(float)), *U = calloc((size_t)(nt * n), sizeof(float));
    uint64_t *who = calloc((size_t)n, sizeof(uint64_t));
    int32_t *u = malloc((size_t)n * sizeof(int32_t));
    qx_t *qx = malloc((size_t)nt * sizeof(qx_t));
    int rc = -1;
    if (!qmem || !z || !H || !U || !who || !u || !qx) goto done;
    for (int64_t t = 0; t < nt; t++) {
        qx[t] = pinfer_qx_at(qmem + t * qbytes, qn);
        if (f.gu_fmt == FMT_Q4 || f.gu_fmt == FMT_Q5) ISA_OPS->quantize_chunks(a->x + t * d, d, &qx[t]);
    }
    work_t w = {.a = a, .f = &f, .nt = nt, .qx = qx, .z = z, .H = H, .U = U};
    if (batch_candidates(a, &w, threads, u, who)) goto done;

    int64_t pairs = 0;
    for (int64_t k = 0; k < w.mu; k++) pairs += __builtin_popcountll(who[u[k]]);
    if (pairs == nt * n && (f.gu_fmt == FMT_Q4 || f.gu_fmt == FMT_Q5) && f.act != ACT_RELU && d > SHORT_ROW) {
        /* every token computes every neuron: the bundle's 2n rows (gate and up of a neuron, read alone as
           neuron_gu reads them) as one matrix through pinfer_q4_rows' tiles, the same bits per token */
        float *GU = malloc((size_t)(nt * 2 * n) * sizeof(float));
        if (!GU) goto done;
        const linear_t m = {f.gu_fmt, f.gu_q, f.gu_scale, f.gu_min, f.gu_qh, NULL, 2 * n, d};
        q4_rows_t job = {&m, qx, nt, GU};
        pinfer_parallel(threads, (2 * n + 3) / 4, q4_rows_job, &job);
        for (int64_t t = 0; t < nt; t++)
            for (int64_t j = 0; j < n; j++) {
                H[t * n + j] = GU[t * 2 * n + 2 * j];
                U[t * n + j] = GU[t * 2 * n + 2 * j + 1];
            }
        free(GU);
    } else {
        pinfer_parallel(pairs * d >= PARALLEL_WORK ? threads : 1, w.mu, gate_up_union, &w);
    }
    /* h in place of the gates (the rest are 0 and stay so), as a single call's rules make them;
       then the survivors of each token, ascending, as a single call compacts them */
    pinfer_parallel(threads, nt, batch_rules, &w);
    for (int64_t t = 0; t < nt; t++) {
        int32_t *idx = a->idx + t * n;
        float *val = a->val + t * n;
        int64_t s = 0;
        for (int64_t k = 0; k < a->counts[2 * t]; k++) {
            const float h = H[t * n + idx[k]];
            if (h != 0.0f) {
                idx[s] = idx[k];
                val[s++] = h;
            }
        }
        a->counts[2 * t + 1] = s;
    }
    rc = batch_down(a, &w, threads, qx);
done:
    free(qmem);
    free(z);
    free(H);
    free(U);
    free(who);
    free(u);
    free(qx);
    return rc;
}

int pinfer_ffn_batch(const ffn_call_t *a, int64_t nt) {
    if (!call_ok(a) || nt < 1 || nt > MAX_BATCH) return -1;
    const int threads = pinfer_pool_enter(a->threads);
    const int rc = ffn_batch(a, nt, threads);
    pinfer_pool_leave(a->threads);
    return rc;
}

/* The number the library was built with for `name`: a code of codes.h ("fmt.q4", "mode.relu",
   "act.gelu", "rule.all"), or the size of a struct Python mirrors with ctypes ("sizeof.ffn_call_t");
   -1 for a name it does not know. pinfer/kernels/__init__.py checks its own on loading the library. */
int64_t pinfer_abi(const char *name) {
    static const struct {
        const char *name;
        int64_t value;
    } table[] = {
        {"fmt.q8", FMT_Q8}, {"fmt.q8r", FMT_Q8R}, {"fmt.q4r", FMT_Q4R}, {"fmt.f16", FMT_F16}, {"fmt.f32", FMT_F32},
        {"fmt.q4", FMT_Q4}, {"fmt.q5", FMT_Q5},
        {"mode.dense", MODE_DENSE}, {"mode.down", MODE_DOWN}, {"mode.predicted", MODE_PREDICTED},
        {"mode.relu", MODE_RELU}, {"mode.given", MODE_GIVEN},
        {"act.silu", ACT_SILU}, {"act.relu", ACT_RELU}, {"act.gelu", ACT_GELU},
        {"rule.all", RULE_ALL}, {"rule.threshold", RULE_THRESHOLD}, {"rule.nonzero", RULE_NONZERO},
        {"sizeof.ffn_call_t", sizeof(ffn_call_t)}, {"sizeof.rows_t", sizeof(rows_t)},
        {"sizeof.linear_t", sizeof(linear_t)}, {"sizeof.cols_ffn_t", sizeof(cols_ffn_t)}, {"max_batch", MAX_BATCH},
    };
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (!strcmp(name, table[i].name)) return table[i].value;
    return pinfer_decode_abi(name);
}
