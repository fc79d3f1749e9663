"""Independent PyTorch forward pass of a LLaMA GGUF: the oracle for pinfer's outputs.

Independent of pinfer: reads with `gguf.GGUFReader`, dequantizes with `gguf.quants.dequantize`,
computes in plain PyTorch (float32 by default, float64 on request).

Conventions, as llama.cpp computes a GGUF llama:
- attn_q / attn_k rows are stored for GGML's "normal" RoPE: each head rotates ADJACENT pairs
  (2i, 2i+1) by pos * base^(-2i / n_rot). (HF checkpoints rotate halves; the converter permutes
  the rows so that this is the same model.)
- GQA: query head h reads kv head h // (n_head // n_head_kv).
- RMSNorm: x * rsqrt(mean(x^2) + eps) * w. FFN: down(silu(gate(x)) * up(x)).
- No output.weight means the output projection is token_embd (tied).

API: `reference_logits(path, ids)` -> (T, vocab) float32; `reference_greedy(path, prompt, n)`
(KV cache); both take float64= and ggml_numerics= (mimic llama.cpp's CPU rounding: int8
activations, f16 KV cache). Dequantized weights are cached per file.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import gguf
from gguf import GGMLQuantizationType as QT


@dataclass(frozen=True)
class LlamaHParams:
    n_layer: int
    d_model: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int  # leading dims of each head that RoPE rotates (llama: all of them)
    rope_base: float
    eps: float
    vocab: int


@dataclass(frozen=True)
class ReferenceModel:
    hp: LlamaHParams
    weights: dict[str, torch.Tensor]  # GGUF name -> float32, linears (out_features, in_features)
    qtypes: dict[str, QT]  # GGUF name -> type stored in the file


def _field(reader: gguf.GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise KeyError(f"GGUF key {key!r} is missing")
        return default
    return field.contents()


def read_hparams(reader: gguf.GGUFReader) -> LlamaHParams:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"reference forward implements 'llama', the file is {arch!r}")
    scaling = reader.fields.get("llama.rope.scaling.type")
    if scaling is not None and scaling.contents() not in ("none", ""):
        raise NotImplementedError(f"RoPE scaling {scaling.contents()!r} is not in the reference")
    n_head = int(_field(reader, "llama.attention.head_count"))
    d_model = int(_field(reader, "llama.embedding_length"))
    head_dim = int(_field(reader, "llama.attention.key_length", d_model // n_head))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    return LlamaHParams(
        n_layer=int(_field(reader, "llama.block_count")),
        d_model=d_model,
        n_ff=int(_field(reader, "llama.feed_forward_length")),
        n_head=n_head,
        n_head_kv=int(_field(reader, "llama.attention.head_count_kv", n_head)),
        head_dim=head_dim,
        n_rot=int(_field(reader, "llama.rope.dimension_count", head_dim)),
        rope_base=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab=int(embd.shape[-1]),  # GGUF shape is (d_model, vocab), reversed numpy order
    )


def load_reference(path: str | os.PathLike) -> ReferenceModel:
    """Dequantized weights and hyper-parameters; cached per file (path, mtime, size)."""
    st = Path(path).resolve().stat()
    return _load(str(Path(path).resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=4)
def _load(path: str, _mtime_ns: int, _size: int) -> ReferenceModel:
    reader = gguf.GGUFReader(path)
    hp = read_hparams(reader)
    weights, qtypes = {}, {}
    for t in reader.tensors:
        qtypes[t.name] = QT(t.tensor_type)
        # t.data: numpy in reversed GGUF order, i.e. (out_features, in_features) for linears;
        # quantized types come as (rows, bytes) and dequantize to (rows, cols).
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = torch.from_numpy(np.array(w, dtype=np.float32).reshape(w.shape))
    if "output.weight" not in weights:  # tied embeddings
        weights["output.weight"] = weights["token_embd.weight"]
        qtypes["output.weight"] = qtypes["token_embd.weight"]
    _check_shapes(hp, weights)
    return ReferenceModel(hp, weights, qtypes)


def _check_shapes(hp: LlamaHParams, w: dict[str, torch.Tensor]) -> None:
    d, q, kv, ff = hp.d_model, hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim, hp.n_ff
    layer = {"attn_norm": (d,), "attn_q": (q, d), "attn_k": (kv, d), "attn_v": (kv, d),
             "attn_output": (d, q), "ffn_norm": (d,), "ffn_gate": (ff, d), "ffn_up": (ff, d),
             "ffn_down": (d, ff)}
    want = {"token_embd.weight": (hp.vocab, d), "output_norm.weight": (d,), "output.weight": (hp.vocab, d)}
    want |= {f"blk.{i}.{n}.weight": s for i in range(hp.n_layer) for n, s in layer.items()}
    for name, shape in want.items():
        if name not in w:
            raise KeyError(f"tensor {name!r} is missing")
        if tuple(w[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(w[name].shape)}, expected {shape}")


# ---------------------------------------------------------------------------------------------
# Forward


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_adjacent(x: torch.Tensor, pos: torch.Tensor, n_rot: int, base: float) -> torch.Tensor:
    """GGML "normal" RoPE. x: (T, n_heads, head_dim); pos: (T,). Pairs (2i, 2i+1) rotate."""
    inv_freq = base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)  # (n_rot/2,)
    ang = pos.to(torch.float64)[:, None] * inv_freq[None, :]  # (T, n_rot/2)
    cos = torch.cos(ang).to(x.dtype)[:, None, :]  # (T, 1, n_rot/2)
    sin = torch.sin(ang).to(x.dtype)[:, None, :]
    x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]  # (T, H, n_rot/2) each
    rot = torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)  # re-interleave
    return torch.cat([rot, x[..., n_rot:]], dim=-1)


# How ggml's CPU backend rounds a matmul's activations for each weight type ("vec_dot_type"):
# K-quants dot with Q8_K (256-value blocks, f32 scale); the legacy quants with Q8_0 / Q8_1
# (32-value blocks, f16 scale); F16 weights with F16 activations; F32 with F32.
_Q8_BLOCK = {QT.Q8_0: 32, QT.Q4_0: 32, QT.Q4_1: 32, QT.Q5_0: 32, QT.Q5_1: 32}
_F_TYPES = {QT.F32: None, QT.F16: torch.float16, QT.BF16: torch.bfloat16}


def ggml_activation(x: torch.Tensor, qtype: QT) -> torch.Tensor:
    """x (..., n) as ggml's CPU matmul sees it against a `qtype` weight, back in x's dtype.

    int8 blocks: q = round_half_even(x * 127 / amax), value = scale * q, as quantize_row_q8_0 /
    q8_1 (AVX) and quantize_row_q8_K compute it. (The Q8_1 block sum used by Q4_1/Q5_1 is
    rounded to f16 separately in ggml; that ~1e-3 relative term is not modelled.)
    """
    if qtype in _F_TYPES:
        f = _F_TYPES[qtype]
        return x if f is None else x.to(f).to(x.dtype)
    block = _Q8_BLOCK.get(qtype, 256)
    b = x.reshape(*x.shape[:-1], -1, block)  # (..., n / block, block)
    amax = b.abs().amax(-1, keepdim=True)
    q = torch.round(b * torch.where(amax > 0, 127.0 / amax, 0.0))
    scale = amax / 127.0
    if block == 32:
        scale = scale.to(torch.float16).to(x.dtype)
    return (q * scale).reshape(x.shape)


KVCache = list  # per layer: [k (S, n_head_kv, hd), v (S, n_head_kv, hd)], grown in place


def forward(
    model: ReferenceModel, token_ids: list[int], *, pos0: int = 0, cache: KVCache | None = None,
    dtype: torch.dtype = torch.float32, last_only: bool = False, ggml_numerics: bool = False, ffn=None,
) -> torch.Tensor:
    """Logits (T, vocab) (or (1, vocab) with last_only) for tokens at positions pos0..pos0+T-1.

    With `cache` (a list, empty at the start), keys/values of earlier calls are reused and this
    call's are appended, so greedy decoding costs one token per step.

    ggml_numerics=False is the exact model on the dequantized weights. True mimics llama.cpp's CPU
    backend: matmul inputs rounded as `ggml_activation` says, and Q, K, V and the attention
    probabilities rounded to f16 (its default F16 KV cache, without flash attention).

    ffn(i, h, gate, up) -> the FFN's hidden values of layer i, from its input h and the gate and up
    projections (default silu(gate) * up): ReLU-family models and predictor rules.
    """
    hp, W = model.hp, model.weights
    f16 = (lambda t: t.to(torch.float16).to(dtype)) if ggml_numerics else (lambda t: t)

    def mm(x: torch.Tensor, name: str) -> torch.Tensor:  # x (T, in) @ W[name].T -> (T, out)
        if ggml_numerics:
            x = ggml_activation(x, model.qtypes[name])
        return x @ W[name].to(dtype).T

    ids = torch.tensor(token_ids, dtype=torch.long)
    T = len(token_ids)
    pos = torch.arange(pos0, pos0 + T)
    x = W["token_embd.weight"].to(dtype)[ids]  # (T, d)
    group = hp.n_head // hp.n_head_kv
    for i in range(hp.n_layer):
        p = f"blk.{i}."
        h = rms_norm(x, W[p + "attn_norm.weight"].to(dtype), hp.eps)
        q = mm(h, p + "attn_q.weight").view(T, hp.n_head, hp.head_dim)
        k = mm(h, p + "attn_k.weight").view(T, hp.n_head_kv, hp.head_dim)
        v = f16(mm(h, p + "attn_v.weight").view(T, hp.n_head_kv, hp.head_dim))
        q = f16(rope_adjacent(q, pos, hp.n_rot, hp.rope_base))
        k = f16(rope_adjacent(k, pos, hp.n_rot, hp.rope_base))
        if cache is not None:
            if len(cache) <= i:
                cache.append([k[:0], v[:0]])
            cache[i][0] = k = torch.cat([cache[i][0], k])  # (S, n_head_kv, hd), S = pos0 + T
            cache[i][1] = v = torch.cat([cache[i][1], v])
        S = k.shape[0]
        k = k.repeat_interleave(group, dim=1)  # (S, n_head, hd): q head h uses kv head h // group
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("thd,shd->hts", q, k) / hp.head_dim**0.5  # (n_head, T, S)
        future = torch.arange(S)[None, :] > (S - T + torch.arange(T))[:, None]  # (T, S)
        probs = f16(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1))
        att = torch.einsum("hts,shd->thd", probs, v).reshape(T, hp.n_head * hp.head_dim)
        x = x + mm(att, p + "attn_output.weight")
        h = rms_norm(x, W[p + "ffn_norm.weight"].to(dtype), hp.eps)
        g, u = mm(h, p + "ffn_gate.weight"), mm(h, p + "ffn_up.weight")
        act = ffn(i, h, g, u) if ffn else torch.nn.functional.silu(g) * u  # (T, n_ff)
        x = x + mm(act, p + "ffn_down.weight")
    if last_only:
        x = x[-1:]
    return mm(rms_norm(x, W["output_norm.weight"].to(dtype), hp.eps), "output.weight")  # (T, vocab)


@contextlib.contextmanager
def _one_thread():
    """One intra-op thread: results independent of the machine's core count, and no spin-wait
    collapse of the many tiny per-head ops when other processes share the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@torch.no_grad()
