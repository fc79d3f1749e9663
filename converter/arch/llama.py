"""LLaMA family (Llama 2/3, SmolLM2, TinyLlama, Mistral): GQA, RMSNorm, SwiGLU, RoPE.

GGUF stores attn_q/attn_k rows permuted for GGML's "normal" RoPE, which rotates adjacent pairs
(2i, 2i+1); the graphs therefore use interleaved RoPE and no rows are moved here."""

from pinfer.formats.config import ModelConfig

# pinfer role -> GGUF tensor name ("{}" is the layer index)
TENSORS = {
    "token_embd": "token_embd.weight",       # (vocab, d_model)
    "output": "output.weight",               # (vocab, d_model), absent when tied
    "output_norm": "output_norm.weight",     # (d_model,)
    "rope_freqs": "rope_freqs.weight",       # (rotary_dim/2,) Llama 3 frequency divisors, optional
    "attn_norm": "blk.{}.attn_norm.weight",  # (d_model,)
    "attn_q": "blk.{}.attn_q.weight",        # (n_head*head_dim, d_model)
    "attn_k": "blk.{}.attn_k.weight",        # (n_head_kv*head_dim, d_model)
    "attn_v": "blk.{}.attn_v.weight",        # (n_head_kv*head_dim, d_model)
    "attn_output": "blk.{}.attn_output.weight",  # (d_model, n_head*head_dim)
    "ffn_norm": "blk.{}.ffn_norm.weight",    # (d_model,)
    "ffn_gate": "blk.{}.ffn_gate.weight",    # (n_ff, d_model)
    "ffn_up": "blk.{}.ffn_up.weight",        # (n_ff, d_model)
    "ffn_down": "blk.{}.ffn_down.weight",    # (d_model, n_ff)
}

ACTIVATION_KEY = "pinfer.feed_forward_activation"

# GGUF metadata key (after "{arch}.") -> config field, for the required integers and floats
KEYS = {
    "block_count": "n_layer",
    "embedding_length": "d_model",
    "feed_forward_length": "n_ff",
    "attention.head_count": "n_head",
    "context_length": "n_ctx_train",
    "attention.layer_norm_rms_epsilon": "norm_eps",
}


def config_from_gguf(meta, tensor_names):
    arch = meta["general.architecture"]
    missing = [f"{arch}.{k}" for k in KEYS if f"{arch}.{k}" not in meta]
    if missing:
        raise ValueError(f"the GGUF lacks the metadata keys {', '.join(missing)}; "
                         "it was written by an incomplete converter")
    v = {field: meta[f"{arch}.{key}"] for key, field in KEYS.items()}
    n_head = int(v["n_head"])
    head_dim = int(meta.get(f"{arch}.attention.key_length", int(v["d_model"]) // n_head))
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise ValueError(f"the model uses RoPE scaling {scaling!r}; pinfer supports none and linear")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    # GGUF has no key for the FFN activation (llama.cpp assumes SwiGLU for llama); pinfer reads its
    # own key, which HF front ends and the test fixtures for ReLU-family models set.
    ffn_act = meta.get(ACTIVATION_KEY, "silu")
    if ffn_act not in ("silu", "relu"):
        raise ValueError(f"{ACTIVATION_KEY} is {ffn_act!r}; pinfer supports silu and relu")
    return ModelConfig(
        arch=arch,
        n_layer=int(v["n_layer"]),
        d_model=int(v["d_model"]),
        n_ff=int(v["n_ff"]),
        n_head=n_head,
        n_head_kv=int(meta.get(f"{arch}.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        vocab=int(vocab),
        n_ctx_train=int(v["n_ctx_train"]),
        norm_eps=float(v["norm_eps"]),
        rope_base=float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rotary_dim=int(meta.get(f"{arch}.rope.dimension_count", head_dim)),
        rope_interleaved=True,
        rope_linear_scale=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        ffn_act=ffn_act,
        tied_embeddings=TENSORS["output"] not in tensor_names,
    )
