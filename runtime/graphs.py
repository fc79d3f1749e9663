"""The dense ONNX graphs the runtime runs, one per layer and one for the head (docs/design.md §4),
built at load from the header's config and block formats with formats/onnx_graph.py, which says how
each block format becomes ONNX Runtime ops. A `.pinf` file holds data only (format version 2): no
graph in it reaches ONNX Runtime, so a crafted file cannot ask for ops, loops or shapes of its own,
and a newer runtime runs files people already have with its newer graphs.
Weights are not inside the graphs: each initializer is a placeholder for a tensor of the file's
directory, bound by the runtime to a view of the memory map. Every tensor a graph uses is checked
against the shape the config implies when the file is opened (schema.weights_problem).
"""

import numpy as np
from onnx import TensorProto

from pinfer.formats import schema as S
from pinfer.formats.schema import PinfFormatError
from pinfer.formats.onnx_graph import F32, GraphBuilder


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
    if cfg.ffn_act == "gelu":       # GeGLU's tanh approximation (ONNX opset 20)
        return b.node("Gelu", [g], approximate="tanh")
    if cfg.ffn_act == "silu":
        return b.node("Mul", [g, b.node("Sigmoid", [g])])
    if cfg.ffn_act == "fatrelu":   # g where g > threshold, else 0
        keep = b.node("Greater", [g, b.const(np.float32(cfg.ffn_act_threshold))])
        return b.node("Where", [keep, g, b.const(np.float32(0))])
    return b.node("Relu", [g])      # relu, drelu


def rms_norm(b, cfg, x, gamma):
    """RMSNorm over the last axis of x, weight `gamma`."""
    ms = b.node("ReduceMean", [b.node("Mul", [x, x]), b.const(np.array([-1]))], keepdims=1)
    inv = b.node("Reciprocal", [b.node("Sqrt", [b.node("Add", [ms, b.const(np.float32(cfg.norm_eps))])])])
    return b.node("Mul", [b.node("Mul", [x, inv]), b.weight(gamma)])


def post_norm(b, cfg, x, gamma):
    """x normed with `gamma` where the file has it (Gemma's norms after attention and the FFN)."""
    return rms_norm(b, cfg, x, gamma) if gamma in b.directory else x


def head_rms_norm(b, cfg, x, n_heads, gamma):
    """RMSNorm of each head's head_dim values in x (1, S, n_heads * head_dim), weight `gamma`."""
    hd = cfg.head_dim
    heads = b.node("Reshape", [x, b.const(np.array([1, -1, n_heads, hd]))])
    return b.node("Reshape", [rms_norm(b, cfg, heads, gamma), b.const(np.array([1, -1, n_heads * hd]))])


def qk_norm(b, cfg, layer, qkv):
    """Qwen3's per-head RMSNorm of q and k, before RoPE (which GroupQueryAttention applies)."""
    hd, hkv = cfg.head_dim, cfg.n_head_kv
    q, k, v = b.node("Split", [qkv, b.const(np.array([cfg.n_head * hd, hkv * hd, hkv * hd]))], n_out=3, axis=2)
    q = head_rms_norm(b, cfg, q, cfg.n_head, S.ATTN_Q_NORM.format(layer))
    k = head_rms_norm(b, cfg, k, hkv, S.ATTN_K_NORM.format(layer))
    return b.node("Concat", [q, k, v], axis=2)


