/* The primitives pinfer's CPU kernels share, and the one switch that picks their instruction set.
 *
 * The kernels (ffn_sparse.c: the sparse FFN and the column kernels; decode.c: attention and the
 * head; ffn_down.c: the dense down projection) hold the orchestration: which rows, which threads,
 * which order. The primitives they call (activations quantized to int8, row dots, axpys over rows,
 * attention heads, the down projection's accumulations) live here and in one unit per instruction
 * set, as ggml splits quants.c from arch/x86/:
 *   quants.h       shared types and constants; the table of primitives per instruction set; the
 *                  generic C that each set compiles for itself (static inline, below)
 *   quants.c       the portable primitives and their table; the switch (pinfer_sparse_isa)
 *   x86/avx2.h     AVX2 helpers both x86 units inline
 *   x86/avx2.c     the AVX2 primitives and their table
 *   x86/avx512.c   the AVX-512 primitives and their table
 *
 * One dispatch mechanism: a kernel calls a primitive only through ISA_OPS, the table of the set
 * pinfer_sparse_isa chose (the best this CPU has unless a test or --isa forces a lower one), so a
 * forced set reaches every kernel. Each table's functions are compiled for its set by function
 * attributes (one build runs on every x86-64 CPU, as target_clones did, without a second
 * mechanism); where a set has no version of its own, its table points at a lower set's. The
 * generic C compiled for AVX2 or AVX-512 sums in the portable build's order (-std=c11: no
 * contraction to FMA, no reassociation), so every build of it gives the same bits.
 */
#ifndef PINFER_QUANTS_H
#define PINFER_QUANTS_H

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>

#include "codes.h"
#include "half.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PINFER_X86 1
#endif

/* What the units share inside the library: not exported, so calls between them go direct. */
#define PINFER_INTERNAL __attribute__((visibility("hidden")))

#define G 32
/* d_model the sparse FFN's stack buffers hold (axpy_q4's scales: MAX_D / G per row) */
#define MAX_D 65536
/* ffn_down.c: output columns per work unit, the width of its accumulators */
#define COL_CHUNK 512
/* Loops under this many weights run on one thread: waking a second costs more than it saves. */
#define PARALLEL_WORK (1 << 18)

/* Rows of at most this many weights are read several at a time (pinfer_dot_rows with R = 2 or 4;
   a matrix's rows where rows_by_four says so), each load of x serving them all; longer ones one at
   a time, which from 4 KB pages read faster (interleaved streams). Measured by
   benchmarks/sparse_kernel.py --shapes smollm2 --formats int4 --fractions 1 and
   benchmarks/row_dots.py. */
#define SHORT_ROW 1024
/* Whether the rows of a matrix of k columns (q4: k/2 bytes a row) are read four at a time: short
   rows, but not rows of whole cache lines, which read faster one at a time on both AVX2 and
   AVX-512 (HeadStep over 64 MB of q4 rows, 576 to 1024 columns). The FFN's gate/up pairs keep
   SHORT_ROW. */
static inline int rows_by_four(int64_t k) { return k <= SHORT_ROW && k % 128 != 0; }
/* Every caller reading a matrix's rows in order (q4 one or four at a time, q8) prefetches the rows
   about AHEAD_BYTES on, each block of them as the same block of the rows at hand is read. The
   hardware prefetcher alone left rows read one at a time waiting on memory (perf: a third of the
   AVX2 row dots' samples on the instructions after the weight loads; AVX2, with twice AVX-512's
   instructions per cache line, keeps fewer lines in flight). Prefetching made decode 6-19% faster
   on SmolLM2 and the 7B-shaped models, most with AVX2 (benchmarks/smollm2_vs_llamacpp.py shows
   the result); 2 to 6 KB ahead gained the same, the next row only about half. Rows past about
   6 KB are not prefetched (rows_ahead 0). */
#define AHEAD_BYTES 3072
static inline int64_t rows_ahead(int64_t row_bytes) { return (AHEAD_BYTES + row_bytes / 2) / row_bytes; }

/* The widest attention head the 8-lane head kernels (x86/avx2.h) keep in registers: 8 * HEAD8_MAX. */
#define HEAD8_MAX 32

/* -- the shared types ---------------------------------------------------------------------------- */

typedef struct {
    int8_t *q;      /* (d) in chunk order */
    float *scale;   /* (d/G) */
    float *sum;     /* (d/G) the sum of the group's x (float): meets the weights' min */
    float *corr;    /* (d/G) -8 * scale * the sum of the group's q: meets the weights' scale for the zero point */
} qx_t;

