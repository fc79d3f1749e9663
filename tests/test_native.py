"""Decode's dense part through pinfer's C kernels (runtime/native.py, pinfer/kernels/csrc/decode.c)
against ONNX Runtime's sessions on the same files, and the head's row dots against NumPy.

Both sides quantize the activations to int8 per group of 32 against the weights' centred values
scale * (q - z) and add a weight's min + z * scale against x itself, so only the order of float sums
differs, and with it, now and then, which way one element of x rounds to int8
(_assert_close_but_for_roundings says the tolerances).
"""

import contextlib
import io

import numpy as np
import pytest

from fixtures import make_tiny_llama_gguf
from test_sparse_kernels import centre, quantized_x
from pinfer.converter.convert import ConvertOptions, convert
from pinfer.converter.passes import DENSE
from pinfer.formats import blocks
from pinfer.formats import schema as S
from pinfer.kernels import ISAS, sparse_isa
from pinfer.kernels.decode import AttentionStep, HeadStep
from pinfer.runtime import autotune, native
from pinfer.runtime.model import Model, RuntimeOptions

BEST = sparse_isa()
AVAILABLE = ISAS[:ISAS.index(BEST) + 1]
IDS = [int(i) for i in np.random.default_rng(3).integers(3, 300, 24)]


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    sparse_isa(BEST)


def _convert(src, out):
    with contextlib.redirect_stderr(io.StringIO()):
        return convert(ConvertOptions(src, out, passes=DENSE))


def _decode(m, ids=IDS, prompt=6):
    m.reset()
    out = [m.forward(ids[:prompt])]
    out += [m.forward([t]) for t in ids[prompt:]]
    return np.concatenate(out)


def _assert_close_but_for_roundings(got, want):
    """Per token, the largest difference of the logits over the largest logit: at float rounding
    (1e-5) for most tokens, and within one int8 step of x (1e-2) for all. Both paths quantize each
    matmul's x to int8 per group of 32 on their own; a last-bit difference upstream (another order
    of the same sums: the C attention's scores or exp against ONNX Runtime's) now and then rounds
    one element of x the other way, which moves the rows it meets by 1/127 of its group's largest
    value times their weights."""
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    assert np.median(err) <= 1e-5 and err.max() <= 1e-2, err
    assert (got.argmax(-1) == want.argmax(-1)).all()


def _kernel_model(path, monkeypatch, **kw):
    """A model whose dense layers decode through the kernel (autotune told to keep it), so that
    their attention and the head run through the C kernels. Its KV cache is f32, as the reference
    sessions' are below: an f16 cache rounds differently in ONNX Runtime's f16 attention (q and
    the heads' output in f16 too) and in the C kernels' (f32 arithmetic over f16 values);
    test_f16_cache_* check that cache."""
    monkeypatch.setattr(autotune, "KEEP_BELOW", 1e9)
    kw.setdefault("kv_type", "f32")
    m = Model(path, RuntimeOptions(threads=kw.pop("threads", 1), n_ctx=64, device="cpu", **kw))
    assert all([L.ffn for L in m.layers]) and all(s is not None for s in [L.native for L in m.layers]) and m.native_head is not None
    assert all(L.attn is None for L in m.layers)      # no attention-only sessions built
    return m


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q5_0", "F16"])
def gguf_file(request, tmp_path_factory):
    d = tmp_path_factory.mktemp("native")
    src = make_tiny_llama_gguf(d / f"t_{request.param}.gguf", qtype=request.param, n_layer=2, d_model=128,
                               n_ff=256, n_head=4, n_head_kv=2, vocab=320, tied_embeddings=request.param == "Q4_1")
    return request.param, _convert(src, d / f"t_{request.param}.pinf")


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("threads", [1, 2])
def test_native_decode_matches_the_sessions(gguf_file, monkeypatch, isa, threads):
    """The formats the converter writes for these tiny GGUFs (q4 with and without min, q5, f16; the
    q8 rows are the head test's and SmolLM2's head): the C kernels' decode against ONNX Runtime's sessions (--dense-kernel off, --ffn-kernel
    off: the reference path), on each instruction set and thread count."""
    qtype, path = gguf_file
    sparse_isa(isa)
    want = _decode(Model(path, RuntimeOptions(threads=1, n_ctx=64, device="cpu", kernels="off", dense_kernel="off",
                                              kv_type="f32")))
    got = _decode(_kernel_model(path, monkeypatch, threads=threads))
    _assert_close_but_for_roundings(got, want)


