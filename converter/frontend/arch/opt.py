"""OPT (PowerInfer's ReLU models): pre-LayerNorm with biases, biases on every projection, learned
positions, and an FFN without a gate: h = relu(fc1 x + b1), out = fc2 h + b2.

Hugging Face's OPT looks position p up in row p + 2 of embed_positions (fairseq's padding offset);
the transform drops those two rows, so pos_embd's row p is position p."""

from pinfer.formats.config import ModelConfig

from .llama import TENSORS, expand_hf, hf_int  # noqa: F401  (the roles are the llama module's)

POSITION_OFFSET = 2

HF_TENSORS = {
    "token_embd.weight": "model.decoder.embed_tokens.weight",
    "position_embd.weight": "model.decoder.embed_positions.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.decoder.final_layer_norm.weight",
    "output_norm.bias": "model.decoder.final_layer_norm.bias",
    "blk.{}.attn_norm.weight": "model.decoder.layers.{}.self_attn_layer_norm.weight",
    "blk.{}.attn_norm.bias": "model.decoder.layers.{}.self_attn_layer_norm.bias",
    "blk.{}.attn_q.weight": "model.decoder.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_q.bias": "model.decoder.layers.{}.self_attn.q_proj.bias",
    "blk.{}.attn_k.weight": "model.decoder.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_k.bias": "model.decoder.layers.{}.self_attn.k_proj.bias",
    "blk.{}.attn_v.weight": "model.decoder.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_v.bias": "model.decoder.layers.{}.self_attn.v_proj.bias",
    "blk.{}.attn_output.weight": "model.decoder.layers.{}.self_attn.out_proj.weight",
    "blk.{}.attn_output.bias": "model.decoder.layers.{}.self_attn.out_proj.bias",
    "blk.{}.ffn_norm.weight": "model.decoder.layers.{}.final_layer_norm.weight",
    "blk.{}.ffn_norm.bias": "model.decoder.layers.{}.final_layer_norm.bias",
    "blk.{}.ffn_up.weight": "model.decoder.layers.{}.fc1.weight",
    "blk.{}.ffn_up.bias": "model.decoder.layers.{}.fc1.bias",
    "blk.{}.ffn_down.weight": "model.decoder.layers.{}.fc2.weight",
    "blk.{}.ffn_down.bias": "model.decoder.layers.{}.fc2.bias",
}


def config_from_hf(c):
    d, n_head = hf_int(c, "hidden_size"), hf_int(c, "num_attention_heads")
    if not c.get("do_layer_norm_before", True):
        raise ValueError("this OPT model normalizes after each block (do_layer_norm_before false, as "
                         "opt-350m does); pinfer supports pre-norm OPT models only")
    if int(c.get("word_embed_proj_dim") or d) != d:
        raise ValueError(f"this OPT model projects its {c['word_embed_proj_dim']}-wide embeddings to "
                         f"{d} (opt-350m); pinfer supports OPT models without that projection")
    if c.get("activation_function", "relu") != "relu":
        raise ValueError(f"config.json's activation_function is {c.get('activation_function')!r}; "
                         "pinfer supports relu for OPT models")
    if not c.get("enable_bias", True) or not c.get("layer_norm_elementwise_affine", True):
        raise ValueError("this OPT model lacks biases or LayerNorm weights; pinfer supports the "
                         "standard OPT layout only")
    return ModelConfig(
        arch="opt",
        n_layer=hf_int(c, "num_hidden_layers"),
        d_model=d,
        n_ff=hf_int(c, "ffn_dim"),
        n_head=n_head,
        n_head_kv=n_head,
        head_dim=d // n_head,
        vocab=hf_int(c, "vocab_size"),
        n_ctx_train=hf_int(c, "max_position_embeddings"),
        norm_eps=1e-5,                  # OPT's nn.LayerNorm default
        rope_base=10000.0,              # unused: positions are learned
        rotary_dim=d // n_head,
        rope_interleaved=False,
        ffn_act="relu",
        tied_embeddings=bool(c.get("tie_word_embeddings", True)),
        ffn_gated=False,
        norm="layer",
        positions="learned",
    )


def hf_tensors(c, cfg):
    """canonical name -> (Hugging Face name, transform or None)."""
    out = expand_hf(HF_TENSORS, cfg)
    hf_pos, _ = out["position_embd.weight"]
    out["position_embd.weight"] = (hf_pos, lambda a: a[POSITION_OFFSET:POSITION_OFFSET + cfg.n_ctx_train])
    return out
