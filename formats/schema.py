"""The `.pinf` file: the one place that knows its bytes. Reader and writer both import this.

Layout (little-endian):

    offset 0        preamble, PREAMBLE_SIZE bytes:
                      magic            8s   MAGIC
                      version          u32  FORMAT_VERSION
                      reserved         u32  0
                      header_offset    u64  where the JSON header starts
                      header_length    u64  its length in bytes
                      header_sha256    32s  SHA-256 of the header bytes
                      zero padding up to PREAMBLE_SIZE
    offset 4096     tensor data, each tensor starting on an ALIGNMENT boundary
    header_offset   UTF-8 JSON header (after the data, so tensors stream out as they are made
                    and the header, which holds their checksums, is written last)

The header is a JSON object with the keys in HEADER_KEYS. Its "tensors" entry is the directory:
name -> {"dtype", "shape", "offset", "nbytes", "sha256"}; every offset is absolute, aligned, and
inside the file. The file holds data only: the runtime builds the ONNX graphs it runs from the
config and the block formats (runtime/graphs.py). Version 1 files carried graphs of their own; a
version-2 reader refuses them with a sentence that says to convert again.
"""

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"PINF\x00\r\n\x1a"
FORMAT_VERSION = 2
ALIGNMENT = 4096
PREAMBLE = struct.Struct("<8sII QQ32s")
PREAMBLE_SIZE = 128

# Sanity limits, checked before anything is allocated.
MAX_HEADER_BYTES = 1 << 30
MAX_TENSORS = 1 << 20
MAX_DIMS = 8

# dtype code in the directory -> numpy dtype (always little-endian)
DTYPES = {
    "u8": np.dtype("<u1"),
    "i8": np.dtype("<i1"),
    "i32": np.dtype("<i4"),
    "f16": np.dtype("<f2"),
    "f32": np.dtype("<f4"),
}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

# "weights" maps each block-format weight base name to its format (a key of BLOCK_FORMATS).
HEADER_KEYS = ("config", "tokenizer", "weights", "ffn", "sparsity", "layers", "plan", "provenance", "tensors")

# Weight block formats. A weight W of shape (rows, K) in format F is stored as the tensors
# `{base}.{part}` for each part of F, with these shapes (K is the reduction axis of MatMulNBits'
# [N, K] convention, and the axis along which groups of GROUP run):
#   q4:  q u8 (rows, K/2)   element 2i in the low nibble of byte i, 2i+1 in the high nibble
#        scale f16 (rows, K/GROUP)
#        min f16 (rows, K/GROUP), optional: value = scale*q + min; without it scale*(q - 8)
#   q5:  q u8 (rows, K/2) the low 4 bits of each element, as q4
#        qh u8 (rows, K/8) the fifth bits: per group of 32, two little-endian u16, bit j of the first
#           element 2j's, bit j of the second element 2j+1's (the nibble planes' order)
#        scale f16 (rows, K/GROUP), min f16 (rows, K/GROUP) optional: value = scale*q + min with q
#        the 5-bit value (0..31); without min scale*(q - 16)
#   q8:  q u8 (rows, K) holding q + 128, scale f16 (rows, K/GROUP): value = scale*q
#   f16: w f16 (rows, K)
#   f32: w f32 (rows, K)
# The "r" formats group along rows instead (groups of GROUP rows share a scale per column). They
# hold neuron-major ffn_down_t exactly as GGUF quantized W_down, whose groups run along n_ff:
#   q4r: q u8 (rows, K/2) as q4, scale f16 (rows/GROUP, K), min f16 (rows/GROUP, K) optional:
#        value[r, k] = scale[r/GROUP, k]*q[r, k] + min[r/GROUP, k], or scale*(q - 8) without min
#   q8r: q u8 (rows, K), scale f16 (rows/GROUP, K): value = scale[r/GROUP, k]*(q[r, k] - 128)
GROUP = 32
BLOCK_FORMATS = {
    "q4": ("q", "scale", "min"),
    "q5": ("q", "qh", "scale", "min"),
    "q8": ("q", "scale"),
    "q4r": ("q", "scale", "min"),
    "q8r": ("q", "scale"),
    "f16": ("w",),
    "f32": ("w",),
}
OPTIONAL_PARTS = ("min",)
NO_MIN_OFFSET = {"q4": 8, "q4r": 8, "q5": 16}    # value = scale*(q - offset) without a min