def test_layers_load_in_order_on_two_threads_and_the_first_failure_is_raised(gguf_file):
    """Model loads its layers `threads` at a time (loading.load_map): results in layer order, and
    of several failing layers the lowest one's error, whichever thread finished first."""
    from pinfer.formats import PinfReader
    from pinfer.runtime.loading import load_map
    run = load_map(2, PinfReader(gguf_file[1]))
    assert run(lambda i: i * i, 7) == [0, 1, 4, 9, 16, 25, 36]

    def fail(i):
        if i in (3, 5):
            raise ValueError(f"layer {i} is damaged")
        return i
    with pytest.raises(ValueError, match="layer 3 is damaged"):
        run(fail, 7)


def test_native_layer_step_matches_the_attention_session(gguf_file):
    """One layer's C call against its attention-only ONNX Runtime session on the same inputs and
    cache: the residual, the FFN's input and the K/V written at the position."""
    qtype, path = gguf_file
    m = Model(path, RuntimeOptions(threads=1, n_ctx=64, device="cpu", kv_type="f32"))  # the FFN's kernel: the C attention
    m.forward(IDS[:5])
    m.bind_activations(1)
    st, rng = m.steps, np.random.default_rng(0)
    m.start(np.asarray([7]), 1)
    i, pos = 1, m.n_past
    st.resid[1].np[...] = rng.standard_normal(st.resid[1].shape)
    st.delta.np[...] = rng.standard_normal(st.delta.shape) * 0.1
    k, v = m.attention.kv[i]
    before = (k.np.copy(), v.np.copy())
    sess = m.devices.session(S.LAYER_GRAPH.format(i), 1, attention_only=True)
    m.attention.bind([None, sess])
    for name, buf in (("resid", st.resid[1]), ("delta", st.delta)):
        sess.bind_in(name, buf)
    sess.bind_out("resid_out", st.resid[0])
    sess.bind_out("ffn_x", st.x)
    sess.run()
    want = [a.copy() for a in (st.resid[0].np, st.x.np, k.np[0, :, pos], v.np[0, :, pos])]
    k.np[...], v.np[...] = before
    native.bind_layer([L.native for L in m.layers][i], m.attention, i, st.resid[1], st.delta, st.resid[0], st.x)()
    got = (st.resid[0].np, st.x.np, k.np[0, :, pos], v.np[0, :, pos])
    for a, b in zip(got, want):
        assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


@pytest.mark.parametrize("isa", AVAILABLE)
def test_f16_cache_holds_the_f32_values_rounded_to_nearest_even(gguf_file, isa):
    """One layer's C call with an f16 KV cache against the same call with an f32 one, both caches
    holding the same (f16-exact) values for the earlier positions: the K/V written at the position
    are the f32 call's rounded to nearest even (NumPy's rounding, and F16C's), and the outputs move
    only by that rounding of one position's K and V (f16 keeps 11 significant bits, 4.9e-4
    relative; 1e-3 of the largest output is twice that)."""
    qtype, path = gguf_file
    sparse_isa(isa)
    models = {kv: Model(path, RuntimeOptions(threads=1, n_ctx=64, device="cpu", kv_type=kv))
              for kv in ("f16", "f32")}       # f16 first: the f32 cache takes its earlier positions
    rng = np.random.default_rng(1)
    inputs = rng.standard_normal((2, 1, 1, models["f32"].cfg.d_model)).astype(np.float32)
    out = {}
    for kv, m in models.items():
        m.forward(IDS[:5])
        m.bind_activations(1)
        m.start(np.asarray([7]), 1)
        st = m.steps
        st.resid[1].np[...], st.delta.np[...] = inputs[0], inputs[1] * 0.1
        k, v = m.attention.kv[1]
        if kv == "f32":         # the earlier positions as the f16 cache holds them
            k16, v16 = models["f16"].attention.kv[1]
            k.np[...], v.np[...] = k16.np.astype(np.float32), v16.np.astype(np.float32)
        native.bind_layer([L.native for L in m.layers][1], m.attention, 1, st.resid[1], st.delta, st.resid[0], st.x)()
        pos = m.n_past
        out[kv] = (st.resid[0].np.copy(), st.x.np.copy(), k.np[0, :, pos].copy(), v.np[0, :, pos].copy())
    for i in (2, 3):
        np.testing.assert_array_equal(out["f16"][i], out["f32"][i].astype(np.float16))
    for got, want in zip(out["f16"][:2], out["f32"][:2]):
        assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


