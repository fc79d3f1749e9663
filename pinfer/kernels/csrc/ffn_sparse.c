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
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "codes.h"   /* FMT_* (q5: gate/up only), MODE_*, ACT_* */
#include "dots.h"
#include "half.h"
#include "pool.h"
#include <stdatomic.h>


#define MAX_D 65536
/* Loops over fewer weights than this run on the calling thread alone. The pool's workers spin
   through a call, so a loop pays no wake-up, only the hand-out of its ranges. SmolLM2's loops
   (576 x 1536) were all under the former limit of 1M weights; from 256k they take both threads:
   benchmarks/decode_profile.py's kernel time per token on 2 threads went from 4.60 to 3.17 ms, and
   benchmarks/sparse_kernel.py --shapes smollm2 --formats int4 --fractions 1 from 14.2 to 16.7 GB/s.
   (PARALLEL_WORK is in dots.h: decode.c's loops share it.) */

/* -- activations --------------------------------------------------------------------------- */

/* qx_t (dots.h): x quantized per group of 32, in chunk order (above) */

/* Position of element e of group g (of ng groups) in chunk order. */
static inline int64_t chunk_pos(int64_t g, int64_t e, int64_t ng) {
    const int64_t c = g / 4, k = g % 4, in_chunk = ng - 4 * c < 4 ? ng - 4 * c : 4;
    return 4 * c * G + (e % 2) * 16 * in_chunk + k * 16 + e / 2;
}

PINFER_CLONES
static void quantize_x(const float *x, int64_t d, qx_t *o) {
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

int64_t pinfer_qx_bytes(int64_t d) { return (int64_t)sizeof(float) * (d / G * 3) + d; }

qx_t pinfer_qx_at(void *mem, int64_t d) {
    float *f = mem;
    const qx_t qx = {(int8_t *)(f + d / G * 3), f, f + d / G, f + d / G * 2};
    return qx;
}

/* -- int4 x int8 row dots -------------------------------------------------------------------- */

/* q5's fifth bits of group g: the even elements' (bit j: element 2j) and the odd ones'. */
static inline uint32_t fifth_bits(const uint8_t *qh, int64_t g) {
    uint32_t w;
    memcpy(&w, qh + 4 * g, 4);
    return w;
}


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

#ifdef PINFER_X86
#define AVX512_DOTS "avx512f,avx512bw,avx512vnni,avx512vl,f16c,fma"

/* q5's fifth bits of the k groups from g: a byte mask per nibble plane (16 bits per group). */
__attribute__((target(AVX512_DOTS), always_inline))
static inline void fifth_masks(const uint8_t *qh, int64_t g, int64_t k, __mmask64 *even, __mmask64 *odd) {
    uint64_t me = 0, mo = 0;
    for (int64_t i = 0; i < k; i++) {
        const uint32_t h = fifth_bits(qh, g + i);
        me |= (uint64_t)(h & 0xffff) << (16 * i);
        mo |= (uint64_t)(h >> 16) << (16 * i);
    }
    *even = me;
    *odd = mo;
}

/* A block of kg groups from g (kg = 16 but at the end of a row: four chunks, 256 weight bytes a
   row) of R rows: the integer sums of each chunk's 16 lanes (four per group) by vpdpbusd, scaled
   by the group's product of the two scales, one conversion of the block's 16 scales per row; the
   zero point and the mins per group, in float, once per block (rows_q4_avx512 says how). */
__attribute__((target(AVX512_DOTS), always_inline))
static inline void block_avx512(const int R, const int MIN, const int QH, const rows4_t *w, const qx_t *x, int64_t g,
                                const int64_t kg, __m512 *acc, __m512 *cacc, const uint8_t *next, int64_t nstride) {
    const __m512i low4 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    const __mmask16 mg = kg == 16 ? 0xffff : (__mmask16)((1u << kg) - 1);
    const __m512 xs = _mm512_maskz_loadu_ps(mg, x->scale + g);
    __m512 xc = _mm512_maskz_loadu_ps(mg, x->corr + g);
    if (QH) xc = _mm512_add_ps(xc, xc);
    const __m512 xsum = MIN ? _mm512_maskz_loadu_ps(mg, x->sum + g) : _mm512_setzero_ps();
    __m512 ws[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (next)
            for (int64_t c = 0; c < kg; c += 4) _mm_prefetch((const char *)(next + r * nstride + (g + c) * 16), _MM_HINT_T0);
        const __m512 sw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mg, w->scale[r] + g));
        ws[r] = _mm512_mul_ps(sw, xs);
        cacc[r] = _mm512_fmadd_ps(sw, xc, cacc[r]);
        if (MIN)    /* min + zero point * scale, against x itself */
            cacc[r] = _mm512_fmadd_ps(_mm512_fmadd_ps(sw, _mm512_set1_ps(QH ? 16.0f : 8.0f),
                                                      _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mg, w->min[r] + g))),
                                      xsum, cacc[r]);
    }
#pragma GCC unroll 4
    for (int64_t c = 0; c < 4; c++) {
        const int64_t k = kg - 4 * c < 4 ? kg - 4 * c : 4, gc = g + 4 * c;
        if (k <= 0) break;
        const __mmask64 m = k == 4 ? ~0ULL : (1ULL << (16 * k)) - 1;
        const __m512i xe = _mm512_maskz_loadu_epi8(m, x->q + gc * G);
        const __m512i xo = _mm512_maskz_loadu_epi8(m, x->q + gc * G + 16 * k);
        const __m512i spread = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                                _mm512_set1_epi32((int)(4 * c)));
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m512i v = _mm512_maskz_loadu_epi8(m, w->q[r] + gc * 16);
            __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
            if (QH) {
                __mmask64 me, mo;
                fifth_masks(w->qh[r], gc, k, &me, &mo);
                lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(me, sixteen));
                hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(mo, sixteen));
            }
            const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(spread, ws[r]), acc[r]);
        }
    }
}

/* R rows (R constant where inlined) against one quantized x, sixteen groups per step: each load of
   x serves the R rows. Every row meets x as scale * (q - z), z the zero point (8, or 16 for q5):
   the integer sums take q as it is, and z comes back per group as scale * x->corr (-8 * x's scale *
   the sum of its q, twice that for q5); a row with a min adds (min + z * scale) * sum(x) per group,
   x itself (as the ONNX graphs do: the centred part against int8 x errs less than q * scale would).
   next: rows to prefetch meanwhile (R of them, nstride bytes apart), or NULL. */
__attribute__((target(AVX512_DOTS), always_inline))
static inline void rows_q4_avx512(const int R, const int MIN, const int QH, const rows4_t *w, const qx_t *x,
                                  int64_t d, float *out, const uint8_t *next, int64_t nstride) {
    const int64_t ng = d / G;
    const __m512 z = _mm512_setzero_ps();
    __m512 acc[4] = {z, z, z, z}, cacc[4] = {z, z, z, z};
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) block_avx512(R, MIN, QH, w, x, g, 16, acc, cacc, next, nstride);
    if (g < ng) block_avx512(R, MIN, QH, w, x, g, ng - g, acc, cacc, next, nstride);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r], cacc[r]));
}

/* block_avx512 for one row against T tokens' x (T constant where inlined): the row's nibbles are
   unpacked once for all of them. Each token's sums take the same operations in the same order as
   block_avx512 with that token alone, so its result has the same bits. It stays apart from
   block_avx512: one function of R rows and T tokens for both made a 7B-shaped layer's 64-token
   FFN batch about 10% slower (111 -> 123 ms, 1 thread). */