def block_parts(fmt, rows, k, has_min=True):
    """{part: (dtype code, shape)} of a (rows, k) weight in block format `fmt`, as the table above
    says: the one byte model of the formats (the reader, the kernels' checks, the planner's bytes
    per token and the GPU's allocations all derive from it)."""
    g = GROUP
    by_row, by_group = (rows, k // g), (rows // g, k)
    parts = {
        "q4": {"q": ("u8", (rows, k // 2)), "scale": ("f16", by_row), "min": ("f16", by_row)},
        "q5": {"q": ("u8", (rows, k // 2)), "qh": ("u8", (rows, k // 8)), "scale": ("f16", by_row),
               "min": ("f16", by_row)},
        "q8": {"q": ("u8", (rows, k)), "scale": ("f16", by_row)},
        "q4r": {"q": ("u8", (rows, k // 2)), "scale": ("f16", by_group), "min": ("f16", by_group)},
        "q8r": {"q": ("u8", (rows, k)), "scale": ("f16", by_group)},
        "f16": {"w": ("f16", (rows, k))},
        "f32": {"w": ("f32", (rows, k))},
    }[fmt]
    if not has_min:
        parts.pop("min", None)
    return parts


def block_nbytes(fmt, rows, k, has_min=True):
    """Bytes of a (rows, k) weight in `fmt`."""
    return sum(DTYPES[dt].itemsize * int(np.prod(shape)) for dt, shape in block_parts(fmt, rows, k, has_min).values())

# Tensor-name templates (GGUF style, so names read the same as in the source file).
TOKEN_EMBD = "token_embd"                   # (vocab, d_model) rows looked up per token
OUTPUT = "output"                           # (vocab, d_model) LM head; absent when tied
OUTPUT_NORM = "output_norm.weight"          # (d_model,)
ATTN_NORM = "blk.{}.attn_norm.weight"       # (d_model,)
ATTN_QKV = "blk.{}.attn_qkv"                # ((n_head + 2 n_head_kv) head_dim, d_model) q, k, v rows
ATTN_OUT = "blk.{}.attn_output"             # (d_model, n_head head_dim)
FFN_NORM = "blk.{}.ffn_norm.weight"         # (d_model,)
FFN_GATE_UP = "blk.{}.ffn_gate_up"          # (n_ff, 2, d_model) neuron j: gate row, up row
FFN_DOWN_T = "blk.{}.ffn_down_t"            # (n_ff, d_model) column j of W_down as row j
# Without a gate (config ffn_gated false: OPT) FFN_GATE_UP holds one row per neuron, (n_ff, 1, d_model).
# Optional f32 biases and LayerNorm shifts, present when the model has them (Qwen2, OPT):
ATTN_QKV_BIAS = "blk.{}.attn_qkv_bias"      # (n_qkv,)
ATTN_OUT_BIAS = "blk.{}.attn_output_bias"   # (d_model,)
ATTN_NORM_BIAS = "blk.{}.attn_norm.bias"    # (d_model,) config norm "layer"
FFN_NORM_BIAS = "blk.{}.ffn_norm.bias"      # (d_model,)
FFN_GATE_UP_BIAS = "blk.{}.ffn_gate_up_bias"  # (n_ff, 1 or 2) file order, like FFN_GATE_UP's rows
FFN_DOWN_BIAS = "blk.{}.ffn_down_bias"      # (d_model,)
OUTPUT_NORM_BIAS = "output_norm.bias"       # (d_model,)
POS_EMBD = "pos_embd"                       # (n_ctx_train, d_model) f32, config positions "learned"
# Optional f32 per-head RMSNorm weights of q and k, applied before RoPE (Qwen3):
ATTN_Q_NORM = "blk.{}.attn_q_norm.weight"   # (head_dim,)
ATTN_K_NORM = "blk.{}.attn_k_norm.weight"   # (head_dim,)
# Optional f32 RMSNorm weights of the attention's and the FFN's outputs, before each is added to the
# residual stream (Gemma 2/3); the FFN's is applied by the next layer's graph (or the head's):
ATTN_POST_NORM = "blk.{}.post_attention_norm.weight"   # (d_model,)
FFN_POST_NORM = "blk.{}.post_ffw_norm.weight"          # (d_model,)
# --quant mixed splits a layer's bundles: the hot prefix (header ffn.hot_rows[i] neurons, f16) stays
# in FFN_GATE_UP / FFN_DOWN_T, the remaining rows (q4) follow in these:
FFN_GATE_UP_COLD = "blk.{}.ffn_gate_up_cold"
FFN_DOWN_T_COLD = "blk.{}.ffn_down_t_cold"
FFN_PRED_W1 = "blk.{}.ffn_pred_w1"          # (rank, d_model) q8 or q4: predictor x -> relu(W1 x)
FFN_PRED_W2 = "blk.{}.ffn_pred_w2"          # (n_ff, rank), W1's format: scores = W2 relu(W1 x) + b2, file order
FFN_PRED_B2 = "blk.{}.ffn_pred_b2"          # (n_ff,) f32
FFN_FREQ = "ffn_freq"                       # (n_layer, n_ff) f32 calibrated activation frequency,
                                            # file order (sorted hottest first in reordered layers)
ROPE_FREQS = "rope_freqs"                  # (rotary_dim/2,) Llama 3 frequency divisors, optional

# Sparsity modes a layer can run in (header "layers"[i]["mode"], with "value"):
#   dense      every neuron
#   down       all gate/up rows; the down rows of neurons with |act(gate)*up| < thresholds[value]
#   predicted  gate/up rows of the predictor's candidates (score >= the threshold calibrated for the
#              mass-recall target `value`); among them the down rule at header sparsity.predictor_sparsity
#   relu       candidates as predicted; among them h != 0 (exact for ReLU-family models)
# and, at run time only, given: the candidates a caller supplies (benchmarks' synthetic active
# sets, the CPU's cold half of a split layer), among them the down rule.


@dataclass(frozen=True)
class Mode:
    """What a sparsity mode computes: the one table every part of pinfer reads."""
    code: int           # its number in the C and CUDA kernels (MODE_* in pinfer/kernels/csrc/codes.h)
    candidates: str     # the neurons considered: "all", the "predictor"'s, or those "given"
    rule: str           # which of them reach the down projection: "all", "threshold" (|h| >= t), "nonzero"

    @property
    def uses_predictor(self):
        return self.candidates == "predictor"


MODES = {
    "dense": Mode(0, "all", "all"),
    "down": Mode(1, "all", "threshold"),
    "predicted": Mode(2, "predictor", "threshold"),
    "relu": Mode(3, "predictor", "nonzero"),
    "given": Mode(4, "given", "threshold"),
}
SPARSITY_MODES = tuple(m for m, spec in MODES.items() if spec.candidates != "given")   # what a file holds


def parse_mode(text):
    """(mode, value or None) from "MODE" or "MODE:VALUE": the one grammar of a sparsity mode, for
    the converter's --sparsity (which also checks the value against what it calibrates) and the
    runtime's. Raises ValueError with a sentence."""
    mode, colon, value = str(text).partition(":")
    if mode not in SPARSITY_MODES:
        raise ValueError(f"sparsity {text!r} is not one of {', '.join(SPARSITY_MODES)} "
                         "(with an optional :VALUE, e.g. down:0.3)")
    if not colon:
        return mode, None
    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"sparsity {text!r}: {value!r} is not a number") from None
    if mode != "dense" and not 0 < v < 1:
        raise ValueError(f"sparsity {text!r}: the value must lie strictly between 0 and 1")
    return mode, v

# Names of the graphs the runtime builds: one per layer plus the head.
LAYER_GRAPH = "layer.{}"
HEAD_GRAPH = "head"

# ONNX initializers that live in the .pinf point at it through this external-data location; the
# runtime binds them to views of the memory map, so the name is a placeholder, never a path.
EXTERNAL_LOCATION = "pinf:"


def part_name(base, part):
    return f"{base}.{part}"


def align(n, a=ALIGNMENT):
    return (n + a - 1) // a * a


class PinfFormatError(ValueError):
    """The one error the reader raises: a sentence saying what was found and what to do."""


MAX_DIM = 1 << 40   # one tensor dimension; the byte count is computed exactly from the shape


def header_problem(h):
    """What is wrong with the types and bounds of a header (a dict with HEADER_KEYS), or None:
    checked before anything uses it, so that a damaged header with a valid checksum (or a
    hand-made one) is one sentence, never an exception deep inside the runtime."""
    from .config import ModelConfig

    types = {"config": dict, "tokenizer": dict, "weights": dict, "ffn": dict, "sparsity": dict, "layers": list,
             "plan": dict, "provenance": dict, "tensors": dict}
    for key, typ in types.items():
        if not isinstance(h[key], typ):
            return f"the header's {key!r} is {type(h[key]).__name__}, not {typ.__name__}"
    try:
        cfg = ModelConfig.from_dict(h["config"])
    except (ValueError, TypeError) as e:
        return str(e)
    for base, fmt in h["weights"].items():
        if fmt not in BLOCK_FORMATS:
            return f"the weight {base!r} has unknown block format {str(fmt)[:20]!r}"
    problem = weights_problem(h, cfg)
    if problem:
        return problem
    layers = h["layers"]
    if layers and (len(layers) != cfg.n_layer or not all(
            isinstance(x, dict) and x.get("mode", "dense") in SPARSITY_MODES
            and isinstance(x.get("value", 0.0), (int, float)) and not isinstance(x.get("value", 0.0), bool)
            for x in layers)):
        return f"the header's layers are not {cfg.n_layer} entries of a sparsity mode and its value"
    tok = h["tokenizer"]
    tokens = tok.get("tokens")
    if not isinstance(tok.get("model"), str) or not isinstance(tokens, list) or not tokens \
            or len(tokens) > cfg.vocab or not all(isinstance(t, str) for t in tokens):
        return f"the tokenizer is malformed (it needs a model name and up to {cfg.vocab} token strings)"
    problem = _tokenizer_problem(tok)
    if problem:
        return f"the tokenizer is malformed ({problem})"
    hot = h["ffn"].get("hot_rows")
    if hot is not None and not (isinstance(hot, list) and all(isinstance(k, int) and not isinstance(k, bool)
                                                               for k in hot)):
        return "the header's ffn.hot_rows is not a list of whole numbers"
    return None


ROW_FORMATS = ("q4r", "q8r")     # groups along rows: only the down projection's neuron-major rows


def _vectors(cfg):
    """name -> exact shape of every f32 tensor the runtime reads besides the block weights (the
    optional ones are checked when present)."""
    d, hd, n_ff = cfg.d_model, cfg.head_dim, cfg.n_ff
    per = 2 if cfg.ffn_gated else 1
    out = {OUTPUT_NORM: [d], OUTPUT_NORM_BIAS: [d], ROPE_FREQS: [cfg.rotary_dim // 2], FFN_FREQ: [cfg.n_layer, n_ff],
           POS_EMBD: [cfg.n_ctx_train, d]}
    for i in range(cfg.n_layer):
        out |= {ATTN_NORM.format(i): [d], FFN_NORM.format(i): [d], ATTN_NORM_BIAS.format(i): [d],
                FFN_NORM_BIAS.format(i): [d], ATTN_QKV_BIAS.format(i): [(cfg.n_head + 2 * cfg.n_head_kv) * hd],
                ATTN_OUT_BIAS.format(i): [d], FFN_GATE_UP_BIAS.format(i): [n_ff, per], FFN_DOWN_BIAS.format(i): [d],
                ATTN_Q_NORM.format(i): [hd], ATTN_K_NORM.format(i): [hd], ATTN_POST_NORM.format(i): [d],
                FFN_POST_NORM.format(i): [d], FFN_PRED_B2.format(i): [n_ff]}
    return out


def _rows(tensors, base, fmt, missing):
    """The first dimension of the first part of block weight `base` in `fmt`, or `missing`."""
    e = tensors.get(part_name(base, BLOCK_FORMATS[fmt][0])) if fmt in BLOCK_FORMATS else None
    return e["shape"][0] if isinstance(e, dict) and e["shape"] else missing


def _matrices(cfg, weights, tensors):
    """base -> (rows, k, per) of every block-format weight the file holds, as the config implies
    (per: a bundle's rows per neuron, None for a plain matrix), or a problem sentence."""
    d, hd, n_ff = cfg.d_model, cfg.head_dim, cfg.n_ff
    per = 2 if cfg.ffn_gated else 1
    out = {TOKEN_EMBD: (cfg.vocab, d, None), OUTPUT: (cfg.vocab, d, None)}
    for i in range(cfg.n_layer):
        out[ATTN_QKV.format(i)] = ((cfg.n_head + 2 * cfg.n_head_kv) * hd, d, None)
        out[ATTN_OUT.format(i)] = (d, cfg.n_head * hd, None)
        hot = n_ff
        if FFN_GATE_UP_COLD.format(i) in weights:      # --quant mixed: a hot prefix (its rows), the rest cold
            hot = _rows(tensors, FFN_GATE_UP.format(i), weights.get(FFN_GATE_UP.format(i)), -1)
            if not 0 < hot < n_ff:
                return f"layer {i}'s hot FFN part holds {hot} of its {n_ff} neurons"
            out[FFN_GATE_UP_COLD.format(i)] = (n_ff - hot, d, per)
            out[FFN_DOWN_T_COLD.format(i)] = (n_ff - hot, d, None)
        out[FFN_GATE_UP.format(i)] = (hot, d, per)
        out[FFN_DOWN_T.format(i)] = (hot, d, None)
        if FFN_PRED_W1.format(i) in weights:
            rank = _rows(tensors, FFN_PRED_W1.format(i), weights[FFN_PRED_W1.format(i)], 0)
            out[FFN_PRED_W1.format(i)] = (rank, d, None)
            out[FFN_PRED_W2.format(i)] = (n_ff, rank, None)
    return out


def weights_problem(h, cfg):
    """What is wrong with the file's weights for the model its config describes, or None: every
    block-format weight has every part of its format, in the dtype and the exact shape that the
    config implies, and every f32 tensor the runtime reads has its shape. Checked when the file is
    opened, so no kernel, ONNX Runtime session or NumPy view meets a tensor of another size."""
    weights, tensors = h["weights"], h["tensors"]
    required = [TOKEN_EMBD] + ([] if cfg.tied_embeddings else [OUTPUT]) + [
        name.format(i) for i in range(cfg.n_layer) for name in (ATTN_QKV, ATTN_OUT, FFN_GATE_UP, FFN_DOWN_T)]
    missing = [b for b in required if b not in weights]
    if missing:
        return f"the weight {missing[0]!r} is missing"
    for name in [OUTPUT_NORM] + [n.format(i) for i in range(cfg.n_layer) for n in (ATTN_NORM, FFN_NORM)]:
        if name not in tensors:
            return f"the tensor {name!r} is missing"
    expected = _matrices(cfg, weights, tensors)
    if isinstance(expected, str):
        return expected
    downs = {name.format(i) for i in range(cfg.n_layer) for name in (FFN_DOWN_T, FFN_DOWN_T_COLD)}
    for base, fmt in weights.items():
        if base not in expected:
            return f"the weight {base[:60]!r} is not one a model of this configuration has"
        rows, k, per = expected[base]
        row_format = fmt in ROW_FORMATS
        if row_format and base not in downs:
            return f"the weight {base!r} is in {fmt}, a format only the down projection's rows use"
        groups_ok = (rows % GROUP == 0) if row_format else (k % GROUP == 0 or fmt in ("f16", "f32"))
        if rows <= 0 or not groups_ok:
            return f"the weight {base!r} ({rows}, {k}) cannot be held in {fmt}"
        for part, (dtype, shape) in block_parts(fmt, rows, k).items():
            e = tensors.get(part_name(base, part))
            if e is None:
                if part in OPTIONAL_PARTS:
                    continue
                return f"the tensor {part_name(base, part)!r} of the {fmt} weight {base!r} is missing"
            want = [rows, per, *block_parts(fmt, 1, k)[part][1][1:]] if per else list(shape)
            if e["dtype"] != dtype or e["shape"] != want:
                return (f"the tensor {part_name(base, part)!r} is {e['dtype']} {e['shape']}; the model's "
                        f"configuration needs {dtype} {want}")
    for name, shape in _vectors(cfg).items():
        e = tensors.get(name)
        if e is not None and (e["dtype"] != "f32" or e["shape"] != shape):
            return f"the tensor {name!r} is {e['dtype']} {e['shape']}; the model's configuration needs f32 {shape}"
    return None


def _tokenizer_problem(tok):
    """What is wrong with the types of the tokenizer's fields besides its tokens, or None."""
    n = len(tok["tokens"])
    is_int = lambda v: isinstance(v, int) and not isinstance(v, bool)     # noqa: E731
    for key in ("bos_id", "eos_id", "eot_id", "eom_id", "unk_id", "pad_id"):
        v = tok.get(key)
        if v is not None and not (is_int(v) and 0 <= v < n):
            return f"{key} is not a token id"
    for key in ("pre", "chat_template", "hf_tokenizer"):
        if tok.get(key) is not None and not isinstance(tok[key], str):
            return f"{key} is not text"
    for key in ("add_bos", "add_eos", "add_space_prefix"):
        if tok.get(key) is not None and not isinstance(tok[key], bool):
            return f"{key} is not true or false"
    lists = {"token_type": is_int, "merges": lambda v: isinstance(v, str),
             "scores": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}
    for key, ok in lists.items():
        v = tok.get(key)
        if (v is not None or (key == "token_type" and key in tok)) and not (isinstance(v, list) and all(ok(x) for x in v)
                                  and (key == "merges" or len(v) == n)):
            return f"{key} is not a list of {n} entries of its type" if key != "merges" else "merges is not text"
    return None