/* Bytes of one qx_t of length d in a single block, and its parts placed in such a block. */
PINFER_INTERNAL int64_t pinfer_qx_bytes(int64_t d);
PINFER_INTERNAL qx_t pinfer_qx_at(void *mem, int64_t d);

/* R <= 4 q4 rows: the rows' q, fifth bits (q5) or NULL, scales and mins (or NULL) by pointer. */
typedef struct {
    const uint8_t *q[4], *qh[4];
    const uint16_t *scale[4], *min[4];
} rows4_t;

/* A matrix of `rows` rows of k weights (decode.c's linear layers, the FFN predictor's W1 and W2). */
typedef struct {
    int fmt;
    const void *q;                  /* q bytes (q4, q5, q8), or the weights (f16, f32) */
    const uint16_t *scale, *min;    /* f16 (rows, k/G); min: q4/q5 only, or NULL */
    const uint8_t *qh;              /* q5's fifth bits (rows, k/8), else NULL */
    const float *bias;              /* (rows), or NULL */
    int64_t rows, k;
} linear_t;

/* A weight by columns (activation sparsity): W^T (inputs, outputs) input-major in a down_t format
   (ffn_sparse.c), the inputs under |thr| dropped; q NULL: none. */
typedef struct {
    int fmt;
    const void *q;
    const uint16_t *scale, *min;
    float thr;
} cols_t;

/* ffn_down.c's W_down, neuron-major (its layouts): n rows of d. */
typedef struct {
    int fmt;
    const void *q;          /* q bytes or f16/f32 weights */
    const uint16_t *scale;  /* f16 */
    const uint16_t *min;    /* f16 or NULL */
    int64_t n, d;
} weights_t;

/* Position of element e of group g (of ng groups) in chunk order (ffn_sparse.c says the layout). */
static inline int64_t chunk_pos(int64_t g, int64_t e, int64_t ng) {
    const int64_t c = g / 4, k = g % 4, in_chunk = ng - 4 * c < 4 ? ng - 4 * c : 4;
    return 4 * c * G + (e % 2) * 16 * in_chunk + k * 16 + e / 2;
}

/* q5's fifth bits of group g: the even elements' (bit j: element 2j) and the odd ones'. */
static inline uint32_t fifth_bits(const uint8_t *qh, int64_t g) {
    uint32_t w;
    memcpy(&w, qh + 4 * g, 4);
    return w;
}

/* -- the primitives of one instruction set ------------------------------------------------------- */

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_COUNT };

typedef void (*rows_q4_fn)(const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next,
                           int64_t nstride);
typedef void (*tokens_q4_fn)(const rows4_t *w, const qx_t *x, int64_t d, float *out, int64_t ostride,
                             const uint8_t *next);
typedef void (*head_fn)(const float *q, const void *K, const void *V, int64_t n, int64_t hd, float scale,
                        float softcap, float *s, float *o);