__attribute__((target(AVX512_DOTS), always_inline))
static inline void block_avx512_tokens(const int T, const int MIN, const int QH, const rows4_t *w, const qx_t *x,
                                       int64_t g, const int64_t kg, __m512 *acc, __m512 *cacc, const uint8_t *next) {
    const __m512i low4 = _mm512_set1_epi8(15), sixteen = _mm512_set1_epi8(16);
    const __mmask16 mg = kg == 16 ? 0xffff : (__mmask16)((1u << kg) - 1);
    if (next)
        for (int64_t c = 0; c < kg; c += 4) _mm_prefetch((const char *)(next + (g + c) * 16), _MM_HINT_T0);
    const __m512 sw = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mg, w->scale[0] + g));
    const __m512 mn = MIN ? _mm512_fmadd_ps(sw, _mm512_set1_ps(QH ? 16.0f : 8.0f),
                                            _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mg, w->min[0] + g)))
                          : _mm512_setzero_ps();
    __m512 ws[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        __m512 xc = _mm512_maskz_loadu_ps(mg, x[t].corr + g);
        if (QH) xc = _mm512_add_ps(xc, xc);
        ws[t] = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(mg, x[t].scale + g));
        cacc[t] = _mm512_fmadd_ps(sw, xc, cacc[t]);
        if (MIN) cacc[t] = _mm512_fmadd_ps(mn, _mm512_maskz_loadu_ps(mg, x[t].sum + g), cacc[t]);
    }
#pragma GCC unroll 4
    for (int64_t c = 0; c < 4; c++) {
        const int64_t k = kg - 4 * c < 4 ? kg - 4 * c : 4, gc = g + 4 * c;
        if (k <= 0) break;
        const __mmask64 m = k == 4 ? ~0ULL : (1ULL << (16 * k)) - 1;
        const __m512i spread = _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                                _mm512_set1_epi32((int)(4 * c)));
        const __m512i v = _mm512_maskz_loadu_epi8(m, w->q[0] + gc * 16);
        __m512i lo = _mm512_and_si512(v, low4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        if (QH) {
            __mmask64 me, mo;
            fifth_masks(w->qh[0], gc, k, &me, &mo);
            lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(me, sixteen));
            hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(mo, sixteen));
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m512i xe = _mm512_maskz_loadu_epi8(m, x[t].q + gc * G);
            const __m512i xo = _mm512_maskz_loadu_epi8(m, x[t].q + gc * G + 16 * k);
            const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(spread, ws[t]), acc[t]);
        }
    }
}

/* One row against T tokens (rows_q4_avx512 with the roles of rows and x swapped): out[t * ostride]. */
__attribute__((target(AVX512_DOTS), always_inline))
static inline void tokens_q4_avx512(const int T, const int MIN, const int QH, const rows4_t *w, const qx_t *x,
                                    int64_t d, float *out, int64_t ostride, const uint8_t *next) {
    const int64_t ng = d / G;
    const __m512 z = _mm512_setzero_ps();
    __m512 acc[4] = {z, z, z, z}, cacc[4] = {z, z, z, z};
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) block_avx512_tokens(T, MIN, QH, w, x, g, 16, acc, cacc, next);
    if (g < ng) block_avx512_tokens(T, MIN, QH, w, x, g, ng - g, acc, cacc, next);
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) out[t * ostride] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], cacc[t]));
}

#define PINFER_TOKENS(T, MIN, QH)                                                                           \
    __attribute__((target(AVX512_DOTS))) static void tokens_avx512_##T##MIN##QH(                           \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, int64_t os, const uint8_t *next) {          \
        tokens_q4_avx512(T, MIN, QH, w, x, d, out, os, next);                                               \
    }
#define PINFER_TOKENS_T(T) PINFER_TOKENS(T, 0, 0) PINFER_TOKENS(T, 0, 1) PINFER_TOKENS(T, 1, 0) PINFER_TOKENS(T, 1, 1)
PINFER_TOKENS_T(1) PINFER_TOKENS_T(2) PINFER_TOKENS_T(3) PINFER_TOKENS_T(4)
typedef void (*tokens_avx512_fn)(const rows4_t *, const qx_t *, int64_t, float *, int64_t, const uint8_t *);
#define PINFER_TOKENS_TABLE(T) {tokens_avx512_##T##00, tokens_avx512_##T##01, tokens_avx512_##T##10, tokens_avx512_##T##11}
static const tokens_avx512_fn tokens_avx512[4][4] = {PINFER_TOKENS_TABLE(1), PINFER_TOKENS_TABLE(2),
                                                     PINFER_TOKENS_TABLE(3), PINFER_TOKENS_TABLE(4)};

/* 0x10 in byte j where bit j of m is set (the fifth bits of two groups' nibble plane). */
__attribute__((target("avx2")))
static inline __m256i sixteens_avx2(uint32_t m) {
    const __m256i pick = _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), pick), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, bit), _mm256_set1_epi8(16));
}

/* block_avx512 on AVX2: kg groups from g (eight but at the end of a row) of R rows, two groups (32
   weight bytes a row) per step by pmaddubsw on q as it is (the pair sums stay under 2 * 31 * 127,
   their sums under 2^15), one group at a row's odd end; the block's eight scales converted once a
   row. ng: the row's groups (the chunks' widths). `next` as block_avx512's: prefetching the rows
   ahead made AVX2 decode about 9% faster on 1 thread and 17% on 2 (SmolLM2 Q4_0;
   benchmarks/smollm2_vs_llamacpp.py --isa avx2 shows the result). With AVX2's 16 vector registers
   the zero-point and min terms go into acc itself (AVX-512 keeps them apart in cacc): four rows'
   separate cacc spilled to the stack. A whole block (kg 8, g a multiple of 8: two whole chunks of
   x) takes x's offsets as constants, not from ng; the two together gained about 3%. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void block_avx2(const int R, const int MIN, const int QH, const rows4_t *w, const qx_t *x, int64_t ng,
                              int64_t g, const int64_t kg, __m256 *acc, const uint8_t *next, int64_t nstride) {
    const __m256i l4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256 xs = pinfer_load8_ps(x->scale + g, kg), xm = MIN ? pinfer_load8_ps(x->sum + g, kg) : _mm256_setzero_ps();
    __m256 xc = pinfer_load8_ps(x->corr + g, kg);
    if (QH) xc = _mm256_add_ps(xc, xc);
    __m256 ws[4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        if (next)
            for (int64_t c = 0; c < kg; c += 4) _mm_prefetch((const char *)(next + r * nstride + (g + c) * 16), _MM_HINT_T0);
        const __m256 sw = pinfer_load8_ph(w->scale[r] + g, kg);
        ws[r] = _mm256_mul_ps(sw, xs);
        acc[r] = _mm256_fmadd_ps(sw, xc, acc[r]);
        if (MIN)    /* min + zero point * scale, against x itself */
            acc[r] = _mm256_fmadd_ps(_mm256_fmadd_ps(sw, _mm256_set1_ps(QH ? 16.0f : 8.0f), pinfer_load8_ph(w->min[r] + g, kg)),
                                     xm, acc[r]);
    }
    int64_t i = 0;
