"""Phi-3 (Phi-3-mini/medium 4k, Phi-3.5-mini's layout, Phi-4-mini): the llama layout with q, k and v
in one fused projection (attn_qkv: q rows, then k, then v) and gate and up in one (GGUF's ffn_up
of 2 n_ff rows, Hugging Face's gate_up_proj: gate rows, then up); rotate-half RoPE, optionally over
a leading part of each head (partial_rotary_factor); a sliding window where the config has one.

The fused tensors are offered under llama's role names as row ranges of the stored tensor (a GGUF
row range of a block-quantized tensor is whole blocks, so it is carried over exactly). Files with
LongRoPE scaling (the 128k-context variants: rope_factors_long/short) are refused."""

import dataclasses

from ..hf_source import RowSlice
from .llama import TENSORS, expand_hf  # noqa: F401  (the roles are the llama module's)
from .llama import config_from_gguf as llama_config_from_gguf
from .llama import config_from_hf as llama_config_from_hf


def _ranges(cfg):
    """role -> (fused role, first row, end row)."""
    q, kv, n = cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim, cfg.n_ff
    return {"attn_q": ("qkv", 0, q), "attn_k": ("qkv", q, q + kv), "attn_v": ("qkv", q + kv, q + 2 * kv),
            "ffn_gate": ("gate_up", 0, n), "ffn_up": ("gate_up", n, 2 * n)}


def gguf_row_splits(cfg):
    """GGUF name -> (stored name, first row, end row) for the roles held in fused tensors."""
    fused = {"qkv": "blk.{}.attn_qkv.weight", "gate_up": "blk.{}.ffn_up.weight"}
    return {TENSORS[role].format(i): (fused[f].format(i), r0, r1)
            for role, (f, r0, r1) in _ranges(cfg).items() for i in range(cfg.n_layer)}


def _refuse_longrope(kind):
    raise ValueError(f"this Phi-3 model uses {kind} RoPE scaling (a 128k-context variant); pinfer supports "
                     "the 4k-context Phi-3 models")


def config_from_gguf(meta, tensor_names):
    if "rope_factors_long.weight" in tensor_names or "rope_factors_short.weight" in tensor_names:
        _refuse_longrope("LongRoPE")
    cfg = llama_config_from_gguf(meta, tensor_names)      # rotate-half: llama.ROTATE_HALF has phi3
    return dataclasses.replace(cfg, sliding_window=int(meta.get("phi3.attention.sliding_window", 0) or 0))


HF_FUSED = {"qkv": "model.layers.{}.self_attn.qkv_proj.weight", "gate_up": "model.layers.{}.mlp.gate_up_proj.weight"}
HF_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output.weight": "lm_head.weight",
    "output_norm.weight": "model.norm.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}


def config_from_hf(c):
    rope = dict(c.get("rope_scaling") or {}) | dict(c.get("rope_parameters") or {})
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind in ("longrope", "su", "yarn"):
        _refuse_longrope(kind)
    cfg = llama_config_from_hf({k: v for k, v in c.items() if k not in ("rope_scaling", "rope_parameters")}
                               | {"rope_theta": rope.get("rope_theta") or c.get("rope_theta") or 10000.0})
    factor = float(rope.get("partial_rotary_factor") or c.get("partial_rotary_factor") or 1.0)
    window = c.get("sliding_window")
    return dataclasses.replace(cfg, arch="phi3", rotary_dim=int(cfg.head_dim * factor), sliding_window=int(window or 0))


def hf_tensors(c, cfg):
    out = expand_hf(HF_TENSORS, cfg)
    for role, (f, r0, r1) in _ranges(cfg).items():
        for i in range(cfg.n_layer):
            out[TENSORS[role].format(i)] = (HF_FUSED[f].format(i), RowSlice(r0, r1))
    return out
