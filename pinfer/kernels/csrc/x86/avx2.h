/* AVX2 helpers that both x86 units inline into their hot loops (always_inline): masked loads of a
 * row's last floats or halves, the sum of eight lanes, e^x in eight lanes, a SIMD activation, and
 * one attention head in 8-wide lanes (head8), which x86/avx512.c compiles again for AVX-512's 32
 * vector registers. A header, not a unit: moved behind a call they would no longer inline. */
#ifndef PINFER_X86_AVX2_H
#define PINFER_X86_AVX2_H

#include "../quants.h"

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

/* activate() (quants.c) in lanes of W (512 or 256) bits: ReLU, or g / (1 + e^-z), z = g (SiLU) or
   GELU's tanh form; pinfer_exp512 where W is 512 (x86/avx512.c). */
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
   so it is not done. HEAD8_MAX is in quants.h. */

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
#endif

#endif
