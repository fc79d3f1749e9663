/* The AVX-512 primitives (quants.h's table for ISA_AVX512) and their table: q4/q5 row dots by VNNI
 * (vpdpbusd) against int8 x, rows four at a time or one row against up to four tokens; the q8 dot;
 * the f16 dot; the axpys and scales of the sparse FFN's down projection; the column kernel's q4r
 * rows; the SIMD rule; attention heads; the dense down projection's grouped accumulation; and the
 * generic C compiled for x86-64-v4. Function attributes give each its instruction set, so the
 * library builds with the compiler's defaults and runs on any x86-64; pinfer_sparse_isa picks this
 * table only where the CPU has AVX-512 VNNI, BW, VL, DQ, CD and x86-64-v3. Every function the
 * table holds begins with PINFER_RAN(ISA_AVX512). */
#include "../quants.h"

#ifdef PINFER_X86
#include "avx2.h"

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

/* The row counts the callers use (1, 2, 4) and token counts (1 to 4), with and without mins and
   fifth bits: each a function of its own, R (T), MIN and QH constants in it. */
#define PINFER_ROWS(R, MIN, QH)                                                                             \
    __attribute__((target(AVX512_DOTS))) static void rows_avx512_##R##MIN##QH(                             \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next, int64_t ns) {           \
        PINFER_RAN(ISA_AVX512);                                                                             \
        rows_q4_avx512(R, MIN, QH, w, x, d, out, next, ns);                                                 \
    }
#define PINFER_ROWS_R(R) PINFER_ROWS(R, 0, 0) PINFER_ROWS(R, 0, 1) PINFER_ROWS(R, 1, 0) PINFER_ROWS(R, 1, 1)
PINFER_ROWS_R(1) PINFER_ROWS_R(2) PINFER_ROWS_R(4)
#define PINFER_TOKENS(T, MIN, QH)                                                                           \
    __attribute__((target(AVX512_DOTS))) static void tokens_avx512_##T##MIN##QH(                           \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, int64_t os, const uint8_t *next) {          \
        PINFER_RAN(ISA_AVX512);                                                                             \
        tokens_q4_avx512(T, MIN, QH, w, x, d, out, os, next);                                               \
    }
#define PINFER_TOKENS_T(T) PINFER_TOKENS(T, 0, 0) PINFER_TOKENS(T, 0, 1) PINFER_TOKENS(T, 1, 0) PINFER_TOKENS(T, 1, 1)
PINFER_TOKENS_T(1) PINFER_TOKENS_T(2) PINFER_TOKENS_T(3) PINFER_TOKENS_T(4)

/* next: a row of as many halves to prefetch meanwhile, or NULL. */
__attribute__((target("avx512f,f16c")))
static float dot_f16_avx512(const uint16_t *w, const float *x, int64_t d, const uint16_t *next) {
    PINFER_RAN(ISA_AVX512);
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {     /* d is a multiple of 32 */
        if (next) _mm_prefetch((const char *)(next + i), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i))), _mm512_loadu_ps(x + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + i + 16))),
                             _mm512_loadu_ps(x + i + 16), a1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

/* y[0, nc) += sum over r < R (at most 4) of v[r] * f16 row q[r]: R rows per pass load and store y
   once. The rows' pointers are copied to a local array the unrolled loop keeps in registers:
   read through q at every step (where y's stores might change them), the loop ran slower than
   inlined into its caller, as it was when the caller's array held them. */
__attribute__((target("avx512f,f16c")))
static void axpy_f16_avx512(float *y, const uint16_t *const *q, const float *v, int R, int64_t nc) {
    PINFER_RAN(ISA_AVX512);
    const uint16_t *row[4];
    for (int r = 0; r < R; r++) row[r] = q[r];
    for (int64_t i = 0; i < nc; i += 16) {
        __m512 acc = _mm512_loadu_ps(y + i);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
            acc = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row[r] + i))),
                                  _mm512_set1_ps(v[r]), acc);
        _mm512_storeu_ps(y + i, acc);
    }
}