def reference_logits(
    gguf_path: str | os.PathLike, token_ids: list[int], *, float64: bool = False, ggml_numerics: bool = False,
    ffn=None,
) -> np.ndarray:
    """(T, vocab) float32 logits of a full causal pass over `token_ids` (no BOS added); ffn: see forward."""
    model = load_reference(gguf_path)
    dtype = torch.float64 if float64 else torch.float32
    with _one_thread():
        logits = forward(model, list(token_ids), dtype=dtype, ggml_numerics=ggml_numerics, ffn=ffn)
    return logits.to(torch.float32).numpy()


@torch.no_grad()
def reference_greedy(
    gguf_path: str | os.PathLike, prompt_ids: list[int], n_new: int, *, float64: bool = False,
    ggml_numerics: bool = False,
) -> list[int]:
    """Greedy (argmax) continuation of `prompt_ids`, `n_new` tokens, with a KV cache."""
    if n_new <= 0:
        return []
    model = load_reference(gguf_path)
    dtype = torch.float64 if float64 else torch.float32
    run = functools.partial(forward, model, dtype=dtype, ggml_numerics=ggml_numerics)
    cache: KVCache = []
    out: list[int] = []
    with _one_thread():
        logits = run(list(prompt_ids), cache=cache, last_only=True)
        while True:
            out.append(int(torch.argmax(logits[-1])))
            if len(out) == n_new:
                return out
            logits = run(out[-1:], pos0=len(prompt_ids) + len(out) - 1, cache=cache)