#pragma GCC unroll 4
    for (; i + 2 <= kg; i += 2) {
        const int64_t gc = g + i, c0 = kg == 8 ? g + i / 4 * 4 : gc / 4 * 4, k = kg == 8 ? 4 : ng - c0 < 4 ? ng - c0 : 4,
                      at = gc - c0;
        const __m256i xe = _mm256_loadu_si256((const __m256i *)(x->q + c0 * G + 16 * at));
        const __m256i xo = _mm256_loadu_si256((const __m256i *)(x->q + c0 * G + 16 * k + 16 * at));
        const __m256i spread = _mm256_setr_epi32((int)i, (int)i, (int)i, (int)i, (int)i + 1, (int)i + 1, (int)i + 1, (int)i + 1);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w->q[r] + gc * 16));
            __m256i lo = _mm256_and_si256(v, l4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), l4);
            if (QH) {
                const uint32_t h0 = fifth_bits(w->qh[r], gc), h1 = fifth_bits(w->qh[r], gc + 1);
                lo = _mm256_or_si256(lo, sixteens_avx2((h0 & 0xffff) | h1 << 16));
                hi = _mm256_or_si256(hi, sixteens_avx2(h0 >> 16 | (h1 & 0xffff0000u)));
            }
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
            const int a = R == 1 ? (int)(i / 2 % 2) : r;    /* one row: two chains (rows_q4_avx2) */
            acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)), _mm256_permutevar8x32_ps(ws[r], spread),
                                     acc[a]);
        }
    }
    if (i < kg) {   /* one group left: the chunk holds k groups; this is group `at` of it */
        const int64_t gc = g + i, c0 = gc / 4 * 4, k = ng - c0 < 4 ? ng - c0 : 4, at = gc - c0;
        const __m128i xe = _mm_loadu_si128((const __m128i *)(x->q + c0 * G + 16 * at));
        const __m128i xo = _mm_loadu_si128((const __m128i *)(x->q + c0 * G + 16 * k + 16 * at));
        const __m128i low4 = _mm_set1_epi8(15);
        const __m256i spread = _mm256_set1_epi32((int)i);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(w->q[r] + gc * 16));
            __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
            if (QH) {
                const __m256i h = sixteens_avx2(fifth_bits(w->qh[r], gc));   /* evens in the low half */
                lo = _mm_or_si128(lo, _mm256_castsi256_si128(h));
                hi = _mm_or_si128(hi, _mm256_extracti128_si256(h, 1));
            }
            const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(lo, xe), _mm_maddubs_epi16(hi, xo));
            const __m128 sums = _mm_cvtepi32_ps(_mm_madd_epi16(p, _mm_set1_epi16(1)));
            const __m256 s8 = _mm256_insertf128_ps(_mm256_setzero_ps(), sums, 0);
            acc[r] = _mm256_fmadd_ps(s8, _mm256_permutevar8x32_ps(ws[r], spread), acc[r]);
        }
    }
}

/* block_avx2 for one row (R = 1: two chains in turn) against T <= 2 tokens' x: the row's nibbles
   unpacked once for both. Each token's chains take the same operations in the same order as
   block_avx2 with that token alone, so its result has the same bits. acc: two per token. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void block_avx2_tokens(const int T, const int MIN, const int QH, const rows4_t *w, const qx_t *x,
                                     int64_t ng, int64_t g, const int64_t kg, __m256 *acc, const uint8_t *next) {
    const __m256i l4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    if (next)
        for (int64_t c = 0; c < kg; c += 4) _mm_prefetch((const char *)(next + (g + c) * 16), _MM_HINT_T0);
    const __m256 sw = pinfer_load8_ph(w->scale[0] + g, kg);
    __m256 ws[2];
#pragma GCC unroll 2
    for (int t = 0; t < T; t++) {
        __m256 xc = pinfer_load8_ps(x[t].corr + g, kg);
        if (QH) xc = _mm256_add_ps(xc, xc);
        ws[t] = _mm256_mul_ps(sw, pinfer_load8_ps(x[t].scale + g, kg));
        acc[2 * t] = _mm256_fmadd_ps(sw, xc, acc[2 * t]);
        if (MIN)
            acc[2 * t] = _mm256_fmadd_ps(_mm256_fmadd_ps(sw, _mm256_set1_ps(QH ? 16.0f : 8.0f), pinfer_load8_ph(w->min[0] + g, kg)),
                                         pinfer_load8_ps(x[t].sum + g, kg), acc[2 * t]);
    }
    int64_t i = 0;
    for (; i + 2 <= kg; i += 2) {
        const int64_t gc = g + i, c0 = kg == 8 ? g + i / 4 * 4 : gc / 4 * 4, k = kg == 8 ? 4 : ng - c0 < 4 ? ng - c0 : 4,
                      at = gc - c0;
        const __m256i spread = _mm256_setr_epi32((int)i, (int)i, (int)i, (int)i, (int)i + 1, (int)i + 1, (int)i + 1, (int)i + 1);
        const __m256i v = _mm256_loadu_si256((const __m256i *)(w->q[0] + gc * 16));
        __m256i lo = _mm256_and_si256(v, l4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), l4);
        if (QH) {
            const uint32_t h0 = fifth_bits(w->qh[0], gc), h1 = fifth_bits(w->qh[0], gc + 1);
            lo = _mm256_or_si256(lo, sixteens_avx2((h0 & 0xffff) | h1 << 16));
            hi = _mm256_or_si256(hi, sixteens_avx2(h0 >> 16 | (h1 & 0xffff0000u)));
        }
        const int a = (int)(i / 2 % 2);
#pragma GCC unroll 2
        for (int t = 0; t < T; t++) {
            const __m256i xe = _mm256_loadu_si256((const __m256i *)(x[t].q + c0 * G + 16 * at));
            const __m256i xo = _mm256_loadu_si256((const __m256i *)(x[t].q + c0 * G + 16 * k + 16 * at));
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xe), _mm256_maddubs_epi16(hi, xo));
            acc[2 * t + a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),
                                             _mm256_permutevar8x32_ps(ws[t], spread), acc[2 * t + a]);
        }
    }
    if (i < kg) {   /* one group left, as in block_avx2 */
        const int64_t gc = g + i, c0 = gc / 4 * 4, k = ng - c0 < 4 ? ng - c0 : 4, at = gc - c0;
        const __m128i low4 = _mm_set1_epi8(15);
        const __m256i spread = _mm256_set1_epi32((int)i);
        const __m128i v = _mm_loadu_si128((const __m128i *)(w->q[0] + gc * 16));
        __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        if (QH) {
            const __m256i h = sixteens_avx2(fifth_bits(w->qh[0], gc));
            lo = _mm_or_si128(lo, _mm256_castsi256_si128(h));
            hi = _mm_or_si128(hi, _mm256_extracti128_si256(h, 1));
        }
#pragma GCC unroll 2
        for (int t = 0; t < T; t++) {
            const __m128i xe = _mm_loadu_si128((const __m128i *)(x[t].q + c0 * G + 16 * at));
            const __m128i xo = _mm_loadu_si128((const __m128i *)(x[t].q + c0 * G + 16 * k + 16 * at));
            const __m128i p = _mm_add_epi16(_mm_maddubs_epi16(lo, xe), _mm_maddubs_epi16(hi, xo));
            const __m128 sums = _mm_cvtepi32_ps(_mm_madd_epi16(p, _mm_set1_epi16(1)));
            const __m256 s8 = _mm256_insertf128_ps(_mm256_setzero_ps(), sums, 0);
            acc[2 * t] = _mm256_fmadd_ps(s8, _mm256_permutevar8x32_ps(ws[t], spread), acc[2 * t]);
        }
    }
}

/* One row against T <= 2 tokens on AVX2 (rows_q4_avx2 with R = 1, per token): out[t * ostride]. */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void tokens_q4_avx2(const int T, const int MIN, const int QH, const rows4_t *w, const qx_t *x, int64_t d,
                                  float *out, int64_t ostride, const uint8_t *next) {
    const int64_t ng = d / G;
    const __m256 z = _mm256_setzero_ps();
    __m256 acc[4] = {z, z, z, z};
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) block_avx2_tokens(T, MIN, QH, w, x, ng, g, 8, acc, next);
    if (g < ng) block_avx2_tokens(T, MIN, QH, w, x, ng, g, ng - g, acc, next);
#pragma GCC unroll 2
    for (int t = 0; t < T; t++) out[t * ostride] = pinfer_hsum8(_mm256_add_ps(acc[2 * t], acc[2 * t + 1]));
}

#define PINFER_TOKENS2(T, MIN, QH)                                                                          \
    __attribute__((target("avx2,fma,f16c"))) static void tokens_avx2_##T##MIN##QH(                         \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, int64_t os, const uint8_t *next) {          \
        tokens_q4_avx2(T, MIN, QH, w, x, d, out, os, next);                                                 \
    }
