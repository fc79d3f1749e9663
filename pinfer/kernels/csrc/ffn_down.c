/* Dense down projection over the neuron-major `down_t` bundle: y = h @ W.
 *
 * Layouts (formats/schema.py; n = n_ff neurons, d = d_model, G = 32):
 *   h      f32 (S, n)              activations, one row per token
 *   y      f32 (S, d)              output, overwritten
 *   W in one of these formats, neuron j's weights being row j:
 *   FMT_Q8   q u8 (n, d), scale f16 (n, d/G)      w[j,i] = scale[j, i/G] * (q[j,i] - 128)
 *   FMT_Q8R  q u8 (n, d), scale f16 (n/G, d)      w[j,i] = scale[j/G, i] * (q[j,i] - 128)
 *   FMT_Q4R  q u8 (n, d/2), scale f16 (n/G, d), min f16 (n/G, d) or none
 *            element 2k of a row in the low nibble of byte k, 2k+1 in the high nibble;
 *            w[j,i] = scale[j/G, i] * q[j,i] + min[j/G, i], or scale * (q - 8) without min
 *   FMT_Q4   q u8 (n, d/2), scale f16 (n, d/G), min f16 (n, d/G) or none: groups along d
 *            w[j,i] = scale[j, i/G] * q[j,i] + min[j, i/G], or scale * (q - 8) without min
 *   FMT_F16  w f16 (n, d)
 *   FMT_F32  w f32 (n, d)
 * The R formats keep GGUF's groups, which run along the neuron axis of W_down, so GGUF's Q4_0,
 * Q4_1 and Q8_0 down matrices are carried over exactly.
 *
 * Work is cut into (token tile, column chunk) units; each output element is summed by one thread
 * in ascending j, so results do not depend on the thread count. The compiler vectorizes the inner
 * loops; target_clones builds AVX-512, AVX2 and portable versions and picks one at load time.
 */
#include <stdint.h>
#include <string.h>

#include "codes.h"
#include "half.h"
#include "pool.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PINFER_CLONES
#endif

#define G 32
#define TOK_TILE 4     /* tokens sharing one conversion of a weight row */
#define COL_CHUNK 512  /* output columns per work unit */

PINFER_CLONES
static void halves_to_floats(const uint16_t *src, float *restrict dst, int64_t n) {
    const half_t *restrict s = (const half_t *)src;
    for (int64_t i = 0; i < n; i++) dst[i] = HALF(s[i]);
}

typedef struct {
    int fmt;
    const void *q;          /* q bytes or f16/f32 weights */
    const uint16_t *scale;  /* f16 */
    const uint16_t *min;    /* f16 or NULL */
    int64_t n, d;
} weights_t;

/* acc[t][i] (+)= sum over rows j in [j0, j1) of h[t, j] * row_j[c0 + i], row_j being W's row j
   before any per-group scale (q - 128 for q8r; q for q4r, whose even and odd columns land in
   acc[t][i] and acc[t][nc/2 + i] so that the loops stay contiguous). */
