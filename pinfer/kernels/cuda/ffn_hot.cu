/* The hot neurons of one layer's sparse FFN on the GPU, one token (decode). CUDA C for NVRTC: no
 * system headers, fp16 through PTX conversions (sm_75 upward; no bf16).
 *
 * Layouts: the file's bundles (formats/schema.py, pinfer/kernels/csrc/ffn_sparse.c) cut to the hot prefix
 * of k neurons (k a multiple of 32); d = d_model, r = predictor rank, G = 32:
 *   gate_up  FMT_Q4   q u8 (k, 2, d/2), scale f16 (k, 2, d/G), min f16 (k, 2, d/G) or null;
 *                     row 2j is neuron j's gate row, 2j+1 its up row; element 2b is the low nibble
 *                     of byte b, 2b+1 the high one; w = scale*q + min, or scale*(q - 8)
 *            FMT_Q5   as FMT_Q4 (the low 4 bits), plus qh u8 (k, 2, d/8) (formats/schema.py);
 *                     w = scale*q + min, or scale*(q - 16)
 *            FMT_F16  w f16 (k, 2, d); FMT_F32 w f32 (k, 2, d)
 *   down_t   FMT_Q4   q u8 (k, d/2), scale f16 (k, d/G), min or null   (groups along d)
 *            FMT_Q4R  q u8 (k, d/2), scale f16 (k/G, d), min or null   (groups of 32 neurons)
 *            FMT_Q8   q u8 (k, d) (q + 128), scale f16 (k, d/G);  FMT_Q8R  q u8 (k, d), scale (k/G, d)
 *            FMT_F16  w f16 (k, d); FMT_F32 w f32 (k, d)
 *   predictor  w1 q8: q u8 (r, d), scale f16 (r, d/G); w2 q8, hot rows: q u8 (k, r), scale (k, r/G);
 *              b2 f32 (k); scores = w2 relu(w1 x) + b2
 *   x f32 (d) in; hid f32 (r); cand i32 (k) + count; gu f32 (k, 2); hval f32 (k) (0 where dropped);
 *   surv i32 (k) + nsurv; y f32 (d) out; xq i8 (d), xs f32 (d/G), xsum f32 (d/G): x quantized, and each group's sum of x
 *
 * One numerics contract with the CPU kernel (pinfer/kernels/csrc/ffn_sparse.c), so that a rule picks the
 * same neurons on both: INT4 gate/up rows meet x quantized to int8 per group of 32 exactly as the
 * CPU quantizes it (scale amax/127, round to nearest even, IEEE division: no fast math), the
 * products summed as integers per group and scaled once per group; only the float sum over
 * groups runs in another order.
 *
 * Per call: [pinfer_pred_hidden, pinfer_select] or a count of k over the identity list ->
 * [pinfer_quantize_x for INT4 rows] -> pinfer_gate_up (gather GEMV, a warp per candidate) -> pinfer_activate (act, the exact rule,
 * compaction) -> pinfer_axpy (a block per 32 survivors, atomic adds into y: fast, summation order
 * unfixed) or pinfer_axpy_det (a thread per output column, survivors in ascending order: the
 * deterministic variant, for tests) -> pinfer_merge (y += the CPU's cold partial sum).
 * The candidate and survivor lists are compacted with atomics, so unordered; every value is
 * written at its neuron's index, so only pinfer_axpy's float additions depend on the order.
 */

#include "codes.h"   /* FMT_*, ACT_*, RULE_*: pinfer/kernels/csrc/codes.h, handed to NVRTC by gpu.py */

typedef unsigned char u8;
typedef unsigned short f16;

#define G 32
#define AXPY_CHUNK 32

