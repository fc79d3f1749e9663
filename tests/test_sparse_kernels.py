"""pinfer's sparse FFN kernel (pinfer/kernels/csrc/ffn_sparse.c) against a NumPy reference on the same
block-format weights: every gate/up and down format, every mode, each instruction set this CPU
has, odd sizes, empty and full active sets, and the same bits at any thread count."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pinfer.formats import blocks
from pinfer.kernels import ISAS, SparseFFN, sparse_isa

RNG = np.random.default_rng(7)
BEST = sparse_isa()
AVAILABLE = ISAS[:ISAS.index(BEST) + 1]


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    sparse_isa(BEST)


def centre(parts, z):
    """(n, d) per weight: min + z * scale of its group, the part of a weight with a min that meets
    x itself (the kernels' int8 x meets scale * (q - z), as in the ONNX graphs)."""
    return np.repeat(parts["min"].astype(np.float64) + z * parts["scale"].astype(np.float64), 32, axis=1)


class Rows(np.ndarray):
    """Dense rows (n, d) that remember the part of each weight that meets x itself (centre())."""

    def dot(self, x, xe):
        m = getattr(self, "mins", None)
        return np.asarray(self) @ xe if m is None else (np.asarray(self) - m) @ xe + m @ x.astype(np.float64)


def gate_up(fmt, n, d):
    """(format, parts (n, 2, ...), dense gate (n, d), dense up (n, d)) (the dense ones Rows)."""
    w = RNG.standard_normal((2 * n, d)).astype(np.float32) * 0.2
    base = fmt.split("-")[0]
    parts = blocks.quantize(base, w)
    if fmt.endswith("-nomin"):
        parts.pop("min")
    dense = blocks.dequantize(base, parts).view(Rows)
    if "min" in parts:
        dense.mins = centre(parts, 16 if base == "q5" else 8)
    out = []
    for k in (0, 1):
        rows = dense[k::2].view(Rows)
        rows.mins = dense.mins[k::2] if "min" in parts else None
        out.append(rows)
    return base, {k: v.reshape(n, 2, -1) for k, v in parts.items()}, out[0], out[1]


def down(fmt, n, d):
    """(format, parts, dense W (n, d)) of down_t."""
    w = RNG.standard_normal((d, n)).astype(np.float32) * 0.2   # W_down as GGUF stores it
    if fmt.startswith("q4r"):
        qt = Q.Q4_0 if fmt == "q4r-nomin" else Q.Q4_1
        f, parts = blocks.from_gguf_transposed(qt, quants.quantize(w, qt), d, n)
        return f, parts, blocks.dequantize(f, parts)
    base = "q4" if fmt.startswith("q4") else fmt
    parts = blocks.quantize(base, w.T.copy())
    if fmt == "q4-nomin":
        parts = {"q": parts["q"], "scale": parts["scale"]}
    return base, parts, blocks.dequantize(base, parts)


def predictor(n, d, r, fmt="q8"):
    """A random predictor as SparseFFN takes it: ((fmt, w1 parts), (fmt, w2 parts), b2)."""
    w1 = blocks.quantize(fmt, RNG.standard_normal((r, d)).astype(np.float32) * 0.3)
    w2 = blocks.quantize(fmt, RNG.standard_normal((n, r)).astype(np.float32) * 0.3)
    b2 = RNG.standard_normal(n).astype(np.float32) * 0.1
    return (fmt, w1), (fmt, w2), b2


def quantized_x(x):
    """x as the kernel sees it against int4 rows: int8 per group of 32, scale amax/127."""
    g = x.reshape(-1, 32)
    s = (np.abs(g).max(1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), s, out=np.zeros_like(s), where=s > 0)
    return (np.rint(g * inv[:, None]) * s[:, None]).reshape(-1).astype(np.float64)


def reference(gu_fmt, G_, U_, W, x, act, mode, thr, cand):
    """(y, survivors) in float64; cand: candidate neurons or None for all."""
    xe = quantized_x(x) if gu_fmt in ("q4", "q5") else x.astype(np.float64)
    g, u = G_.dot(x, xe), U_.dot(x, xe)
    if act == "gelu":           # GeGLU's 0.5 g (1 + tanh(z)), z = sqrt(2/pi) (g + 0.044715 g^3), as g sigmoid(2 z):
        # the same function; exp in float32 as the kernel's expf, which overflows (h exactly 0)
        # for g below about -10, where h is under 1e-37 anyway
        with np.errstate(over="ignore"):
            e = np.exp((-2 * np.sqrt(2 / np.pi) * (g + 0.044715 * g ** 3)).astype(np.float32)).astype(np.float64)
        a = g / (1 + e)
    else:
        a = np.maximum(g, 0) if act == "relu" else g / (1 + np.exp(-g))
    h = a * u
    keep = np.ones(len(h), bool) if cand is None else np.isin(np.arange(len(h)), cand)
    if mode in ("down", "predicted"):
        keep &= np.abs(h) >= thr
    keep &= h != 0
    return (h * keep) @ W.astype(np.float64), np.flatnonzero(keep), h


def gap_threshold(values, q):
    """A threshold between two well-separated values near the q quantile, so that float rounding
    in the kernel cannot move a neuron across it."""
    v = np.sort(values)
    k = int(q * (len(v) - 1))
    gaps = np.diff(v[max(0, k - 8):k + 8])
    i = max(0, k - 8) + int(np.argmax(gaps))
    return float((v[i] + v[i + 1]) / 2)


def scores(pred, x):
    """The predictor's logits as the kernel computes them: its q8 or q4 rows against x, then against
    the hidden z, each rounded to int8 per group of 32 as quantized_x does (a q4 row's centre()
    meets them unrounded)."""
    def rows(fmt, parts):
        dense = blocks.dequantize(fmt, parts).view(Rows)
        dense.mins = centre(parts, 8) if "min" in parts else None
        return dense
    (f1, w1), (f2, w2), b2 = pred
    z = np.maximum(rows(f1, w1).dot(x, quantized_x(x)), 0).astype(np.float32)
    return rows(f2, w2).dot(z, quantized_x(z)) + b2


CASES = [("q4", "q4r"), ("q4", "q4"), ("q4-nomin", "q4r-nomin"), ("q4", "q4-nomin"), ("f16", "f16"),
         ("q4-nomin", "f16"), ("f16", "q4r"), ("f32", "f32"), ("q4", "q8"), ("q5", "q4r"), ("q5-nomin", "q8")]


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("gu_fmt, dn_fmt", CASES)
@pytest.mark.parametrize("mode, act", [("dense", "silu"), ("down", "silu"), ("predicted", "silu"),
                                       ("relu", "relu"), ("dense", "relu"), ("dense", "gelu"), ("down", "gelu")])
@pytest.mark.parametrize("n, d", [(96, 96), (64, 160), (128, 288)])
def test_sparse_ffn_matches_numpy(isa, gu_fmt, dn_fmt, mode, act, n, d):
    sparse_isa(isa)
    gf, gparts, G_, U_ = gate_up(gu_fmt, n, d)
    df, dparts, W = down(dn_fmt, n, d)
    pred = predictor(n, d, 32, "q4" if n == 64 else "q8")   # the q4 predictor's rows of 160 and 32 four at a time
    x = RNG.standard_normal(d).astype(np.float32)
    s = scores(pred, x)
    pred_thr = gap_threshold(s, 0.4)
    cand = np.flatnonzero(s >= pred_thr) if mode in ("predicted", "relu") else None
    _, _, h = reference(gf, G_, U_, W, x, act, "dense", 0, None)
    thr = gap_threshold(np.abs(h), 0.3)
    want, keep, _ = reference(gf, G_, U_, W, x, act, mode, thr, cand)

    # layers this small run on one thread whatever `threads` says (PARALLEL_WORK); thread
    # independence is tested on a layer large enough to split, below
    ffn = SparseFFN((gf, gparts), (df, dparts), n, d, act=act, predictor=pred)
    y = np.full(d, np.nan, np.float32)
    counts = ffn(x, y, mode, thr, pred_thr)
    idx, _ = ffn.survivors()
    assert counts == (n if cand is None else len(cand), len(keep))
    assert np.array_equal(idx, keep)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-4 * (np.abs(want).max() + 1e-6))


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_predictor_candidates_at_llama_widths(isa, fmt):
    """The predictor's q8 rows over whole blocks of 16 (8 on AVX2) groups and their tails, or its q4
    rows (W1's 4192 wide one at a time, W2's 448 wide four at a time): x of 4192 (8 blocks and 3
    groups), a rank of 448 (14 groups, as LLaMA-7B's predictors). Every candidate survives (silu,
    |h| >= 0), so the survivors are the candidates. W1 is large enough to split over two threads,
    which give the same bits."""
    sparse_isa(isa)
    n, d, r = 256, 4192, 448
    gf, gparts, G_, U_ = gate_up("q4", n, d)
    df, dparts, W = down("q4r", n, d)
    pred = predictor(n, d, r, fmt)
    x = RNG.standard_normal(d).astype(np.float32)
    s = scores(pred, x)
    ffn = SparseFFN((gf, gparts), (df, dparts), n, d, predictor=pred)
    ffn2 = SparseFFN((gf, gparts), (df, dparts), n, d, predictor=pred, threads=2)
    for q in (0.2, 0.5, 0.9):
        pred_thr = gap_threshold(s, q)
        y, y2 = np.empty(d, np.float32), np.empty(d, np.float32)
        want = np.flatnonzero(s >= pred_thr)
        assert ffn(x, y, "predicted", 0.0, pred_thr) == (len(want), len(want))
        assert np.array_equal(ffn.survivors()[0], want)
        assert ffn2(x, y2, "predicted", 0.0, pred_thr) == (len(want), len(want))
        np.testing.assert_array_equal(y2, y)