/* R formats: acc[t][...] = sum over rows j in [j0, j1) of h[t, j] * row_j, before the group's
   scale, row_j being q - 128 (q8r) or q (q4r, whose even and odd columns land in acc[t][i] and
   acc[t][nc/2 + i]). Columns go in tiles of G whose sums stay in registers while the rows of the
   group stream past. */
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
__attribute__((target("avx512f,avx512bw")))
static void accumulate_grouped_avx512(const weights_t *w, const float *h, float (*acc)[COL_CHUNK], int64_t nt,
                                      int64_t j0, int64_t j1, int64_t c0, int64_t nc) {
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
#endif

/* Portable version of the above, same order of additions per output element as far as the
   compiler keeps it (results may differ from the AVX-512 path in the last bits). */
static void accumulate_grouped_portable(const weights_t *w, const float *h, float (*acc)[COL_CHUNK], int64_t nt,
                                        int64_t j0, int64_t j1, int64_t c0, int64_t nc) {
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

static void accumulate_grouped(const weights_t *w, const float *h, float (*acc)[COL_CHUNK], int64_t nt,
                               int64_t j0, int64_t j1, int64_t c0, int64_t nc) {
#if defined(__x86_64__) && defined(__GNUC__)
    static int avx512 = -1;
    if (avx512 < 0) avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
    if (avx512) {
        accumulate_grouped_avx512(w, h, acc, nt, j0, j1, c0, nc);
        return;
    }
#endif
    accumulate_grouped_portable(w, h, acc, nt, j0, j1, c0, nc);
}

/* Other formats: acc[t][i] += sum over rows j of h[t, j] * W[j, c0 + i]. */
PINFER_CLONES
static void accumulate_rows(const weights_t *w, const float *restrict h, float (*restrict acc)[COL_CHUNK],
                            int64_t nt, int64_t j0, int64_t j1, int64_t c0, int64_t nc) {
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

/* y[t, c0:c0+nc] for tokens t in [0, nt) of this tile. */
static void down_unit(const weights_t *w, const float *h, float *y, int64_t nt, int64_t c0, int64_t nc) {
    const int64_t n = w->n, d = w->d, half = nc / 2;
    const int grouped = w->fmt == FMT_Q8R || w->fmt == FMT_Q4R;
    float acc[TOK_TILE][COL_CHUNK], sc[COL_CHUNK], off[COL_CHUNK];
    if (!grouped) {
        memset(acc, 0, sizeof(acc));
        accumulate_rows(w, h, acc, nt, 0, n, c0, nc);
        for (int64_t t = 0; t < nt; t++) memcpy(y + t * d + c0, acc[t], (size_t)nc * sizeof(float));
        return;
    }
    for (int64_t t = 0; t < nt; t++) memset(y + t * d + c0, 0, (size_t)nc * sizeof(float));
    for (int64_t b = 0; b < n; b += G) {
        float hsum[TOK_TILE] = {0};
        for (int64_t t = 0; t < nt; t++)
            for (int64_t j = b; j < b + G; j++) hsum[t] += h[t * n + j];
        accumulate_grouped(w, h, acc, nt, b, b + G, c0, nc);
        /* y += scale * acc + offset * sum(h); offset: min, or -8 scale for q4r without min, or 0
           for q8r (its 128 is already inside the row values) */
        halves_to_floats(w->scale + (b / G) * d + c0, sc, nc);
        if (w->fmt == FMT_Q4R && w->min) {
            halves_to_floats(w->min + (b / G) * d + c0, off, nc);
        } else {
            const float k = w->fmt == FMT_Q4R ? -8.0f : 0.0f;
            for (int64_t i = 0; i < nc; i++) off[i] = k * sc[i];
        }
        for (int64_t t = 0; t < nt; t++) {
            float *yt = y + t * d + c0;
            if (w->fmt == FMT_Q4R) {
                for (int64_t k = 0; k < half; k++) {
                    yt[2 * k] += sc[2 * k] * acc[t][k] + off[2 * k] * hsum[t];
                    yt[2 * k + 1] += sc[2 * k + 1] * acc[t][half + k] + off[2 * k + 1] * hsum[t];
                }
            } else {
                for (int64_t i = 0; i < nc; i++) yt[i] += sc[i] * acc[t][i] + off[i] * hsum[t];
            }
        }
    }
}

typedef struct {
    const weights_t *w;
    const float *h;
    float *y;
    int64_t S, cols, n_col;
} units_t;

/* Work units [u0, u1): unit u is token tile u / n_col, column chunk u % n_col. */
static void down_units(void *p, int64_t u0, int64_t u1) {
    const units_t *a = p;
    const int64_t n = a->w->n, d = a->w->d;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t t0 = (u / a->n_col) * TOK_TILE, c0 = (u % a->n_col) * a->cols;
        const int64_t nt = a->S - t0 < TOK_TILE ? a->S - t0 : TOK_TILE, nc = d - c0 < a->cols ? d - c0 : a->cols;
        down_unit(a->w, a->h + t0 * n, a->y + t0 * d, nt, c0, nc);
    }
}

void pinfer_down(int fmt, const void *q, const uint16_t *scale, const uint16_t *min, const float *h, float *y,
                 int64_t S, int64_t n, int64_t d, int threads) {
    weights_t w = {fmt, q, scale, min, n, d};
    const int64_t chunk = d < COL_CHUNK ? d : COL_CHUNK;
    /* decode: narrower chunks so that every thread gets work */
    const int64_t cw = S == 1 && threads > 1 ? ((d / threads + G - 1) / G) * G : chunk;
    const int64_t cols = cw < chunk ? cw : chunk;
    const int64_t n_col = (d + cols - 1) / cols, n_tok = (S + TOK_TILE - 1) / TOK_TILE;
    units_t units = {&w, h, y, S, cols, n_col};
    const int t = pinfer_pool_enter(threads);
    pinfer_parallel(t, n_col * n_tok, down_units, &units);
    pinfer_pool_leave(threads);
}

/* Lets setuptools build this file as an extension module; pinfer loads it with ctypes. */
#include <Python.h>
static struct PyModuleDef pinfer_kernels_module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&pinfer_kernels_module); }