__device__ __forceinline__ float h2f(f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

/* The same butterfly on every lane: every lane ends with the same sum, in a fixed order. */
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ int global_warp() { return (int)((blockIdx.x * blockDim.x + threadIdx.x) >> 5); }

/* dot of one q8 row (n values, q + 128, a scale per 32) with float v; a warp, lane = element. */
__device__ __forceinline__ float dot_q8(const u8 *q, const f16 *s, const float *v, int n, int lane) {
    float acc = 0.0f;
    for (int g = 0; g < n / G; g++) acc += h2f(s[g]) * ((float)q[g * G + lane] - 128.0f) * v[g * G + lane];
    return warp_sum(acc);
}

/* hid = relu(w1 x) */
extern "C" __global__ void pinfer_pred_hidden(const u8 *w1q, const f16 *w1s, const float *x, float *hid, int r,
                                              int d) {
    const int row = global_warp(), lane = threadIdx.x & 31;
    if (row >= r) return;
    const float v = dot_q8(w1q + (size_t)row * d, w1s + (size_t)row * (d / G), x, d, lane);
    if (lane == 0) hid[row] = v > 0.0f ? v : 0.0f;
}

/* cand += the hot neurons whose score w2 hid + b2 reaches thr */
extern "C" __global__ void pinfer_select(const u8 *w2q, const f16 *w2s, const float *b2, const float *hid, float thr,
                                         int k, int r, int *cand, int *count) {
    const int j = global_warp(), lane = threadIdx.x & 31;
    if (j >= k) return;
    const float score = dot_q8(w2q + (size_t)j * r, w2s + (size_t)j * (r / G), hid, r, lane) + b2[j];
    if (lane == 0 && score >= thr) cand[atomicAdd(count, 1)] = j;
}

/* x quantized to int8 per group of 32 as the CPU's quantize_x does: a warp per group, lane = element */
extern "C" __global__ void pinfer_quantize_x(const float *x, int d, signed char *xq, float *xs, float *xsum) {
    const int g = global_warp(), lane = threadIdx.x & 31;
    if (g >= d / G) return;
    const float v = x[g * G + lane];
    float amax = fabsf(v);
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const float sc = amax / 127.0f, inv = sc > 0.0f ? 1.0f / sc : 0.0f;
    const int qv = __float2int_rn(__fmul_rn(v, inv));
    float total = v;        /* the sum of x itself: a weight's min meets x, as on the CPU */
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    xq[g * G + lane] = (signed char)qv;
    if (lane == 0) {
        xs[g] = sc;
        xsum[g] = total;
    }
}

/* one gate or up row of neuron j against x (INT4/INT5 rows: against xq, see pinfer_quantize_x); a
   warp. FMT_Q5: h holds the fifth bits, per group a u32 (bit b: element 2b, bit 16 + b: 2b + 1) */
__device__ float row_dot(int fmt, const void *q, const f16 *s, const f16 *m, const u8 *h, size_t row,
                         const float *x, const signed char *xq, const float *xs, const float *xsum, int d, int lane) {
    float acc = 0.0f;
    if (fmt == FMT_Q4 || fmt == FMT_Q5) {
        /* a lane takes 4 bytes: 8 elements of one group, 4 lanes a group; xq meets scale * (q - z), z the
           zero point (8, or 16 for q5), and the group's first lane adds (min + z * scale) * sum(x) */
        const unsigned *w = (const unsigned *)((const u8 *)q + row * (d / 2));
        const unsigned *hr = fmt == FMT_Q5 ? (const unsigned *)(h + row * (d / 8)) : 0;
        const f16 *sr = s + row * (d / G), *mr = m ? m + row * (d / G) : 0;
        for (int t = lane; t < d / 8; t += 32) {
            const unsigned v = w[t];
            const int e = 8 * t, g = e / G;
            const unsigned hw = hr ? hr[g] : 0u;
            const int z = hr ? 16 : 8;
            const float sc = h2f(sr[g]), cm = mr ? h2f(mr[g]) + (float)z * sc : 0.0f;
            int part = 0;
            for (int i = 0; i < 4; i++) {
                const unsigned b = (v >> (8 * i)) & 255u, k = (unsigned)(e % G) / 2 + i;   /* byte k of the group */
                const int lo = (int)(b & 15u) | (int)((hw >> k) & 1u) << 4;
                const int hi = (int)(b >> 4) | (int)((hw >> (16 + k)) & 1u) << 4;
                part += (lo - z) * xq[e + 2 * i] + (hi - z) * xq[e + 2 * i + 1];
            }
            acc += sc * xs[g] * (float)part + (e % G == 0 ? cm * xsum[g] : 0.0f);
        }
    } else if (fmt == FMT_F16) {
        const unsigned *w = (const unsigned *)((const f16 *)q + row * d);
        for (int t = lane; t < d / 2; t += 32) {
            const unsigned v = w[t];
            acc += h2f((f16)(v & 0xffffu)) * x[2 * t] + h2f((f16)(v >> 16)) * x[2 * t + 1];
        }
    } else {
        const float *w = (const float *)q + row * d;
        for (int t = lane; t < d; t += 32) acc += w[t] * x[t];
    }
    return warp_sum(acc);
}

/* gu[j] = (gate_j . x, up_j . x) for the *count candidates; a warp each */
extern "C" __global__ void pinfer_gate_up(int fmt, const void *q, const f16 *s, const f16 *m, const u8 *h,
                                          const float *x,
                                          const signed char *xq, const float *xs, const float *xsum,
                                          const int *cand, const int *count, int d, float *gu) {
    const int w = global_warp(), lane = threadIdx.x & 31;
    if (w >= *count) return;
    const int j = cand[w];
    const float g = row_dot(fmt, q, s, m, h, 2 * (size_t)j, x, xq, xs, xsum, d, lane);
    const float u = row_dot(fmt, q, s, m, h, 2 * (size_t)j + 1, x, xq, xs, xsum, d, lane);
    if (lane == 0) {
        gu[2 * j] = g;
        gu[2 * j + 1] = u;
    }
}

/* h = act(gate) * up and the rule over the candidates; survivors appended to surv, h into hval
   (hval must be zero beforehand: dropped and unselected neurons stay 0) */
extern "C" __global__ void pinfer_activate(const float *gu, const int *cand, const int *count, int act, int rule,
                                           float thr, float *hval, int *surv, int *nsurv) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= *count) return;
    const int j = cand[i];
    const float g = gu[2 * j], u = gu[2 * j + 1];
    /* not __expf: as the CPU; gelu as g sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3)), the CPU's form */
    const float z = act == ACT_GELU ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
    const float a = act == ACT_RELU ? (g > 0.0f ? g : 0.0f) : g / (1.0f + expf(-z));
    const float h = a * u;
    /* as the CPU kernel: dropped only when |h| < thr, so a NaN survives and shows in y */
    const int keep = rule == RULE_ALL ? 1 : rule == RULE_NONZERO ? h != 0.0f : !(fabsf(h) < thr);
    if (keep && h != 0.0f) {
        hval[j] = h;
        surv[atomicAdd(nsurv, 1)] = j;
    }
}