@pytest.mark.parametrize("isa", AVAILABLE)
def test_empty_and_full_candidate_sets(isa):
    sparse_isa(isa)
    n, d = 64, 96
    gf, gparts, G_, U_ = gate_up("q4", n, d)
    df, dparts, W = down("q4r", n, d)
    ffn = SparseFFN((gf, gparts), (df, dparts), n, d, predictor=predictor(n, d, 64))
    x = RNG.standard_normal(d).astype(np.float32)
    y = np.full(d, np.nan, np.float32)
    assert ffn(x, y, "predicted", 0.0, np.inf) == (0, 0)
    assert not y.any()
    assert ffn(x, y, "predicted", 0.0, -np.inf)[0] == n
    dense = np.empty(d, np.float32)
    ffn(x, dense, "dense")
    np.testing.assert_array_equal(y, dense)       # every candidate, threshold 0: dense
    assert ffn(x, y, "given", candidates=np.arange(n)) == (n, n)
    np.testing.assert_array_equal(y, dense)
    assert ffn(x, y, "given", candidates=[]) == (0, 0) and not y.any()
    some = np.array([3, 17, 40, 63])
    ffn(x, y, "given", candidates=some)
    want, _, _ = reference(gf, G_, U_, W, x, "silu", "dense", 0, some)
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-4 * np.abs(want).max())
    with pytest.raises(ValueError, match="ascending distinct"):
        ffn(x, y, "given", candidates=[5, 3])


