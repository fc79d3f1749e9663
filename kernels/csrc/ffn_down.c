/* Dense down projection over the neuron-major `down_t` bundle.
 *
 * Layout (DESIGN.md §3, formats/schema.py):
 *   h      f32 (S, n_ff)             activations, one row per token
 *   q      u8  (n_ff, d)             q8 weights offset by 128: w = scale * (q - 128)
 *   scale  f16 (n_ff, d / 32)        one scale per group of 32 along d
 *   w16    f16 (n_ff, d)             f16 weights (the f16 entry point)
 *   w32    f32 (n_ff, d)             f32 weights (the f32 entry point)
 *   y      f32 (S, d)                y[s, :] = sum_j h[s, j] * W[j, :]
 *
 * Each output element is summed by one thread in ascending j, so results do not depend on the
 * thread count. Threads split the d groups (decode) or the tokens (prefill). The compiler
 * vectorizes the inner loops; target_clones builds AVX-512, AVX2 and portable versions and picks
 * one at load time.
 */
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PINFER_CLONES
#endif

#define GROUP 32
#define TOK_TILE 4 /* tokens that share one load and conversion of a weight group */

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exp = 127 - 15 + 1;
            while (!(man & 0x400)) { man <<= 1; exp--; }
            bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000 | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* y[t0..t0+nt) over groups [g0, g1) of d, from q8 rows. */
PINFER_CLONES
static void down_q8_tile(const float *restrict h, const uint8_t *restrict q, const uint16_t *restrict scale, float *restrict y,
                         int64_t nt, int64_t n_ff, int64_t d, int64_t g0, int64_t g1) {
    const int64_t nb = d / GROUP;
    for (int64_t t = 0; t < nt; t++)
        memset(y + t * d + g0 * GROUP, 0, (size_t)(g1 - g0) * GROUP * sizeof(float));
    for (int64_t j = 0; j < n_ff; j++) {
        const uint8_t *qj = q + j * d;
        const uint16_t *sj = scale + j * nb;
        for (int64_t g = g0; g < g1; g++) {
            float w[GROUP];
            const float s = f16_to_f32(sj[g]);
            for (int i = 0; i < GROUP; i++) w[i] = s * (float)((int)qj[g * GROUP + i] - 128);
            for (int64_t t = 0; t < nt; t++) {
                const float c = h[t * n_ff + j];
                float *yt = y + t * d + g * GROUP;
                for (int i = 0; i < GROUP; i++) yt[i] += c * w[i];
            }
        }
    }
}

PINFER_CLONES
static void down_f16_tile(const float *restrict h, const uint16_t *restrict w16, float *restrict y, int64_t nt, int64_t n_ff,
                          int64_t d, int64_t g0, int64_t g1) {
    for (int64_t t = 0; t < nt; t++)
        memset(y + t * d + g0 * GROUP, 0, (size_t)(g1 - g0) * GROUP * sizeof(float));
    for (int64_t j = 0; j < n_ff; j++) {
        const uint16_t *wj = w16 + j * d;
        for (int64_t g = g0; g < g1; g++) {
            float w[GROUP];
            for (int i = 0; i < GROUP; i++) w[i] = f16_to_f32(wj[g * GROUP + i]);
            for (int64_t t = 0; t < nt; t++) {
                const float c = h[t * n_ff + j];
                float *yt = y + t * d + g * GROUP;
                for (int i = 0; i < GROUP; i++) yt[i] += c * w[i];
            }
        }
    }
}

PINFER_CLONES
static void down_f32_tile(const float *restrict h, const float *restrict w32, float *restrict y, int64_t nt,
                          int64_t n_ff, int64_t d, int64_t g0, int64_t g1) {
    for (int64_t t = 0; t < nt; t++)
        memset(y + t * d + g0 * GROUP, 0, (size_t)(g1 - g0) * GROUP * sizeof(float));
    for (int64_t j = 0; j < n_ff; j++) {
        const float *wj = w32 + j * d;
        for (int64_t t = 0; t < nt; t++) {
            const float c = h[t * n_ff + j];
            float *yt = y + t * d;
            for (int64_t i = g0 * GROUP; i < g1 * GROUP; i++) yt[i] += c * wj[i];
        }
    }
}

static void tile(int fmt, const float *h, const void *q, const uint16_t *scale, float *y, int64_t nt,
                 int64_t n_ff, int64_t d, int64_t g0, int64_t g1) {
    if (fmt == 0) down_q8_tile(h, q, scale, y, nt, n_ff, d, g0, g1);
    else if (fmt == 1) down_f16_tile(h, q, y, nt, n_ff, d, g0, g1);
    else down_f32_tile(h, q, y, nt, n_ff, d, g0, g1);
}

/* fmt 0: q8 (q, scale); 1: f16 (w16 in q); 2: f32 (w32 in q). d must be a multiple of 32. */
static void down_any(int fmt, const float *h, const void *q, const uint16_t *scale, float *y,
                     int64_t S, int64_t n_ff, int64_t d, int threads) {
    const int64_t nb = d / GROUP;
    if (S == 1) {
        /* decode: split the groups of d among threads */
        int nt = threads < nb ? threads : (int)nb;
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int p = 0; p < nt; p++) {
            int64_t g0 = nb * p / nt, g1 = nb * (p + 1) / nt;
            tile(fmt, h, q, scale, y, 1, n_ff, d, g0, g1);
        }
        return;
    }
    const int64_t tiles = (S + TOK_TILE - 1) / TOK_TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t k = 0; k < tiles; k++) {
        int64_t t0 = k * TOK_TILE, nt = S - t0 < TOK_TILE ? S - t0 : TOK_TILE;
        tile(fmt, h + t0 * n_ff, q, scale, y + t0 * d, nt, n_ff, d, 0, nb);
    }
}

void pinfer_down_q8(const float *h, const uint8_t *q, const uint16_t *scale, float *y, int64_t S,
                    int64_t n_ff, int64_t d, int threads) {
    down_any(0, h, q, scale, y, S, n_ff, d, threads);
}

void pinfer_down_f16(const float *h, const uint16_t *w16, float *y, int64_t S, int64_t n_ff,
                     int64_t d, int threads) {
    down_any(1, h, w16, 0, y, S, n_ff, d, threads);
}

void pinfer_down_f32(const float *h, const float *w32, float *y, int64_t S, int64_t n_ff, int64_t d,
                     int threads) {
    down_any(2, h, w32, 0, y, S, n_ff, d, threads);
}

/* Lets setuptools build this file as an extension module; pinfer loads it with ctypes. */
#include <Python.h>
static struct PyModuleDef pinfer_kernels_module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&pinfer_kernels_module); }
