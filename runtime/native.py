"""Decode's dense part through pinfer's C kernels (pinfer/kernels/decode.py) instead of ONNX Runtime,
for the layers and heads of a kind they cover: RMSNorm (Gemma's post norms and Qwen3's and Gemma 3's
per-head q/k norms too), RoPE, attention over the whole context or a sliding window. For one token
ONNX Runtime's fixed cost per session and node outweighed the bytes: on SmolLM2 the 30 attention
sessions took ~3.3 ms a token for ~15 MB of weights. Prompts still run through ONNX Runtime's
graphs, which fill the same KV cache; --dense-kernel off keeps every step there."""

import numpy as np

from pinfer.formats import schema as S
from pinfer.formats.reader import huge_empty
from pinfer.kernels import MAX_BATCH, transpose_q4
from pinfer.kernels.decode import LINEAR_FORMATS, AttentionStep, HeadStep

from .sparse import activation_levels, input_threshold


def refusal(reader, cfg, i=None):
    """Why layer i (None: the head) cannot run through the C kernels, or None where it can."""
    tensors, weights = reader.tensors, reader.header["weights"]
    if cfg.norm == "layer":
        return "LayerNorm"
    if i is None:
        base = S.TOKEN_EMBD if cfg.tied_embeddings else S.OUTPUT
        return None if weights.get(base) in LINEAR_FORMATS else f"a head in {weights.get(base)}"
    if cfg.positions != "rope" or cfg.n_head % cfg.n_head_kv or \
            not 0 < cfg.rotary_dim <= cfg.head_dim or cfg.rotary_dim % 2:
        return "an attention the kernel lacks (learned positions, uneven heads or RoPE widths)"
    if (S.ATTN_Q_NORM.format(i) in tensors) != (S.ATTN_K_NORM.format(i) in tensors):
        return "a per-head norm of q or of k alone"
    fmts = {weights.get(S.ATTN_QKV.format(i)), weights.get(S.ATTN_OUT.format(i))}
    return None if fmts <= set(LINEAR_FORMATS) else f"attention weights in {sorted(map(str, fmts))}"


def attention_steps(reader, cfg, threads, load_map, layers, activation=0.0, kept=None):
    """Per layer an AttentionStep for the layers in `layers` (the planner's choice: plan.decide),
    None for the others, made by load_map (the model's: several layers at a time). The steps read the weights from the file's map where the
    reader is mapped (RuntimeOptions.mmap), else their own copies (PinfReader.release says why);
    with activation sparsity (RuntimeOptions.activation) the q/k/v and output projections by
    columns, transposed (columns()), counting the inputs they keep into kept[i] ((n_layer, 2)
    int64: Counters.attn_kept)."""
    def optional(name):
        return reader.tensor(name) if name in reader.tensors else None

    def step(i):
        if i not in layers:
            return None
        qkv, out = (columns(reader, cfg, i, activation) if activation else
                    ((reader.block(S.ATTN_QKV.format(i), own=True), None),
                     (reader.block(S.ATTN_OUT.format(i), own=True), None)))
        return AttentionStep(
            qkv[0], out[0],
            reader.tensor(S.ATTN_NORM.format(i)), reader.tensor(S.FFN_NORM.format(i)),
            n_head=cfg.n_head, n_kv=cfg.n_head_kv, head_dim=cfg.head_dim, rot=cfg.rotary_dim,
            interleaved=cfg.rope_interleaved, eps=cfg.norm_eps, scale=cfg.attn_scale, softcap=cfg.attn_softcap,
            qkv_bias=optional(S.ATTN_QKV_BIAS.format(i)), out_bias=optional(S.ATTN_OUT_BIAS.format(i)),
            down_bias=optional(S.FFN_DOWN_BIAS.format(i)), q_norm=optional(S.ATTN_Q_NORM.format(i)),
            k_norm=optional(S.ATTN_K_NORM.format(i)), post_norm=optional(S.ATTN_POST_NORM.format(i)),
            delta_norm=optional(S.FFN_POST_NORM.format(i - 1)) if i else None,
            window=window(cfg, i), threads=threads, qkv_t=qkv[1], out_t=out[1],
            kept=kept[i] if kept is not None else None)
    return load_map(step, cfg.n_layer)