PINFER_TOKENS2(1, 0, 0) PINFER_TOKENS2(1, 0, 1) PINFER_TOKENS2(1, 1, 0) PINFER_TOKENS2(1, 1, 1)
PINFER_TOKENS2(2, 0, 0) PINFER_TOKENS2(2, 0, 1) PINFER_TOKENS2(2, 1, 0) PINFER_TOKENS2(2, 1, 1)
static const tokens_avx512_fn tokens_avx2[2][4] = {
    {tokens_avx2_100, tokens_avx2_101, tokens_avx2_110, tokens_avx2_111},
    {tokens_avx2_200, tokens_avx2_201, tokens_avx2_210, tokens_avx2_211}};

/* rows_q4_avx512 on AVX2, eight groups per step, the rows at `next` prefetched meanwhile. A row read
   alone (R = 1) adds its steps into two accumulators in turn: with one, each step waited on the
   last one's FMA (4 cycles) while its other instructions took about 3. HeadStep over q4 rows, 1
   thread, AVX2, both variants alternating in one process (a throwaway build): 4096 wide 24.4 ->
   27.7 GB/s, 1536 wide 20.8 -> 22.4, and 4096 wide on 2 threads 45.0 -> 53.3. Such a row's sum is
   not the bits R = 2 or 4 would give it, so the callers read all of a matrix's rows alone or none
   (dots.h). */
__attribute__((target("avx2,fma,f16c"), always_inline))
static inline void rows_q4_avx2(const int R, const int MIN, const int QH, const rows4_t *w, const qx_t *x, int64_t d,
                                float *out, const uint8_t *next, int64_t nstride) {
    const int64_t ng = d / G;
    const __m256 z = _mm256_setzero_ps();
    __m256 acc[4] = {z, z, z, z};
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) block_avx2(R, MIN, QH, w, x, ng, g, 8, acc, next, nstride);
    if (g < ng) block_avx2(R, MIN, QH, w, x, ng, g, ng - g, acc, next, nstride);
    if (R == 1) acc[0] = _mm256_add_ps(acc[0], acc[1]);
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) out[r] = pinfer_hsum8(acc[r]);
}

/* The row counts the callers use (1, 2, 4), with and without mins and fifth bits: each a function of
   its own, R, MIN and QH constants in it. */
#define PINFER_ROWS(R, MIN, QH)                                                                             \
    __attribute__((target(AVX512_DOTS))) static void rows_avx512_##R##MIN##QH(                             \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next, int64_t ns) {           \
        rows_q4_avx512(R, MIN, QH, w, x, d, out, next, ns);                                                 \
    }                                                                                                      \
    __attribute__((target("avx2,fma,f16c"))) static void rows_avx2_##R##MIN##QH(                           \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next, int64_t ns) {           \
        rows_q4_avx2(R, MIN, QH, w, x, d, out, next, ns);                                                   \
    }
#define PINFER_ROWS_R(R) PINFER_ROWS(R, 0, 0) PINFER_ROWS(R, 0, 1) PINFER_ROWS(R, 1, 0) PINFER_ROWS(R, 1, 1)
PINFER_ROWS_R(1) PINFER_ROWS_R(2) PINFER_ROWS_R(4)
typedef void (*rows_avx512_fn)(const rows4_t *, const qx_t *, int64_t, float *, const uint8_t *, int64_t);
typedef void (*rows_avx2_fn)(const rows4_t *, const qx_t *, int64_t, float *, const uint8_t *, int64_t);
#define PINFER_ROWS_TABLE(isa, R) {rows_##isa##_##R##00, rows_##isa##_##R##01, rows_##isa##_##R##10, rows_##isa##_##R##11}
static const rows_avx512_fn rows_avx512[3][4] = {PINFER_ROWS_TABLE(avx512, 1), PINFER_ROWS_TABLE(avx512, 2),
                                                 PINFER_ROWS_TABLE(avx512, 4)};
static const rows_avx2_fn rows_avx2[3][4] = {PINFER_ROWS_TABLE(avx2, 1), PINFER_ROWS_TABLE(avx2, 2),
                                             PINFER_ROWS_TABLE(avx2, 4)};
#endif

static int isa = -1;

static int detect_isa(void) {
#ifdef PINFER_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl"))
        return ISA_AVX512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        return ISA_AVX2;
#endif
    return ISA_PORTABLE;
}

/* The best instruction set this CPU has; with `want` >= 0, that one if the CPU has it (tests). */
int pinfer_sparse_isa(int want) {
    const int best = detect_isa();
    if (want >= 0) isa = want <= best ? want : best;
    else if (isa < 0) isa = best;
    return isa;
}

static void dot_rows(int R, const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next,
                     int64_t nstride) {
#ifdef PINFER_X86
    const int r = R == 4 ? 2 : R - 1, kind = (w->min[0] != NULL) * 2 + (w->qh[0] != NULL);  /* rows share a format */
    if (isa == ISA_AVX512) {
        rows_avx512[r][kind](w, x, d, out, next, nstride);
        return;
    }
    if (isa == ISA_AVX2) {
        rows_avx2[r][kind](w, x, d, out, next, nstride);
        return;
    }
#endif
    (void)next, (void)nstride;
    for (int r = 0; r < R; r++) out[r] = dot_q4_portable(w->q[r], w->qh[r], w->scale[r], w->min[r], x, d);
}

/* `next`: a row of as many bytes to prefetch while this one is read (the next candidate's: a
   gather's rows are short streams the hardware prefetcher does not follow in time), or NULL. */
static float dot_q4(const uint8_t *q, const uint8_t *qh, const uint16_t *scale, const uint16_t *min, const qx_t *x,
                    int64_t d, const uint8_t *next) {
    const rows4_t w = {{q}, {qh}, {scale}, {min}};
    float out;
    dot_rows(1, &w, x, d, &out, next, 0);
    return out;
}

#ifdef PINFER_X86
/* next: a row of as many halves to prefetch meanwhile, or NULL. */
__attribute__((target("avx512f,f16c")))
static float dot_f16_avx512(const uint16_t *w, const float *x, int64_t d, const uint16_t *next) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {     /* d is a multiple of 32 */
        if (next) _mm_prefetch((const char *)(next + i), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i))), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i + 16))),
                             _mm512_loadu_ps(x + i + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

/* y[0, nc) += sum over r < R of v[r] * f16 row q[r]: R rows per pass load and store y once. */
__attribute__((target("avx512f,f16c")))
static void axpy_f16_avx512(float *y, const uint16_t *const *q, const float *v, int R, int64_t nc) {
    for (int64_t i = 0; i < nc; i += 16) {
        __m512 acc = _mm512_loadu_ps(y + i);
        for (int r = 0; r < R; r++)
            acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(q[r] + i))),
                                  _mm512_set1_ps(v[r]), acc);
        _mm512_storeu_ps(y + i, acc);
    }
}
#endif

