"""The dense part of a decode step in C (pinfer/kernels/csrc/decode.c): a layer's attention and the
head for one token, over weights and buffers checked here once; the bound calls pass one pointer."""

import ctypes

import numpy as np

from pinfer.formats import schema as S

from . import MAX_BATCH, SPARSE_DOWN, _check, _lib, _parts

LINEAR_FORMATS = ("q4", "q5", "q8", "f16", "f32")
P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Linear(ctypes.Structure):
    """linear_t of decode.c."""
    _fields_ = [("fmt", ctypes.c_int), ("q", P), ("scale", P), ("min", P), ("qh", P), ("bias", P),
                ("rows", I64), ("k", I64)]


class _Cols(ctypes.Structure):
    """cols_t of csrc/quants.h: a weight by columns, or q None."""
    _fields_ = [("fmt", ctypes.c_int), ("q", P), ("scale", P), ("min", P), ("thr", F32)]


class _AttnCall(ctypes.Structure):
    """attn_call_t of decode.c."""
    _fields_ = [("qkv", _Linear), ("out", _Linear), ("attn_norm", P), ("ffn_norm", P), ("down_bias", P),
                ("eps", F32), ("scale", F32), ("softcap", F32)] + \
        [(n, I64) for n in ("d", "n_head", "n_kv", "hd", "rot", "n_ctx")] + [("interleaved", ctypes.c_int)] + \
        [(n, P) for n in ("k_cache", "v_cache", "cos", "sin", "total")] + [("back", I64)] + \
        [(n, P) for n in ("resid", "delta", "resid_out", "x_out", "work")] + [("threads", ctypes.c_int),
                                                                             ("kv_f16", ctypes.c_int)] + \
        [(n, P) for n in ("q_norm", "k_norm", "post_norm", "delta_norm")] + [("window", I64)] + \
        [("qkv_c", _Cols), ("out_c", _Cols), ("kept", P)]


class _HeadCall(ctypes.Structure):
    """head_call_t of decode.c."""
    _fields_ = [("w", _Linear), ("norm", P), ("eps", F32), ("softcap", F32), ("d", I64), ("resid", P),
                ("delta", P), ("logits", P), ("work", P), ("threads", ctypes.c_int), ("delta_norm", P)]


def _vector(a, n, what):
    if a is None:
        return None
    a = np.asarray(a)
    _check(a, np.dtype(np.float32), (n,), what)
    return a


def linear(weight, rows, k, bias=None, what="weight"):
    """A checked _Linear of the block-format weight (fmt, parts) of shape (rows, k), and the arrays
    it points into (keep them alive with it)."""
    fmt, parts = weight
    if fmt != "f32" and k % S.GROUP:
        raise ValueError(f"{what}: {k} columns are not whole groups of {S.GROUP}")
    code, (q, scale, mn) = _parts(LINEAR_FORMATS, fmt, parts, rows, k, what)
    qh = parts.get("qh")
    bias = _vector(bias, rows, f"{what} bias")
    ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
    return _Linear(code, q, scale, mn, ptr(qh), ptr(bias), rows, k), (parts, bias)


def columns(weight_t, rows, k, bias=None, what="weight"):
    """(a shape-only _Linear: the rows, k and bias the kernel counts, no weights; the checked _Cols
    of W^T (k, rows), the inputs under |thr| dropped; the arrays they point into). weight_t:
    (fmt, parts, thr), fmt one of kernels.SPARSE_DOWN."""
    fmt, parts, thr = weight_t
    code, (q, scale, mn) = _parts(SPARSE_DOWN, fmt, parts, k, rows, f"{what} by columns")
    if rows % S.GROUP or k % S.GROUP or not np.isfinite(thr) or thr < 0:
        raise ValueError(f"{what} by columns: {k} x {rows} with threshold {thr} (multiples of {S.GROUP}, "
                         "a finite threshold of 0 or more)")
    bias = _vector(bias, rows, f"{what} bias")
    return (_Linear(0, None, None, None, None, None if bias is None else bias.ctypes.data, rows, k),
            _Cols(code, q, scale, mn, float(thr)), (parts, bias))


