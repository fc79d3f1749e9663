"""The calibration model: one LLaMA-family layer at a time in PyTorch, from dequantized weights.

Only the converter's passes use this; it is built from the same source tensors as the `.pinf`
and follows the runtime's conventions (formats/config.py): GGUF row order for attn_q/attn_k,
so RoPE rotates ADJACENT pairs (2i, 2i+1) when cfg.rope_interleaved, halves otherwise; query
head h reads kv head h // (n_head / n_head_kv); RMSNorm x * rsqrt(mean(x^2) + eps) * w.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pinfer.formats import blocks


@dataclass
class LayerWeights:
    attn_norm: torch.Tensor   # (d,)
    wq: torch.Tensor          # (n_head*hd, d)
    wk: torch.Tensor          # (n_head_kv*hd, d)
    wv: torch.Tensor          # (n_head_kv*hd, d)
    wo: torch.Tensor          # (d, n_head*hd)
    ffn_norm: torch.Tensor    # (d,)
    gate: torch.Tensor        # (n_ff, d)
    up: torch.Tensor          # (n_ff, d)
    down: torch.Tensor        # (d, n_ff)


def _tensor(a):
    return torch.from_numpy(np.require(a, np.float32, ["C", "W"]))


def load_layer(src, names, i):
    """Dequantize layer i's weights; `names` maps pinfer roles to source tensor-name templates."""
    t = lambda key: _tensor(src.floats(names[key].format(i)))  # noqa: E731
    return LayerWeights(
        attn_norm=t("attn_norm").reshape(-1), wq=t("attn_q"), wk=t("attn_k"), wv=t("attn_v"),
        wo=t("attn_output"), ffn_norm=t("ffn_norm").reshape(-1), gate=t("ffn_gate"), up=t("ffn_up"),
        down=t("ffn_down"))


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


class Rotary:
    """cos/sin (T, rotary_dim/2) for positions 0..T-1, applied in the file's pair layout."""

    def __init__(self, cfg, n_pos, freq_divisors=None):
        half = cfg.rotary_dim // 2
        inv = cfg.rope_base ** (-torch.arange(half, dtype=torch.float64) * 2 / cfg.rotary_dim)
        if freq_divisors is not None:
            inv = inv / torch.as_tensor(np.asarray(freq_divisors), dtype=torch.float64)
        ang = torch.outer(torch.arange(n_pos, dtype=torch.float64) / cfg.rope_linear_scale, inv)
        self.cos, self.sin = ang.cos().float(), ang.sin().float()
        self.rot, self.interleaved = cfg.rotary_dim, cfg.rope_interleaved

    def __call__(self, x):
        """x (B, H, T, hd) -> rotated."""
        T = x.shape[2]
        cos, sin = self.cos[:T], self.sin[:T]
        r, rest = x[..., :self.rot], x[..., self.rot:]
        if self.interleaved:
            a, b = r[..., 0::2], r[..., 1::2]
            out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
        else:
            a, b = r[..., :self.rot // 2], r[..., self.rot // 2:]
            out = torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)
        return torch.cat([out, rest], dim=-1)


def attention(h, w, cfg, rotary):
    """h (B, T, d) residual stream -> h + causal self-attention(h)."""
    B, T, _ = h.shape
    hd = cfg.head_dim
    x = rms_norm(h, w.attn_norm, cfg.norm_eps)
    q = (x @ w.wq.T).view(B, T, cfg.n_head, hd).transpose(1, 2)
    k = (x @ w.wk.T).view(B, T, cfg.n_head_kv, hd).transpose(1, 2)
    v = (x @ w.wv.T).view(B, T, cfg.n_head_kv, hd).transpose(1, 2)
    q, k = rotary(q), rotary(k)
    group = cfg.n_head // cfg.n_head_kv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return h + o.transpose(1, 2).reshape(B, T, cfg.n_head * hd) @ w.wo.T


def ffn_input(h, w, cfg):
    return rms_norm(h, w.ffn_norm, cfg.norm_eps)


def ffn_hidden(x, w, cfg):
    """x (..., d) -> act(gate x) * (up x), (..., n_ff): the values the sparsity rules judge."""
    g = x @ w.gate.T
    act = F.silu(g) if cfg.ffn_act == "silu" else torch.relu(g)
    return act * (x @ w.up.T)


class Head:
    """Final norm and LM head: token log-likelihoods, with the vocabulary in chunks."""

    def __init__(self, src, names, cfg, rows=512):
        self.norm = _tensor(src.floats(names["output_norm"])).reshape(-1)
        out = names["output"] if not cfg.tied_embeddings else names["token_embd"]
        self.w = _tensor(src.floats(out))                 # (vocab, d)
        self.eps, self.rows = cfg.norm_eps, rows

    def nll(self, h, targets):
        """h (N, d), targets (N,) -> negative log-likelihoods (N,), float64; `rows` tokens at a time
        bound the logits buffer."""
        x = rms_norm(h, self.norm, self.eps)
        out = []
        for s in range(0, len(x), self.rows):
            lp = (x[s:s + self.rows] @ self.w.T).log_softmax(-1)
            out.append(-lp.gather(1, targets[s:s + self.rows, None])[:, 0].double())
        return torch.cat(out)


class Embedding:
    def __init__(self, src, names):
        t = src.tensor(names["token_embd"])
        exact = blocks.from_gguf(t.ttype, t.raw, t.rows, t.k)
        self.fmt, self.parts = exact if exact is not None else ("f32", {"w": src.floats(names["token_embd"])})

    def __call__(self, ids):
        """ids (B, T) int -> (B, T, d) float32."""
        rows = blocks.dequantize(self.fmt, self.parts, rows=np.asarray(ids).reshape(-1))
        return torch.from_numpy(rows).view(*np.shape(ids), -1)