typedef struct {
    /* x quantized to int8 per group of 32 (qx_t): in the nibbles' chunk order for q4/q5 rows, in
       element order for q8 rows (there qx_t's sum is scale * the sum of q, corr unused) */
    void (*quantize_chunks)(const float *x, int64_t d, qx_t *o);
    void (*quantize_natural)(const float *x, int64_t d, qx_t *o);
    /* R q4/q5 rows against x in chunk order, out[r] (pinfer_dot_rows): [R = 1, 2, 4 as 0, 1, 2]
       [kind: 2 * (the rows have mins) + (q5)]; `next`: R rows nstride bytes apart to prefetch
       meanwhile, or NULL */
    rows_q4_fn rows_q4[3][4];
    /* one q4/q5 row against T tokens' x, out[t * ostride]: [T - 1][kind] for T up to tokens_max,
       each token's result the bits of rows_q4 with R = 1; tokens_max 0: none (one token at a time) */
    tokens_q4_fn tokens_q4[4][4];
    int tokens_max;
    /* one q8 row (u8 q + 128, f16 scale per group) against x in element order; `next`: the row to
       prefetch meanwhile (AHEAD_BYTES), or NULL. Rows are read one at a time: over SmolLM2's head
       shape (49152 x 576), AVX2, one thread of a 2-core EPYC, one at a time read 22 GB/s, four at a
       time sharing the loads of x 10 GB/s. */
    float (*dot_q8)(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, const uint8_t *next);
    /* float rows against float x; dot_f16's `next`: a row of as many halves to prefetch, or NULL */
    float (*dot_f16)(const uint16_t *w, const float *x, int64_t d, const uint16_t *next);
    float (*dot_f32)(const float *w, const float *x, int64_t d);
    /* y[0, nc) += sum over rows r < R, in order, of v[r] * row q[r]: R rows per pass load and
       store y once */
    void (*axpy_f16)(float *y, const uint16_t *const *q, const float *v, int R, int64_t nc);
    void (*axpy_f32)(float *y, const float *const *q, const float *v, int R, int64_t nc);
    /* p (ng groups of 32, in order) += sum over rows r < R, in order, of v[r] * scale of q8 row q[r]
       * (q - 128): R rows per pass load and store p once, where one row at a time had run at a
       third of the gate/up rows' speed per byte (perf of LLaMA-7B-shaped ReLU layers, 10% of
       rows). The Rn rows at `next` (the next pass's) are prefetched meanwhile, a line every two
       groups: 2-5% faster decode on the ReLU model of benchmarks/synthetic_decode.py. */
    void (*axpy_q8)(float *p, const uint8_t *const *q, const uint16_t *const *sc, const float *v, int R, int64_t ng,
                    const uint8_t *const *next, int Rn);
    /* q4 row of weight v: a[g] = v * scale[g], off[g] += v * min[g] (or -8 * a[g] without min) */
    void (*row_scales)(float *a, float *off, const uint16_t *sc, const uint16_t *mn, float v, int64_t ng);
    /* p (ng groups of 32, nibble order) += sum over rows r < R, in order, of a[r][g] * nibbles of
       q4 row q[r] (16 bytes per group): R rows per pass load and store p once */
    void (*axpy_q4)(float *p, const uint8_t *const *q, const float (*a)[MAX_D / G], int R, int64_t ng);
    /* q4r: p += scale * acc + offset * vsum per column, acc and p in nibble order, the scales and
       mins (f16, columns in order) of one group of 32 neurons; offset = min, or -8 * scale */
    void (*scale_group)(float *p, const float *acc, const uint16_t *sc, const uint16_t *mn, float vsum, int64_t ng);
    /* a whole q4r group of R survivors (at most G) summed and scaled straight into p, the bits of
       axpy_q4 then scale_group; next[0..n_next): rows to prefetch meanwhile. NULL: none (the
       caller runs axpy_q4 and scale_group) */
    void (*axpy_scaled_q4r)(float *p, const uint8_t *const *q, const float *v, int R, const uint16_t *sc,
                            const uint16_t *mn, float vsum, int64_t ng, const uint8_t *const *next, int n_next);
    /* the column kernel's q4r rows against int8 inputs: R (a multiple of 4) rows at this range's
       columns, xq their int8 inputs packed four to an int32 (scale xs, xs * their sum vsum), one
       group of 32 inputs' scales and mins; p += their sum, in nibble order where
       cols_q4r_nibbles, else in order. NULL: none (the inputs meet the rows as floats) */
    void (*cols_q4r)(float *p, const uint8_t *const *rows, const int32_t *xq, int R, float xs, float vsum,
                     const uint16_t *sc, const uint16_t *mn, int64_t ng, const uint8_t *const *next, int n_next);
    int cols_q4r_nibbles;
    /* h = act(g) * u of n neurons, or 0 where the mode's rule drops the neuron (ffn_sparse.c) */
    void (*rules)(int act, const float *g, const float *u, int64_t n, int mode, float thr, float *h);
    /* one attention head over positions 0..n-1 of K and V: [f16 cache][hd 32, 64, 96, 128, any other
       multiple of 8 up to 8 * HEAD8_MAX], NULL where none; `head` takes any head (f16: the cache's
       type) */
    head_fn head8[2][5];
    void (*head)(const float *q, const void *K, const void *V, int64_t n, int64_t hd, float scale, float softcap,
                 float *s, float *o, int f16);
    /* ffn_down.c: halves to floats; acc[t][...] of rows [j0, j1) of W (weights_t) against h, plain
       formats (accumulate_rows: +=) and the R formats before their group's scale (accumulate_grouped,
       ffn_down.c says the layout) */
    void (*halves_to_floats)(const uint16_t *src, float *dst, int64_t n);
    void (*accumulate_rows)(const weights_t *w, const float *h, float (*acc)[COL_CHUNK], int64_t nt, int64_t j0,
                            int64_t j1, int64_t c0, int64_t nc);
    void (*accumulate_grouped)(const weights_t *w, const float *h, float (*acc)[COL_CHUNK], int64_t nt, int64_t j0,
                               int64_t j1, int64_t c0, int64_t nc);
} isa_ops_t;

