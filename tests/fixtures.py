"""Tiny LLaMA GGUF files for tests, written the way llama.cpp's convert_hf_to_gguf writes them.

Independent of pinfer: only numpy and gguf-py (`gguf.GGUFWriter`, `gguf.quants`). Together with
`tests/reference.py` this is the oracle pinfer is tested against.

Layout conventions (as gguf-py expects them):
- 2-D weights are numpy (out_features, in_features), row-major; GGUF records the shape reversed.
- attn_q / attn_k rows are in GGML "normal" RoPE order (adjacent pairs rotate together). The
  converter gets there by permuting HF's rows; our rows are random, so any row order is already
  a valid GGUF order and no permutation is needed.
- Norm weights stay F32 whatever `qtype` is, as in llama.cpp's own files.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import gguf
from gguf import GGMLQuantizationType as QT, GGUFValueType as VT

# Quant types a fixture can be written in. gguf-py 0.19 can dequantize the K-quants but not
# quantize them (quants.quantize raises NotImplementedError), so Q4_K and Q6_K use the small
# encoders below; their bytes are checked against gguf.quants.dequantize in the tests.
QTYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")

_FILE_TYPE = {
    "F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "Q5_0": gguf.LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1, "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_M, "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
}

CONTROL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# BPE merges are learned from this text; it allows a few hundred merges.
TRAINING_TEXT = """\
The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is Rome.
Once upon a time, in a small village, there lived an old man and his three daughters. Every
morning the old man walked to the river to fetch water, and every evening he told his daughters
stories about the mountains, the forests and the sea. def fibonacci(n): return n if n < 2 else
fibonacci(n - 1) + fibonacci(n - 2). Hello, world! How are you today? I am fine, thank you.
The quick brown fox jumps over the lazy dog. 0123456789 is a list of the ten digits we use.
"""


# ---------------------------------------------------------------------------------------------
# Tokenizer: byte-level GPT-2 BPE


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (b' ' -> 'Ġ', b'\\n' -> 'Ċ')."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_PRETOKENIZE = re.compile(r"'(?:[sdmt]|ll|ve|re)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def tiny_bpe_vocab(
    vocab_size: int = 320, text: str = TRAINING_TEXT
) -> tuple[list[str], list[int], list[str]]:
    """(tokens, token_types, merges) of a byte-level BPE with exactly `vocab_size` tokens.

    ids 0..255 are the single bytes in byte order (id == byte value), then one token per learned
    merge, then CONTROL_TOKENS (token_type 3; every other token is type 1, normal).
    """
    n_merges = vocab_size - 256 - len(CONTROL_TOKENS)
    if n_merges < 0:
        raise ValueError(f"vocab_size {vocab_size} is below the {256 + len(CONTROL_TOKENS)} base tokens")
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    known = set(tokens)
    words = Counter(tuple(b2u[b] for b in w.encode()) for w in _PRETOKENIZE.findall(text))
    merges: list[str] = []
    while len(tokens) < 256 + n_merges:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            raise ValueError(f"the training text allows at most {len(tokens) + len(CONTROL_TOKENS)} tokens")
        best = min(pairs, key=lambda p: (-pairs[p], p))  # most frequent, ties lexicographic
        merges.append(f"{best[0]} {best[1]}")
        if best[0] + best[1] not in known:  # two merge paths can spell the same token
            tokens.append(best[0] + best[1])
            known.add(tokens[-1])
        words = Counter({_merge_word(w, best): c for w, c in words.items()})
    types = [int(gguf.TokenType.NORMAL)] * len(tokens) + [int(gguf.TokenType.CONTROL)] * len(CONTROL_TOKENS)
    return tokens + list(CONTROL_TOKENS), types, merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


# ---------------------------------------------------------------------------------------------
# K-quant encoders (simple round-to-nearest; llama.cpp's own search is better but the format
# is the same, and that is what a reader has to get right)

QK_K = 256


def _div0(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, with 0 where b == 0 (all-zero blocks get scale 0 and q 0)."""
    return np.divide(a, b, out=np.zeros(np.broadcast(a, b).shape, np.float32), where=b > 0)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols // 256 * 210) uint8 Q6_K blocks.

    Block: ql[128] low nibbles, qh[64] high 2 bits, scales[16] int8 (one per 16 values), d f16.
    value = d * scale * (q - 32), q in 0..63.
    """
    rows = x.shape[0]
    blk = x.astype(np.float32).reshape(-1, 16, 16)  # (n_blocks, sub-block, value)
    sub = np.abs(blk).max(axis=-1) / 31.0  # (n_blocks, 16) wanted per-sub-block scale
    d = (sub.max(axis=-1) / 127.0).astype(np.float16)  # (n_blocks,)
    d32 = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(_div0(sub, d32)), -128, 127).astype(np.int8)
    q = np.round(_div0(blk, (d32 * sc)[..., None]))  # (n_blocks, 16, 16)
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # (n, half, quarter, 32)
    # value index = half*128 + quarter*32 + j
    lo = (q & 0x0F).reshape(-1, 2, 2, 64)  # quarter pairs (0,1) and (2,3) share ql bytes
    ql = lo[:, :, 0] | (lo[:, :, 1] << 4)  # (n, 2, 64)
    hi = q >> 4  # (n, half, quarter, 32), 2 bits each
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # (n, 2, 32)
    n = q.shape[0]
    out = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)], axis=1)
    return out.reshape(rows, -1)


def quantize_q4_k(x: np.ndarray, top: int = 15) -> np.ndarray:
    """(rows, cols) float -> (rows, cols // 256 * 144) uint8 Q4_K blocks.

    Block: d f16, dmin f16, scales[12] (eight 6-bit scales and mins, packed), qs[128] nibbles.
    value = d * sc * q - dmin * m, q in 0..15, one (sc, m) per 32 values. top=31: Q5_K (below).
    """
    rows = x.shape[0]
    blk = x.astype(np.float32).reshape(-1, 8, 32)  # (n_blocks, sub-block, value)
    mins = np.maximum(-blk.min(axis=-1), 0.0)  # (n, 8) offset subtracted, >= 0
    scales = (blk.max(axis=-1) + mins) / top  # (n, 8)
    d = (scales.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (mins.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(_div0(scales, d32)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(_div0(mins, dmin32)), 0, 63).astype(np.uint8)
    q = np.round(_div0(blk + (dmin32 * m)[..., None], (d32 * sc)[..., None]))  # (n_blocks, 8, 32)
    q5 = np.clip(q, 0, top).astype(np.uint8)  # (n_blocks, 8, 32)
    q = (q5 & 15).reshape(-1, 4, 2, 32)  # sub-blocks 2g, 2g+1 share bytes
    qs = q[:, :, 0] | (q[:, :, 1] << 4)  # (n, 4, 32)
    # 6-bit packing: bytes 0-3 sc[0:4] | top bits of sc[4:8]; 4-7 the same for m; 8-11 low nibbles
    packed = np.concatenate([
        sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
        m[:, :4] | ((m[:, 4:] >> 4) << 6),
        (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4),
    ], axis=1)
    n = q.shape[0]
    halves = [d.reshape(n, 1).view(np.uint8), dmin.reshape(n, 1).view(np.uint8)]
    fifth = []
    if top == 31:   # Q5_K: qh[l] bit j is the fifth bit of sub-block j's element l
        fifth = [((q5 >> 4) << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)]
    out = np.concatenate([*halves, packed, *fifth, qs.reshape(n, 128)], axis=1)
    return out.reshape(rows, -1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """(rows, cols) float -> (rows, cols // 256 * 176) uint8 Q5_K blocks: Q4_K's with q in 0..31,
    whose fifth bits sit in qh[32] between the scales and the nibbles."""
    return quantize_q4_k(x, top=31)


_K_ENCODERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def encode_tensor(w: np.ndarray, qtype: str) -> tuple[np.ndarray, QT | None]:
    """(array to write, raw_dtype for GGUFWriter.add_tensor); F32/F16 are written as-is."""
    if qtype == "F32":
        return w.astype(np.float32), None
    if qtype == "F16":
        return w.astype(np.float16), None
    block = gguf.GGML_QUANT_SIZES[QT[qtype]][0]
    if w.shape[-1] % block:
        raise ValueError(f"{qtype} needs rows that are a multiple of {block}; got shape {w.shape}")
    if qtype in _K_ENCODERS:
        return _K_ENCODERS[qtype](w), QT[qtype]
    return gguf.quants.quantize(w.astype(np.float32), QT[qtype]), QT[qtype]


# ---------------------------------------------------------------------------------------------
# The model file


def tiny_llama_weights(
    *, n_layer: int, d_model: int, n_ff: int, n_head: int, n_head_kv: int, vocab: int,
    tied_embeddings: bool, seed: int,
) -> dict[str, np.ndarray]:
    """GGUF tensor name -> float32 weights, (out_features, in_features) for linears.

    std 1/sqrt(fan_in) keeps every residual update O(1); the embedding (std 0.5) also serves as
    the tied output, where it gives logits of std ~0.5 * sqrt(d_model).
    """
    rng = np.random.default_rng(seed)
    head_dim = d_model // n_head

    def linear(n_out: int, n_in: int) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"token_embd.weight": (0.5 * rng.standard_normal((vocab, d_model))).astype(np.float32)}  # (vocab, d)
    for i in range(n_layer):
        w[f"blk.{i}.attn_norm.weight"] = norm(d_model)  # (d,)
        w[f"blk.{i}.attn_q.weight"] = linear(n_head * head_dim, d_model)  # (n_head*hd, d)
        w[f"blk.{i}.attn_k.weight"] = linear(n_head_kv * head_dim, d_model)  # (n_head_kv*hd, d)
        w[f"blk.{i}.attn_v.weight"] = linear(n_head_kv * head_dim, d_model)  # (n_head_kv*hd, d)
        w[f"blk.{i}.attn_output.weight"] = linear(d_model, n_head * head_dim)  # (d, n_head*hd)
        w[f"blk.{i}.ffn_norm.weight"] = norm(d_model)  # (d,)
        w[f"blk.{i}.ffn_gate.weight"] = linear(n_ff, d_model)  # (n_ff, d)
        w[f"blk.{i}.ffn_up.weight"] = linear(n_ff, d_model)  # (n_ff, d)
        w[f"blk.{i}.ffn_down.weight"] = linear(d_model, n_ff)  # (d, n_ff)
    w["output_norm.weight"] = norm(d_model)  # (d,)
    if not tied_embeddings:
        w["output.weight"] = linear(vocab, d_model)  # (vocab, d)
    return w


def make_tiny_llama_gguf(
    path: str | Path,
    *,
    qtype: str = "F32",
    n_layer: int = 2,
    d_model: int = 64,
    n_ff: int = 128,
    n_head: int = 4,
    n_head_kv: int = 2,
    vocab: int = 320,
    rope_base: float = 10000.0,
    eps: float = 1e-5,
    tied_embeddings: bool = False,
    ctx: int = 256,
    seed: int = 0,
    arch_name: str = "llama",
    extra_kv: dict[str, Any] | None = None,
    weights: dict[str, np.ndarray] | None = None,
) -> Path:
    """Write a random LLaMA GGUF with a real byte-level BPE tokenizer; returns `path`.

    Weights depend only on the shape arguments and `seed`, not on `qtype`, so files that differ
    only in qtype hold quantizations of the same model. `arch_name` sets general.architecture
    and the prefix of the hyper-parameter keys. `extra_kv` adds or overrides keys (a value of None
    removes the key); ints are written UINT32, floats FLOAT32, lists as arrays. `weights` (GGUF
    name -> float32 array) replaces the random weights, e.g. with a Hugging Face model's.
    """
    if qtype not in QTYPES:
        raise ValueError(f"qtype {qtype!r} is not one of {QTYPES}")
    if d_model % n_head or n_head % n_head_kv:
        raise ValueError(f"d_model {d_model}, n_head {n_head}, n_head_kv {n_head_kv} do not divide")
    path = Path(path)
    tokens, types, merges = tiny_bpe_vocab(vocab)
    if weights is None:
        weights = tiny_llama_weights(
            n_layer=n_layer, d_model=d_model, n_ff=n_ff, n_head=n_head, n_head_kv=n_head_kv,
            vocab=vocab, tied_embeddings=tied_embeddings, seed=seed,
        )
    a = arch_name
    kv: dict[str, Any] = {
        "general.architecture": (a, VT.STRING),
        "general.type": ("model", VT.STRING),
        "general.name": (f"tiny-{a}-{qtype}", VT.STRING),
        f"{a}.block_count": (n_layer, VT.UINT32),
        f"{a}.context_length": (ctx, VT.UINT32),
        f"{a}.embedding_length": (d_model, VT.UINT32),
        f"{a}.feed_forward_length": (n_ff, VT.UINT32),
        f"{a}.attention.head_count": (n_head, VT.UINT32),
        f"{a}.attention.head_count_kv": (n_head_kv, VT.UINT32),
        f"{a}.rope.freq_base": (rope_base, VT.FLOAT32),
        f"{a}.attention.layer_norm_rms_epsilon": (eps, VT.FLOAT32),
        "general.file_type": (int(_FILE_TYPE[qtype]), VT.UINT32),
        f"{a}.vocab_size": (vocab, VT.UINT32),
        f"{a}.rope.dimension_count": (d_model // n_head, VT.UINT32),
        "tokenizer.ggml.model": ("gpt2", VT.STRING),
        "tokenizer.ggml.pre": ("default", VT.STRING),
        "tokenizer.ggml.tokens": (tokens, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.token_type": (types, VT.ARRAY, VT.INT32),
        "tokenizer.ggml.merges": (merges, VT.ARRAY, VT.STRING),
        "tokenizer.ggml.bos_token_id": (tokens.index("<|im_start|>"), VT.UINT32),
        "tokenizer.ggml.eos_token_id": (tokens.index("<|im_end|>"), VT.UINT32),
        "tokenizer.ggml.padding_token_id": (tokens.index("<|endoftext|>"), VT.UINT32),
        "tokenizer.ggml.add_bos_token": (False, VT.BOOL),
        "tokenizer.chat_template": (CHATML_TEMPLATE, VT.STRING),
        "general.quantization_version": (gguf.GGML_QUANT_VERSION, VT.UINT32),
    }
    for key, value in (extra_kv or {}).items():
        if value is None:
            kv.pop(key, None)
        else:
            kv[key] = _typed(value)

    writer = gguf.GGUFWriter(str(path), arch=a)
    writer.kv_data[0].clear()  # the writer pre-sets general.architecture; `kv` alone decides
    for key, (value, vtype, *sub) in kv.items():
        writer.add_key_value(key, value, vtype, sub[0] if sub else None)
    for name, w in weights.items():
        if w.ndim == 1:
            writer.add_tensor(name, w)  # norms: F32 always
        else:
            data, raw_dtype = encode_tensor(w, qtype)
            writer.add_tensor(name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _typed(value: Any) -> tuple:
    if isinstance(value, bool):
        return (value, VT.BOOL)
    if isinstance(value, int):
        return (value, VT.UINT32 if 0 <= value < 2**32 else VT.INT64)
    if isinstance(value, float):
        return (value, VT.FLOAT32)
    if isinstance(value, str):
        return (value, VT.STRING)
    if isinstance(value, (list, tuple)) and value:
        return (list(value), VT.ARRAY, _typed(value[0])[1])
    raise TypeError(f"extra_kv value {value!r}: expected bool, int, float, str or a non-empty list")


# Calibration small enough for a unit test: seconds per tiny model.
QUICK_PASSES = dict(calib_tokens=4096, heldout_tokens=2048, seq_len=128, early_check=False)   # the full passes


def convert_tiny_silu(d: Path, **passes: Any) -> Path:
    """A 2-layer Q4_1 SiLU model (d_model 64, n_ff 128) built in d and converted with quick
    calibration and the converter's own choices (or `passes`); returns the .pinf path."""
    from pinfer.converter.convert import ConvertOptions, convert
    from pinfer.converter.passes import PassOptions
    src = make_tiny_llama_gguf(d / "silu.gguf", qtype="Q4_1", n_layer=2, d_model=64, n_ff=128, seed=5)
    return convert(ConvertOptions(src, d / "silu.pinf", report=False, passes=PassOptions(**{**QUICK_PASSES, **passes})))
