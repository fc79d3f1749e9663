"""Back end: the dense ONNX graphs, one per layer and one for the head (docs/design.md §4).

Weights are not inside the graphs: each initializer is a placeholder whose external-data location
is schema.EXTERNAL_LOCATION and whose name is a tensor of the `.pinf` directory; the runtime binds
it to a view of the memory map. Block formats become ONNX Runtime contrib ops:
  q4  -> MatMulNBits(bits=4) (default zero point 8), plus sum_blocks(x) @ (min + 8*scale)^T when
         the weight has a min (GGUF Q4_1); the extra term is exact and reads K/32 values per row;
  q8  -> MatMulNBits(bits=8) (default zero point 128: .pinf stores q8 offset by 128);
  f16/f32 -> MatMul with the transposed weight (f16 cast to f32; both folded at session load).
"""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from pinfer.formats import schema as S

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
IR_VERSION = 10  # onnxruntime 1.2x/1.3x accept up to 10-13; onnx 1.23 writes 14 by default
F32 = TensorProto.FLOAT
ACCURACY_LEVEL = 4  # MatMulNBits quantizes activations to int8 per block, as llama.cpp does

_ONNX_DTYPE = {"u8": TensorProto.UINT8, "i8": TensorProto.INT8, "f16": TensorProto.FLOAT16,
               "f32": TensorProto.FLOAT, "i32": TensorProto.INT32}


