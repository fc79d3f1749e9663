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
 * in ascending j, so results do not depend on the thread count. The accumulations over rows are
 * quants.h's primitives (ISA_OPS): generic C the compiler vectorizes for each instruction set, and
 * AVX-512 code for the R formats (x86/avx512.c).
 */
#include <stdint.h>
#include <string.h>

#include "codes.h"
#include "pool.h"
#include "quants.h"   /* weights_t, COL_CHUNK (output columns per work unit) and the primitives */

#define TOK_TILE 4     /* tokens sharing one conversion of a weight row */

/* y[t, c0:c0+nc] for tokens t in [0, nt) of this tile. */
static void down_unit(const weights_t *w, const float *h, float *y, int64_t nt, int64_t c0, int64_t nc) {
    const isa_ops_t *const ops = ISA_OPS;
    const int64_t n = w->n, d = w->d, half = nc / 2;
    const int grouped = w->fmt == FMT_Q8R || w->fmt == FMT_Q4R;
    float acc[TOK_TILE][COL_CHUNK], sc[COL_CHUNK], off[COL_CHUNK];
    if (!grouped) {
        memset(acc, 0, sizeof(acc));
        ops->accumulate_rows(w, h, acc, nt, 0, n, c0, nc);
        for (int64_t t = 0; t < nt; t++) memcpy(y + t * d + c0, acc[t], (size_t)nc * sizeof(float));
        return;
    }
    for (int64_t t = 0; t < nt; t++) memset(y + t * d + c0, 0, (size_t)nc * sizeof(float));
    for (int64_t b = 0; b < n; b += G) {
        float hsum[TOK_TILE] = {0};
        for (int64_t t = 0; t < nt; t++)
            for (int64_t j = b; j < b + G; j++) hsum[t] += h[t * n + j];
        ops->accumulate_grouped(w, h, acc, nt, b, b + G, c0, nc);
        /* y += scale * acc + offset * sum(h); offset: min, or -8 scale for q4r without min, or 0
           for q8r (its 128 is already inside the row values) */
        ops->halves_to_floats(w->scale + (b / G) * d + c0, sc, nc);
        if (w->fmt == FMT_Q4R && w->min) {
            ops->halves_to_floats(w->min + (b / G) * d + c0, off, nc);
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