def layer_graph(cfg, layer, weights, directory, kv_f16=False):
    """Layer `layer`: (resid, delta) -> (resid_out, ffn_h, ffn_x); delta is the previous FFN's output.

    resid_out = resid + delta + attention(...) (+ the down projection's bias); ffn_h (1, S, n_ff)
    = act(gate)*up, the input of the down projection, which pinfer's kernels compute from the
    neuron-major ffn_down_t.

    kv_f16: the KV cache holds f16 values, the attention runs in f32 over them: the cached
    positions (total_len - S of them) are cast to f32 for GroupQueryAttention, which returns the
    whole present in f32 (not in place), and the graph outputs the S new positions' K and V in f16
    (new_key, new_value) for the runtime to write into the cache (kv.AttentionState.write_back).
    GroupQueryAttention in f16 instead (q, K, V and tables in one type) ran slower and cost
    SmolLM2 0.15% of perplexity on the wikitext test text (27.034 against 26.993 over 20
    chunks of 512); this costs it what the f16 values do."""
    b = GraphBuilder(S.LAYER_GRAPH.format(layer), directory)
    d, hd, hkv = cfg.d_model, cfg.head_dim, cfg.n_head_kv
    n_qkv = (cfg.n_head + 2 * hkv) * hd
    kv = TensorProto.FLOAT16 if kv_f16 else F32
    resid = b.input("resid", F32, [1, "S", d])
    delta = b.input("delta", F32, [1, "S", d])
    past_k = b.input("past_key", kv, [1, hkv, "T", hd])
    past_v = b.input("past_value", kv, [1, hkv, "T", hd])
    seqlens = b.input("seqlens_k", TensorProto.INT32, [1])
    total = b.input("total_len", TensorProto.INT32, [])
    cos = b.input("cos_cache", F32, ["C", cfg.rotary_dim // 2])
    sin = b.input("sin_cache", F32, ["C", cfg.rotary_dim // 2])

    if layer:       # the previous layer's FFN output, normed where the model does (Gemma)
        delta = post_norm(b, cfg, delta, S.FFN_POST_NORM.format(layer - 1))
    x, r1 = norm_skip(b, cfg, delta, resid, S.ATTN_NORM.format(layer), S.ATTN_NORM_BIAS.format(layer))
    qkv_base = S.ATTN_QKV.format(layer)
    qkv = add_bias(b, b.linear(x, qkv_base, weights[qkv_base], n_qkv, d), S.ATTN_QKV_BIAS.format(layer))
    if S.ATTN_Q_NORM.format(layer) in directory:
        qkv = qk_norm(b, cfg, layer, qkv)
    attn, pk, pv = attention(b, cfg, layer, qkv, (past_k, past_v), (seqlens, total), (cos, sin), resid, kv_f16)
    o_base = S.ATTN_OUT.format(layer)
    o = add_bias(b, b.linear(attn, o_base, weights[o_base], d, cfg.n_head * hd), S.ATTN_OUT_BIAS.format(layer))
    o = post_norm(b, cfg, o, S.ATTN_POST_NORM.format(layer))
    x2, r2 = norm_skip(b, cfg, o, r1, S.FFN_NORM.format(layer), S.FFN_NORM_BIAS.format(layer))
    h = ffn_hidden(b, cfg, layer, x2, weights)

    b.output(add_bias(b, r2, S.FFN_DOWN_BIAS.format(layer)), "resid_out", F32, [1, "S", d])
    b.output(h, "ffn_h", F32, [1, "S", cfg.n_ff])
    b.output(x2, "ffn_x", F32, [1, "S", d])     # the FFN input, for the predictors
    present = ("new_key", "new_value") if kv_f16 else ("present_key", "present_value")
    b.output(pk, present[0], kv, [1, hkv, "S" if kv_f16 else "T", hd])
    b.output(pv, present[1], kv, [1, hkv, "S" if kv_f16 else "T", hd])
    return b.build()


def attention(b, cfg, layer, qkv, past, lengths, tables, resid, kv_f16):
    """(heads' output, present K, present V) of GroupQueryAttention over qkv and the cache `past`;
    kv_f16 (layer_graph says how): the cached positions cast to f32 for it, and for present the
    call's new positions only, rounded to f16."""
    (past_k, past_v), (seqlens, total) = past, lengths
    rope = cfg.positions == "rope"
    attrs = dict(num_heads=cfg.n_head, kv_num_heads=cfg.n_head_kv, do_rotary=int(rope),
                 rotary_interleaved=int(cfg.rope_interleaved))
    if cfg.windowed(layer):
        attrs["local_window_size"] = cfg.sliding_window
    if cfg.attn_scale:
        attrs["scale"] = cfg.attn_scale
    if cfg.attn_softcap:
        attrs["softcap"] = cfg.attn_softcap
    if kv_f16:      # the cached positions, in f32: past = cache[:, :, :total_len - S]
        total64 = b.node("Reshape", [b.node("Cast", [total], to=TensorProto.INT64), b.const(np.array([1]))])
        cached = b.node("Sub", [total64, b.node("Shape", [resid], start=1, end=2)])
        zero, axis = b.const(np.array([0])), b.const(np.array([2]))
        past_k, past_v = (b.node("Cast", [b.node("Slice", [p, zero, cached, axis])], to=F32) for p in (past_k, past_v))
    attn, pk, pv = b.node("GroupQueryAttention",
                          [qkv, "", "", past_k, past_v, seqlens, total] + (list(tables) if rope else []),
                          n_out=3, domain="com.microsoft", **attrs)
    if kv_f16:      # the new positions' K and V, rounded to f16
        pk, pv = (b.node("Cast", [b.node("Slice", [p, cached, total64, axis])], to=TensorProto.FLOAT16)
                  for p in (pk, pv))
    return attn, pk, pv


def head_graph(cfg, weights, directory):
    """(resid, delta) of the last layer -> logits (1, S, vocab)."""
    b = GraphBuilder(S.HEAD_GRAPH, directory)
    resid = b.input("resid", F32, [1, "S", cfg.d_model])
    delta = b.input("delta", F32, [1, "S", cfg.d_model])
    delta = post_norm(b, cfg, delta, S.FFN_POST_NORM.format(cfg.n_layer - 1))
    x, _ = norm_skip(b, cfg, delta, resid, S.OUTPUT_NORM, S.OUTPUT_NORM_BIAS)
    base = S.TOKEN_EMBD if cfg.tied_embeddings else S.OUTPUT
    logits = b.linear(x, base, weights[base], cfg.vocab, cfg.d_model)
    if cfg.final_softcap:           # c * tanh(logits / c) (Gemma 2)
        c = b.const(np.float32(cfg.final_softcap))
        logits = b.node("Mul", [b.node("Tanh", [b.node("Div", [logits, c])]), c])
    b.output(logits, "logits", F32, [1, "S", cfg.vocab])
    return b.build()


def build(path, header, cfg, name, kv_f16=False):
    """The ModelProto of graph `name` (S.LAYER_GRAPH.format(i) or S.HEAD_GRAPH) for the file at
    `path` whose checked header is `header` (cfg: its ModelConfig; kv_f16: layer_graph's).
    Raises PinfFormatError, naming the file, when a tensor the graph needs is missing or not of the
    shape the config implies."""
    weights, directory = header["weights"], header["tensors"]
    try:
        if name == S.HEAD_GRAPH:
            return head_graph(cfg, weights, directory)
        return layer_graph(cfg, int(name.rsplit(".", 1)[1]), weights, directory, kv_f16)
    except KeyError as e:
        raise PinfFormatError(f"{path}: the tensor {e.args[0]!r} that the {name} graph needs is missing; "
                              "re-run `pinfer convert` to make a new file") from None
    except ValueError as e:
        raise PinfFormatError(f"{path}: {e}; re-run `pinfer convert` to make a new file") from None
