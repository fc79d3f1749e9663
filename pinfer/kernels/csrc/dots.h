/* The row dots ffn_sparse.c defines, shared with decode.c (the attention and head of a decode
 * step): activations quantized to int8 per group of 32 in the nibbles' chunk order (ffn_sparse.c
 * says the layout), and the dots of q4/q5 rows, f16 and f32 rows with them, on the instruction set
 * pinfer_sparse_isa chose. */
#ifndef PINFER_DOTS_H
#define PINFER_DOTS_H

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PINFER_X86 1
#endif
#if defined(PINFER_X86) && !defined(__clang__)
#define PINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PINFER_CLONES
#endif

#define G 32
/* Loops under this many weights run on one thread: waking a second costs more than it saves. */
#define PARALLEL_WORK (1 << 18)

/* Rows of at most this many weights are read several at a time (pinfer_dot_rows_ahead with R = 2
   or 4; a matrix's rows where rows_by_four says so), each load of x serving them all; longer ones
   one at a time, which from 4 KB pages read faster (interleaved streams). Measured by
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

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

typedef struct {
    int8_t *q;      /* (d) in chunk order */
    float *scale;   /* (d/G) */
    float *sum;     /* (d/G) the sum of the group's x (float): meets the weights' min */
    float *corr;    /* (d/G) -8 * scale * the sum of the group's q: meets the weights' scale for the zero point */
} qx_t;

/* Bytes of one qx_t of length d in a single block, and its parts placed in such a block. */
int64_t pinfer_qx_bytes(int64_t d);
qx_t pinfer_qx_at(void *mem, int64_t d);

#ifdef PINFER_X86
/* AVX2 loads of a row's last n < 8 floats or halves (as floats), the rest zero, without reading past
   them (and without a copy through memory, which would stall the load on the store). */
__attribute__((target("avx2"), always_inline))
static inline __m256 pinfer_load8_ps(const float *p, int64_t n) {
    if (n == 8) return _mm256_loadu_ps(p);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
}

/* The sum of the eight lanes, in one fixed order. */
__attribute__((target("avx"), always_inline))
static inline float pinfer_hsum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 h2 = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h2, _mm_shuffle_ps(h2, h2, 1)));
}

__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 pinfer_load8_ph(const uint16_t *p, int64_t n) {
    if (n == 8) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    __m128i h = _mm_maskload_epi32((const int *)p, _mm_cmpgt_epi32(_mm_set1_epi32((int)(n / 2)), _mm_setr_epi32(0, 1, 2, 3)));
    if (n & 1)
        h = _mm_blendv_epi8(h, _mm_set1_epi16((short)p[n - 1]),
                            _mm_cmpeq_epi16(_mm_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7), _mm_set1_epi16((short)(n - 1))));
    return _mm256_cvtph_ps(h);
}

/* e^x in 16 (8) lanes to about 1 ulp: x = n ln2 + r, |r| <= ln2 / 2, e^r by a degree-6 polynomial
   (Cephes' expf coefficients), times 2^n. Below -87 it is e^-87 (1.6e-38, which passes for 0 in the
   softmax and SiLU sums it meets); above 88.72 infinity, as expf (a SiLU of a very negative gate is
   then -0, as libm's). */
#define PINFER_EXP_POLY(fma, mul, add, set1, r)                                                       \
    fma(fma(fma(fma(fma(fma(set1(1.9875691500e-4f), r, set1(1.3981999507e-3f)), r, set1(8.3334519073e-3f)), r, \
                    set1(4.1665795894e-2f)), r, set1(1.6666665459e-1f)), r, set1(5.0000001201e-1f)),           \
        mul(r, r), add(r, set1(1.0f)))

