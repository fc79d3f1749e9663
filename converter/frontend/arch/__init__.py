"""Architecture registry: a source architecture name -> the module that maps it (mlx-lm style).

Each module provides, as data, `TENSORS`: pinfer roles -> canonical (GGUF-style) tensor names, and
hooks: `config_from_gguf(meta, tensor_names) -> ModelConfig` for GGUF files and, for Hugging Face
folders, `config_from_hf(config_json) -> ModelConfig` and `hf_tensors(config_json, cfg)`, the
canonical names -> (Hugging Face name, transform or None). Roles in OPTIONAL are used when the
source has them (biases, learned positions, an untied LM head) and are absent from `roles()`
otherwise."""

import importlib

# GGUF general.architecture -> module name in this package
ARCHS = {
    "llama": "llama",
    "mistral": "llama",  # GGUF mistral files that keep their own name are llama-shaped
    "qwen2": "llama",    # q/k/v biases; rotate-half RoPE (llama.cpp's NEOX: Q/K rows not permuted)
    "qwen3": "llama",    # per-head q/k RMSNorm; rotate-half RoPE
    "phi3": "phi3",      # fused qkv and gate/up projections; rotate-half RoPE
    "gemma2": "gemma",   # GeGLU, post-norms, soft-capping, alternating windowed layers
    "gemma3": "gemma",   # GeGLU, post-norms, q/k norms, 5:1 windowed layers with their own RoPE base
}

# Hugging Face config.json model_type -> module name in this package
HF_ARCHS = {
    "llama": "llama",      # Llama 2/3, SmolLM2, TinyLlama; ReluLLaMA (relu), ProSparse (fatrelu)
    "mistral": "llama",    # sliding-window attention
    "qwen2": "llama",      # q/k/v biases
    "qwen3": "llama",      # per-head q/k RMSNorm, head_dim apart from hidden_size / heads
    "phi3": "phi3",        # fused qkv_proj and gate_up_proj; partial rotary
    "gemma2": "gemma",     # GeGLU, post-norms, soft-capping, alternating windowed layers
    "gemma3_text": "gemma",  # Gemma 3's text model (the multimodal gemma3 folders are refused)
    "bamboo": "llama",     # dReLU: relu on gate and on up
    "opt": "opt",          # LayerNorm, biases, learned positions, relu FFN without a gate
}

OPTIONAL = frozenset({
    "output", "rope_freqs", "pos_embd", "output_norm_bias",
    "attn_norm_bias", "attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias",
    "ffn_norm_bias", "ffn_gate_bias", "ffn_up_bias", "ffn_down_bias", "attn_q_norm", "attn_k_norm",
})


class UnsupportedArchitecture(ValueError):
    pass


def supported():
    return sorted(ARCHS)


def get(name):
    if name not in ARCHS:
        raise UnsupportedArchitecture(
            f"the model's architecture is {name!r}, which pinfer cannot convert; "
            f"supported architectures: {', '.join(supported())}")
    return importlib.import_module(f".{ARCHS[name]}", __name__)


def get_hf(model_type, architectures=()):
    if model_type not in HF_ARCHS:
        named = f" ({', '.join(map(str, architectures))})" if architectures else ""
        raise UnsupportedArchitecture(
            f"the model's architecture is {model_type!r}{named}, which pinfer cannot convert; "
            f"supported Hugging Face model types: {', '.join(sorted(HF_ARCHS))}")
    return importlib.import_module(f".{HF_ARCHS[model_type]}", __name__)


def roles(tensors, names, cfg):
    """The role -> name map the converter uses: required roles always (a missing one is then
    reported by name), optional ones and the gate only where the source has them."""
    def present(role):
        return tensors[role].format(0) in names
    out = {}
    for role, name in tensors.items():
        if role == "ffn_gate" and not cfg.ffn_gated:
            continue
        if role in OPTIONAL and not present(role):
            continue
        out[role] = name
    return out
