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

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PINFER_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PINFER_CLONES
#endif

#define G 32
#define TOK_TILE 4     /* tokens sharing one conversion of a weight row */
#define COL_CHUNK 512  /* output columns per work unit */

enum { FMT_Q8 = 0, FMT_Q8R = 1, FMT_Q4R = 2, FMT_F16 = 3, FMT_F32 = 4 };

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

typedef struct {
    int fmt;
    const void *q;          /* q bytes or f16/f32 weights */
    const uint16_t *scale;  /* f16 */
    const uint16_t *min;    /* f16 or NULL */
    int64_t n, d;
} weights_t;

/* Row j of W, columns [c0, c0 + nc), as floats; R formats give q (or q - 128) unscaled. */
PINFER_CLONES
static void load_row(const weights_t *w, int64_t j, int64_t c0, int64_t nc, float *restrict out) {
    const int64_t d = w->d;
    switch (w->fmt) {
    case FMT_Q8: {
        const uint8_t *q = (const uint8_t *)w->q + j * d + c0;
        const uint16_t *s = w->scale + j * (d / G) + c0 / G;
        for (int64_t g = 0; g < nc / G; g++) {
            const float sc = f16_to_f32(s[g]);
            for (int i = 0; i < G; i++) out[g * G + i] = sc * (float)((int)q[g * G + i] - 128);
        }
        break;
    }
    case FMT_Q8R: {
        const uint8_t *restrict q = (const uint8_t *)w->q + j * d + c0;
        for (int64_t i = 0; i < nc; i++) out[i] = (float)((int)q[i] - 128);
        break;
    }
    case FMT_Q4R: {
        const uint8_t *restrict q = (const uint8_t *)w->q + j * (d / 2) + c0 / 2;
        for (int64_t k = 0; k < nc / 2; k++) {
            out[2 * k] = (float)(q[k] & 15);
            out[2 * k + 1] = (float)(q[k] >> 4);
        }
        break;
    }
    case FMT_F16: {
        const uint16_t *restrict q = (const uint16_t *)w->q + j * d + c0;
        for (int64_t i = 0; i < nc; i++) out[i] = f16_to_f32(q[i]);
        break;
    }
    default: {
        memcpy(out, (const float *)w->q + j * d + c0, (size_t)nc * sizeof(float));
    }
    }
}

/* y[t, c0:c0+nc] for tokens t in [0, nt) of this tile. */
PINFER_CLONES
static void down_unit(const weights_t *w, const float *restrict h, float *restrict y, int64_t nt, int64_t c0,
                      int64_t nc) {
    const int64_t n = w->n, d = w->d;
    const int grouped = w->fmt == FMT_Q8R || w->fmt == FMT_Q4R;
    float row[COL_CHUNK], acc[TOK_TILE][COL_CHUNK], sc[COL_CHUNK], off[COL_CHUNK];
    for (int64_t t = 0; t < nt; t++) memset(y + t * d + c0, 0, (size_t)nc * sizeof(float));
    for (int64_t b = 0; b < n; b += G) {
        const int64_t jend = grouped ? b + G : n;
        float hsum[TOK_TILE] = {0};
        if (grouped) memset(acc, 0, sizeof(acc));
        for (int64_t j = b; j < jend; j++) {
            load_row(w, j, c0, nc, row);
            for (int64_t t = 0; t < nt; t++) {
                const float c = h[t * n + j];
                float *restrict a = grouped ? acc[t] : y + t * d + c0;
                for (int64_t i = 0; i < nc; i++) a[i] += c * row[i];
                hsum[t] += c;
            }
        }
        if (!grouped) break; /* the loop above covered every neuron */
        /* y += scale * acc + offset * sum(h): offset is min, -8 scale (q4 without min) or
           -128 scale is already inside q8's row values, so 0 */
        const uint16_t *s = w->scale + (b / G) * d + c0;
        for (int64_t i = 0; i < nc; i++) sc[i] = f16_to_f32(s[i]);
        if (w->fmt == FMT_Q4R && w->min) {
            const uint16_t *m = w->min + (b / G) * d + c0;
            for (int64_t i = 0; i < nc; i++) off[i] = f16_to_f32(m[i]);
        } else {
            const float k = w->fmt == FMT_Q4R ? -8.0f : 0.0f;
            for (int64_t i = 0; i < nc; i++) off[i] = k * sc[i];
        }
        for (int64_t t = 0; t < nt; t++) {
            float *restrict yt = y + t * d + c0;
            for (int64_t i = 0; i < nc; i++) yt[i] += sc[i] * acc[t][i] + off[i] * hsum[t];
        }
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
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int64_t u = 0; u < n_col * n_tok; u++) {
        const int64_t t0 = (u / n_col) * TOK_TILE, c0 = (u % n_col) * cols;
        const int64_t nt = S - t0 < TOK_TILE ? S - t0 : TOK_TILE, nc = d - c0 < cols ? d - c0 : cols;
        down_unit(&w, h + t0 * n, y + t0 * d, nt, c0, nc);
    }
}

/* Lets setuptools build this file as an extension module; pinfer loads it with ctypes. */
#include <Python.h>
static struct PyModuleDef pinfer_kernels_module = {PyModuleDef_HEAD_INIT, "_kernels", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&pinfer_kernels_module); }