/* The instruction set every kernel runs (ISA_*): the best this CPU has from the library's load on,
   or what pinfer_sparse_isa forced. */
extern PINFER_INTERNAL int pinfer_isa_level;
extern PINFER_INTERNAL const isa_ops_t *const pinfer_ops[ISA_COUNT];
extern PINFER_INTERNAL const isa_ops_t pinfer_ops_portable;
#ifdef PINFER_X86
extern PINFER_INTERNAL const isa_ops_t pinfer_ops_avx2, pinfer_ops_avx512;
#endif
#define ISA_OPS (pinfer_ops[pinfer_isa_level])

/* The sets whose code ran since pinfer_isa_ran last cleared them (bit ISA_*): every function of a
   table marks its own set first, so a test sees which sets a kernel reached. A relaxed load and a
   branch: the mask is written once per set until cleared, so threads do not contend for it. */
extern PINFER_INTERNAL _Atomic unsigned pinfer_isa_ran_mask;
#define PINFER_RAN(set)                                                                                    \
    do {                                                                                                   \
        if (!(atomic_load_explicit(&pinfer_isa_ran_mask, memory_order_relaxed) & (1u << (set))))          \
            atomic_fetch_or_explicit(&pinfer_isa_ran_mask, 1u << (set), memory_order_relaxed);            \
    } while (0)

/* One dot per q4 row r < R (R = 1, 2 or 4) against x in chunk order, out[r]; `next`: R rows to
   prefetch meanwhile, nstride bytes apart (NULL: none). A row's sum is the same bits with R = 2 or
   4; with R = 1 (a row read alone) it may differ by float rounding (AVX2 sums it in two chains), so
   a caller reads every row of a matrix alone, or none: then no result depends on how rows are
   split over threads. */
static inline void pinfer_dot_rows(int R, const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next,
                                   int64_t nstride) {
    const int kind = (w->min[0] != NULL) * 2 + (w->qh[0] != NULL);  /* rows share a format */
    ISA_OPS->rows_q4[R == 4 ? 2 : R - 1][kind](w, x, d, out, next, nstride);
}

/* Rows 4 * b0 .. 4 * b1 (the last range ends at the matrix's end) of a q4 or q5 matrix against
   each of nt tokens' x quantized in chunk order (qx[t]): out[t * ostride + row], no bias. Short rows
   (rows_by_four) four at a time and the rows past the matrix's last whole block of four alone, so
   ranges of whole blocks give the same bits on any number of threads; each block meets every
   token while in cache; the rows ahead prefetched. decode.c's linear layers and ffn_sparse.c's
   predictor and row dots. */
PINFER_INTERNAL void pinfer_q4_rows(const linear_t *w, const qx_t *qx, int64_t nt, float *out, int64_t ostride,
                                    int64_t b0, int64_t b1);

/* Portable primitives the x86 tables share where their set has no version of its own (quants.c). */
PINFER_INTERNAL void pinfer_head_portable(const float *q, const void *K, const void *V, int64_t n, int64_t hd,
                                          float scale, float softcap, float *s, float *o, int f16);
PINFER_INTERNAL void pinfer_row_scales_portable(float *a, float *off, const uint16_t *sc, const uint16_t *mn, float v,
                                                int64_t ng);
PINFER_INTERNAL void pinfer_axpy_q4_portable(float *p, const uint8_t *const *q, const float (*a)[MAX_D / G], int R,
                                             int64_t ng);
PINFER_INTERNAL void pinfer_scale_group_portable(float *p, const float *acc, const uint16_t *sc, const uint16_t *mn,
                                                 float vsum, int64_t ng);
PINFER_INTERNAL void pinfer_accumulate_grouped_portable(const weights_t *w, const float *h, float (*acc)[COL_CHUNK],
                                                        int64_t nt, int64_t j0, int64_t j1, int64_t c0, int64_t nc);

/* -- the generic C every set compiles for itself ------------------------------------------------ */