def test_f16_cache_decodes_as_the_f32_one_up_to_its_rounding(gguf_file, monkeypatch):
    """The whole model with the C kernels' decode, f16 against f32 caches: the same greedy tokens
    nearly everywhere. This random tiny model's attention is far sharper than a trained one's (its
    unscaled random q and k give large scores), so the f16 rounding of K and V moves its logits by
    about 1% of the largest (1.0-1.5% measured); SmolLM2's perplexity with each cache is the
    quality check (test_smollm2.py)."""
    qtype, path = gguf_file
    got = _decode(_kernel_model(path, monkeypatch, kv_type="f16"))
    want = _decode(_kernel_model(path, monkeypatch, kv_type="f32"))
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


@pytest.mark.parametrize("fmt", ["q4", "q4-nomin", "q5", "q5-nomin", "q8", "f16", "f32", "f32-40", "q4-576", "q8-576",
                                 "q5-1088", "q8-1088"])
@pytest.mark.parametrize("isa", AVAILABLE)
def test_head_row_dots_against_numpy(fmt, isa):
    """The head's linear (every format decode.c reads) against NumPy: float x against float rows;
    int8 x (per group of 32, amax / 127) against scale * (q - z) rows, plus (min + z * scale) *
    sum(x) where the rows have a min (z: 8 for q4, 16 for q5; q8 stores q + 128 with no min)."""
    sparse_isa(isa)
    rng = np.random.default_rng(1)
    # 3 or 4 groups: chunk tails; 576 (SmolLM2's width): a whole block of 16 groups and 2 more, rows four at a
    # time; 1088: rows past SHORT_ROW, one at a time; f32: any width
    vocab, d = 200, {"f32-40": 40, "q4-576": 576, "q8-576": 576, "q5-1088": 1088, "q8-1088": 1088}.get(fmt, 96 + 32 * (fmt == "q8"))
    base = fmt.split("-")[0]
    parts = (blocks.quantize(base, rng.standard_normal((vocab, d)).astype(np.float32)) if base != "f32"
             else {"w": rng.standard_normal((vocab, d)).astype(np.float32)})
    if fmt.endswith("nomin"):
        parts.pop("min")
    w = blocks.dequantize(base, parts).astype(np.float64)
    norm = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    resid, delta = (rng.standard_normal(d).astype(np.float32) for _ in range(2))
    logits = np.empty(vocab, np.float32)
    HeadStep((base, parts), norm, vocab, eps=1e-5, threads=2).bind(resid, delta, logits)()
    r = resid + delta
    x = (r / np.sqrt((r * r).mean() + 1e-5) * norm).astype(np.float32)
    if base in ("f16", "f32"):
        want = w @ x
    else:
        c = centre(parts, {"q4": 8, "q5": 16}[base]) if "min" in parts else 0.0
        want = (w - c) @ quantized_x(x) + (c @ x.astype(np.float64) if "min" in parts else 0.0)
    assert np.abs(logits - want).max() <= 1e-5 * np.abs(want).max()


@pytest.mark.parametrize("fmt", ["q4", "q5", "q8", "f16", "f32", "q4-4096"])
@pytest.mark.parametrize("isa", AVAILABLE)
def test_head_rows_give_each_row_its_own_calls_bits(fmt, isa):
    """The head over nt rows in one call (pinfer_head_rows: the weights read once) against one call
    per row: the same bits, since each row's dots are the same function over the same row and x
    whatever nt is. Softcap on, 2 threads, 1 to MAX_BATCH rows; 4096 columns take the token tiles."""
    from pinfer.kernels import MAX_BATCH
    sparse_isa(isa)
    base = fmt.split("-")[0]
    rng = np.random.default_rng(11)
    vocab, d = 136, 4096 if fmt == "q4-4096" else 96
    w = rng.standard_normal((vocab, d)).astype(np.float32)
    parts = {"w": w} if base == "f32" else blocks.quantize(base, w)
    step = HeadStep((base, parts), (1 + 0.1 * rng.standard_normal(d)).astype(np.float32), vocab, eps=1e-5,
                    softcap=30.0, threads=2)
    for nt in (1, 3, 5, MAX_BATCH):
        resid, delta = (rng.standard_normal((nt, d)).astype(np.float32) for _ in range(2))
        got, want = np.empty((nt, vocab), np.float32), np.empty((nt, vocab), np.float32)
        step.bind_rows(resid, delta, got)()
        for t in range(nt):
            step.bind(resid[t], delta[t], want[t])()
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="1 to 64 rows"):
        big = np.zeros((MAX_BATCH + 1, d), np.float32)
        step.bind_rows(big, big, np.zeros((MAX_BATCH + 1, vocab), np.float32))


