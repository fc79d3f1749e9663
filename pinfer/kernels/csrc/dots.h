/* The row dots ffn_sparse.c defines, shared with decode.c (the attention and head of a decode
 * step): activations quantized to int8 per group of 32 in the nibbles' chunk order (ffn_sparse.c
 * says the layout), and the dots of q4/q5 rows, f16 and f32 rows with them, on the instruction set
 * pinfer_sparse_isa chose. */
#ifndef PINFER_DOTS_H
#define PINFER_DOTS_H

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

/* Rows of at most this many weights are read several at a time (pinfer_dot_rows_ahead with R = 2 or 4),
   each load of x serving them all; longer ones one at a time. On a 2-core EPYC (AVX-512), with a C
   harness over pinfer_dot_rows_ahead that the repository does not keep: rows of 576 read 12 GB/s one
   at a time and 22-24 four at a time; rows of 1536 and 4096 from 4 KB pages read faster one at a
   time (interleaved streams). What the repository shows: benchmarks/sparse_kernel.py --shapes
   smollm2 --formats int4 --fractions 1 (dense FFN 11.5 -> 19.7 GB/s with the four-row reads) and
   benchmarks/row_dots.py (the rows as the head reads them). */
#define SHORT_ROW 1024

enum { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

typedef struct {
    int8_t *q;      /* (d) in chunk order */
    float *scale;   /* (d/G) */
    float *lanes;   /* (d/8): each group's scale four times, one per 32-bit lane of its sums */
    float *sum;     /* (d/G) the sum of the group's x (float): meets the weights' min */
    int32_t *off;   /* (d/8) per 32-bit lane of the AVX-512 sums, -8 * the sum of the q it meets */
    int16_t *off16; /* (d/4) the same per 16-bit lane of the AVX2 sums */
} qx_t;

/* Bytes of one qx_t of length d in a single block, and its parts placed in such a block. */
int64_t pinfer_qx_bytes(int64_t d);
qx_t pinfer_qx_at(void *mem, int64_t d);

int pinfer_sparse_isa(int want);
void pinfer_quantize_x(const float *x, int64_t d, qx_t *o);
/* One row's dot per q4 row r < R (R = 1, 2 or 4): the rows' q, fifth bits (q5) or NULL, scales and
   mins (or NULL) by pointer; out[r]. Each row's sum is the same bits whatever R it is computed in
   (pinfer_dot_rows_ahead). */
typedef struct {
    const uint8_t *q[4], *qh[4];
    const uint16_t *scale[4], *min[4];
} rows4_t;
/* next: R rows to prefetch meanwhile, nstride bytes apart (NULL: none). */
void pinfer_dot_rows_ahead(int R, const rows4_t *w, const qx_t *x, int64_t d, float *out, const uint8_t *next,
                           int64_t nstride);
float pinfer_dot_f16(const uint16_t *w, const float *x, int64_t d);
float pinfer_dot_f32(const float *w, const float *x, int64_t d);

#endif