PINFER_CLONES
static float dot_f16(const uint16_t *w, const float *x, int64_t d, const uint16_t *next) {
#ifdef PINFER_X86
    if (isa == ISA_AVX512) return dot_f16_avx512(w, x, d, next);
#endif
    (void)next;
    const half_t *h = (const half_t *)w;
    float acc[16] = {0};
    for (int64_t i = 0; i < d; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += HALF(h[i + k]) * x[i + k];
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += acc[k];
    return s;
}

PINFER_CLONES
static float dot_f32(const float *w, const float *x, int64_t d) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= d; i += 16)
        for (int k = 0; k < 16; k++) acc[k] += w[i + k] * x[i + k];
    for (int k = 0; i < d; i++, k++) acc[k] += w[i] * x[i];     /* any length: head_dim, f32 rows */
    float s = 0.0f;
    for (int k = 0; k < 16; k++) s += acc[k];
    return s;
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
        g = dot_f16(row, x, d, pf);
        if (f->act != ACT_RELU || g > 0.0f) u = dot_f16(row + d, x, d, pf ? pf + d : NULL);
    } else if (f->gu_fmt == FMT_F32) {
        const float *row = (const float *)f->gu_q + j * 2 * d;
        g = dot_f32(row, x, d);
        if (f->act != ACT_RELU || g > 0.0f) u = dot_f32(row + d, x, d);
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
            dot_rows(2, &w, qx, d, gu, pf, d / 2);
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
    dot_rows(4, &w, qx, d, gu, j + PAIR_AHEAD + 2 <= n ? w.q[0] + PAIR_AHEAD * d : NULL, d / 2);
    g[0] = gu[0], u[0] = gu[1], g[1] = gu[2], u[1] = gu[3];
}

/* p (ng groups of 32, nibble order) += sum over rows r < R, in order, of a[r][g] * nibbles of q4
   row q[r] (16 bytes per group): R rows per pass load and store p once. */
#define AXPY_ROWS 4
#ifdef PINFER_X86
__attribute__((target("avx512f,avx512bw")))
static void axpy_q4_avx512(float *p, const uint8_t *const *q, const float (*a)[MAX_D / G], int R, int64_t ng) {
    const __m128i low4 = _mm_set1_epi8(15);
    for (int64_t g = 0; g < ng; g++) {
        __m512 lo = _mm512_loadu_ps(p + G * g), hi = _mm512_loadu_ps(p + G * g + 16);
        for (int r = 0; r < R; r++) {
            const __m128i v = _mm_loadu_si128((const __m128i *)(q[r] + 16 * g));
            const __m512 ag = _mm512_set1_ps(a[r][g]);
            lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4))), ag, lo);
            hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4))),
                                 ag, hi);
        }
        _mm512_storeu_ps(p + G * g, lo);
        _mm512_storeu_ps(p + G * g + 16, hi);
    }
}
#endif

static void axpy_q4_portable(float *restrict p, const uint8_t *const *q, const float (*a)[MAX_D / G], int R,
                             int64_t ng) {
    for (int64_t g = 0; g < ng; g++)
        for (int r = 0; r < R; r++)
            for (int e = 0; e < 16; e++) {
                p[G * g + e] += a[r][g] * (float)(q[r][16 * g + e] & 15);
                p[G * g + 16 + e] += a[r][g] * (float)(q[r][16 * g + e] >> 4);
            }
}

static void axpy_q4(float *p, const uint8_t *const *q, const float (*a)[MAX_D / G], int R, int64_t ng) {
#ifdef PINFER_X86
    if (isa == ISA_AVX512) {
        axpy_q4_avx512(p, q, a, R, ng);
        return;
    }
#endif
    axpy_q4_portable(p, q, a, R, ng);
}

/* p (ng groups of 32, in order) += sum over rows r < R, in order, of v[r] * scale of q8 row q[r] *
   (q - 128): R rows per pass load and store p once, where one row at a time had run at a third of
   the gate/up rows' speed per byte (perf of LLaMA-7B-shaped ReLU layers, 10% of rows). The Rn rows
   at `next` (the next pass's) are prefetched meanwhile, a line every two groups: 2-5% faster
   decode on the ReLU model of benchmarks/synthetic_decode.py. */
#ifdef PINFER_X86
__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
static void axpy_q8_avx512(float *p, const uint8_t *const *q, const uint16_t *const *sc, const float *v, int R,
                           int64_t ng, const uint8_t *const *next, int Rn) {
    const __m128i flip = _mm_set1_epi8((char)0x80);
    for (int64_t g = 0; g < ng; g++) {
        if (!(g & 1))
            for (int r = 0; r < Rn; r++) _mm_prefetch((const char *)(next[r] + G * g), _MM_HINT_T0);
        __m512 lo = _mm512_loadu_ps(p + G * g), hi = _mm512_loadu_ps(p + G * g + 16);
        for (int r = 0; r < R; r++) {
            const __m512 a = _mm512_set1_ps(v[r] * _cvtsh_ss(sc[r][g]));
            const __m128i b0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(q[r] + G * g)), flip);
            const __m128i b1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(q[r] + G * g + 16)), flip);
            lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0)), a, lo);
            hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1)), a, hi);
        }
        _mm512_storeu_ps(p + G * g, lo);
        _mm512_storeu_ps(p + G * g + 16, hi);
    }
}

__attribute__((target("avx2,fma,f16c")))
static void axpy_q8_avx2(float *p, const uint8_t *const *q, const uint16_t *const *sc, const float *v, int R,
                         int64_t ng, const uint8_t *const *next, int Rn) {
    const __m128i flip = _mm_set1_epi8((char)0x80);
    for (int64_t g = 0; g < ng; g++) {
        if (!(g & 1))
            for (int r = 0; r < Rn; r++) _mm_prefetch((const char *)(next[r] + G * g), _MM_HINT_T0);
        __m256 acc[4];
        for (int e = 0; e < 4; e++) acc[e] = _mm256_loadu_ps(p + G * g + 8 * e);
        for (int r = 0; r < R; r++) {
            const __m256 a = _mm256_set1_ps(v[r] * _cvtsh_ss(sc[r][g]));
            const __m128i b0 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(q[r] + G * g)), flip);
            const __m128i b1 = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(q[r] + G * g + 16)), flip);
            acc[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b0)), a, acc[0]);
            acc[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b0, 8))), a, acc[1]);
            acc[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b1)), a, acc[2]);
            acc[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b1, 8))), a, acc[3]);
        }
        for (int e = 0; e < 4; e++) _mm256_storeu_ps(p + G * g + 8 * e, acc[e]);
    }
}
#endif

/* q4 row of weight v: a[g] = v * scale[g], off[g] += v * min[g] (or -8 * a[g] without min). */
#ifdef PINFER_X86
__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
static void row_scales_avx512(float *a, float *off, const uint16_t *sc, const uint16_t *mn, float v, int64_t ng) {
    const __m512 vv = _mm512_set1_ps(v), m8 = _mm512_set1_ps(-8.0f);
    for (int64_t g = 0; g < ng; g += 16) {
        const __mmask16 m = ng - g >= 16 ? 0xffff : (__mmask16)((1u << (ng - g)) - 1);
        const __m512 ag = _mm512_mul_ps(vv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, sc + g)));
        _mm512_mask_storeu_ps(a + g, m, ag);
        const __m512 o = mn ? _mm512_mul_ps(vv, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, mn + g)))
                            : _mm512_mul_ps(m8, ag);
        _mm512_mask_storeu_ps(off + g, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, off + g), o));
    }
}
#endif

static void row_scales(float *a, float *off, const uint16_t *sc16, const uint16_t *mn16, float v, int64_t ng) {
#ifdef PINFER_X86
    if (isa == ISA_AVX512) {
        row_scales_avx512(a, off, sc16, mn16, v, ng);
        return;
    }
#endif
    const half_t *sc = (const half_t *)sc16, *mn = (const half_t *)mn16;
    for (int64_t g = 0; g < ng; g++) a[g] = v * HALF(sc[g]);
    if (mn)
        for (int64_t g = 0; g < ng; g++) off[g] += v * HALF(mn[g]);
    else
        for (int64_t g = 0; g < ng; g++) off[g] += -8.0f * a[g];
}

#ifdef PINFER_X86
/* p[0..32) += scale * acc + offset * vsum for one group of 32 columns: lo/hi the even/odd
   (nibble-order) halves of acc, sc/mn the group's f16 scales and mins (mn NULL: offset -8 * scale). */