/* weight (j, c) of down_t */
__device__ __forceinline__ float down_w(int fmt, const void *q, const f16 *s, const f16 *m, int j, int c, int d) {
    if (fmt == FMT_F16) return h2f(((const f16 *)q)[(size_t)j * d + c]);
    if (fmt == FMT_F32) return ((const float *)q)[(size_t)j * d + c];
    if (fmt == FMT_Q8 || fmt == FMT_Q8R) {
        const size_t gi = fmt == FMT_Q8R ? (size_t)(j / G) * d + c : (size_t)j * (d / G) + c / G;
        return h2f(s[gi]) * ((float)((const u8 *)q)[(size_t)j * d + c] - 128.0f);
    }
    const u8 v = ((const u8 *)q)[(size_t)j * (d / 2) + c / 2];
    const float nib = (float)((c & 1) ? v >> 4 : v & 15);
    const size_t gi = fmt == FMT_Q4R ? (size_t)(j / G) * d + c : (size_t)j * (d / G) + c / G;
    const float sc = h2f(s[gi]);
    return m ? sc * nib + h2f(m[gi]) : sc * (nib - 8.0f);
}

/* y += sum over survivors of h_j down_j: block b takes survivors [32b, 32b + 32), a thread per column
   (grid.y column tiles); y must be zero beforehand */
extern "C" __global__ void pinfer_axpy(int fmt, const void *q, const f16 *s, const f16 *m, const float *hval,
                                       const int *surv, const int *nsurv, int d, float *y) {
    const int base = blockIdx.x * AXPY_CHUNK, n = *nsurv;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (base >= n || c >= d) return;
    const int end = base + AXPY_CHUNK < n ? base + AXPY_CHUNK : n;
    float acc = 0.0f;
    for (int i = base; i < end; i++) {
        const int j = surv[i];
        acc += hval[j] * down_w(fmt, q, s, m, j, c, d);
    }
    atomicAdd(y + c, acc);
}

/* y = sum over neurons 0..k-1 in ascending order of h_j down_j (h_j = 0 skipped): the same bits on
   every run */
extern "C" __global__ void pinfer_axpy_det(int fmt, const void *q, const f16 *s, const f16 *m, const float *hval,
                                           int k, int d, float *y) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= d) return;
    float acc = 0.0f;
    for (int j = 0; j < k; j++) {
        const float h = hval[j];
        if (h != 0.0f) acc += h * down_w(fmt, q, s, m, j, c, d);
    }
    y[c] = acc;
}

/* y += the cold partial sum */
extern "C" __global__ void pinfer_merge(float *y, const float *cold, int d) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < d) y[c] += cold[c];
}