def _buffer(a, n, what, dtype=np.float32):
    if a.dtype != dtype or not a.flags.c_contiguous or a.size != n:
        raise ValueError(f"{what}: expected {n} contiguous {np.dtype(dtype)} values, got {a.dtype} {a.shape}")
    return a.ctypes.data


class AttentionStep:
    """One layer's attention for one token (decode.c's pinfer_attn_call): (resid, delta) ->
    (resid_out, x_out) as the layer graph computes them without its FFN, the KV cache written at
    the position total - 1."""

    def __init__(self, qkv, out, attn_norm, ffn_norm, *, n_head, n_kv, head_dim, rot, interleaved, eps,
                 scale=0.0, softcap=0.0, qkv_bias=None, out_bias=None, down_bias=None, q_norm=None, k_norm=None,
                 post_norm=None, delta_norm=None, window=0, threads=1, qkv_t=None, out_t=None, kept=None):
        """q_norm, k_norm (head_dim): per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3);
        post_norm (d): RMSNorm of the attention's output (Gemma); delta_norm (d): RMSNorm of delta before
        it joins resid (the previous layer's post-FFN norm, Gemma); window: attend to the last `window`
        positions at most (0: all). qkv_t, out_t: (fmt, parts, threshold) of the projection
        transposed, run by columns (activation sparsity) in place of qkv's or out's rows (then None);
        kept: a (2,) int64 array the calls add the inputs they keep to (q/k/v's, the output's)."""
        d = len(attn_norm)
        if window < 0:
            raise ValueError(f"an attention window of {window} positions")
        if n_head % n_kv or not 0 < rot <= head_dim or rot % 2:
            raise ValueError(f"{n_head} heads over {n_kv} kv heads with RoPE over {rot} of {head_dim} dims "
                             "is not a shape the attention kernel takes")
        n_qkv = (n_head + 2 * n_kv) * head_dim
        self.cols = [_Cols(), _Cols()]
        if qkv_t is None:
            self.qkv, keep_qkv = linear(qkv, n_qkv, d, qkv_bias, "attn_qkv")
        else:
            self.qkv, self.cols[0], keep_qkv = columns(qkv_t, n_qkv, d, qkv_bias, "attn_qkv")
        if out_t is None:
            self.out, keep_out = linear(out, d, n_head * head_dim, out_bias, "attn_output")
        else:
            self.out, self.cols[1], keep_out = columns(out_t, d, n_head * head_dim, out_bias, "attn_output")
        self.norms = tuple(_vector(v, d, name) for v, name in ((attn_norm, "attn_norm"), (ffn_norm, "ffn_norm"),
                                                              (down_bias, "ffn_down bias")))
        self.extra = tuple(_vector(v, n, name) for v, n, name in (
            (q_norm, head_dim, "attn_q_norm"), (k_norm, head_dim, "attn_k_norm"), (post_norm, d, "post_attention_norm"),
            (delta_norm, d, "post_ffw_norm")))
        self.window = int(window)
        self.keep = (keep_qkv, keep_out)
        self.work = np.empty(0, np.float32)     # scratch every bound call shares: they run one at a time
        self.shape = dict(d=d, n_head=n_head, n_kv=n_kv, hd=head_dim, rot=rot)
        self.params = dict(eps=eps, scale=scale or head_dim ** -0.5, softcap=softcap, interleaved=int(interleaved))
        self.threads = threads
        # by columns: the inputs q/k/v's and the output's calls kept, added to in place
        self.kept = np.zeros(2, np.int64) if kept is None else kept
        _buffer(self.kept, 2, "kept", np.int64)

    def bind(self, resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total, back=0):
        """Fix the buffers (float32; k/v_cache (1, n_kv, n_ctx, head_dim) float32 or float16, both
        the same, cos/sin (n_ctx, rot/2), total an int32 scalar array: the cached length once the
        call is done, of which this token is `back` from the end); returns a zero-argument callable."""
        call, ref, work = self._call(1, resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total, back)
        f = _lib.pinfer_attn_call

        def run():
            if f(ref):
                raise ValueError("the attention kernel's position is outside the KV cache")
        run.keep = (call, work, self, resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total)
        return run

    def bind_batch(self, resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total):
        """bind() for the last nt tokens of a call in one call of the kernel (pinfer_attn_batch: each
        weight row read once for all of them): resid ... x_out (nt, d), 1 <= nt <= MAX_BATCH."""
        nt = len(resid)
        if not 1 <= nt <= MAX_BATCH:
            raise ValueError(f"an attention batch is 1 to {MAX_BATCH} tokens, not {nt}")
        call, ref, work = self._call(nt, resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total, 0)
        f = _lib.pinfer_attn_batch

        def run():
            if f(ref, nt):
                raise ValueError("the attention kernel's positions are outside the KV cache")
        run.keep = (call, work, self, resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total)
        return run

    def _call(self, nt, resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total, back):
        sh = self.shape
        d, n_ctx = sh["d"], k_cache.shape[2]
        kv = k_cache.dtype
        if kv not in (np.float32, np.float16):
            raise ValueError(f"k cache: expected float32 or float16 values, got {kv}")
        ptr = lambda a: None if a is None else a.ctypes.data  # noqa: E731
        call = _AttnCall(self.qkv, self.out, *(ptr(v) for v in self.norms), self.params["eps"], self.params["scale"],
                         self.params["softcap"], d, sh["n_head"], sh["n_kv"], sh["hd"], sh["rot"], n_ctx,
                         self.params["interleaved"],
                         *(_buffer(c, sh["n_kv"] * n_ctx * sh["hd"], name, kv) for c, name in ((k_cache, "k cache"),
                                                                                              (v_cache, "v cache"))),
                         *(_buffer(t, n_ctx * (sh["rot"] // 2), name) for t, name in ((cos, "cos"), (sin, "sin"))),
                         _buffer(total, 1, "total", np.int32), back,
                         *(_buffer(a, nt * d, name) for a, name in ((resid, "resid"), (delta, "delta"),
                                                                    (resid_out, "resid_out"), (x_out, "x_out"))),
                         None, self.threads, int(kv == np.float16), *(ptr(v) for v in self.extra), self.window,
                         *self.cols, self.kept.ctypes.data)
        ref = ctypes.byref(call)
        need = _lib.pinfer_attn_work(ref, nt)
        if len(self.work) < need:       # calls bound before keep the smaller buffer they point into
            self.work = np.empty(need, np.float32)
        work = self.work
        call.work = work.ctypes.data
        return call, ref, work


class HeadStep:
    """The head for one token (decode.c's pinfer_head_call): logits = W RMSNorm(resid + delta), delta
    normed first where delta_norm is given."""

    def __init__(self, weight, norm, vocab, *, eps, softcap=0.0, delta_norm=None, threads=1):
        """delta_norm (d): RMSNorm of delta before it joins resid (the last layer's post-FFN norm, Gemma)."""
        self.d = len(norm)
        self.w, self.keep = linear(weight, vocab, self.d, what="head")
        self.norm = _vector(norm, self.d, "output_norm")
        self.delta_norm = _vector(delta_norm, self.d, "post_ffw_norm")
        self.vocab, self.eps, self.softcap, self.threads = vocab, eps, softcap, threads

    def bind(self, resid, delta, logits):
        """One row: resid, delta (d,), logits (vocab,) float32; returns a zero-argument callable."""
        return self.bind_rows(resid, delta, logits)

    def bind_rows(self, resid, delta, logits):
        """nt rows in one call, the head's weights read once for all (1 <= nt <= MAX_BATCH): resid,
        delta (nt, d) and logits (nt, vocab), or one row of each as bind() takes them."""
        nt = len(resid) if np.ndim(resid) == 2 else 1
        if not 1 <= nt <= MAX_BATCH:
            raise ValueError(f"the head takes 1 to {MAX_BATCH} rows a call, not {nt}")
        call = _HeadCall(self.w, self.norm.ctypes.data, self.eps, self.softcap, self.d,
                         _buffer(resid, nt * self.d, "resid"), _buffer(delta, nt * self.d, "delta"),
                         _buffer(logits, nt * self.vocab, "logits"), None, self.threads,
                         None if self.delta_norm is None else self.delta_norm.ctypes.data)
        ref = ctypes.byref(call)
        work = np.empty(_lib.pinfer_head_work(ref, nt), np.float32)
        call.work = work.ctypes.data
        f = _lib.pinfer_head_rows

        def run():
            f(ref, nt)
        run.keep = (call, work, self, resid, delta, logits)
        return run
