"""What a decode step reads: weight bytes per token, from the file's tensor directory and the
shares of FFN rows the rules read (runtime/sparse.py Counters); and what a load holds in memory."""

from pinfer.formats import schema as S

from .options import Note

_GATE_UP = (S.FFN_GATE_UP, S.FFN_GATE_UP_COLD)
_DOWN = (S.FFN_DOWN_T, S.FFN_DOWN_T_COLD)
_PREDICTOR = (S.FFN_PRED_W1, S.FFN_PRED_W2, S.FFN_PRED_B2)


def weight_bytes_per_token(reader, cfg, shares=(1.0, 1.0), predictor_layers=(), tensor_shares=None):
    """Bytes of weights one decode step reads: every layer's and the head's, one embedding row
    (the table when it is also the LM head); of the FFN rows, the shares (gate/up, down) read; the
    predictors of `predictor_layers` only; of a tensor in tensor_shares ({base name: share}, e.g.
    attention_shares()), that share."""
    kind, tensor_shares = {}, tensor_shares or {}
    for i in range(cfg.n_layer):
        for names, k in ((_GATE_UP, 0), (_DOWN, 1), (_PREDICTOR, 2 if i in predictor_layers else 3)):
            kind.update({t.format(i): k for t in names})
    total = 0.0
    for n, e in reader.tensors.items():
        if n.startswith("blk."):
            base = n if n in kind or n in tensor_shares else n.rsplit(".", 1)[0]
            k = kind.get(base)
            total += e["nbytes"] * (shares[k] if k in (0, 1) else 0.0 if k == 3 else tensor_shares.get(base, 1.0))
        elif n == S.OUTPUT_NORM or n.startswith(S.OUTPUT + "."):
            total += e["nbytes"]
    embd = sum(e["nbytes"] for n, e in reader.tensors.items() if n.startswith(S.TOKEN_EMBD + "."))
    return total + (embd if cfg.tied_embeddings else embd // cfg.vocab)


# What the process holds beside the model: Python, NumPy, ONNX Runtime and pinfer's libraries,
# thread stacks and the activation buffers (about 120 MB measured with a 7B-shaped model, whose
# RSS after decoding was 4.11 GB for 3.72 GB of weights held and 0.27 GB of KV cache).
PROCESS_BYTES = 128 << 20


def kv_cache_bytes(cfg, n_ctx, itemsize=2):
    """A KV cache of n_ctx tokens (K and V of every layer; f16: 2 bytes, the runtime's default)."""
    return 2 * cfg.n_layer * n_ctx * cfg.n_head_kv * cfg.head_dim * itemsize


def held_bytes(tensors, tied_embeddings):
    """Bytes of weights a one-copy load holds (loading.one_copy): every tensor once, but the token
    embedding where it is not also the head (its rows are read from the file's map as tokens come)."""
    return sum(e["nbytes"] for n, e in tensors.items() if tied_embeddings or not n.startswith(S.TOKEN_EMBD + "."))


def expected_bytes(tensors, tied_embeddings, kv_bytes):
    """The RAM a one-copy load is expected to take once its KV cache is in use."""
    return held_bytes(tensors, tied_embeddings) + kv_bytes + PROCESS_BYTES


def memory_note(tensors, cfg, n_ctx, kv_bytes):
    """The load's note of what a one-copy load holds and expects to take."""
    held = held_bytes(tensors, cfg.tied_embeddings)
    return Note(f"memory: the weights once, {held / 1e9:.2f} GB, and a {n_ctx}-token KV cache, {kv_bytes / 1e9:.2f} "
                f"GB: about {expected_bytes(tensors, cfg.tied_embeddings, kv_bytes) / 1e9:.2f} GB in all")


def attention_shares(model):
    """{q/k/v's or the output's weight: the share of its rows read} of the layers whose attention
    runs by columns (activation sparsity), from the inputs they kept (Counters.attn_kept) over the
    tokens the FFN counters saw since their reset (each layer's FFN counts n_ff rows a token)."""
    c, cfg = model.counters, model.cfg
    layers = sum(L.ffn is not None for L in model.layers)
    tokens = c.full / (cfg.n_ff * layers) if layers else 0
    out = {}
    if not tokens:
        return out
    for i, step in enumerate(L.native for L in model.layers):
        if step is None:
            continue
        for k, (base, width) in enumerate(((S.ATTN_QKV.format(i), cfg.d_model),
                                           (S.ATTN_OUT.format(i), cfg.n_head * cfg.head_dim))):
            if step.cols[k].q:
                out[base] = min(1.0, c.attn_kept[i, k] / (tokens * width))
    return out