/* -- the row-grouped form of W_down from the neuron-major one -------------------------------------
 * q of an R format (n, d) (FMT_Q8R: bytes; FMT_Q4R: nibble pairs along d) to the plain format's q
 * of W_down (d, n) (FMT_Q8: bytes; FMT_Q4: nibble pairs along n): out[i, j] = in[j, i]. The
 * scales and mins, (n/G, d) -> (d, n/G), are plain transposes the caller makes. Every dense layer
 * of a one-copy load makes its W_down here, so its time is load time. A tile reads 16 input rows
 * (UNT_J) 64 bytes at a time (UNT_I values): 64 rows at the input's stride of d/2 bytes fall in two
 * L1 sets and evict each other. A q4 byte holds the values of rows i and i + 1 (i even), so each
 * byte read writes both rows' nibbles. A 7B layer's W_down (11008 x 4096), 1 thread: 53 ms with
 * 64 x 64 tiles and one row a byte, 24 ms so. */
#define UNT_J 16
#define UNT_I 128
void pinfer_untranspose_q(int fmt, const uint8_t *in, uint8_t *out, int64_t n, int64_t d) {
    for (int64_t j0 = 0; j0 < n; j0 += UNT_J) {
        const int64_t j1 = j0 + UNT_J < n ? j0 + UNT_J : n;
        for (int64_t i0 = 0; i0 < d; i0 += UNT_I) {
            const int64_t i1 = i0 + UNT_I < d ? i0 + UNT_I : d;
            if (fmt == FMT_Q8R) {
                for (int64_t i = i0; i < i1; i++) {
                    uint8_t *o = out + i * n;
                    for (int64_t j = j0; j < j1; j++)
                        o[j] = in[j * d + i];
                }
                continue;
            }
            /* FMT_Q4R: n and d even, and so are i0 and i1 */
            for (int64_t i = i0; i < i1; i += 2) {
                uint8_t *lo = out + i * (n / 2), *hi = lo + n / 2;
                const uint8_t *c = in + i / 2;
                for (int64_t j = j0; j + 1 < j1; j += 2) {
                    const uint8_t a = c[j * (d / 2)], b = c[(j + 1) * (d / 2)];
                    lo[j / 2] = (uint8_t)((a & 15) | (b << 4));
                    hi[j / 2] = (uint8_t)((a >> 4) | (b & 0xF0));
                }
            }
        }
    }
}