__attribute__((target("avx512f,avx512bw,f16c")))
static inline void scale_add_group(float *p, __m512 lo, __m512 hi, const uint16_t *sc, const uint16_t *mn,
                                   float vsum) {
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    const __m512 vs = _mm512_set1_ps(vsum);
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)sc));
    const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(sc + 16)));
    const __m512 se = _mm512_permutex2var_ps(s0, even, s1), so = _mm512_permutex2var_ps(s0, odd, s1);
    __m512 oe = _mm512_mul_ps(se, _mm512_set1_ps(-8.0f)), oo = _mm512_mul_ps(so, _mm512_set1_ps(-8.0f));
    if (mn) {
        const __m512 m0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mn));
        const __m512 m1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(mn + 16)));
        oe = _mm512_permutex2var_ps(m0, even, m1);
        oo = _mm512_permutex2var_ps(m0, odd, m1);
    }
    _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), _mm512_fmadd_ps(se, lo, _mm512_mul_ps(oe, vs))));
    _mm512_storeu_ps(p + 16, _mm512_add_ps(_mm512_loadu_ps(p + 16), _mm512_fmadd_ps(so, hi, _mm512_mul_ps(oo, vs))));
}

/* q4r: p += scale * acc + offset * vsum per column, acc and p in nibble order, the scales and
   mins (f16, columns in order) of one group of 32 neurons; offset = min, or -8 * scale. */
__attribute__((target("avx512f,avx512bw,f16c")))
static void scale_group_avx512(float *p, const float *acc, const uint16_t *sc, const uint16_t *mn, float vsum,
                               int64_t ng) {
    for (int64_t g = 0; g < ng; g++)
        scale_add_group(p + G * g, _mm512_loadu_ps(acc + G * g), _mm512_loadu_ps(acc + G * g + 16), sc + G * g,
                        mn ? mn + G * g : NULL, vsum);
}

/* One pass of a whole q4r group of R survivors (at most G, as the group holds G neurons): their
   rows summed (weights v[r]) in registers and scaled straight into p, with the arithmetic of
   axpy_q4 then scale_group in their order (the same bits) but no acc buffer to clear, store and
   reload. next[0..n_next): rows to prefetch meanwhile (the next group's survivors). */
__attribute__((target("avx512f,avx512bw,f16c")))
static void axpy_scaled_q4r_avx512(float *p, const uint8_t *const *q, const float *v, int R, const uint16_t *sc,
                                   const uint16_t *mn, float vsum, int64_t ng, const uint8_t *const *next,
                                   int n_next) {
    const __m128i low4 = _mm_set1_epi8(15);
    int64_t g = 0;
    /* four groups of columns at a time (a cache line of each row): eight independent sums, where
       one group's two would wait on the FMA's latency; each column's sum keeps its order */
    for (; g + 4 <= ng; g += 4) {
        for (int r = 0; r < n_next; r++) _mm_prefetch((const char *)(next[r] + 16 * g), _MM_HINT_T0);
        __m512 lo[4], hi[4];
        for (int k = 0; k < 4; k++) lo[k] = hi[k] = _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m512 ag = _mm512_set1_ps(v[r]);
            for (int k = 0; k < 4; k++) {
                const __m128i w = _mm_loadu_si128((const __m128i *)(q[r] + 16 * (g + k)));
                lo[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(w, low4))), ag, lo[k]);
                hi[k] = _mm512_fmadd_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(w, 4), low4))), ag, hi[k]);
            }
        }
        for (int k = 0; k < 4; k++)
            scale_add_group(p + G * (g + k), lo[k], hi[k], sc + G * (g + k), mn ? mn + G * (g + k) : NULL, vsum);
    }
    for (; g < ng; g++) {
        if (g % 4 == 0)
            for (int r = 0; r < n_next; r++) _mm_prefetch((const char *)(next[r] + 16 * g), _MM_HINT_T0);
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();
        for (int r = 0; r < R; r++) {
            const __m128i w = _mm_loadu_si128((const __m128i *)(q[r] + 16 * g));
            const __m512 ag = _mm512_set1_ps(v[r]);
            lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(w, low4))), ag, lo);
            hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(w, 4), low4))),
                                 ag, hi);
        }
        scale_add_group(p + G * g, lo, hi, sc + G * g, mn ? mn + G * g : NULL, vsum);
    }
}
#endif

static void scale_group(float *p, const float *acc, const uint16_t *sc16, const uint16_t *mn16, float vsum,
                        int64_t ng) {
#ifdef PINFER_X86
    if (isa == ISA_AVX512) {
        scale_group_avx512(p, acc, sc16, mn16, vsum, ng);
        return;
    }
#endif
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

/* p += sum over survivors k of val[k] * row idx[k] of down_t, columns [c0, c1), in ascending k:
   a run of survivors that may continue in the next call (the batch splits them in blocks of whole
   q4r groups). Rows stream whole (axpy order); q4 rows land in p in the nibbles' order (per group
   of 32 columns: the even columns, then the odd ones), their min terms in off; down_cols_finish
   puts them back in order. p, off, acc: scratch of nc, nc/G and nc floats, p and off zeroed before
   the first run. */
PINFER_CLONES
static void down_cols_acc(const ffn_t *f, const int32_t *idx, const float *val, int64_t m, int64_t c0, int64_t c1,
                          float *restrict p, float *restrict off, float *restrict acc, float (*a)[MAX_D / G]) {
    const int64_t d = f->d, nc = c1 - c0, ng = nc / G, g0 = c0 / G;
    if (f->down_fmt == FMT_F16 || f->down_fmt == FMT_F32) {
        const int wide = f->down_fmt == FMT_F32;
#ifdef PINFER_X86
        if (!wide && isa == ISA_AVX512) {
            for (int64_t k = 0; k < m; k += AXPY_ROWS) {
                const int R = m - k < AXPY_ROWS ? (int)(m - k) : AXPY_ROWS;
                const uint16_t *q[AXPY_ROWS];
                for (int r = 0; r < R; r++) q[r] = (const uint16_t *)f->dn_q + (int64_t)idx[k + r] * d + c0;
                axpy_f16_avx512(p, q, val + k, R, nc);
            }
            return;
        }
#endif
        for (int64_t k = 0; k < m; k++) {
            const int64_t at = (int64_t)idx[k] * d + c0;
            const float v = val[k];
            float *restrict yo = p;
            if (wide)
                for (int64_t i = 0; i < nc; i++) yo[i] += v * ((const float *)f->dn_q)[at + i];
            else
                for (int64_t i = 0; i < nc; i++) yo[i] += v * HALF(((const half_t *)f->dn_q)[at + i]);
        }
        return;
    }
    if (f->down_fmt == FMT_Q8) {
#ifdef PINFER_X86
        if (isa == ISA_AVX512 || isa == ISA_AVX2) {
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
                (isa == ISA_AVX512 ? axpy_q8_avx512 : axpy_q8_avx2)(p, q, sc, val + k, R, ng, next, Rn);
            }
            return;
        }
#endif
        for (int64_t k = 0; k < m; k++) {
            const int64_t j = idx[k];
            const uint8_t *restrict q = (const uint8_t *)f->dn_q + j * d + c0;
            const half_t *sc = (const half_t *)f->dn_scale + j * (d / G) + g0;
            const float v = val[k];
            for (int64_t g = 0; g < ng; g++) {
                const float a = v * HALF(sc[g]);
                float *restrict yo = p + g * G;
                for (int e = 0; e < G; e++) yo[e] += a * (float)((int)q[g * G + e] - 128);
            }
        }
        return;
    }
    if (f->down_fmt == FMT_Q4) {
        for (int64_t k = 0; k < m; k += AXPY_ROWS) {
            const int R = m - k < AXPY_ROWS ? (int)(m - k) : AXPY_ROWS;
            const uint8_t *q[AXPY_ROWS];
            for (int r = 0; r < R; r++) {
                const int64_t j = idx[k + r];
                const half_t *sc = (const half_t *)f->dn_scale + j * (d / G) + g0;
                const half_t *mn = f->dn_min ? (const half_t *)f->dn_min + j * (d / G) + g0 : NULL;
                const float v = val[k + r];
                q[r] = (const uint8_t *)f->dn_q + j * (d / 2) + c0 / 2;
                row_scales(a[r], off, (const uint16_t *)sc, (const uint16_t *)mn, v, ng);
            }
            axpy_q4(p, q, (const float (*)[MAX_D / G])a, R, ng);
        }
        return;
    }
    /* FMT_Q4R: survivors of one group of 32 neurons share the per-column scale and min: sum their
       rows unscaled in acc, then scale once per group */
    for (int64_t k = 0; k < m;) {
        const int64_t grp = idx[k] / G;
#ifdef PINFER_X86
        if (isa == ISA_AVX512) {     /* the group's survivors in one pass */
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
            axpy_scaled_q4r_avx512(p, q, v, (int)(e - k), f->dn_scale + grp * d + c0,
                                   f->dn_min ? f->dn_min + grp * d + c0 : NULL, vsum, ng, next, (int)(e2 - e));
            k = e;
            continue;
        }
#endif
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
            axpy_q4(acc, q, (const float (*)[MAX_D / G])a, R, ng);
        }
        scale_group(p, acc, f->dn_scale + grp * d + c0, f->dn_min ? f->dn_min + grp * d + c0 : NULL, vsum, ng);
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
            w->z[t * r + k] = pinfer_dot_q8(a->w1q + k * d, a->w1s + k * (d / G), &w->px[t], d, isa, next);
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
            w->score[t * n + j] = pinfer_dot_q8(a->w2q + j * r, a->w2s + j * (r / G), &w->pz[t], r, isa, next) + a->b2[j];
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
    void (*const quantize)(const float *, int64_t, qx_t *) = q4 ? quantize_x : pinfer_quantize_natural;
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

/* h = rule(act(g) * u) of n neurons into h (rule()), the activation in SIMD lanes. */
#ifdef PINFER_X86
/* activate() in lanes of W (512 or 256) bits: ReLU, or g / (1 + e^-z), z = g (SiLU) or GELU's tanh
   form. */
#define ACTIVATE_LANES(W, act, gv)                                                                            \
    ((act) == ACT_RELU                                                                                        \
         ? _mm##W##_max_ps(gv, _mm##W##_setzero_ps())                                                         \
         : _mm##W##_div_ps(gv, _mm##W##_add_ps(_mm##W##_set1_ps(1.0f), pinfer_exp##W(_mm##W##_sub_ps(         \
                                   _mm##W##_setzero_ps(),                                                     \
                                   (act) == ACT_GELU                                                          \
                                       ? _mm##W##_mul_ps(_mm##W##_set1_ps(1.5957691216057308f),               \
                                                         _mm##W##_fmadd_ps(_mm##W##_mul_ps(                   \
                                                                               _mm##W##_set1_ps(0.044715f), gv), \
                                                                           _mm##W##_mul_ps(gv, gv), gv))      \
                                       : gv)))))

