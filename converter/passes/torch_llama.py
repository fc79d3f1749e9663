"""The calibration model: one decoder layer at a time in PyTorch, from dequantized weights.

Only the converter's passes use this; it is built from the same source tensors as the `.pinf`
and follows the runtime's conventions (formats/config.py): RoPE rotates ADJACENT pairs (2i, 2i+1)
when cfg.rope_interleaved (GGUF's attn_q/attn_k row order), halves otherwise (Hugging Face's);
query head h reads kv head h // (n_head / n_head_kv); RMSNorm x * rsqrt(mean(x^2) + eps) * w, or
LayerNorm with a bias; biases, learned positions and a gate-less FFN where the model has them
(Qwen2, OPT). The architecture's tensor names map roles to source tensors; optional roles (the
biases, "ffn_gate", "pos_embd") are simply absent from the map when the model lacks them.
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
    gate: torch.Tensor | None  # (n_ff, d); None without a gate (OPT)
    up: torch.Tensor          # (n_ff, d)
    down: torch.Tensor        # (d, n_ff)
    bias: dict                # role -> (n,) for the optional vectors the model has (BIAS_ROLES)
    index: int = 0            # the layer's number (windowed or global, its RoPE table)


BIAS_ROLES = ("attn_norm_bias", "attn_q_bias", "attn_k_bias", "attn_v_bias", "attn_output_bias",
              "ffn_norm_bias", "ffn_gate_bias", "ffn_up_bias", "ffn_down_bias",
              "attn_q_norm", "attn_k_norm",     # Qwen3's and Gemma 3's per-head q/k RMSNorm weights
              "attn_post_norm", "ffn_post_norm")   # Gemma's norms of the attention's and FFN's outputs


def _tensor(a):
    return torch.from_numpy(np.require(a, np.float32, ["C", "W"]))


def load_layer(src, names, i, device="cpu"):
    """Dequantize layer i's weights onto `device`; `names` maps pinfer roles to source tensor-name
    templates."""
    t = lambda key: _tensor(src.floats(names[key].format(i))).to(device)  # noqa: E731
    return LayerWeights(
        attn_norm=t("attn_norm").reshape(-1), wq=t("attn_q"), wk=t("attn_k"), wv=t("attn_v"),
        wo=t("attn_output"), ffn_norm=t("ffn_norm").reshape(-1),
        gate=t("ffn_gate") if "ffn_gate" in names else None, up=t("ffn_up"), down=t("ffn_down"),
        bias={k: t(k).reshape(-1) for k in BIAS_ROLES if k in names}, index=i)


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def norm(x, w, b, cfg):
    """The model's norm: RMSNorm, or LayerNorm (weight w, bias b) when cfg.norm == "layer"."""
    if cfg.norm == "layer":
        return F.layer_norm(x, x.shape[-1:], w, b, cfg.norm_eps)
    return rms_norm(x, w, cfg.norm_eps)


def _linear(x, w, b):
    return x @ w.T if b is None else x @ w.T + b


class Rotary:
    """cos/sin (T, rotary_dim/2) for positions 0..T-1, applied in the file's pair layout."""

    def __init__(self, cfg, n_pos, freq_divisors=None, device="cpu", local=False):
        from pinfer.runtime.kv import rope_tables      # the runtime's tables: one definition of RoPE
        self.cos, self.sin = (torch.from_numpy(t).to(device) for t in rope_tables(cfg, n_pos, freq_divisors, local))
        self.rot, self.interleaved = cfg.rotary_dim, cfg.rope_interleaved
        # the windowed layers' own table (Gemma 3), where the model has one
        self.local = Rotary(cfg, n_pos, None, device, True) if cfg.rope_base_local and not local else None

    def __call__(self, x, local=False):
        """x (B, H, T, hd) -> rotated (local: with the windowed layers' table)."""
        if local and self.local is not None:
            return self.local(x)
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


def _same(name, x):
    return x


def attention(h, w, cfg, rotary, tap=_same):
    """h (B, T, d) residual stream -> h + causal self-attention(h). tap(name, x) sees (and may
    replace) the input of the q/k/v projections ("qkv") and of the output projection ("o"):
    activation sparsity's calibration and its reference (converter/passes/activation.py)."""
    B, T, _ = h.shape
    hd, bias = cfg.head_dim, w.bias.get
    x = tap("qkv", norm(h, w.attn_norm, bias("attn_norm_bias"), cfg))
    q = _linear(x, w.wq, bias("attn_q_bias")).view(B, T, cfg.n_head, hd).transpose(1, 2)
    k = _linear(x, w.wk, bias("attn_k_bias")).view(B, T, cfg.n_head_kv, hd).transpose(1, 2)
    v = _linear(x, w.wv, bias("attn_v_bias")).view(B, T, cfg.n_head_kv, hd).transpose(1, 2)
    if "attn_q_norm" in w.bias:
        q, k = rms_norm(q, bias("attn_q_norm"), cfg.norm_eps), rms_norm(k, bias("attn_k_norm"), cfg.norm_eps)
    if cfg.positions == "rope":
        local = cfg.rope_local(w.index)
        q, k = rotary(q, local), rotary(k, local)
    group = cfg.n_head // cfg.n_head_kv
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    windowed, scale = cfg.windowed(w.index) and T > cfg.sliding_window, cfg.attn_scale or None
    if windowed or cfg.attn_softcap:
        pos = torch.arange(T, device=h.device)
        mask = (pos[None, :] <= pos[:, None]) & ((pos[:, None] - pos[None, :] < cfg.sliding_window) if windowed else True)
    if cfg.attn_softcap:            # scores c * tanh(s / c), then the mask (Gemma 2)
        s = (q @ k.transpose(-1, -2)) * (scale or hd ** -0.5)
        s = torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
        o = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ v
    elif windowed:
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    else:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    o = _linear(tap("o", o.transpose(1, 2).reshape(B, T, cfg.n_head * hd)), w.wo, bias("attn_output_bias"))
    if "attn_post_norm" in w.bias:
        o = rms_norm(o, bias("attn_post_norm"), cfg.norm_eps)
    return h + o