@pytest.mark.parametrize("gu_fmt", ["q4", "q5", "q5-nomin"])
def test_int8_dot_products_agree_across_instruction_sets(gu_fmt):
    """The integer group sums are exact on every path; only the float combination may differ."""
    if len(AVAILABLE) < 2:
        pytest.skip(f"this CPU has only the {BEST} path, so there is nothing to compare")
    n, d = 64, 4096 + 96          # a chunk tail of three groups
    gf, gparts, G_, U_ = gate_up(gu_fmt, n, d)
    df, dparts, W = down("q4", n, d)
    ffn = SparseFFN((gf, gparts), (df, dparts), n, d)
    x = RNG.standard_normal(d).astype(np.float32)
    outs = {}
    for isa in AVAILABLE:
        sparse_isa(isa)
        outs[isa] = np.empty(d, np.float32)
        ffn(x, outs[isa], "dense")
    for isa in AVAILABLE[1:]:
        np.testing.assert_allclose(outs[isa], outs["portable"], rtol=0, atol=1e-5 * np.abs(outs["portable"]).max())


def test_bad_input_is_refused_with_a_sentence():
    n, d = 64, 96
    gf, gparts, _, _ = gate_up("q4", n, d)
    df, dparts, _ = down("q4r", n, d)
    with pytest.raises(ValueError, match="not q8"):
        SparseFFN(("q8", gparts), (df, dparts), n, d)
    with pytest.raises(ValueError, match="scale missing"):
        SparseFFN((gf, {"q": gparts["q"]}), (df, dparts), n, d)
    with pytest.raises(ValueError, match="gate_up.q: expected"):
        SparseFFN((gf, gparts), (df, dparts), n, 128)
    ffn = SparseFFN((gf, gparts), (df, dparts), n, d)
    with pytest.raises(ValueError, match="needs a predictor"):
        ffn(np.zeros(d, np.float32), np.zeros(d, np.float32), "predicted")
    with pytest.raises(ValueError, match="not 96 float32"):
        ffn(np.zeros(d, np.float64), np.zeros(d, np.float32))


