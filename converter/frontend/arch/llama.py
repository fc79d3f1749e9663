"""LLaMA family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, ReluLLaMA, ProSparse, Bamboo):
GQA, RMSNorm, a gated FFN, RoPE; Qwen2's q/k/v biases; Qwen3's per-head RMSNorm of q and k before
RoPE; Mistral's sliding window.

Q/K row order, the one place it is handled: GGUF stores attn_q/attn_k rows permuted for GGML's
"normal" RoPE, which rotates adjacent pairs (2i, 2i+1), so GGUF configs say rope_interleaved; a
Hugging Face checkpoint keeps the rotate-half order (pairs (i, i + rotary_dim/2)), so HF configs
say rope_interleaved=False. No rows are moved in either case: the graphs follow the flag."""

import numpy as np

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
    # optional (arch.OPTIONAL): used where the source has them
    "output_norm_bias": "output_norm.bias",
    "pos_embd": "position_embd.weight",      # (n_ctx_train, d_model) learned positions
    "attn_norm_bias": "blk.{}.attn_norm.bias",
    "attn_q_bias": "blk.{}.attn_q.bias",
    "attn_k_bias": "blk.{}.attn_k.bias",
    "attn_v_bias": "blk.{}.attn_v.bias",
    "attn_output_bias": "blk.{}.attn_output.bias",
    "ffn_norm_bias": "blk.{}.ffn_norm.bias",
    "ffn_gate_bias": "blk.{}.ffn_gate.bias",
    "ffn_up_bias": "blk.{}.ffn_up.bias",
    "ffn_down_bias": "blk.{}.ffn_down.bias",
    "attn_q_norm": "blk.{}.attn_q_norm.weight",   # (head_dim,) Qwen3
    "attn_k_norm": "blk.{}.attn_k_norm.weight",
}

# canonical name -> Hugging Face name ("{}" is the layer index) for LlamaForCausalLM and kin
HF_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
    "blk.{}.attn_q.bias": "model.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.bias": "model.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.bias": "model.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_output.bias": "model.layers.{}.self_attn.o_proj.bias",
    "blk.{}.ffn_gate.bias": "model.layers.{}.mlp.gate_proj.bias",
    "blk.{}.ffn_up.bias": "model.layers.{}.mlp.up_proj.bias",
    "blk.{}.ffn_down.bias": "model.layers.{}.mlp.down_proj.bias",
    "blk.{}.attn_q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "blk.{}.attn_k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
}

# Hugging Face hidden_act -> pinfer ffn_act; Bamboo's dReLU is its own model type
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu", "fatrelu": "fatrelu"}

ACTIVATION_KEY = "pinfer.feed_forward_activation"

# GGUF architectures whose converters keep Hugging Face's Q/K row order: RoPE rotates halves (what
# llama.cpp calls NEOX) rather than the adjacent pairs llama files are permuted into
ROTATE_HALF = frozenset({"qwen2", "qwen3", "phi3", "gemma2", "gemma3"})

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
    # PowerInfer's files (their predictors' fc1) hold ReLU-family models: ReluLLaMA, ProSparse
    ffn_act = meta.get(ACTIVATION_KEY, "relu" if "blk.0.fc1.weight" in tensor_names else "silu")
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
        rope_interleaved=arch not in ROTATE_HALF,
        rope_linear_scale=float(meta.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0,
        ffn_act=ffn_act,
        tied_embeddings=TENSORS["output"] not in tensor_names,
    )


def gguf_row_splits(cfg):
    """Roles held as row ranges of a fused GGUF tensor (phi3.py has them): none here."""
    return {}


def rope_from_hf(c):
    """(kind, base, scaling parameters) from a config.json: transformers 5 writes rope_parameters,
    earlier versions rope_theta and rope_scaling."""
    params = dict(c.get("rope_scaling") or {}) | dict(c.get("rope_parameters") or {})
    kind = params.get("rope_type") or params.get("type") or "default"
    base = float(params.get("rope_theta") or c.get("rope_theta") or 10000.0)
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"the model uses RoPE scaling {kind!r}; pinfer supports none, linear and llama3 "
                         "from Hugging Face folders")
    return kind, base, params


def llama3_divisors(params, base, rotary_dim):
    """Llama 3.1's per-frequency divisors (the GGUF rope_freqs tensor): frequencies whose wavelength
    exceeds the original context are divided by `factor`, short ones kept, those between blended."""
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_ctx = float(params["original_max_position_embeddings"])
    inv = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    wavelen = 2 * np.pi / inv
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    scaled = (1 - smooth) * inv / factor + smooth * inv       # 1/factor for long waves, 1 for short
    return (inv / scaled).astype(np.float32)


def hf_int(c, key, *fallbacks):
    for k in (key, *fallbacks):
        if c.get(k) is not None:
            return int(c[k])
    raise ValueError(f"config.json lacks {key!r}; it is not a complete model configuration")


def config_from_hf(c):
    model_type = c.get("model_type")
    act = "drelu" if model_type == "bamboo" else HF_ACTIVATIONS.get(c.get("hidden_act", "silu"))
    if act is None:
        raise ValueError(f"config.json's hidden_act is {c.get('hidden_act')!r}; pinfer supports "
                         f"{', '.join(sorted(HF_ACTIVATIONS))} for {model_type} models")
    kind, base, rope = rope_from_hf(c)
    d, n_head = hf_int(c, "hidden_size"), hf_int(c, "num_attention_heads")
    head_dim = int(c.get("head_dim") or d // n_head)
    window = c.get("sliding_window") if (model_type == "mistral" or c.get("use_sliding_window")) else None
    return ModelConfig(
        arch=model_type,
        n_layer=hf_int(c, "num_hidden_layers"),
        d_model=d,
        n_ff=hf_int(c, "intermediate_size"),
        n_head=n_head,
        n_head_kv=int(c.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        vocab=hf_int(c, "vocab_size"),
        n_ctx_train=hf_int(c, "max_position_embeddings"),
        norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_base=base,
        rotary_dim=head_dim,
        rope_interleaved=False,
        rope_linear_scale=float(rope.get("factor") or 1.0) if kind == "linear" else 1.0,
        ffn_act=act,
        ffn_act_threshold=float(c.get("hidden_act_param", 0.0)) if act == "fatrelu" else 0.0,
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        sliding_window=int(window or 0),
    )


def expand_hf(table, cfg):
    """A canonical -> Hugging Face name table with "{}" templates, per layer, without transforms;
    the LM head dropped when tied."""
    out = {}
    for canon, hf in table.items():
        for i in range(cfg.n_layer) if "{}" in canon else [None]:
            out[canon.format(i) if i is not None else canon] = (hf.format(i) if i is not None else hf, None)
    if cfg.tied_embeddings:
        out.pop("output.weight", None)
    return out


def hf_tensors(c, cfg):
    """canonical name -> (Hugging Face name, transform or None); a name None is computed from the
    configuration (Llama 3.1's rope_freqs)."""
    out = expand_hf(HF_TENSORS, cfg)
    kind, base, rope = rope_from_hf(c)
    if kind == "llama3":
        out["rope_freqs.weight"] = (None, lambda _: llama3_divisors(rope, base, cfg.rotary_dim))
    return out
