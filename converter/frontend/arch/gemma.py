"""Gemma 2 and Gemma 3 (text): the llama layout plus a GeGLU FFN (tanh-approximated GELU on the
gate), RMSNorms after attention and after the FFN as well as before them, embeddings scaled by
sqrt(d_model), windowed layers alternating with global ones (Gemma 2: every other layer; Gemma 3:
five of every six, rotating with base 10000 while the global layers use the file's base and
scaling), Gemma 3's per-head q/k RMSNorm, Gemma 2's soft-capping of attention scores and logits,
and an attention scale from query_pre_attn_scalar. Rotate-half RoPE; the LM head is the embedding.

Norm weights: Gemma's RMSNorm multiplies by (1 + w); llama.cpp's converter stores w + 1 in the GGUF,
and the Hugging Face transform adds the 1, so every norm here is a plain multiplier. GGUF has no
query_pre_attn_scalar: like llama.cpp, 1/sqrt(head_dim), except the 27B models (46 and 62 layers),
which scale by 1/sqrt(d_model / n_head)."""

import dataclasses
import math

from pinfer.formats.config import ModelConfig

from .llama import HF_TENSORS as LLAMA_HF_TENSORS
from .llama import TENSORS as LLAMA_TENSORS
from .llama import config_from_gguf as llama_config_from_gguf
from .llama import expand_hf, gguf_row_splits, hf_int  # noqa: F401  (no fused tensors)

TENSORS = dict(LLAMA_TENSORS) | {
    "attn_post_norm": "blk.{}.post_attention_norm.weight",   # (d_model,) after attention
    "ffn_post_norm": "blk.{}.post_ffw_norm.weight",          # (d_model,) after the FFN
}

GGUF_PATTERN = {"gemma2": 2, "gemma3": 6}      # llama.cpp's fixed sliding-window patterns
GGUF_LOCAL_BASE = {"gemma3": 10000.0}
BIG_27B = {("gemma2", 46), ("gemma3", 62)}


def config_from_gguf(meta, tensor_names):
    arch = meta["general.architecture"]
    cfg = llama_config_from_gguf(meta, tensor_names)
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    scale = 1 / math.sqrt(cfg.d_model / cfg.n_head) if (arch, cfg.n_layer) in BIG_27B else 0.0
    return dataclasses.replace(
        cfg, ffn_act="gelu", tied_embeddings=True, sliding_window=window,
        sliding_pattern=GGUF_PATTERN[arch] if window else 0, rope_base_local=GGUF_LOCAL_BASE.get(arch, 0.0),
        embed_scale=math.sqrt(cfg.d_model), attn_scale=scale,
        attn_softcap=float(meta.get(f"{arch}.attn_logit_softcapping", 0.0) or 0.0),
        final_softcap=float(meta.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0))


# llama's names, but for the norm before the FFN, plus the norms after attention and the FFN
HF_TENSORS = LLAMA_HF_TENSORS | {
    "blk.{}.ffn_norm.weight": "model.layers.{}.pre_feedforward_layernorm.weight",
    "blk.{}.post_attention_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.post_ffw_norm.weight": "model.layers.{}.post_feedforward_layernorm.weight",
}


def _plus_one(a):
    return a.astype("float32") + 1.0


def _pattern(layer_types):
    """The N of "windowed unless (i + 1) % N == 0" that layer_types follows (0: all windowed)."""
    kinds = [t == "sliding_attention" for t in layer_types]
    if all(kinds):
        return 0
    for n in range(1, len(kinds) + 1):
        if kinds == [(i + 1) % n != 0 for i in range(len(kinds))]:
            return n
    raise ValueError(f"config.json's layer_types {layer_types[:8]} do not repeat a sliding/full pattern that "
                     "ends each period with a full-attention layer; pinfer supports Gemma's patterns")


def _rope(params, c, what):
    """(base, linear factor) of one rope parameter set."""
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ("default", "linear"):
        raise ValueError(f"the model's {what} layers use RoPE scaling {kind!r}; pinfer supports none and linear "
                         "for Gemma")
    base = float(params.get("rope_theta") or c.get("rope_theta") or 10000.0)
    return base, float(params.get("factor") or 1.0) if kind == "linear" else 1.0


def config_from_hf(c):
    model_type = c.get("model_type")
    act = c.get("hidden_activation") or c.get("hidden_act")
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"config.json's hidden_activation is {act!r}; pinfer supports gelu_pytorch_tanh for "
                         f"{model_type} models")
    n_layer = hf_int(c, "num_hidden_layers")
    types = c.get("layer_types") or [
        "full_attention" if (i + 1) % (2 if model_type == "gemma2" else 6) == 0 else "sliding_attention"
        for i in range(n_layer)]
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if "full_attention" in rope:        # Gemma 3: one set per layer type
        base, factor = _rope(rope["full_attention"], c, "global")
        local = _rope(rope.get("sliding_attention", {}), c, "windowed")[0]
    else:
        (base, factor), local = _rope(rope, c, "every"), 0.0
    if float(c.get("rope_local_base_freq") or 0.0):
        local = float(c["rope_local_base_freq"])
    d, n_head = hf_int(c, "hidden_size"), hf_int(c, "num_attention_heads")
    head_dim = int(c.get("head_dim") or d // n_head)
    window = int(c.get("sliding_window") or 0)
    return ModelConfig(
        arch=model_type, n_layer=n_layer, d_model=d, n_ff=hf_int(c, "intermediate_size"), n_head=n_head,
        n_head_kv=int(c.get("num_key_value_heads") or n_head), head_dim=head_dim, vocab=hf_int(c, "vocab_size"),
        n_ctx_train=hf_int(c, "max_position_embeddings"), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_base=base, rotary_dim=head_dim, rope_interleaved=False, rope_linear_scale=factor, ffn_act="gelu",
        tied_embeddings=bool(c.get("tie_word_embeddings", True)), sliding_window=window,
        sliding_pattern=_pattern(types) if window else 0, rope_base_local=local if window else 0.0,
        embed_scale=math.sqrt(d), attn_scale=float(c.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_softcap=float(c.get("attn_logit_softcapping") or 0.0),
        final_softcap=float(c.get("final_logit_softcapping") or 0.0))


def hf_tensors(c, cfg):
    out = expand_hf(HF_TENSORS, cfg)
    return {k: (hf, _plus_one if k.endswith("norm.weight") else t) for k, (hf, t) in out.items()}