/* x quantized per group of 32 in chunk order. */
__attribute__((always_inline))
static inline void quantize_chunks_generic(const float *x, int64_t d, qx_t *o) {
    const int64_t ng = d / G;
    for (int64_t g = 0; g < ng; g++) {
        const float *xg = x + g * G;
        float amax = 0.0f;
        for (int64_t e = 0; e < G; e++) {
            const float a = fabsf(xg[e]);
            amax = a > amax ? a : amax;
        }
        const float s = amax / 127.0f, inv = s > 0.0f ? 1.0f / s : 0.0f;
        int8_t *even = o->q + chunk_pos(g, 0, ng), *odd = o->q + chunk_pos(g, 1, ng);
        float total = 0.0f;
        int32_t qsum = 0;
        for (int64_t e = 0; e < G / 2; e++) {
            even[e] = (int8_t)lrintf(xg[2 * e] * inv);
            odd[e] = (int8_t)lrintf(xg[2 * e + 1] * inv);
            total += xg[2 * e] + xg[2 * e + 1];
            qsum += even[e] + odd[e];
        }
        o->scale[g] = s;
        o->sum[g] = total;      /* of x itself: a weight's min meets x exactly, as in the ONNX graphs */
        o->corr[g] = -8.0f * s * (float)qsum;   /* the zero point 8 against the group's int8 x */
    }
}