@pytest.mark.parametrize("gu_fmt, dn_fmt", [("q4", "q4r"), ("q4", "q4"), ("f16", "q8")])
def test_threads_split_large_layers_without_changing_a_bit(gu_fmt, dn_fmt):
    """Above about a million weights per pass the kernel uses its threads (smaller layers run on
    one); the split must not change the result."""
    n, d = 1088, 1024
    gf, gparts, G_, U_ = gate_up(gu_fmt, n, d)
    df, dparts, W = down(dn_fmt, n, d)
    x = RNG.standard_normal(d).astype(np.float32)
    outs = []
    for threads in (1, 2, 3):
        y = np.empty(d, np.float32)
        assert SparseFFN((gf, gparts), (df, dparts), n, d, threads=threads)(x, y, "dense")[0] == n
        outs.append(y)
    want, _, _ = reference(gf, G_, U_, W, x, "silu", "dense", 0, None)
    np.testing.assert_allclose(outs[0], want, rtol=0, atol=2e-4 * np.abs(want).max())
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("dn_fmt", ["q4r", "q4r-nomin"])
@pytest.mark.parametrize("n, d", [(96, 96), (1088, 1024)])
def test_down_as_row_dots_over_w_down(isa, dn_fmt, n, d):
    """With W_down given (the transpose of a q4r down_t), the down projection runs as row dots once
    rows_from of the neurons survive, h meeting the rows as int8 per group of 32 (as x meets the
    gate/up rows). Below rows_from the axpy runs, exactly as without W_down. The same bits at any
    thread count."""
    sparse_isa(isa)
    gf, gparts, G_, U_ = gate_up("q4", n, d)
    df, dparts, W = down(dn_fmt, n, d)
    x = RNG.standard_normal(d).astype(np.float32)
    _, _, h = reference(gf, G_, U_, W, x, "silu", "dense", 0, None)
    thr = gap_threshold(np.abs(h), 0.5)          # half the neurons survive
    want, keep, _ = reference(gf, G_, U_, W, x, "silu", "down", thr, None)
    plain = SparseFFN((gf, gparts), (df, dparts), n, d)
    y_axpy = np.empty(d, np.float32)
    plain(x, y_axpy, "down", thr)
    # h as the row dots see it: the kernel's own float32 h (the float64 reference's h can round to
    # the other int8 step, one step times a row of W), quantized per group of 32
    idx, hv = plain.survivors()
    assert np.array_equal(idx, keep)
    hq = np.zeros(n, np.float32)
    hq[idx] = hv
    _, rows = blocks.from_transposed_r(df, dparts)      # W_down's mins meet h itself
    mins = centre(rows, 8).T if "min" in rows else np.zeros(W.shape)
    want_rows = quantized_x(hq) @ (W.astype(np.float64) - mins) + hq.astype(np.float64) @ mins
    outs = {}
    for rows_from, threads in ((0.4, 1), (0.4, 2), (0.6, 1)):
        ffn = SparseFFN((gf, gparts), (df, dparts), n, d, threads=threads, down_rows="transpose",
                        rows_from=rows_from)
        y = np.full(d, np.nan, np.float32)
        assert ffn(x, y, "down", thr) == (n, len(keep))
        outs[rows_from, threads] = y
    spread = np.abs(want).max()
    np.testing.assert_allclose(outs[0.4, 1], want_rows, rtol=0, atol=2e-4 * spread)
    assert np.abs(outs[0.4, 1] - want).max() < 2e-2 * spread
    np.testing.assert_array_equal(outs[0.4, 2], outs[0.4, 1])
    np.testing.assert_array_equal(outs[0.6, 1], y_axpy)      # 50% survive: under 0.6, the axpy


