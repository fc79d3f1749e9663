/* The numbers pinfer/kernels/__init__.py passes the kernels, in one place: ffn_down.c, ffn_sparse.c,
 * decode.c, quants.h (so the primitives' units) and cuda/ffn_hot.cu (NVRTC gets this file as
 * "codes.h") include it; pinfer_abi (ffn_sparse.c) reports each by name, and Python checks its own
 * table against them when it loads the library. Plain C without includes, for NVRTC. */
#ifndef PINFER_CODES_H
#define PINFER_CODES_H

/* block formats (formats/schema.py BLOCK_FORMATS): "fmt.q8" ... */
enum { FMT_Q8 = 0, FMT_Q8R = 1, FMT_Q4R = 2, FMT_F16 = 3, FMT_F32 = 4, FMT_Q4 = 5, FMT_Q5 = 6 };
/* sparsity modes (formats/schema.py MODES): "mode.dense" ... */
enum { MODE_DENSE = 0, MODE_DOWN = 1, MODE_PREDICTED = 2, MODE_RELU = 3, MODE_GIVEN = 4 };
/* activations (pinfer/kernels ACTIVATIONS): "act.silu" ... */
enum { ACT_SILU = 0, ACT_RELU = 1, ACT_GELU = 2 };
/* a mode's rule, as the GPU kernels take it (pinfer/kernels RULES): "rule.all" ... */
enum { RULE_ALL = 0, RULE_THRESHOLD = 1, RULE_NONZERO = 2 };
/* tokens of one batch call (pinfer_ffn_batch, pinfer_attn_batch): the FFN's tokens of a neuron are
   one 64-bit mask; "max_batch" */
#define MAX_BATCH 64

#endif
