/* The AVX2 primitives (quants.h's table for ISA_AVX2) and their table: q4/q5 row dots by pmaddubsw
 * against int8 x, rows four at a time or one row against up to two tokens; the q8 dot; the q8 axpy
 * of the sparse FFN's down projection; the column kernel's q4r rows; the SIMD rule; attention heads
 * of 8-wide lanes; and the generic C compiled for x86-64-v3. Function attributes give each its
 * instruction set; pinfer_sparse_isa picks this table where the CPU has x86-64-v3 (AVX2, FMA, F16C,
 * BMI1/2, LZCNT, MOVBE) and no AVX-512 table, or where AVX2 is forced. What AVX2 has no version of
 * (the q4 axpys and scales, the dense down projection's grouped accumulation) is the portable
 * table's. Every function the table holds begins with PINFER_RAN(ISA_AVX2); quants.h's table says
 * what each computes. */
#include "../quants.h"

#ifdef PINFER_X86
#include "avx2.h"

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

/* rows_q4_avx512 on AVX2, eight groups per step, the rows at `next` prefetched meanwhile. A row read
   alone (R = 1) adds its steps into two accumulators in turn: with one, each step waited on the
   last one's FMA (4 cycles) while its other instructions took about 3. HeadStep over q4 rows, 1
   thread, AVX2, both variants alternating in one process (a throwaway build): 4096 wide 24.4 ->
   27.7 GB/s, 1536 wide 20.8 -> 22.4, and 4096 wide on 2 threads 45.0 -> 53.3. Such a row's sum is
   not the bits R = 2 or 4 would give it, so the callers read all of a matrix's rows alone or none
   (quants.h). */
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

/* The row counts the callers use (1, 2, 4) and token counts (1, 2), with and without mins and fifth
   bits: each a function of its own, R (T), MIN and QH constants in it. */
#define PINFER_ROWS(R, MIN, QH)                                                                             \
    __attribute__((target("avx2,fma,f16c"))) static void rows_avx2_##R##MIN##QH(                           \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next, int64_t ns) {           \
        PINFER_RAN(ISA_AVX2);                                                                               \
        rows_q4_avx2(R, MIN, QH, w, x, d, out, next, ns);                                                   \
    }
#define PINFER_ROWS_R(R) PINFER_ROWS(R, 0, 0) PINFER_ROWS(R, 0, 1) PINFER_ROWS(R, 1, 0) PINFER_ROWS(R, 1, 1)
PINFER_ROWS_R(1) PINFER_ROWS_R(2) PINFER_ROWS_R(4)
#define PINFER_TOKENS2(T, MIN, QH)                                                                          \
    __attribute__((target("avx2,fma,f16c"))) static void tokens_avx2_##T##MIN##QH(                         \
        const rows4_t *w, const qx_t *x, int64_t d, float *out, int64_t os, const uint8_t *next) {          \
        PINFER_RAN(ISA_AVX2);                                                                               \
        tokens_q4_avx2(T, MIN, QH, w, x, d, out, os, next);                                                 \
    }
PINFER_TOKENS2(1, 0, 0) PINFER_TOKENS2(1, 0, 1) PINFER_TOKENS2(1, 1, 0) PINFER_TOKENS2(1, 1, 1)
PINFER_TOKENS2(2, 0, 0) PINFER_TOKENS2(2, 0, 1) PINFER_TOKENS2(2, 1, 0) PINFER_TOKENS2(2, 1, 1)