__attribute__((target("avx512f,fma"), always_inline))
static inline __m512 pinfer_exp512(__m512 x) {
    /* x second: min and max return it where it is NaN, which then goes through (2^n: inf past 88.72) */
    x = _mm512_max_ps(_mm512_set1_ps(-87.0f), _mm512_min_ps(_mm512_set1_ps(100.0f), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
    return _mm512_scalef_ps(PINFER_EXP_POLY(_mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_set1_ps, r), n);
}

__attribute__((target("avx2,fma"), always_inline))
static inline __m256 pinfer_exp256(__m256 x0) {
    const __m256 x = _mm256_max_ps(_mm256_set1_ps(-87.0f), _mm256_min_ps(_mm256_set1_ps(88.7228f), x0));  /* NaN stays */
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x));
    const __m256 p = PINFER_EXP_POLY(_mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_set1_ps, r);
    /* 2^n = 2^(n - s) * (1 + s), s = 1 where n > 0: -126 <= n - s <= 127 is a normal float's exponent */
    const __m256 s = _mm256_and_ps(_mm256_cmp_ps(n, _mm256_setzero_ps(), _CMP_GT_OQ), _mm256_set1_ps(1.0f));
    const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_sub_ps(n, s)), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(two_n)), _mm256_add_ps(s, _mm256_set1_ps(1.0f)));
    return _mm256_blendv_ps(e, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x0, _mm256_set1_ps(88.7228f), _CMP_GT_OQ));
}
#endif

int pinfer_sparse_isa(int want);
void pinfer_quantize_x(const float *x, int64_t d, qx_t *o);
/* One row's dot per q4 row r < R (R = 1, 2 or 4): the rows' q, fifth bits (q5) or NULL, scales and
   mins (or NULL) by pointer; out[r]. A row's sum is the same bits with R = 2 or 4; with R = 1 (a row
   read alone) it may differ by float rounding (AVX2 sums it in two chains), so a caller reads every
   row of a matrix alone, or none: then no result depends on how rows are split over threads
   (pinfer_dot_rows_ahead). */
typedef struct {
    const uint8_t *q[4], *qh[4];
    const uint16_t *scale[4], *min[4];
} rows4_t;
/* next: R rows to prefetch meanwhile, nstride bytes apart (NULL: none). */
void pinfer_dot_rows_ahead(int R, const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next,
                           int64_t nstride);
/* A matrix of `rows` rows of k weights (decode.c's linear layers, the FFN predictor's W1 and W2). */
typedef struct {
    int fmt;
    const void *q;                  /* q bytes (q4, q5, q8), or the weights (f16, f32) */
    const uint16_t *scale, *min;    /* f16 (rows, k/G); min: q4/q5 only, or NULL */
    const uint8_t *qh;              /* q5's fifth bits (rows, k/8), else NULL */
    const float *bias;              /* (rows), or NULL */
    int64_t rows, k;
} linear_t;
/* Rows 4 * b0 .. 4 * b1 (the last range ends at the matrix's end) of a q4 or q5 matrix against
   each of nt tokens' x quantized in chunk order (qx[t]): out[t * ostride + row], no bias. Short rows
   (rows_by_four) four at a time and the rows past the matrix's last whole block of four alone, so
   ranges of whole blocks give the same bits on any number of threads; each block meets every
   token while in cache; the rows ahead prefetched. */
void pinfer_q4_rows(const linear_t *w, const qx_t *qx, int64_t nt, float *out, int64_t ostride, int64_t b0,
                    int64_t b1);
float pinfer_dot_f16(const uint16_t *w, const float *x, int64_t d);
/* q8 rows (u8 q + 128, f16 scale per group) against x quantized per group of 32 in element order
   (decode.c): the head's and attention's q8 rows and the FFN predictor's. */
void pinfer_quantize_natural(const float *x, int64_t d, qx_t *o);
float pinfer_dot_q8(const uint8_t *q, const uint16_t *scale, const qx_t *x, int64_t k, int isa, const uint8_t *next);
float pinfer_dot_f32(const float *w, const float *x, int64_t d);
/* A weight by columns (activation sparsity): W^T (inputs, outputs) input-major in a down_t format
   (ffn_sparse.c), the inputs under |thr| dropped; q NULL: none. */
typedef struct {
    int fmt;
    const void *q;
    const uint16_t *scale, *min;
    float thr;
} cols_t;
/* y (d) = the kept inputs of x (n) times their rows of c, inside a pool bracket (ffn_sparse.c's
   pinfer_cols without entering the pool); idx and val: scratch of n. Returns the inputs kept. */
int64_t pinfer_cols_run(const cols_t *c, int64_t n, int64_t d, const float *x, float *y, int32_t *idx, float *val,
                        int threads);
/* decode.c's part of pinfer_abi (ffn_sparse.c): the sizes of its structs, or -1. */
int64_t pinfer_decode_abi(const char *name);

#endif