@pytest.mark.parametrize("k", [576, 1088])
@pytest.mark.parametrize("isa", AVAILABLE)
def test_row_dots_bits_do_not_depend_on_the_thread_split(k, isa):
    """A q4 matrix of 1002 rows on 2 threads gives the same bits as on 1. A row read alone sums in
    another order than in a block of four (quants.h), so the threads take whole blocks: split by rows
    (501 each), the first range would end inside a block and read its last row alone. Rows of 576
    columns go four at a time; rows of 1088 (past SHORT_ROW) always alone."""
    sparse_isa(isa)
    rng = np.random.default_rng(k)
    rows = 1002
    parts = blocks.quantize("q4", rng.standard_normal((rows, k)).astype(np.float32))
    norm = np.ones(k, np.float32)
    resid, delta = rng.standard_normal(k).astype(np.float32), np.zeros(k, np.float32)
    out = [np.empty(rows, np.float32) for _ in range(2)]
    for threads, logits in zip((1, 2), out):
        HeadStep(("q4", parts), norm, rows, eps=1e-5, threads=threads).bind(resid, delta, logits)()
    np.testing.assert_array_equal(out[0], out[1])


def _rms(v, g, eps=1e-5):
    return v / np.sqrt((v * v).mean() + eps) * g


def _rotate_half(v, c, s):
    h = len(c)
    return np.concatenate([v[:h] * c - v[h:] * s, v[h:] * c + v[:h] * s])