__attribute__((target("avx512f,avx512bw")))
static void axpy_q4_avx512(float *p, const uint8_t *const *q, const float (*a)[MAX_D / G], int R, int64_t ng) {
    PINFER_RAN(ISA_AVX512);
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

__attribute__((target("avx512f,avx512bw,avx512vl,f16c,fma")))
static void axpy_q8_avx512(float *p, const uint8_t *const *q, const uint16_t *const *sc, const float *v, int R,
                           int64_t ng, const uint8_t *const *next, int Rn) {
    PINFER_RAN(ISA_AVX512);
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

__attribute__((target("avx512f,avx512bw,avx512vl,f16c")))
static void row_scales_avx512(float *a, float *off, const uint16_t *sc, const uint16_t *mn, float v, int64_t ng) {
    PINFER_RAN(ISA_AVX512);
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
    PINFER_RAN(ISA_AVX512);
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
    PINFER_RAN(ISA_AVX512);
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

/* The column kernel's q4r path on AVX-512 VNNI: the kept inputs of one group of 32 (one scale per
   column) quantized to int8 (their amax / 127, as x for the row dots), four rows at a time
   transposed in registers so that vpdpbusd sums each column's four nibbles times the four
   inputs exactly in int32; the group's sums are scaled once into p (nibble order, as
   axpy_scaled_q4r_avx512's). rows: R (a multiple of 4) row pointers at this range's columns, xq
   their int8 inputs packed four to an int32. */
__attribute__((target("avx512f,avx512bw,avx512vnni,f16c")))
static void cols_q4r_vnni(float *p, const uint8_t *const *rows, const int32_t *xq, int R, float xs, float vsum,
                          const uint16_t *sc, const uint16_t *mn, int64_t ng, const uint8_t *const *next, int n_next) {
    PINFER_RAN(ISA_AVX512);
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

/* e^x in 16 lanes (PINFER_EXP_POLY, x86/avx2.h, says how). */
__attribute__((target("avx512f,fma"), always_inline))
static inline __m512 pinfer_exp512(__m512 x) {
    /* x second: min and max return it where it is NaN, which then goes through (2^n: inf past 88.72) */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(100.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    return _mm512_scalef_ps(PINFER_EXP_POLY(_mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_set1_ps, r), n);
}

__attribute__((target("avx512f,fma")))
static void rules_avx512(int act, const float *g, const float *u, int64_t n, int mode, float thr, float *h) {
    PINFER_RAN(ISA_AVX512);
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
    PINFER_RAN(ISA_AVX512);
    const int64_t ng = k / G;
    __m512 acc = _mm512_setzero_ps(), macc = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 16 <= ng; g += 16) block_q8_avx512(q, scale, x, g, 16, &acc, &macc, next);
    if (g < ng) block_q8_avx512(q, scale, x, g, ng - g, &acc, &macc, next);
    return _mm512_reduce_add_ps(_mm512_fnmadd_ps(macc, _mm512_set1_ps(128.0f), acc));
}

#define HEAD_AVX512 "avx512f,fma"
/* pinfer_head_portable with hd in 16-wide lanes (the last ones masked). */
__attribute__((target(HEAD_AVX512)))
static void head_avx512(const float *q, const float *K, const float *V, int64_t n, int64_t hd, float scale,
                        float softcap, float *s, float *o) {
    const int64_t nv = (hd + 15) / 16;
    if (nv > 16) {
        pinfer_head_portable(q, K, V, n, hd, scale, softcap, s, o, 0);
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

/* Any head: f32 caches in 16-wide lanes, f16 ones portable (head8 takes the multiples of 8). */
__attribute__((target(HEAD_AVX512)))
static void head_any_avx512(const float *q, const void *K, const void *V, int64_t n, int64_t hd, float scale,
                            float softcap, float *s, float *o, int f16) {
    PINFER_RAN(ISA_AVX512);
    if (f16) pinfer_head_portable(q, K, V, n, hd, scale, softcap, s, o, 1);
    else head_avx512(q, K, V, n, hd, scale, softcap, s, o);
}

/* head8 (x86/avx2.h) for one width and one KV type (F16), with AVX-512's 32 vector registers for
   the 16-register spills of NV = 16; `hd` is read only by the variable-width ones (head8_any*). */
#define PINFER_HEAD8(NAME, NV, F16)                                                                             \
    __attribute__((target("avx512f,avx512vl,fma,f16c"))) static void NAME##_avx512(                               \
        const float *q, const void *K, const void *V, int64_t n, int64_t hd, float scale, float softcap,        \
        float *s, float *o) {                                                                                   \
        (void)hd;                                                                                               \
        PINFER_RAN(ISA_AVX512);                                                                                 \
        head8(NV, F16, q, K, V, n, scale, softcap, s, o);                                                       \
    }
PINFER_HEAD8(head8_4, 4, 0) PINFER_HEAD8(head8_8, 8, 0) PINFER_HEAD8(head8_12, 12, 0) PINFER_HEAD8(head8_16, 16, 0)
PINFER_HEAD8(head8_any, (int)(hd / 8), 0)
PINFER_HEAD8(head8_4_h, 4, 1) PINFER_HEAD8(head8_8_h, 8, 1) PINFER_HEAD8(head8_12_h, 12, 1)
PINFER_HEAD8(head8_16_h, 16, 1) PINFER_HEAD8(head8_any_h, (int)(hd / 8), 1)

/* R formats: acc[t][...] = sum over rows j in [j0, j1) of h[t, j] * row_j, before the group's
   scale, row_j being q - 128 (q8r) or q (q4r, whose even and odd columns land in acc[t][i] and
   acc[t][nc/2 + i]). Columns go in tiles of G whose sums stay in registers while the rows of the
   group stream past. */
__attribute__((target("avx512f,avx512bw")))
static void accumulate_grouped_avx512(const weights_t *w, const float *h, float (*acc)[COL_CHUNK], int64_t nt,
                                      int64_t j0, int64_t j1, int64_t c0, int64_t nc) {
    PINFER_RAN(ISA_AVX512);
    const int64_t n = w->n, d = w->d, half = nc / 2;
    const __m512i low4 = _mm512_set1_epi32(15);
    for (int64_t t = 0; t < nt; t++) {
        const float *ht = h + t * n;
        for (int64_t c = 0; c < nc; c += G) {
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
            int64_t j = j0;
            if (w->fmt == FMT_Q4R) {
                const uint8_t *q = (const uint8_t *)w->q + (c0 + c) / 2;
                for (; j + 1 < j1; j += 2) { /* two rows per step: four independent sums */
                    __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * (d / 2))));
                    __m512i v1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + (j + 1) * (d / 2))));
                    __m512 x0 = _mm512_set1_ps(ht[j]), x1 = _mm512_set1_ps(ht[j + 1]);
                    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, low4)), x0, a0);
                    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), x0, a1);
                    b0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v1, low4)), x1, b0);
                    b1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v1, 4)), x1, b1);
                }
                for (; j < j1; j++) {
                    __m512i v0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(q + j * (d / 2))));
                    __m512 x0 = _mm512_set1_ps(ht[j]);
                    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v0, low4)), x0, a0);
                    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v0, 4)), x0, a1);
                }
                _mm512_storeu_ps(acc[t] + c / 2, _mm512_add_ps(a0, b0));
                _mm512_storeu_ps(acc[t] + half + c / 2, _mm512_add_ps(a1, b1));
            } else {
                const uint8_t *q = (const uint8_t *)w->q + c0 + c;
                const __m128i flip = _mm_set1_epi8((char)0x80);
                for (; j < j1; j++) { /* q - 128 as a signed byte: q ^ 0x80 */
                    const uint8_t *r = q + j * d;
                    __m512i v0 = _mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)r), flip));
                    __m512i v1 = _mm512_cvtepi8_epi32(_mm_xor_si128(_mm_loadu_si128((const __m128i *)(r + 16)), flip));
                    __m512 x0 = _mm512_set1_ps(ht[j]);
                    a0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v0), x0, a0);
                    a1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v1), x0, a1);
                }
                _mm512_storeu_ps(acc[t] + c, a0);
                _mm512_storeu_ps(acc[t] + c + 16, a1);
            }
        }
    }
}