class GraphBuilder:
    def __init__(self, name, directory):
        self.name = name
        self.directory = directory   # tensor name -> {"dtype", "shape", ...} of the .pinf
        self.nodes, self.inits, self.inputs, self.outputs = [], [], [], []
        self._bound = set()
        self._n = 0

    def tmp(self, hint):
        self._n += 1
        return f"{hint}_{self._n}"

    def node(self, op, inputs, n_out=1, domain="", **attrs):
        outs = [self.tmp(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, domain=domain, **attrs))
        return outs[0] if n_out == 1 else outs

    def weight(self, name):
        """A placeholder initializer for the .pinf tensor `name`."""
        if name not in self._bound:
            e = self.directory[name]
            t = TensorProto(name=name, data_type=_ONNX_DTYPE[e["dtype"]], dims=e["shape"])
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", S.EXTERNAL_LOCATION), ("offset", "0"), ("length", str(e["nbytes"]))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            self.inits.append(t)
            self._bound.add(name)
        return name

    def const(self, array, hint="c"):
        name = self.tmp(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def input(self, name, elem, shape):
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    def output(self, value, name, elem, shape):
        self.nodes.append(helper.make_node("Identity", [value], [name]))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))

    def f32(self, name):
        e = self.directory[name]
        return self.weight(name) if e["dtype"] == "f32" else self.node("Cast", [self.weight(name)], to=F32)

    def linear(self, x, base, fmt, rows, k):
        """x (1, S, k) @ W^T for the block-format weight `base` of shape (rows, k) -> (1, S, rows)."""
        part = lambda p: S.part_name(base, p)  # noqa: E731
        if fmt in ("f16", "f32"):
            w = self.node("Reshape", [self.f32(part("w")), self.const(np.array([rows, k]))])
            return self.node("MatMul", [x, self.node("Transpose", [w], perm=[1, 0])])
        bits = {"q4": 4, "q8": 8}[fmt]
        nb = k // S.GROUP
        q = self.node("Reshape", [self.weight(part("q")), self.const(np.array([rows, nb, S.GROUP * bits // 8]))])
        scale = self.node("Reshape", [self.f32(part("scale")), self.const(np.array([rows, nb]))])
        y = self.node("MatMulNBits", [x, q, scale], domain="com.microsoft",
                      K=k, N=rows, bits=bits, block_size=S.GROUP, accuracy_level=ACCURACY_LEVEL)
        if fmt == "q4" and part("min") in self.directory:
            # value = scale*q + min = scale*(q - 8) + (min + 8*scale)
            mins = self.node("Reshape", [self.f32(part("min")), self.const(np.array([rows, nb]))])
            offset = self.node("Add", [mins, self.node("Mul", [scale, self.const(np.float32(8))])])
            sums = self.node("ReduceSum", [self.node("Reshape", [x, self.const(np.array([1, -1, nb, S.GROUP]))]),
                                           self.const(np.array([-1]))], keepdims=0)
            y = self.node("Add", [y, self.node("MatMul", [sums, self.node("Transpose", [offset], perm=[1, 0])])])
        return y

    def build(self):
        g = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, initializer=self.inits)
        m = helper.make_model(g, opset_imports=OPSETS, producer_name="pinfer")
        m.ir_version = IR_VERSION
        return m


def bundle_rows(directory, base):
    """Neurons held by the bundle tensor `base` (its parts' first dimension)."""
    return next(e["shape"][0] for name, e in directory.items() if name.rsplit(".", 1)[0] == base)


def norm_skip(b, cfg, x, skip, gamma, beta):
    """(normed, x + skip) with the model's norm: RMSNorm, or LayerNorm when cfg.norm == "layer"."""
    if cfg.norm == "layer":
        out = b.node("SkipLayerNormalization", [x, skip, b.weight(gamma), b.weight(beta)], n_out=4,
                     domain="com.microsoft", epsilon=cfg.norm_eps)
    else:
        out = b.node("SkipSimplifiedLayerNormalization", [x, skip, b.weight(gamma)], n_out=4,
                     domain="com.microsoft", epsilon=cfg.norm_eps)
    return out[0], out[3]


def add_bias(b, y, name):
    """y + the f32 vector `name` when the file has it (biased models), else y."""
    return b.node("Add", [y, b.weight(name)]) if name in b.directory else y


def ffn_hidden(b, cfg, layer, x, weights):
    """h (1, S, n_ff) of the FFN input x: act(gate)*up, or act(up) without a gate (OPT)."""
    gu_base, cold_base = S.FFN_GATE_UP.format(layer), S.FFN_GATE_UP_COLD.format(layer)
    per = 2 if cfg.ffn_gated else 1
    d, n_ff = cfg.d_model, cfg.n_ff
    if cold_base in weights:    # --quant mixed: hot rows f16, then cold rows q4, neurons in order
        hot = bundle_rows(directory=b.directory, base=gu_base)
        gu = b.node("Concat", [b.linear(x, gu_base, weights[gu_base], per * hot, d),
                               b.linear(x, cold_base, weights[cold_base], per * (n_ff - hot), d)], axis=2)
    else:
        gu = b.linear(x, gu_base, weights[gu_base], per * n_ff, d)  # (1, S, 2 n_ff): g0 u0 g1 u1 ...
    bias = S.FFN_GATE_UP_BIAS.format(layer)
    if bias in b.directory:
        gu = b.node("Add", [gu, b.node("Reshape", [b.weight(bias), b.const(np.array([-1]))])])
    if not cfg.ffn_gated:
        return _act(b, cfg, gu)
    gate, up = b.node("Split", [b.node("Reshape", [gu, b.const(np.array([1, -1, n_ff, 2]))])],
                      n_out=2, axis=3, num_outputs=2)
    if cfg.ffn_act == "drelu":
        up = b.node("Relu", [up])
    return b.node("Reshape", [b.node("Mul", [_act(b, cfg, gate), up]), b.const(np.array([1, -1, n_ff]))])


def _act(b, cfg, g):
    if cfg.ffn_act == "silu":
        return b.node("Mul", [g, b.node("Sigmoid", [g])])
    if cfg.ffn_act == "fatrelu":   # g where g > threshold, else 0
        keep = b.node("Greater", [g, b.const(np.float32(cfg.ffn_act_threshold))])
        return b.node("Where", [keep, g, b.const(np.float32(0))])
    return b.node("Relu", [g])      # relu, drelu


def layer_graph(cfg, layer, weights, directory):
    """Layer `layer`: (resid, delta) -> (resid_out, ffn_h, ffn_x); delta is the previous FFN's output.

    resid_out = resid + delta + attention(...) (+ the down projection's bias); ffn_h (1, S, n_ff)
    = act(gate)*up, the input of the down projection, which pinfer's kernels compute from the
    neuron-major ffn_down_t."""
    b = GraphBuilder(S.LAYER_GRAPH.format(layer), directory)
    d, hd, hkv = cfg.d_model, cfg.head_dim, cfg.n_head_kv
    n_qkv = (cfg.n_head + 2 * hkv) * hd
    resid = b.input("resid", F32, [1, "S", d])
    delta = b.input("delta", F32, [1, "S", d])
    past_k = b.input("past_key", F32, [1, hkv, "T", hd])
    past_v = b.input("past_value", F32, [1, hkv, "T", hd])
    seqlens = b.input("seqlens_k", TensorProto.INT32, [1])
    total = b.input("total_len", TensorProto.INT32, [])
    cos = b.input("cos_cache", F32, ["C", cfg.rotary_dim // 2])
    sin = b.input("sin_cache", F32, ["C", cfg.rotary_dim // 2])

    x, r1 = norm_skip(b, cfg, delta, resid, S.ATTN_NORM.format(layer), S.ATTN_NORM_BIAS.format(layer))
    qkv_base = S.ATTN_QKV.format(layer)
    qkv = add_bias(b, b.linear(x, qkv_base, weights[qkv_base], n_qkv, d), S.ATTN_QKV_BIAS.format(layer))
    rope = cfg.positions == "rope"
    attrs = dict(num_heads=cfg.n_head, kv_num_heads=hkv, do_rotary=int(rope),
                 rotary_interleaved=int(cfg.rope_interleaved))
    if cfg.sliding_window:
        attrs["local_window_size"] = cfg.sliding_window
    attn, pk, pv = b.node("GroupQueryAttention",
                          [qkv, "", "", past_k, past_v, seqlens, total] + ([cos, sin] if rope else []),
                          n_out=3, domain="com.microsoft", **attrs)
    o_base = S.ATTN_OUT.format(layer)
    o = add_bias(b, b.linear(attn, o_base, weights[o_base], d, cfg.n_head * hd), S.ATTN_OUT_BIAS.format(layer))
    x2, r2 = norm_skip(b, cfg, o, r1, S.FFN_NORM.format(layer), S.FFN_NORM_BIAS.format(layer))
    h = ffn_hidden(b, cfg, layer, x2, weights)

    b.output(add_bias(b, r2, S.FFN_DOWN_BIAS.format(layer)), "resid_out", F32, [1, "S", d])
    b.output(h, "ffn_h", F32, [1, "S", cfg.n_ff])
    b.output(x2, "ffn_x", F32, [1, "S", d])     # the FFN input, for the predictors
    b.output(pk, "present_key", F32, [1, hkv, "T", hd])
    b.output(pv, "present_value", F32, [1, hkv, "T", hd])
    return b.build()


def head_graph(cfg, weights, directory):
    """(resid, delta) of the last layer -> logits (1, S, vocab)."""
    b = GraphBuilder(S.HEAD_GRAPH, directory)
    resid = b.input("resid", F32, [1, "S", cfg.d_model])
    delta = b.input("delta", F32, [1, "S", cfg.d_model])
    x, _ = norm_skip(b, cfg, delta, resid, S.OUTPUT_NORM, S.OUTPUT_NORM_BIAS)
    base = S.TOKEN_EMBD if cfg.tied_embeddings else S.OUTPUT
    logits = b.linear(x, base, weights[base], cfg.vocab, cfg.d_model)
    b.output(logits, "logits", F32, [1, "S", cfg.vocab])
    return b.build()


def serialize(model):
    # onnx.checker insists that external data be a readable file, which the placeholders are
    # not; ONNX Runtime validates each graph when the converter's verification step loads it.
    return model.SerializeToString()