__attribute__((target("avx2,fma,f16c")))
static void axpy_q8_avx2(float *p, const uint8_t *const *q, const uint16_t *const *sc, const float *v, int R,
                         int64_t ng, const uint8_t *const *next, int Rn) {
    PINFER_RAN(ISA_AVX2);
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

/* cols_q4r_vnni on AVX2: vpmaddubsw then vpmaddwd sum the four rows' nibbles times their inputs
   in int32 (exact: 15 * 127 * 2 fits an int16), eight bytes of each of the four rows per step;
   p in the columns' own order (the scales applied after the even and odd sums are interleaved). */
__attribute__((target("avx2,fma,f16c")))
static void cols_q4r_avx2(float *p, const uint8_t *const *rows, const int32_t *xq, int R, float xs, float vsum,
                          const uint16_t *sc, const uint16_t *mn, int64_t ng, const uint8_t *const *next, int n_next) {
    PINFER_RAN(ISA_AVX2);
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

__attribute__((target("avx2,fma")))
static void rules_avx2(int act, const float *g, const float *u, int64_t n, int mode, float thr, float *h) {
    PINFER_RAN(ISA_AVX2);
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
    PINFER_RAN(ISA_AVX2);
    const int64_t ng = k / G;
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= ng; g += 8) block_q8_avx2(q, scale, x, g, 8, &acc, next);
    if (g < ng) block_q8_avx2(q, scale, x, g, ng - g, &acc, next);
    return pinfer_hsum8(acc);
}

/* head8 (x86/avx2.h) for one width and one KV type (F16); `hd` is read only by the variable-width
   ones (head8_any*). */
#define PINFER_HEAD8(NAME, NV, F16)                                                                             \
    __attribute__((target("avx2,fma,f16c"))) static void NAME(const float *q, const void *K, const void *V,     \
                                                             int64_t n, int64_t hd, float scale, float softcap, \
                                                             float *s, float *o) {                              \
        (void)hd;                                                                                               \
        PINFER_RAN(ISA_AVX2);                                                                                   \
        head8(NV, F16, q, K, V, n, scale, softcap, s, o);                                                       \
    }
PINFER_HEAD8(head8_4, 4, 0) PINFER_HEAD8(head8_8, 8, 0) PINFER_HEAD8(head8_12, 12, 0) PINFER_HEAD8(head8_16, 16, 0)
PINFER_HEAD8(head8_any, (int)(hd / 8), 0)
PINFER_HEAD8(head8_4_h, 4, 1) PINFER_HEAD8(head8_8_h, 8, 1) PINFER_HEAD8(head8_12_h, 12, 1)
PINFER_HEAD8(head8_16_h, 16, 1) PINFER_HEAD8(head8_any_h, (int)(hd / 8), 1)

PINFER_GENERIC(ISA_AVX2, avx2, __attribute__((target("arch=x86-64-v3"))))

#define PINFER_KINDS(f, R) {f##_##R##00, f##_##R##01, f##_##R##10, f##_##R##11}
PINFER_INTERNAL const isa_ops_t pinfer_ops_avx2 = {
    .quantize_chunks = quantize_chunks_generic_avx2,
    .quantize_natural = quantize_natural_generic_avx2,
    .rows_q4 = {PINFER_KINDS(rows_avx2, 1), PINFER_KINDS(rows_avx2, 2), PINFER_KINDS(rows_avx2, 4)},
    .tokens_q4 = {PINFER_KINDS(tokens_avx2, 1), PINFER_KINDS(tokens_avx2, 2)},
    .tokens_max = 2,
    .dot_q8 = dot_q8_avx2,
    .dot_f16 = dot_f16_generic_avx2,
    .dot_f32 = dot_f32_generic_avx2,
    .axpy_f16 = axpy_f16_generic_avx2,
    .axpy_f32 = axpy_f32_generic_avx2,
    .axpy_q8 = axpy_q8_avx2,
    .cols_q4r = cols_q4r_avx2,
    .cols_q4r_nibbles = 0,
    .rules = rules_avx2,
    .head8 = {{head8_4, head8_8, head8_12, head8_16, head8_any},
              {head8_4_h, head8_8_h, head8_12_h, head8_16_h, head8_any_h}},
    .head = pinfer_head_portable,
    .halves_to_floats = halves_to_floats_generic_avx2,
    .accumulate_rows = accumulate_rows_generic_avx2,
    /* no AVX2 versions: the portable table's (quants.c) */
    .row_scales = pinfer_row_scales_portable,
    .axpy_q4 = pinfer_axpy_q4_portable,
    .scale_group = pinfer_scale_group_portable,
    .accumulate_grouped = pinfer_accumulate_grouped_portable,
};
#endif