def by_columns(reader, i, level):
    """(q/k/v, output): whether layer i's C attention runs each projection by columns at activation
    sparsity `level`: a q4 weight whose level is above 0 (the others by rows)."""
    levels, weights = activation_levels(reader.header, level), reader.header["weights"]
    return tuple(weights.get(base.format(i)) == "q4" and bool(levels[proj])
                 for base, proj in ((S.ATTN_QKV, "qkv"), (S.ATTN_OUT, "o")))


def columns(reader, cfg, i, level):
    """Layer i's ((qkv's rows or None, its transpose and threshold or None), the same of the output
    projection) for activation sparsity `level`: each q4 projection transposed into its own copy (the map's
    pages let go), the other formats and a projection at level 0 by rows. Raises ValueError where the file has no thresholds."""
    out, levels = [], activation_levels(reader.header, level)
    for cols, (base, proj, rows, k) in zip(by_columns(reader, i, level), (
            (S.ATTN_QKV.format(i), "qkv", (cfg.n_head + 2 * cfg.n_head_kv) * cfg.head_dim, cfg.d_model),
            (S.ATTN_OUT.format(i), "o", cfg.d_model, cfg.n_head * cfg.head_dim))):
        thr = input_threshold(reader.header, i, proj, levels[proj])
        fmt, parts = reader.block(base)
        if not cols:
            out.append((reader.block(base, own=True), None))
            continue
        out.append((None, (*transpose_q4(fmt, parts, rows, k, huge_empty, base), thr)))
        reader.release(*(S.part_name(base, p) for p in parts))
    return out


class Head:
    """The head of a call's last row through the C kernels: head(resid, delta) -> logits (1, vocab)
    of the last row of the model's buffers (Bufs in host memory), a copy; bound again when the
    buffers change."""

    def __init__(self, step, vocab):
        self.step, self.logits, self.run, self.bound_to = step, np.empty(vocab, np.float32), None, (None, None)

    def __call__(self, resid, delta):
        if self.bound_to[0] is not resid or self.bound_to[1] is not delta:    # kept: ids cannot be reused
            self.run = self.step.bind(resid.np[0, -1], delta.np[0, -1], self.logits)
            self.bound_to = (resid, delta)
        self.run()
        return self.logits[None].copy()

    def rows(self, resid, delta, start):
        """Logits (n - start, vocab) of rows start.. of the buffers, MAX_BATCH rows a call."""
        n = resid.shape[1]
        out = np.empty((n - start, len(self.logits)), np.float32)
        for t in range(start, n, MAX_BATCH):
            u = min(t + MAX_BATCH, n)
            self.step.bind_rows(resid.np[0, t:u], delta.np[0, t:u], out[t - start:u - start])()
        return out


def head(reader, cfg, threads):
    """The Head, or None where refusal() says why not."""
    if refusal(reader, cfg):
        return None
    base = S.TOKEN_EMBD if cfg.tied_embeddings else S.OUTPUT
    last = S.FFN_POST_NORM.format(cfg.n_layer - 1)
    return Head(HeadStep(reader.block(base, own=True), reader.tensor(S.OUTPUT_NORM), cfg.vocab, eps=cfg.norm_eps,
                         softcap=cfg.final_softcap, delta_norm=reader.tensor(last) if last in reader.tensors else None,
                         threads=threads), cfg.vocab)


def window(cfg, i):
    """Positions layer i's attention reads at most (0: all): the latest sliding_window, as the layer
    graph's GroupQueryAttention reads them with local_window_size = sliding_window (the test against
    it decodes past the window, and fails with one position more)."""
    return cfg.sliding_window if cfg.windowed(i) else 0


def bind_layer(step, state, i, resid, delta, resid_out, x_out):
    """Layer i's AttentionStep bound to the model's buffers (Bufs in host memory, (1, n, d)) and to
    its KV cache, RoPE tables and lengths (kv.AttentionState): one token, or a prompt's n tokens in
    one call of the kernel."""
    k, v, cos, sin = state.layer(i)
    total = np.asarray(state.total).reshape(1)
    if resid.shape[1] == 1:
        return step.bind(resid.np[0, 0], delta.np[0, 0], resid_out.np[0, 0], x_out.np[0, 0], k.np, v.np, cos.np, sin.np,
                         total)
    return step.bind_batch(resid.np[0], delta.np[0], resid_out.np[0], x_out.np[0], k.np, v.np, cos.np, sin.np, total)