__attribute__((target("avx512f,fma")))
static void rules_avx512(int act, const float *g, const float *u, int64_t n, int mode, float thr, float *h) {
    const int cut = mode == MODE_DOWN || mode == MODE_PREDICTED || mode == MODE_GIVEN;
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1);
        const __m512 gv = _mm512_maskz_loadu_ps(m, g + i);
        __m512 hv = _mm512_mul_ps(ACTIVATE_LANES(512, act, gv), _mm512_maskz_loadu_ps(m, u + i));
        /* kept unless |h| < thr, as rule() keeps a NaN */
        if (cut) hv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(_mm512_abs_ps(hv), _mm512_set1_ps(thr), _CMP_NLT_UQ), hv);
        _mm512_mask_storeu_ps(h + i, m, hv);
    }
}

__attribute__((target("avx2,fma")))
static void rules_avx2(int act, const float *g, const float *u, int64_t n, int mode, float thr, float *h) {
    const int cut = mode == MODE_DOWN || mode == MODE_PREDICTED || mode == MODE_GIVEN;
    for (int64_t i = 0; i < n; i += 8) {     /* the last lanes masked: every h the same bits wherever it is */
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i < 8 ? n - i : 8)),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 gv = _mm256_maskload_ps(g + i, m);
        __m256 hv = _mm256_mul_ps(ACTIVATE_LANES(256, act, gv), _mm256_maskload_ps(u + i, m));
        if (cut)
            hv = _mm256_and_ps(hv, _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), hv), _mm256_set1_ps(thr), _CMP_NLT_UQ));
        _mm256_maskstore_ps(h + i, m, hv);
    }
}
#endif

static void rules(int act, const float *g, const float *u, int64_t n, int mode, float thr, float *h) {
#ifdef PINFER_X86
    if (isa == ISA_AVX512) {
        rules_avx512(act, g, u, n, mode, thr, h);
        return;
    }
    if (isa == ISA_AVX2) {
        rules_avx2(act, g, u, n, mode, thr, h);
        return;
    }
#endif
    for (int64_t i = 0; i < n; i++) h[i] = rule(act, g[i], u[i], mode, thr);
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
        rules(f->act, g, u, b1 - b0, a->mode, a->thr, a->val + b0);
    }
}

/* A batch's rules over tokens t0..t1: h in place of their gates. */
static void batch_rules(void *p, int64_t t0, int64_t t1) {
    work_t *w = p;
    const int64_t n = w->a->n;
    rules(w->f->act, w->H + t0 * n, w->U + t0 * n, (t1 - t0) * n, w->a->mode, w->a->thr, w->H + t0 * n);
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
    const int64_t ahead = rows_ahead(n / 2);     /* dots.h */
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
            dot_rows(R, &rows, &w->qx[t], n, w->y + t * d + i, next, n / 2);
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
    quantize_x(h, n, &qh);
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

#ifdef PINFER_X86
/* The column kernel's q4r path on AVX-512 VNNI: the kept inputs of one group of 32 (one scale per
   column) quantized to int8 (their amax / 127, as x for the row dots), four rows at a time
   transposed in registers so that vpdpbusd sums each column's four nibbles times the four
   inputs exactly in int32; the group's sums are scaled once into p (nibble order, as
   axpy_scaled_q4r_avx512's). rows: R (a multiple of 4) row pointers at this range's columns, xq
   their int8 inputs packed four to an int32. */
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
static void cols_q4r_vnni(float *p, const uint8_t *const *rows, const int32_t *xq, int R, float xs, float vsum,
                          const uint16_t *sc, const uint16_t *mn, int64_t ng, const uint8_t *const *next, int n_next) {
    const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m512i bytes = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
    const __m512i low4 = _mm512_set1_epi8(15);
    const __m512 s = _mm512_set1_ps(xs);
    int64_t g = 0;
    for (; g < ng; g += 4) {
        const int K = ng - g < 4 ? (int)(ng - g) : 4;
        for (int r = 0; r < n_next; r++) _mm_prefetch((const char *)(next[r] + 16 * g), _MM_HINT_T0);
        __m512i e[4], o[4];
        for (int k = 0; k < 4; k++) e[k] = o[k] = _mm512_setzero_si512();
        for (int r = 0; r < R; r += 4) {
            const __m512i xb = _mm512_set1_epi32(xq[r / 4]);
            for (int k = 0; k < K; k++) {
                const int64_t at = 16 * (g + k);
                __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rows[r] + at)));
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[r + 1] + at)), 1);
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[r + 2] + at)), 2);
                v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(rows[r + 3] + at)), 3);
                /* byte b of each of the four rows side by side: dword b holds column 2b's nibbles
                   (low) and column 2b + 1's (high) of rows r..r+3 */
                v = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, v), bytes);
                e[k] = _mm512_dpbusd_epi32(e[k], _mm512_and_si512(v, low4), xb);
                o[k] = _mm512_dpbusd_epi32(o[k], _mm512_and_si512(_mm512_srli_epi16(v, 4), low4), xb);
            }
        }
        for (int k = 0; k < K; k++)
            scale_add_group(p + G * (g + k), _mm512_mul_ps(_mm512_cvtepi32_ps(e[k]), s),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(o[k]), s), sc + G * (g + k), mn ? mn + G * (g + k) : NULL,
                            vsum);
    }
}
/* cols_q4r_vnni on AVX2: vpmaddubsw then vpmaddwd sum the four rows' nibbles times their inputs
   in int32 (exact: 15 * 127 * 2 fits an int16), eight bytes of each of the four rows per step;
   p in the columns' own order (the scales applied after the even and odd sums are interleaved). */