PINFER_GENERIC(ISA_AVX512, avx512, __attribute__((target("arch=x86-64-v4"))))

#define PINFER_KINDS(f, R) {f##_##R##00, f##_##R##01, f##_##R##10, f##_##R##11}
PINFER_INTERNAL const isa_ops_t pinfer_ops_avx512 = {
    .quantize_chunks = quantize_chunks_generic_avx512,
    .quantize_natural = quantize_natural_generic_avx512,
    .rows_q4 = {PINFER_KINDS(rows_avx512, 1), PINFER_KINDS(rows_avx512, 2), PINFER_KINDS(rows_avx512, 4)},
    .tokens_q4 = {PINFER_KINDS(tokens_avx512, 1), PINFER_KINDS(tokens_avx512, 2), PINFER_KINDS(tokens_avx512, 3),
                  PINFER_KINDS(tokens_avx512, 4)},
    .tokens_max = 4,
    .dot_q8 = dot_q8_avx512,
    .dot_f16 = dot_f16_avx512,
    .dot_f32 = dot_f32_generic_avx512,
    .axpy_f16 = axpy_f16_avx512,
    .axpy_f32 = axpy_f32_generic_avx512,
    .axpy_q8 = axpy_q8_avx512,
    .row_scales = row_scales_avx512,
    .axpy_q4 = axpy_q4_avx512,
    .scale_group = scale_group_avx512,
    .axpy_scaled_q4r = axpy_scaled_q4r_avx512,
    .cols_q4r = cols_q4r_vnni,
    .cols_q4r_nibbles = 1,
    .rules = rules_avx512,
    .head8 = {{head8_4_avx512, head8_8_avx512, head8_12_avx512, head8_16_avx512, head8_any_avx512},
              {head8_4_h_avx512, head8_8_h_avx512, head8_12_h_avx512, head8_16_h_avx512, head8_any_h_avx512}},
    .head = head_any_avx512,
    .halves_to_floats = halves_to_floats_generic_avx512,
    .accumulate_rows = accumulate_rows_generic_avx512,
    .accumulate_grouped = accumulate_grouped_avx512,
};
#endif