def test_down_rows_are_checked():
    n, d = 64, 96
    gf, gparts, _, _ = gate_up("q4", n, d)
    df, dparts, _ = down("q4r", n, d)
    plain, rows = blocks.from_transposed_r(df, dparts)
    with pytest.raises(ValueError, match=r"down rows.q: expected .* shape \(96, 32\)"):
        SparseFFN((gf, gparts), (df, dparts), n, d, down_rows=(plain, {**rows, "q": rows["q"][:, :16].copy()}))
    with pytest.raises(ValueError, match="down rows in"):
        SparseFFN((gf, gparts), (df, dparts), n, d, down_rows=("q8", rows))
    with pytest.raises(ValueError, match="rows_from 1.5"):
        SparseFFN((gf, gparts), (df, dparts), n, d, down_rows=(plain, rows), rows_from=1.5)


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("dn_fmt", ["q4r", "q4r-nomin"])
def test_q4r_groups_of_few_and_many_survivors(isa, dn_fmt):
    """q4r down: on AVX-512 every group of 32 neurons takes one fused pass whatever its survivors
    (1 to 32 here), the other paths the buffered one; against NumPy, in one call."""
    sparse_isa(isa)
    n, d = 256, 160
    gf, gparts, G_, U_ = gate_up("q4", n, d)
    df, dparts, W = down(dn_fmt, n, d)
    x = RNG.standard_normal(d).astype(np.float32)
    # groups 0-3: 1, 3, 4 and 5 survivors; groups 4-7: every neuron
    cand = np.concatenate([[5], [32, 40, 63], [64, 70, 80, 95], [96, 97, 110, 120, 127], np.arange(128, 256)])
    want, keep, _ = reference(gf, G_, U_, W, x, "silu", "given", 0.0, cand)
    y = np.full(d, np.nan, np.float32)
    assert SparseFFN((gf, gparts), (df, dparts), n, d)(x, y, "given", 0.0, candidates=cand.astype(np.int32)) \
        == (len(cand), len(keep))
    np.testing.assert_allclose(y, want, rtol=0, atol=2e-4 * np.abs(want).max())


def per_token(ffn, x, mode, thr, pred_thr, cands=None):
    """Each row of x through its own single-token call: (y, counts, survivors)."""
    ys, counts, kept = np.empty_like(x), [], []
    for t in range(len(x)):
        counts.append(ffn(x[t], ys[t], mode, thr, pred_thr, candidates=None if cands is None else cands[t]))
        kept.append(ffn.survivors())
    return ys, counts, kept


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("gu_fmt, dn_fmt", CASES)
@pytest.mark.parametrize("mode, act", [("dense", "silu"), ("down", "silu"), ("predicted", "silu"),
                                       ("relu", "relu"), ("given", "silu"), ("predicted", "gelu")])