__attribute__((target("avx2,fma,f16c")))
static void cols_q4r_avx2(float *p, const uint8_t *const *rows, const int32_t *xq, int R, float xs, float vsum,
                          const uint16_t *sc, const uint16_t *mn, int64_t ng, const uint8_t *const *next, int n_next) {
    const __m256i dwords = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    const __m256i bytes = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256 s = _mm256_set1_ps(xs), vs = _mm256_set1_ps(vsum);
    for (int64_t g = 0; g < ng; g++) {
        if (g % 4 == 0)
            for (int r = 0; r < n_next; r++) _mm_prefetch((const char *)(next[r] + 16 * g), _MM_HINT_T0);
        __m256i e[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, o[2] = {e[0], e[0]};
        for (int r = 0; r < R; r += 4) {
            const __m256i xb = _mm256_set1_epi32(xq[r / 4]);
            for (int h = 0; h < 2; h++) {
                const int64_t at = 16 * g + 8 * h;
                int64_t w[4];
                for (int k = 0; k < 4; k++) memcpy(&w[k], rows[r + k] + at, 8);
                /* byte b of the four rows side by side: dword b holds column 2b's nibbles (low) and
                   column 2b + 1's (high) of rows r..r+3, b in this half's eight bytes */
                __m256i v = _mm256_setr_epi64x(w[0], w[1], w[2], w[3]);
                v = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v, dwords), bytes);
                const __m256i lo = _mm256_and_si256(v, low4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
                e[h] = _mm256_add_epi32(e[h], _mm256_madd_epi16(_mm256_maddubs_epi16(lo, xb), ones));
                o[h] = _mm256_add_epi32(o[h], _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xb), ones));
            }
        }
        for (int h = 0; h < 2; h++) {     /* columns 16h .. 16h + 15, in order */
            const __m256 fe = _mm256_mul_ps(_mm256_cvtepi32_ps(e[h]), s), fo = _mm256_mul_ps(_mm256_cvtepi32_ps(o[h]), s);
            const __m256 a = _mm256_unpacklo_ps(fe, fo), b = _mm256_unpackhi_ps(fe, fo);
            const __m256 c[2] = {_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31)};
            for (int k = 0; k < 2; k++) {
                const int64_t at = G * g + 16 * h + 8 * k;
                const __m256 sk = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(sc + at)));
                const __m256 ok = mn ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mn + at)))
                                     : _mm256_mul_ps(sk, _mm256_set1_ps(-8.0f));
                _mm256_storeu_ps(p + at, _mm256_add_ps(_mm256_loadu_ps(p + at), _mm256_fmadd_ps(sk, c[k], _mm256_mul_ps(ok, vs))));
            }
        }
    }
}
#endif

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
    const int64_t d = f->d, ng = d / G;
    for (int64_t t = t0; t < t1; t++) {
        const int64_t g0 = t * w->per, g1 = g0 + w->per < ng ? g0 + w->per : ng;
        if (g0 >= g1) continue;
        const int64_t c0 = g0 * G, nc = (g1 - g0) * G;
#ifdef PINFER_X86
        const int fast = f->down_fmt == FMT_Q4R && (isa == ISA_AVX512 || isa == ISA_AVX2);
#else
        const int fast = 0;
#endif
        /* the int8 paths need the sums and a zero row; a 7B gate|up's under malloc's mmap threshold */
        float *scratch = malloc(fast ? (size_t)nc * sizeof(float) + (size_t)nc / 2
                                     : (size_t)(2 * nc + nc / G + AXPY_ROWS * (MAX_D / G)) * sizeof(float));
        if (!scratch) {
            memset(w->y + c0, 0xff, (size_t)nc * sizeof(float));  /* NaN: never silently wrong */
            continue;
        }
#ifdef PINFER_X86
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
                (isa == ISA_AVX512 ? cols_q4r_vnni : cols_q4r_avx2)(
                    acc, rows, quads, R, xs, xs * (float)isum, f->dn_scale + grp * d + c0,
                    f->dn_min ? f->dn_min + grp * d + c0 : NULL, nc / G, next, n_next);
                k = e;
            }
            if (isa == ISA_AVX512) down_cols_finish(f, acc, NULL, w->y, c0, c0 + nc);   /* nibble order */
            else memcpy(w->y + c0, acc, (size_t)nc * sizeof(float));
            free(scratch);
            continue;
        }
#endif
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
    if (isa < 0) pinfer_sparse_isa(-1);
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
    if (isa < 0) pinfer_sparse_isa(-1);
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
    rules(a->act, g, u, a->n, MODE_DOWN, a->thr_h, a->h);
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
    if (a->gu_fmt == FMT_Q4 || a->gu_fmt == FMT_Q5) quantize_x(a->x, d, &qx);

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
    if (isa < 0) pinfer_sparse_isa(-1);
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
            quantize_x(w->H + t * n, n, &qx[t]);     /* h, quantized per group of 32 neurons */
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
        if (f.gu_fmt == FMT_Q4 || f.gu_fmt == FMT_Q5) quantize_x(a->x + t * d, d, &qx[t]);
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
    if (isa < 0) pinfer_sparse_isa(-1);
    const int threads = pinfer_pool_enter(a->threads);
    const int rc = ffn_batch(a, nt, threads);
    pinfer_pool_leave(a->threads);
    return rc;
}

/* -- the row dots for decode.c (dots.h) ------------------------------------------------------- */

void pinfer_quantize_x(const float *x, int64_t d, qx_t *o) { quantize_x(x, d, o); }

void pinfer_dot_rows_ahead(int R, const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next,
                           int64_t nstride) {
    dot_rows(R, w, x, d, out, next, nstride);
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
#ifdef PINFER_X86
        const int kind = (w->min != NULL) * 2 + (w->qh != NULL), avx512 = isa == ISA_AVX512, avx2 = isa == ISA_AVX2;
#endif
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
#ifdef PINFER_X86
                    if (avx512) {       /* each row unpacked once for the T tokens */
                        tokens_avx512[T - 1][kind](&rows, &qx[t], k, out + t * ostride + i, ostride, next);
                        continue;
                    }
                    if (avx2) {         /* for two tokens at a time */
                        for (int j = 0; j < T; j += 2)
                            tokens_avx2[T - j >= 2][kind](&rows, &qx[t + j], k, out + (t + j) * ostride + i, ostride,
                                                          j == 0 ? next : NULL);
                        continue;
                    }
#endif
                    for (int j = 0; j < T; j++)
                        dot_rows(1, &rows, &qx[t + j], k, out + (t + j) * ostride + i, j == 0 ? next : NULL, stride);
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
            dot_rows((int)R, &rows, &qx[t], k, out + t * ostride + i, t == 0 ? next : NULL, stride);
    }
}

float pinfer_dot_f16(const uint16_t *w, const float *x, int64_t d) { return dot_f16(w, x, d, NULL); }

float pinfer_dot_f32(const float *w, const float *x, int64_t d) { return dot_f32(w, x, d); }

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
