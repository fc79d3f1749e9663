/* The portable primitives (quants.h's table for ISA_PORTABLE), the table of every instruction set,
 * and the one switch between them (pinfer_sparse_isa); with them what decode.c and ffn_sparse.c
 * both read rows through (pinfer_q4_rows). Plain C, compiled for the baseline x86-64 (or any
 * target); every function the portable table holds begins with PINFER_RAN(ISA_PORTABLE). */

#include "quants.h"

PINFER_INTERNAL int pinfer_isa_level = ISA_PORTABLE;
PINFER_INTERNAL _Atomic unsigned pinfer_isa_ran_mask;

/* The best set this CPU has. AVX2's table runs code compiled for x86-64-v3 and AVX-512's for
   x86-64-v4 (their generic C), so each asks for those levels' features besides its own. */
static int best_isa(void) {
#ifdef PINFER_X86
    __builtin_cpu_init();
    const int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
                   __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                   __builtin_cpu_supports("lzcnt") && __builtin_cpu_supports("movbe");
    if (v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512vnni"))
        return ISA_AVX512;
    if (v3) return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

/* Every kernel runs the best set from the library's load on. */
__attribute__((constructor)) static void pick_isa(void) { pinfer_isa_level = best_isa(); }

/* The set every kernel uses (ISA_*); with `want` >= 0, that one from now on if the CPU has it,
   else the best it has (tests and --isa force a lower one; pinfer.kernels.sparse_isa). */
int pinfer_sparse_isa(int want) {
    if (want >= 0) {
        const int best = best_isa();
        pinfer_isa_level = want <= best ? want : best;
    }
    return pinfer_isa_level;
}

/* The sets whose code ran since the last clear (bit ISA_*: pinfer_isa_ran_mask); clear: clear them. */
unsigned pinfer_isa_ran(int clear) {
    return clear ? atomic_exchange(&pinfer_isa_ran_mask, 0u) : atomic_load(&pinfer_isa_ran_mask);
}

int64_t pinfer_qx_bytes(int64_t d) { return (int64_t)sizeof(float) * (d / G * 3) + d; }

qx_t pinfer_qx_at(void *mem, int64_t d) {
    float *f = mem;
    const qx_t qx = {(int8_t *)(f + d / G * 3), f, f + d / G, f + d / G * 2};
    return qx;
}

/* -- row dots ---------------------------------------------------------------------------------- */

/* Dot of one q4 row (q5 with its fifth bits qh, else NULL) with the quantized x, before the min
   term: sum over groups of scale_w[g] * scale_x[g] * sum(q * xq). */
static float dot_q4_portable(const uint8_t *q, const uint8_t *qh, const uint16_t *scale, const uint16_t *min,
                             const qx_t *x, int64_t d) {
    const int64_t ng = d / G;
    const int off = qh ? 16 : 8;     /* the zero point, in the integer sums here (the SIMD rows take it
                                        per group through x->corr) */
    float acc = 0.0f;
    for (int64_t g = 0; g < ng; g++) {
        int32_t s = 0;
        const uint32_t h = qh ? fifth_bits(qh, g) : 0;
        for (int64_t k = 0; k < 16; k++) {
            const uint8_t b = q[g * 16 + k];
            const int lo = (b & 15) | (int)((h >> k) & 1) << 4, hi = (b >> 4) | (int)((h >> (16 + k)) & 1) << 4;
            s += (lo - off) * x->q[chunk_pos(g, 2 * k, ng)] + (hi - off) * x->q[chunk_pos(g, 2 * k + 1, ng)];
        }
        acc += HALF(((const half_t *)scale)[g]) * x->scale[g] * (float)s;
    }
    if (!min) return acc;
    float m = 0.0f;     /* the min term: sum over groups of (min + zero point * scale) * sum(x) */
    for (int64_t g = 0; g < ng; g++)
        m += (HALF(((const half_t *)min)[g]) + (float)off * HALF(((const half_t *)scale)[g])) * x->sum[g];
    return acc + m;
}

/* R rows one at a time (the table's rows_q4; kind and the rows to prefetch go unused). */
#define ROWS_PORTABLE(R)                                                                                    \
    static void rows_portable_##R(const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next, \
                                  int64_t nstride) {                                                        \
        (void)next, (void)nstride;                                                                          \
        PINFER_RAN(ISA_PORTABLE);                                                                           \
        for (int r = 0; r < R; r++) out[r] = dot_q4_portable(w->q[r], w->qh[r], w->scale[r], w->min[r], x, d); \
    }
ROWS_PORTABLE(1) ROWS_PORTABLE(2) ROWS_PORTABLE(4)

static float dot_q8_portable(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, const uint8_t *next) {
    (void)next;
    PINFER_RAN(ISA_PORTABLE);
    float acc = 0.0f;
    for (int64_t g = 0; g < k / G; g++) {
        int32_t s = 0;
        for (int64_t e = 0; e < G; e++) s += ((int)q[g * G + e] - 128) * x->q[g * G + e];
        acc += HALF(((const half_t *)scale)[g]) * x->scale[g] * (float)s;
    }
    return acc;
}

/* The bytes of a tile of rows that meets four tokens at a time: their x stays in L1 (16 KB at 4096
   columns) and the tile in L2. Walking every token for each row instead read every x from L2 once
   per row: 7B-shaped attention, 64 tokens, ran at 60 GMAC/s. */
#define TILE_BYTES (32 << 10)

void pinfer_q4_rows(const linear_t *w, const qx_t *qx, int64_t nt, float *out, int64_t ostride, int64_t b0,
                    int64_t b1) {
    const int64_t k = w->k, stride = k / 2, ng = k / G, r1 = 4 * b1 < w->rows ? 4 * b1 : w->rows;
    const int four = rows_by_four(k);         /* short rows share the loads of x */
    const int64_t ahead = rows_ahead(stride);
    rows4_t rows;
    if (!four && nt > 1) {      /* rows read alone: tiles of rows against four tokens at a time */
        const isa_ops_t *const ops = ISA_OPS;
        const int kind = (w->min != NULL) * 2 + (w->qh != NULL), most = ops->tokens_max;
        const int64_t tile = TILE_BYTES / stride > 1 ? TILE_BYTES / stride : 1;
        for (int64_t i0 = 4 * b0; i0 < r1; i0 += tile) {
            const int64_t i1 = i0 + tile < r1 ? i0 + tile : r1;
            for (int64_t t = 0; t < nt; t += 4) {
                const int T = nt - t < 4 ? (int)(nt - t) : 4;
                for (int64_t i = i0; i < i1; i++) {
                    rows.q[0] = (const uint8_t *)w->q + i * stride;
                    rows.qh[0] = w->qh ? w->qh + i * (k / 8) : NULL;
                    rows.scale[0] = w->scale + i * ng;
                    rows.min[0] = w->min ? w->min + i * ng : NULL;
                    const uint8_t *next = t == 0 && ahead && i + 1 + ahead <= w->rows ? rows.q[0] + ahead * stride : NULL;
                    if (most) {         /* each row unpacked once for up to `most` tokens */
                        for (int j = 0; j < T; j += most)
                            ops->tokens_q4[(T - j < most ? T - j : most) - 1][kind](
                                &rows, &qx[t + j], k, out + (t + j) * ostride + i, ostride, j == 0 ? next : NULL);
                        continue;
                    }
                    for (int j = 0; j < T; j++)
                        pinfer_dot_rows(1, &rows, &qx[t + j], k, out + (t + j) * ostride + i, j == 0 ? next : NULL,
                                        stride);
                }
            }
        }
        return;
    }
    for (int64_t i = 4 * b0, R = 1; i < r1; i += R) {
        R = r1 - i >= 4 && four ? 4 : 1;
        for (int j = 0; j < R; j++) {
            rows.q[j] = (const uint8_t *)w->q + (i + j) * stride;
            rows.qh[j] = w->qh ? w->qh + (i + j) * (k / 8) : NULL;
            rows.scale[j] = w->scale + (i + j) * ng;
            rows.min[j] = w->min ? w->min + (i + j) * ng : NULL;
        }
        const uint8_t *next = ahead && i + R + ahead <= w->rows ? rows.q[0] + ahead * stride : NULL;
        for (int64_t t = 0; t < nt; t++)
            pinfer_dot_rows((int)R, &rows, &qx[t], k, out + t * ostride + i, t == 0 ? next : NULL, stride);
    }
}

/* -- the sparse FFN's down projection over survivors ---------------------------------------------- */

void pinfer_axpy_q4_portable(float *restrict p, const uint8_t *const *q, const float (*a)[MAX_D / G], int R,
                             int64_t ng) {
    PINFER_RAN(ISA_PORTABLE);
    for (int64_t g = 0; g < ng; g++)
        for (int r = 0; r < R; r++)
            for (int e = 0; e < 16; e++) {
                p[G * g + e] += a[r][g] * (float)(q[r][16 * g + e] & 15);
                p[G * g + 16 + e] += a[r][g] * (float)(q[r][16 * g + e] >> 4);
            }
}

static void axpy_q8_portable(float *p, const uint8_t *const *qr, const uint16_t *const *scr, const float *v, int R,
                             int64_t ng, const uint8_t *const *next, int Rn) {
    (void)next, (void)Rn;
    PINFER_RAN(ISA_PORTABLE);
    for (int r = 0; r < R; r++) {
        const uint8_t *restrict q = qr[r];
        const half_t *sc = (const half_t *)scr[r];
        for (int64_t g = 0; g < ng; g++) {
            const float a = v[r] * HALF(sc[g]);
            float *restrict yo = p + g * G;
            for (int e = 0; e < G; e++) yo[e] += a * (float)((int)q[g * G + e] - 128);
        }
    }
}

void pinfer_row_scales_portable(float *a, float *off, const uint16_t *sc16, const uint16_t *mn16, float v,
                                int64_t ng) {
    PINFER_RAN(ISA_PORTABLE);
    const half_t *sc = (const half_t *)sc16, *mn = (const half_t *)mn16;
    for (int64_t g = 0; g < ng; g++) a[g] = v * HALF(sc[g]);
    if (mn)
        for (int64_t g = 0; g < ng; g++) off[g] += v * HALF(mn[g]);
    else
        for (int64_t g = 0; g < ng; g++) off[g] += -8.0f * a[g];
}

void pinfer_scale_group_portable(float *p, const float *acc, const uint16_t *sc16, const uint16_t *mn16, float vsum,
                                 int64_t ng) {
    PINFER_RAN(ISA_PORTABLE);
    const half_t *sc = (const half_t *)sc16, *mn = (const half_t *)mn16;
    for (int64_t g = 0; g < ng; g++)
        for (int e = 0; e < 16; e++) {
            const float s0 = HALF(sc[g * G + 2 * e]), s1 = HALF(sc[g * G + 2 * e + 1]);
            const float o0 = mn ? HALF(mn[g * G + 2 * e]) : -8.0f * s0;
            const float o1 = mn ? HALF(mn[g * G + 2 * e + 1]) : -8.0f * s1;
            p[g * G + e] += s0 * acc[g * G + e] + o0 * vsum;
            p[g * G + 16 + e] += s1 * acc[g * G + 16 + e] + o1 * vsum;
        }
}

/* -- the rule ------------------------------------------------------------------------------------ */

/* silu: g sigmoid(g); relu; gelu, tanh-approximated (GeGLU: Gemma): 0.5 g (1 + tanh(z)) with
   z = sqrt(2/pi) (g + 0.044715 g^3), which is g sigmoid(2 z) */
static float activate(int act, float g) {
    if (act == ACT_RELU) return g > 0.0f ? g : 0.0f;
    const float z = act == ACT_GELU ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
    return g / (1.0f + expf(-z));
}

/* h = act(g) * u, or 0 where the mode's rule skips the neuron. */
static float rule(int act, float g, float u, int mode, float thr) {
    const float h = activate(act, g) * u;
    if (mode == MODE_RELU) return h;
    if ((mode == MODE_DOWN || mode == MODE_PREDICTED || mode == MODE_GIVEN) && fabsf(h) < thr) return 0.0f;
    return h;
}

static void rules_portable(int act, const float *g, const float *u, int64_t n, int mode, float thr, float *h) {
    PINFER_RAN(ISA_PORTABLE);
    for (int64_t i = 0; i < n; i++) h[i] = rule(act, g[i], u[i], mode, thr);
}

/* -- attention ------------------------------------------------------------------------------------ */

/* Element i of a K or V cache of f32 (f16 0) or f16 (f16 1) values. */
static inline float kv_at(const void *p, int64_t i, int f16) {
    return f16 ? HALF(((const half_t *)p)[i]) : ((const float *)p)[i];
}

/* One head over positions 0..n-1: scores s = scale q.K_j (softcapped), their softmax, o = sum p_j V_j.
   Every ISA sums in the same order within its own lanes; the ISAs differ by float rounding only. */
void pinfer_head_portable(const float *q, const void *K, const void *V, int64_t n, int64_t hd, float scale,
                          float softcap, float *s, float *o, int f16) {
    PINFER_RAN(ISA_PORTABLE);
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

/* -- the dense down projection (ffn_down.c) ------------------------------------------------------- */

/* ffn_down.c's R formats (accumulate_grouped), each output element's sum in row order: the AVX-512
   version sums pairs of rows apart and fuses its multiplies, so its bits may differ in the last place. */
void pinfer_accumulate_grouped_portable(const weights_t *w, const float *h, float (*acc)[COL_CHUNK], int64_t nt,
                                        int64_t j0, int64_t j1, int64_t c0, int64_t nc) {
    PINFER_RAN(ISA_PORTABLE);
    const int64_t n = w->n, d = w->d, half = nc / 2;
    for (int64_t t = 0; t < nt; t++) {
        memset(acc[t], 0, (size_t)nc * sizeof(float));
        for (int64_t j = j0; j < j1; j++) {
            const float x = h[t * n + j];
            if (w->fmt == FMT_Q4R) {
                const uint8_t *q = (const uint8_t *)w->q + j * (d / 2) + c0 / 2;
                for (int64_t k = 0; k < half; k++) {
                    acc[t][k] += x * (float)(q[k] & 15);
                    acc[t][half + k] += x * (float)(q[k] >> 4);
                }
            } else {
                const uint8_t *q = (const uint8_t *)w->q + j * d + c0;
                for (int64_t k = 0; k < nc; k++) acc[t][k] += x * (float)((int)q[k] - 128);
            }
        }
    }
}

/* -- the tables ---------------------------------------------------------------------------------- */

PINFER_GENERIC(ISA_PORTABLE, portable, )

#define ROWS_ALL(R) {rows_portable_##R, rows_portable_##R, rows_portable_##R, rows_portable_##R}
PINFER_INTERNAL const isa_ops_t pinfer_ops_portable = {
    .quantize_chunks = quantize_chunks_generic_portable,
    .quantize_natural = quantize_natural_generic_portable,
    .rows_q4 = {ROWS_ALL(1), ROWS_ALL(2), ROWS_ALL(4)},
    .tokens_max = 0,
    .dot_q8 = dot_q8_portable,
    .dot_f16 = dot_f16_generic_portable,
    .dot_f32 = dot_f32_generic_portable,
    .axpy_f16 = axpy_f16_generic_portable,
    .axpy_f32 = axpy_f32_generic_portable,
    .axpy_q8 = axpy_q8_portable,
    .row_scales = pinfer_row_scales_portable,
    .axpy_q4 = pinfer_axpy_q4_portable,
    .scale_group = pinfer_scale_group_portable,
    .rules = rules_portable,
    .head = pinfer_head_portable,
    .halves_to_floats = halves_to_floats_generic_portable,
    .accumulate_rows = accumulate_rows_generic_portable,
    .accumulate_grouped = pinfer_accumulate_grouped_portable,
};

#ifdef PINFER_X86
PINFER_INTERNAL const isa_ops_t *const pinfer_ops[ISA_COUNT] = {&pinfer_ops_portable, &pinfer_ops_avx2,
                                                                &pinfer_ops_avx512};
#else
PINFER_INTERNAL const isa_ops_t *const pinfer_ops[ISA_COUNT] = {&pinfer_ops_portable, &pinfer_ops_portable,
                                                                &pinfer_ops_portable};
#endif