def test_batch_gives_each_token_its_single_call_bits(isa, gu_fmt, dn_fmt, mode, act):
    """The batch entry (prefill over the union of the tokens' candidates) reproduces every token's
    single call bit for bit: its candidates, survivors and output. n = 288 spans three of the down
    pass's blocks of 128 neurons; tokens draw different candidate sets."""
    sparse_isa(isa)
    n, d, nt = 288, 160, 7
    gf, gparts, G_, U_ = gate_up(gu_fmt, n, d)
    df, dparts, W = down(dn_fmt, n, d)
    pred = predictor(n, d, 32, "q4" if mode == "relu" else "q8")
    x = RNG.standard_normal((nt, d)).astype(np.float32)
    pred_thr = gap_threshold(scores(pred, x[2]), 0.6)     # token 2 meets the float64 reference below
    _, _, h = reference(gf, G_, U_, W, x[0], act, "dense", 0, None)
    thr = gap_threshold(np.abs(h), 0.3)
    cands = [np.sort(RNG.choice(n, size=k, replace=False)).astype(np.int32) for k in (0, 1, 30, 100, 200, 288, 57)]
    ffn = SparseFFN((gf, gparts), (df, dparts), n, d, act=act, predictor=pred)
    want, want_counts, want_kept = per_token(ffn, x, mode, thr, pred_thr, cands if mode == "given" else None)
    y = np.full((nt, d), np.nan, np.float32)
    run = ffn.bind_batch(x, y, mode, thr, pred_thr)
    if mode == "given":
        run.set_candidates(cands)
    assert run() == tuple(np.sum(want_counts, axis=0))
    for t in range(nt):
        assert tuple(run.counts[t]) == want_counts[t]
        s = want_counts[t][1]
        assert np.array_equal(run.idx[t, :s], want_kept[t][0]) and np.array_equal(run.val[t, :s], want_kept[t][1])
    np.testing.assert_array_equal(y, want)
    ref, _, _ = reference(gf, G_, U_, W, x[2], act, mode if mode != "given" else "down", thr,
                          cands[2] if mode == "given" else None if mode in ("dense", "down") else
                          np.flatnonzero(scores(pred, x[2]) >= pred_thr))
    np.testing.assert_allclose(y[2], ref, rtol=0, atol=2e-4 * (np.abs(ref).max() + 1e-6))


@pytest.mark.parametrize("isa", AVAILABLE)
def test_batch_with_row_dots_and_threads(isa):
    """Tokens past rows_from take the row dots over W_down, the others the axpy, in one batch; a
    layer large enough to split over threads gives the same bits on 1 and 2 threads, equal to the
    single calls. 64 tokens (the most) pass, 65 are refused with a sentence."""
    sparse_isa(isa)
    n, d = 1088, 1024
    gf, gparts, G_, U_ = gate_up("q4", n, d)
    df, dparts, W = down("q4r", n, d)
    x = RNG.standard_normal((64, d)).astype(np.float32)
    cands = [np.sort(RNG.choice(n, size=int(k), replace=False)).astype(np.int32)
             for k in np.linspace(0, n, 64)]
    outs = []
    for threads in (1, 2):
        ffn = SparseFFN((gf, gparts), (df, dparts), n, d, threads=threads, down_rows="transpose", rows_from=0.5)
        want, want_counts, _ = per_token(ffn, x, "given", 0.0, 0.0, cands)
        assert sum(c[1] >= ffn.rows.from_ for c in want_counts) > 10 and sum(c[1] < ffn.rows.from_ for c in want_counts) > 10
        y = np.empty_like(x)
        run = ffn.bind_batch(x, y, "given")
        run.set_candidates(cands)
        run()
        np.testing.assert_array_equal(y, want)
        outs.append(y)
    np.testing.assert_array_equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        ffn.bind_batch(np.zeros((65, d), np.float32), np.zeros((65, d), np.float32))


@pytest.mark.parametrize("isa", AVAILABLE)
@pytest.mark.parametrize("gu_fmt", ["q4", "q5"])
@pytest.mark.parametrize("nt", [2, 5, 64])
def test_dense_batch_of_wide_rows_gives_each_token_its_single_call_bits(isa, gu_fmt, nt):
    """A dense batch over rows wider than SHORT_ROW (as at 7B shapes) takes the gate/up bundle as one
    matrix and W_down's rows for every token through pinfer_q4_rows' tiles of four tokens
    (AVX-512); each token still gets its single call's bits, on 1 and 2 threads. nt 5: a tile's
    last tokens alone; 1088 columns: a partial block of sixteen groups; n 1056: rows past the last
    whole tile."""
    sparse_isa(isa)
    n, d = 1056, 1088
    gf, gparts, _, _ = gate_up(gu_fmt, n, d)
    df, dparts, _ = down("q4r", n, d)
    x = RNG.standard_normal((nt, d)).astype(np.float32)
    for threads in (1, 2):
        ffn = SparseFFN((gf, gparts), (df, dparts), n, d, threads=threads, down_rows="transpose", rows_from=0.5)
        want, _, _ = per_token(ffn, x, "dense", 0.0, 0.0)
        y = np.empty_like(x)
        ffn.bind_batch(x, y, "dense")()
        np.testing.assert_array_equal(y, want)