def ffn_output(y, w, cfg):
    """The FFN's output y (..., d), normed where the model does (Gemma), before the residual add."""
    return rms_norm(y, w.bias["ffn_post_norm"], cfg.norm_eps) if "ffn_post_norm" in w.bias else y


def ffn_input(h, w, cfg):
    return norm(h, w.ffn_norm, w.bias.get("ffn_norm_bias"), cfg)


def ffn_residual(h, w):
    """The residual stream the FFN's down projection adds to: h plus the down bias, if any."""
    b = w.bias.get("ffn_down_bias")
    return h if b is None else h + b


def ffn_hidden(x, w, cfg):
    """x (..., d) -> act(gate x) * (up x), or act(up x) without a gate, (..., n_ff): the values
    the sparsity rules judge."""
    up = _linear(x, w.up, w.bias.get("ffn_up_bias"))
    if w.gate is None:
        return activation(up, cfg)
    if cfg.ffn_act == "drelu":
        up = torch.relu(up)
    return activation(_linear(x, w.gate, w.bias.get("ffn_gate_bias")), cfg) * up


def activation(g, cfg):
    if cfg.ffn_act == "gelu":
        return F.gelu(g, approximate="tanh")
    if cfg.ffn_act == "silu":
        return F.silu(g)
    if cfg.ffn_act == "fatrelu":
        return torch.where(g > cfg.ffn_act_threshold, g, torch.zeros_like(g))
    return torch.relu(g)


class Head:
    """Final norm and LM head on `device`: token log-likelihoods, with the vocabulary in chunks. The
    head's float32 weights (vocab x d_model: 0.5 GB at LLaMA-7B's shapes) are dequantized on first
    use, after the layers, so that they do not sit in memory beside every layer's calibration."""

    def __init__(self, src, names, cfg, rows=512, device="cpu"):
        self.norm = _tensor(src.floats(names["output_norm"])).reshape(-1).to(device)
        self.bias = (_tensor(src.floats(names["output_norm_bias"])).reshape(-1).to(device)
                     if "output_norm_bias" in names else None)
        self._src, self._out = src, names["output"] if not cfg.tied_embeddings else names["token_embd"]
        self._w = None
        self.cfg, self.rows, self.device = cfg, rows, device

    @property
    def w(self):
        if self._w is None:
            self._w = _tensor(self._src.floats(self._out)).to(self.device)     # (vocab, d)
        return self._w

    def release(self):
        """Drop the float32 weights until the next use."""
        self._w = None

    def logits(self, h):
        return self._cap(norm(h, self.norm, self.bias, self.cfg) @ self.w.T)

    def _cap(self, logits):
        c = self.cfg.final_softcap
        return torch.tanh(logits / c) * c if c else logits

    def nll(self, h, targets):
        """h (N, d), targets (N,) -> negative log-likelihoods (N,), float64; `rows` tokens at a time
        bound the logits buffer."""
        x, targets = norm(h, self.norm, self.bias, self.cfg), targets.to(self.device)
        out = []
        for s in range(0, len(x), self.rows):
            lp = self._cap(x[s:s + self.rows] @ self.w.T).log_softmax(-1)
            out.append(-lp.gather(1, targets[s:s + self.rows, None])[:, 0].double())
        return torch.cat(out)


class Embedding:
    """Token rows (and learned positions) on `device`, from the file's own blocks."""

    def __init__(self, src, names, device="cpu", scale=1.0):
        self.device, self.scale = device, scale
        t = src.tensor(names["token_embd"])
        exact = blocks.from_gguf(t.ttype, t.raw, t.rows, t.k)
        self.fmt, self.parts = exact if exact is not None else ("f32", {"w": src.floats(names["token_embd"])})
        self.pos = _tensor(src.floats(names["pos_embd"])).to(device) if "pos_embd" in names else None

    def __call__(self, ids):
        """ids (B, T) int -> (B, T, d) float32, plus the learned position rows 0..T-1 if any."""
        rows = blocks.dequantize(self.fmt, self.parts, rows=np.asarray(ids).reshape(-1))
        out = torch.from_numpy(rows).view(*np.shape(ids), -1).to(self.device)
        if self.scale != 1.0:        # Gemma: sqrt(d_model)
            out = out * self.scale
        return out if self.pos is None else out + self.pos[:out.shape[-2]]