/* x quantized per group of 32 in element order (qx_t's corr unused): q8 rows read it. */
__attribute__((always_inline))
static inline void quantize_natural_generic(const float *x, int64_t d, qx_t *o) {
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

__attribute__((always_inline))
static inline float dot_f16_generic(const uint16_t *w, const float *x, int64_t d, const uint16_t *next) {
    (void)next;
    const half_t *h = (const half_t *)w;
    float acc[16] = {0};
    for (int64_t i = 0; i < d; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += HALF(h[i + k]) * x[i + k];
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += acc[k];
    return s;
}

__attribute__((always_inline))
static inline float dot_f32_generic(const float *w, const float *x, int64_t d) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += w[i + k] * x[i + k];
    for (int k = 0; i < d; i++, k++) acc[k] += w[i] * x[i];     /* any length: head_dim, f32 rows */
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += acc[k];
    return s;
}

__attribute__((always_inline))
static inline void axpy_f16_generic(float *restrict y, const uint16_t *const *q, const float *v, int R, int64_t nc) {
    for (int r = 0; r < R; r++) {
        const half_t *restrict w = (const half_t *)q[r];
        const float a = v[r];
        for (int64_t i = 0; i < nc; i++) y[i] += a * HALF(w[i]);
    }
}

__attribute__((always_inline))
static inline void axpy_f32_generic(float *restrict y, const float *const *q, const float *v, int R, int64_t nc) {
    for (int r = 0; r < R; r++) {
        const float *restrict w = q[r];
        const float a = v[r];
        for (int64_t i = 0; i < nc; i++) y[i] += a * w[i];
    }
}

__attribute__((always_inline))
static inline void halves_to_floats_generic(const uint16_t *src, float *restrict dst, int64_t n) {
    const half_t *restrict s = (const half_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = HALF(s[i]);
}

/* ffn_down.c's plain formats: acc[t][i] += sum over rows j of h[t, j] * W[j, c0 + i]. */
__attribute__((always_inline))
static inline void accumulate_rows_generic(const weights_t *w, const float *restrict h,
                                           float (*restrict acc)[COL_CHUNK], int64_t nt, int64_t j0, int64_t j1,
                                           int64_t c0, int64_t nc) {
    const int64_t n = w->n, d = w->d;
    for (int64_t j = j0; j < j1; j++) {
        for (int64_t t = 0; t < nt; t++) {
            const float c = h[t * n + j];
            float *restrict a = acc[t];
            if (w->fmt == FMT_F16) {
                const half_t *restrict q = (const half_t *)w->q + j * d + c0;
                for (int64_t i = 0; i < nc; i++) a[i] += c * HALF(q[i]);
            } else if (w->fmt == FMT_F32) {
                const float *restrict q = (const float *)w->q + j * d + c0;
                for (int64_t i = 0; i < nc; i++) a[i] += c * q[i];
            } else if (w->fmt == FMT_Q4) { /* groups along d; element 2k low nibble, 2k+1 high */
                const uint8_t *restrict q = (const uint8_t *)w->q + j * (d / 2) + c0 / 2;
                const half_t *s = (const half_t *)w->scale + j * (d / G) + c0 / G;
                const half_t *m = w->min ? (const half_t *)w->min + j * (d / G) + c0 / G : NULL;
                for (int64_t g = 0; g < nc / G; g++) {
                    const float cs = c * HALF(s[g]), off = m ? c * HALF(m[g]) : -8.0f * cs;
                    const uint8_t *qg = q + g * (G / 2);
                    float *ag = a + g * G;
                    for (int i = 0; i < G / 2; i++) {
                        ag[2 * i] += cs * (float)(qg[i] & 15) + off;
                        ag[2 * i + 1] += cs * (float)(qg[i] >> 4) + off;
                    }
                }
            } else { /* FMT_Q8: groups along d, scale applied per element */
                const uint8_t *restrict q = (const uint8_t *)w->q + j * d + c0;
                const half_t *s = (const half_t *)w->scale + j * (d / G) + c0 / G;
                for (int64_t g = 0; g < nc / G; g++) {
                    const float cs = c * HALF(s[g]);
                    for (int i = 0; i < G; i++) a[g * G + i] += cs * (float)((int)q[g * G + i] - 128);
                }
            }
        }
    }
}

/* The generic primitives compiled for one set (TARGET: its function attributes), each marking it:
   the tables take those their set has no version of its own for (unused: the others). */
#define PINFER_GENERIC(SET, S, TARGET)                                                                               \
    TARGET __attribute__((unused)) static void quantize_chunks_generic_##S(const float *x, int64_t d, qx_t *o) {     \
        PINFER_RAN(SET);                                                                                             \
        quantize_chunks_generic(x, d, o);                                                                            \
    }                                                                                                                \
    TARGET __attribute__((unused)) static void quantize_natural_generic_##S(const float *x, int64_t d, qx_t *o) {    \
        PINFER_RAN(SET);                                                                                             \
        quantize_natural_generic(x, d, o);                                                                           \
    }                                                                                                                \
    TARGET __attribute__((unused)) static float dot_f16_generic_##S(const uint16_t *w, const float *x, int64_t d,    \
                                                            const uint16_t *next) {                                  \
        PINFER_RAN(SET);                                                                                             \
        return dot_f16_generic(w, x, d, next);                                                                       \
    }                                                                                                                \
    TARGET __attribute__((unused)) static float dot_f32_generic_##S(const float *w, const float *x, int64_t d) {     \
        PINFER_RAN(SET);                                                                                             \
        return dot_f32_generic(w, x, d);                                                                             \
    }                                                                                                                \
    TARGET __attribute__((unused)) static void axpy_f16_generic_##S(float *y, const uint16_t *const *q,              \
                                                                    const float *v, int R, int64_t nc) {             \
        PINFER_RAN(SET);                                                                                             \
        axpy_f16_generic(y, q, v, R, nc);                                                                            \
    }                                                                                                                \
    TARGET __attribute__((unused)) static void axpy_f32_generic_##S(float *y, const float *const *q, const float *v, \
                                                            int R, int64_t nc) {                                     \
        PINFER_RAN(SET);                                                                                             \
        axpy_f32_generic(y, q, v, R, nc);                                                                            \
    }                                                                                                                \
    TARGET __attribute__((unused)) static void halves_to_floats_generic_##S(const uint16_t *src,                     \
                                                                            float *restrict dst, int64_t n) {        \
        PINFER_RAN(SET);                                                                                             \
        halves_to_floats_generic(src, dst, n);                                                                       \
    }                                                                                                                \
    TARGET __attribute__((unused)) static void accumulate_rows_generic_##S(                                          \
        const weights_t *w, const float *restrict h, float (*restrict acc)[COL_CHUNK], int64_t nt, int64_t j0,       \
        int64_t j1, int64_t c0, int64_t nc) {                                                                        \
        PINFER_RAN(SET);                                                                                             \
        accumulate_rows_generic(w, h, acc, nt, j0, j1, c0, nc);                                                      \
    }

/* -- what one kernel unit lends another ---------------------------------------------------------- */

/* y (d) = the kept inputs of x (n) times their rows of c, inside a pool bracket (ffn_sparse.c's
   pinfer_cols without entering the pool); idx and val: scratch of n. Returns the inputs kept. */
PINFER_INTERNAL int64_t pinfer_cols_run(const cols_t *c, int64_t n, int64_t d, const float *x, float *y, int32_t *idx,
                                        float *val, int threads);
/* decode.c's part of pinfer_abi (ffn_sparse.c): the sizes of its structs, or -1. */
PINFER_INTERNAL int64_t pinfer_decode_abi(const char *name);

#endif