@pytest.mark.parametrize("hd", [32, 36, 40, 64, 96, 128])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
@pytest.mark.parametrize("isa", AVAILABLE)
def test_attention_step_against_numpy(hd, softcap, isa):
    """One layer's attention call (float weights, so that x is not quantized) against NumPy in
    float64: head widths the scores take as constants (32, 64, 96, 128), a multiple of 8 they take as
    a variable (40), and one that is not (36: AVX-512's masked lanes, the portable loop on AVX2),
    with and without a softcap, over 1 to 37 positions (the scores go four positions at a time: every
    remainder). Float32 sums in another order than NumPy's: 1e-5 of the largest value."""
    sparse_isa(isa)
    rng = np.random.default_rng(hd)
    n_head, n_kv, n_ctx = 4, 2, 48
    d = n_head * hd
    n_qkv = (n_head + 2 * n_kv) * hd
    w_qkv, w_out = ((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32) for shape in ((n_qkv, d), (d, d)))
    g1, g2 = ((1 + 0.1 * rng.standard_normal(d)).astype(np.float32) for _ in range(2))
    step = AttentionStep(("f32", {"w": w_qkv}), ("f32", {"w": w_out}), g1, g2, n_head=n_head, n_kv=n_kv, head_dim=hd,
                         rot=hd, interleaved=False, eps=1e-5, softcap=softcap)
    k_cache, v_cache = (rng.standard_normal((1, n_kv, n_ctx, hd)).astype(np.float32) for _ in range(2))
    angle = np.arange(n_ctx)[:, None] * 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    resid, delta, resid_out, x_out = (np.zeros(d, np.float32) for _ in range(4))
    total = np.zeros(1, np.int32)
    run = step.bind(resid, delta, resid_out, x_out, k_cache, v_cache, cos, sin, total)
    for n in (1, 2, 3, 4, 5, 8, 37):
        resid[...], delta[...] = rng.standard_normal(d), rng.standard_normal(d)
        total[0] = n
        K, V = k_cache.astype(np.float64), v_cache.astype(np.float64)
        r1 = resid.astype(np.float64) + delta
        qkv = w_qkv.astype(np.float64) @ _rms(r1, g1)
        q, k, v = (qkv[:n_head * hd].reshape(n_head, hd), qkv[n_head * hd:(n_head + n_kv) * hd].reshape(n_kv, hd),
                   qkv[(n_head + n_kv) * hd:].reshape(n_kv, hd))
        q = np.stack([_rotate_half(h, cos[n - 1], sin[n - 1]) for h in q])
        K[0, :, n - 1] = np.stack([_rotate_half(h, cos[n - 1], sin[n - 1]) for h in k])
        V[0, :, n - 1] = v
        att = []
        for h in range(n_head):
            scores = K[0, h // (n_head // n_kv), :n] @ q[h] * hd ** -0.5
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            p = np.exp(scores - scores.max())
            att.append(p @ V[0, h // (n_head // n_kv), :n] / p.sum())
        r2 = r1 + w_out.astype(np.float64) @ np.concatenate(att)
        run()
        np.testing.assert_allclose(k_cache[0, :, n - 1], K[0, :, n - 1], rtol=0, atol=1e-5 * np.abs(K).max())
        for got, want in ((resid_out, r2), (x_out, _rms(r2, g2))):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (n, np.abs(got - want).max())


@pytest.mark.parametrize("fmt", ["q4", "q5", "q8", "f16", "f32", "q4-576"])
@pytest.mark.parametrize("kv", [np.float32, np.float16])
@pytest.mark.parametrize("isa", AVAILABLE)
def test_attention_batch_gives_each_token_its_own_calls_bits(fmt, kv, isa):
    """pinfer_attn_batch over a prompt's tokens against one pinfer_attn_call per token, in order,
    from the same cache: the same bits (resid_out, x_out and the cache). Exact because decode.c
    computes each token's dots with the same function over the same row and x whatever the batch
    holds, and a token's heads read the cache up to its own position in the same order. Two
    threads, 1 to MAX_BATCH tokens after 5 cached ones, biases on, GQA (4 heads over 2)."""
    from pinfer.kernels import MAX_BATCH
    sparse_isa(isa)
    base = fmt.split("-")[0]
    rng = np.random.default_rng(7)
    n_head, n_kv, hd, n_ctx = 4, 2, 144 if fmt == "q4-576" else 32, 80
    d = n_head * hd
    n_qkv = (n_head + 2 * n_kv) * hd

    def weight(rows, k):
        w = (rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32)
        return base, {"w": w} if base == "f32" else blocks.quantize(base, w)
    qkv, out = weight(n_qkv, d), weight(d, d)
    g1, g2 = ((1 + 0.1 * rng.standard_normal(d)).astype(np.float32) for _ in range(2))
    step = AttentionStep(qkv, out, g1, g2, n_head=n_head, n_kv=n_kv, head_dim=hd, rot=hd, interleaved=False,
                         eps=1e-5, qkv_bias=rng.standard_normal(n_qkv).astype(np.float32),
                         out_bias=rng.standard_normal(d).astype(np.float32),
                         down_bias=rng.standard_normal(d).astype(np.float32), threads=2)
    angle = np.arange(n_ctx)[:, None] * 10000.0 ** (-np.arange(hd // 2) / (hd // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    start = (rng.standard_normal((1, n_kv, n_ctx, hd)).astype(kv) for _ in range(2))
    k0, v0 = start
    for nt in (1, 2, 7, 58, MAX_BATCH):
        resid, delta = (rng.standard_normal((nt, d)).astype(np.float32) for _ in range(2))
        caches, outs = [], []
        for batch in (False, True):
            k, v = k0.copy(), v0.copy()
            resid_out, x_out = np.zeros((nt, d), np.float32), np.zeros((nt, d), np.float32)
            total = np.array([5 + nt], np.int32)
            if batch:
                step.bind_batch(resid, delta, resid_out, x_out, k, v, cos, sin, total)()
            else:
                for t in range(nt):
                    step.bind(resid[t], delta[t], resid_out[t], x_out[t], k, v, cos, sin, total, nt - 1 - t)()
            caches.append((k, v))
            outs.append((resid_out, x_out))
        for a, b in zip(caches[0] + outs[0], caches[1] + outs[1]):
            np.testing.assert_array_equal(a, b)


def test_attention_batch_refuses_what_does_not_fit():
    """More tokens than MAX_BATCH, or a batch past the cache's end, get one sentence."""
    from pinfer.kernels import MAX_BATCH
    rng = np.random.default_rng(0)
    n_head, hd, n_ctx, d = 2, 32, 8, 64
    w = lambda rows: ("f32", {"w": rng.standard_normal((rows, d)).astype(np.float32)})  # noqa: E731
    step = AttentionStep(w(3 * d), w(d), np.ones(d, np.float32), np.ones(d, np.float32), n_head=n_head, n_kv=n_head,
                         head_dim=hd, rot=hd, interleaved=False, eps=1e-5)
    cos = sin = np.zeros((n_ctx, hd // 2), np.float32)
    k = v = np.zeros((1, n_head, n_ctx, hd), np.float32)
    big = np.zeros((MAX_BATCH + 1, d), np.float32)
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        step.bind_batch(big, big, big, big, k, v, cos, sin, np.array([1], np.int32))
    rows = np.zeros((4, d), np.float32)
    run = step.bind_batch(rows, rows, rows.copy(), rows.copy(), k, v, cos, sin, np.array([n_ctx + 1], np.int32))
    with pytest.raises(ValueError, match="outside the KV cache"):
        run()


def test_prompts_through_the_kernels_batch_call_with_native_attention(gguf_file, monkeypatch):
    """A prompt through the kernel's batch call runs its attention token by token through the C
    kernels, then decode goes on from the same cache: as the graphs' prompt would."""
    qtype, path = gguf_file
    m = _kernel_model(path, monkeypatch)
    want = _decode(m)
    m.prefill_through_kernel(8)
    assert m.batches(6)
    got = _decode(m)
    _assert_close_but_for_roundings(got, want)


def test_refused_layers_keep_their_sessions(tmp_path, monkeypatch):
    """Kinds of layer the C kernels lack keep ONNX Runtime's sessions, and native.refusal says why
    (OPT's LayerNorm and learned positions); decode is still the model's. --dense-kernel off builds
    none of the C steps."""
    pytest.importorskip("transformers")
    from test_hf_models import make_hf_model
    make_hf_model(tmp_path / "opt", "opt")
    path = _convert(tmp_path / "opt", tmp_path / "opt.pinf")
    monkeypatch.setattr(autotune, "KEEP_BELOW", 1e9)
    m = Model(path, RuntimeOptions(threads=1, n_ctx=64, device="cpu", kv_type="f32"))
    assert all(s is None for s in [L.native for L in m.layers]) and m.native_head is None
    assert "LayerNorm" in native.refusal(m.reader, m.cfg, 0) and "LayerNorm" in native.refusal(m.reader, m.cfg)
    [paths] = [n for n in m.notes if n.describe().startswith("paths:")]    # the reasons, said with -v
    assert paths.quiet and f"layers 0-{m.cfg.n_layer - 1}: attention: ONNX Runtime (LayerNorm" in paths.describe()
    assert "FFN: ONNX Runtime's graph (the kernels take gated" in paths.describe(), paths.describe()
    want = _decode(Model(path, RuntimeOptions(threads=1, n_ctx=64, device="cpu", kernels="off", dense_kernel="off",
                                              kv_type="f32")))
    _assert_close_but_for_roundings(_decode(m), want)
    off = Model(path, RuntimeOptions(threads=1, n_ctx=64, device="cpu", dense_kernel="off"))
    assert off.native_head is None and all(s is None for s in [L.native for L in off.layers])


@pytest.mark.parametrize("case", ["llama3.1", "qwen2", "phi3", "llama-tied", "qwen3", "mistral", "gemma2", "gemma3"])
def test_hugging_face_layouts_decode_through_the_c_kernels(tmp_path, monkeypatch, case):
    """Float weights, and what these layouts add: Llama 3's RoPE frequency divisors, Qwen2's qkv
    biases, Phi-3's RoPE over half of each head, a tied head, Qwen3's per-head q/k norms, Mistral's
    sliding window (16 positions: _decode's 24 tokens pass it), Gemma 2's post norms, soft caps and
    windowed layers, Gemma 3's q/k norms and local RoPE base. The C kernels' decode against the
    sessions' within float rounding."""
    pytest.importorskip("transformers")
    from test_hf_models import make_hf_model
    make_hf_model(tmp_path / case, case)
    path = _convert(tmp_path / case, tmp_path / f"{case}.pinf")
    want = _decode(Model(path, RuntimeOptions(threads=1, n_ctx=64, device="cpu", kernels="off", dense_kernel="off",
                                              kv_type="f32")))
    got = _decode(_kernel_model(path, monkeypatch))
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).all()
