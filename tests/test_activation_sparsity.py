"""Training-free activation sparsity (issue 40): the column-skipping kernel (kernels.Columns) against
NumPy at every instruction set, and the PyTorch reference of converter/passes/activation.py against
the calibration model's own layer."""

import math
import tempfile
from pathlib import Path

import numpy as np
import pytest

from pinfer.formats import blocks
from pinfer.kernels import Columns, sparse_isa

BEST = sparse_isa()
FORMATS = ("q4r", "q4", "q8", "f16", "f32")


def weight(fmt, n, d, rng):
    if fmt == "q4r":
        return {"q": rng.integers(0, 256, (n, d // 2), np.uint8), "scale": (rng.random((n // 32, d)) * 0.01).astype(np.float16)}
    if fmt == "q4":
        return {"q": rng.integers(0, 256, (n, d // 2), np.uint8), "scale": (rng.random((n, d // 32)) * 0.01).astype(np.float16),
                "min": (rng.random((n, d // 32)) * -0.05).astype(np.float16)}
    if fmt == "q8":
        return {"q": rng.integers(0, 256, (n, d), np.uint8), "scale": (rng.random((n, d // 32)) * 0.01).astype(np.float16)}
    return {"w": rng.standard_normal((n, d)).astype(np.float16 if fmt == "f16" else np.float32)}


def int8_bound(fmt, x, keep, W):
    """Per output, how far int8 inputs can move it: half a step of each kept input's group times |w|."""
    if fmt != "q4r" or sparse_isa() == "portable":
        return 0.0
    xk = np.where(keep, np.abs(x), 0).reshape(-1, 32)
    half_step = np.repeat(xk.max(1) / 127 / 2, 32)
    return (np.where(keep, half_step, 0) @ np.abs(W)) * 1.001


@pytest.fixture
def each_isa():
    yield
    sparse_isa(BEST)


@pytest.mark.parametrize("isa", ["avx512", "avx2", "portable"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_columns_sum_the_kept_rows_as_numpy_does(fmt, isa, each_isa):
    if sparse_isa(isa) != isa:
        pytest.skip(f"this CPU has no {isa} path (its best: {BEST})")
    rng = np.random.default_rng(3)
    n, d = 512, 1024        # kept rows x d over PARALLEL_WORK: two threads split the columns
    parts = weight(fmt, n, d, rng)
    W = blocks.dequantize(fmt, parts).reshape(n, d).astype(np.float64)
    x = rng.standard_normal(n).astype(np.float32)
    x[::7] = 0.0            # a zero input is never read, whatever the threshold
    out = {}
    for level in (0.0, 0.4, 0.9):
        t = float(np.quantile(np.abs(x), level)) if level else 0.0
        keep = (np.abs(x) >= t) & (x != 0)
        ref = np.where(keep, x, 0).astype(np.float64) @ W
        for threads in (1, 2):
            c = Columns(fmt, parts, n, d, threads)
            y = np.full(d, np.nan, np.float32)
            assert c(x, y, t) == keep.sum()
            assert np.array_equal(c.idx[:keep.sum()], np.flatnonzero(keep))     # the survivors, ascending
            # float32 sums of up to 512 terms: relative error well under 1e-5 of the largest output;
            # where the kept inputs meet the rows as int8 (q4r on AVX-512 and AVX2: per group of 32, amax / 127,
            # rounded) each input may be off by half a step, each output by the sum of those times |w|
            tol = 1e-5 * np.abs(ref).max() + int8_bound(fmt, x, keep, W)
            assert np.all(np.abs(y - ref) <= tol), (np.abs(y - ref) / tol).max()
            out[(level, threads)] = y.copy()
        # every output element is summed by one thread in ascending input order: the same bits
        assert np.array_equal(out[(level, 1)], out[(level, 2)])


def test_columns_refuse_what_they_cannot_read():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="multiples of 32"):
        Columns("q4r", weight("q4r", 64, 32, rng), 64, 40)
    with pytest.raises(ValueError, match="the kernels take"):
        Columns("q5", {}, 64, 64)
    c = Columns("q4r", weight("q4r", 64, 64, rng), 64, 64)
    with pytest.raises(ValueError, match="x: expected"):
        c(np.zeros(32, np.float32), np.zeros(64, np.float32))


def _source(gguf):
    from pinfer.converter.convert import ConvertOptions, _front_end
    with tempfile.TemporaryDirectory() as d:
        return _front_end(ConvertOptions(source=str(gguf), output=str(Path(d) / "x.pinf")))


def test_the_reference_is_the_calibration_model_and_drops_what_it_says(silu_gguf):
    torch = pytest.importorskip("torch")
    from pinfer.converter.passes import activation as A
    from pinfer.converter.passes import calib_data
    from pinfer.converter.passes import calibrate
    from pinfer.converter.passes import torch_llama as TL
    from pinfer.runtime.tokenizer import Tokenizer
    fe = _source(silu_gguf)
    src, names, cfg = fe.src, fe.roles, fe.cfg
    cs = calib_data.build(Tokenizer.from_spec(fe.tokenizer), None, 64, 4096, 256)
    evaluated = cs.heldout[:4]
    configs = {"dense": {}, "all 0.5": dict.fromkeys(A.PROJECTIONS, 0.5), "down 0.5": {"down": 0.5}}
    embed, head = TL.Embedding(src, names), TL.Head(src, names, cfg)
    thresholds = A.thresholds(src, names, cfg, cs.train, embed, (0.5,))
    res = A.evaluate(src, names, cfg, evaluated, embed, head, thresholds, configs)

    # dense: the calibration model's own layer (attention, FFN input and hidden, down), no tap
    rot = TL.Rotary(cfg, evaluated.shape[1])
    with torch.no_grad():
        h = embed(evaluated)
        for i in range(cfg.n_layer):
            w = TL.load_layer(src, names, i)
            res_h, _, hact = calibrate.forward_ffn(h, w, cfg, rot)
            h = res_h + TL.ffn_output(hact @ w.down.T, w, cfg)
        first = evaluated.shape[1] // 2
        targets = torch.from_numpy(np.ascontiguousarray(evaluated[:, first + 1:]).reshape(-1))
        nll = float(head.nll(h[:, first:-1].reshape(-1, cfg.d_model), targets).mean())
    # the same PyTorch operations in the same order on the same inputs: equal but for the last bits
    assert math.isclose(res["dense"][0], nll, rel_tol=1e-6)
    assert all(v == 0 for v in res["dense"][1].values())
    # thresholds rise with the level; the held-out text drops near the calibrated share
    for per in thresholds:
        assert all(0 < per[p][0.5] for p in A.PROJECTIONS)
    dropped = res["all 0.5"][1]
    assert all(0.3 < dropped[p] < 0.7 for p in A.PROJECTIONS), dropped
    assert res["down 0.5"][1]["qkv"] == 0 and 0.3 < res["down 0.5"][1]["down"] < 0.7
    # dropping inputs moves the loss
    assert res["all 0.5"][0] != res["dense"][0]


def test_the_column_ffn_is_the_transposed_bundle_under_both_thresholds(each_isa):
    """kernels.ColumnFFN over transpose_gate_up's layout against NumPy: the transpose is exact, and
    the layer is act(gate x') * (up x') with x' = x under thr_x dropped, h under thr_h dropped."""
    from pinfer.kernels import ColumnFFN, transpose_gate_up
    rng = np.random.default_rng(7)
    n, d = 256, 128
    for with_min in (False, True):
        gu = {"q": rng.integers(0, 256, (n, 2, d // 2), np.uint8),
              "scale": (rng.random((n, 2, d // 32)) * 0.05).astype(np.float16)}
        if with_min:
            gu["min"] = (-rng.random((n, 2, d // 32)) * 0.3).astype(np.float16)
        dn = weight("q4r", n, d, rng)
        W = blocks.dequantize("q4", {k: v.reshape(2 * n, -1) for k, v in gu.items()}).reshape(n, 2, d)
        t = transpose_gate_up("q4", gu, n, d)
        Wt = blocks.dequantize(*t).reshape(d, 2 * n)
        assert np.array_equal(Wt[:, 0::2], W[:, 0].T) and np.array_equal(Wt[:, 1::2], W[:, 1].T)
        x = rng.standard_normal(d).astype(np.float32)
        tx = float(np.quantile(np.abs(x), 0.4))
        xs = np.where(np.abs(x) >= tx, x, 0).astype(np.float64)
        g, u = W[:, 0] @ xs, W[:, 1] @ xs
        h = g / (1 + np.exp(-g)) * u
        th = float(np.quantile(np.abs(h), 0.3))
        ref = np.where(np.abs(h) >= th, h, 0) @ blocks.dequantize("q4r", dn).reshape(n, d)
        for isa in ("portable", BEST):
            sparse_isa(isa)
            y = np.empty(d, np.float32)
            kept_x, kept_h = ColumnFFN(t, ("q4r", dn), n, d, "silu", 2, tx).bind(x, y, "down", th)()
            assert kept_x == (xs != 0).sum() * n // d
            # the int8 paths quantize x and h per group of 32 (amax / 127): a neuron within a step
            # of thr_h may fall on the other side; the output moves by about 1% of its largest value
            assert abs(kept_h - (np.abs(h) >= th).sum()) <= 3
            assert np.abs(y - ref).max() < (1e-5 if isa == "portable" else 0.05) * np.abs(ref).max()


@pytest.fixture(scope="module")
def act_file(tmp_path_factory):
    """The tiny SiLU model converted with calibration and --activation-thresholds."""
    from fixtures import convert_tiny_silu
    return convert_tiny_silu(tmp_path_factory.mktemp("act"), activation=True)


def _decode(model, ids):
    model.reset()
    return np.concatenate([model.forward([t]) for t in ids])


def test_activation_sparsity_decodes_as_the_reference_drops(act_file):
    """The runtime's --activation-sparsity 0.3 on the tiny calibrated file, token by token, against
    the PyTorch reference (activation.layer_forward) with the file's own thresholds for all four
    projections' inputs: the same next tokens and logits within the int8 paths' error; about 70% of
    the FFN inputs kept."""
    torch = pytest.importorskip("torch")
    from pinfer.converter.passes import activation as A
    from pinfer.converter.passes import torch_llama as TL
    from pinfer.kernels import ColumnFFN
    from pinfer.runtime.model import Model, RuntimeOptions
    m = Model(act_file, RuntimeOptions(activation=0.3, kernels="on", sparsity="dense", threads=1))
    assert all(isinstance(f.kernel, ColumnFFN) for f in [L.ffn for L in m.layers])
    assert all(s.cols[0].q and s.cols[1].q for s in [L.native for L in m.layers])        # q/k/v and output by columns
    said = "\n".join(n.describe() for n in m.notes)
    assert "attention: C kernels, by columns; FFN: columns, activation sparsity 0.3" in said, said
    layers = m.reader.header["layers"]
    ids = list(np.random.default_rng(0).integers(3, m.cfg.vocab, 48))
    got = _decode(m, ids)
    gu, down = m.counters.fractions()
    # the thresholds were taken on the model as it runs at 0.3: about 70% of each input kept here too
    assert 0.6 < gu < 0.8 and 0.6 < down < 0.8, (gu, down)

    fe = _source(act_file.with_name("silu.gguf"))
    src, names, cfg = fe.src, fe.roles, fe.cfg
    embed, head, rot = TL.Embedding(src, names), TL.Head(src, names, cfg), TL.Rotary(cfg, len(ids))
    refs, taps = {}, []
    with torch.no_grad():
        for name, level in (("sparse", "0.3"), ("dense", None)):
            h = embed(np.asarray([ids]))
            for i in range(cfg.n_layer):
                t = {p: layers[i]["input_thresholds"][p][level] for p in A.PROJECTIONS} if level else {}
                taps.append(A.Sparsifier(t))
                h = A.layer_forward(h, TL.load_layer(src, names, i), cfg, rot, taps[-1])
            refs[name] = head.logits(h)[0].numpy()
    # the attention's inputs kept, as the runtime counts them (Counters.attn_kept) and as the reference
    # drops them, per layer and projection: the same decisions but where an input lies within float32
    # rounding of its threshold (x is computed in another order), so within 2% of the inputs
    from pinfer.runtime.accounting import attention_shares
    shares = attention_shares(m)
    for i in range(cfg.n_layer):
        for p, base in (("qkv", f"blk.{i}.attn_qkv"), ("o", f"blk.{i}.attn_output")):
            dropped, total = taps[i].dropped[p]
            assert abs(shares[base] - (1 - dropped / total)) < 0.02, (i, p, shares[base], dropped / total)
    spread = np.abs(refs["sparse"]).max()
    top1 = {k: (got.argmax(-1) == r.argmax(-1)).mean() for k, r in refs.items()}
    # int8 activations and the f16 KV cache against float32 (dense against dense: 2% of the range at
    # most, every top-1 the same), and an input within an int8 step of its threshold may land on the
    # other side of it: an error of that input's share (here up to 17% of the range), which flips the
    # closer calls of this random model (a sixth of its top-2 gaps are under 0.04)
    err = np.abs(got - refs["sparse"])
    assert err.max() < 0.25 * spread
    assert top1["sparse"] >= 0.75 and top1["sparse"] > top1["dense"] + 0.15, top1
    # what ran is the reference with the thresholds, not without: its mean error a quarter of the
    # other's here (a path ignoring a projection's threshold would sit nearer the dense reference)
    assert err.mean() < 0.5 * np.abs(got - refs["dense"]).mean()


def test_activation_sparsity_needs_calibrated_thresholds(silu_file, tmp_path):
    from fixtures import convert_tiny_silu
    from pinfer.converter.passes import activation as A
    from pinfer.runtime.model import Model, RuntimeOptions
    with pytest.raises(ValueError, match="has no thresholds .*for activation sparsity 0.3 .*--activation-thresholds"):
        Model(silu_file, RuntimeOptions(activation=0.3, kernels="on"))     # calibrated, but without them
    with pytest.raises(ValueError, match="is not auto or a share of inputs"):
        RuntimeOptions(activation=1.5)
    with pytest.raises(ValueError, match="'most' is not auto or a share of inputs"):
        RuntimeOptions(activation="most")       # through the API, not the CLI's parser: one sentence too
    # --activation-thresholds records them without the rest of calibration; the layers stay dense
    (tmp_path / "recorded").mkdir()
    recorded = convert_tiny_silu(tmp_path / "recorded", sparsity="none", activation=True)
    m = Model(recorded, RuntimeOptions(activation=0.3, kernels="on", threads=1))
    layers = m.reader.header["layers"]
    assert all(lay["mode"] == "dense" and set(lay["input_thresholds"]) == set(A.PROJECTIONS) for lay in layers)
    assert all(0 < lay["input_thresholds"]["gate_up"]["0.3"] < lay["input_thresholds"]["gate_up"]["0.5"] for lay in layers)
    assert np.isfinite(_decode(m, [5, 6, 7])).all()
    gu, down = m.counters.fractions()
    assert 0.6 < gu < 0.8 and 0.6 < down < 0.8, (gu, down)


def test_converter_chooses_levels_within_the_perplexity_budget(act_file):
    """convert --activation-thresholds records the level per projection (activation.choose): the
    highest model-wide level within --max-ppl-increase, then greedy one-level steps that stay within
    it; every configuration it measured is in the curve, the chosen one within the budget."""
    from pinfer.converter.passes import activation as A
    from pinfer.formats.reader import PinfReader
    rec = PinfReader(act_file).header["sparsity"]["activation"]
    budget, chosen, curve = rec["max_ppl_increase"], rec["chosen"], rec["curve"]
    assert set(chosen) == set(A.PROJECTIONS) and budget == 0.01
    uniform = curve[:len(A.LEVELS)]
    assert [c["levels"] for c in uniform] == [dict.fromkeys(A.PROJECTIONS, s) for s in A.LEVELS]
    best = max([0.0] + [s for s, c in zip(A.LEVELS, uniform) if c["ppl_increase"] <= budget])
    assert min(chosen.values()) == best
    if any(chosen.values()):
        spent = next(c for c in curve if c["levels"] == chosen)["ppl_increase"]
        assert spent <= budget
    # a level drops about that share of each input (thresholds taken on the model as it runs)
    for s, c in zip(A.LEVELS, uniform):
        assert all(abs(d - s) < 0.05 for d in c["dropped"].values()), (s, c)


def test_evaluate_is_the_reference_forward(act_file):
    """activation.evaluate's NLL of a mixed configuration equals the layers run one by one through
    layer_forward with the file's thresholds and the head's NLL of the second halves."""
    torch = pytest.importorskip("torch")
    from pinfer.converter.passes import activation as A
    from pinfer.converter.passes import torch_llama as TL
    from pinfer.formats.reader import PinfReader
    fe = _source(act_file.with_name("silu.gguf"))
    src, names, cfg = fe.src, fe.roles, fe.cfg
    layers = PinfReader(act_file).header["layers"]
    found = [{p: {float(k): v for k, v in lay["input_thresholds"][p].items()} for p in A.PROJECTIONS}
             for lay in layers]
    ids = np.random.default_rng(1).integers(3, cfg.vocab, (3, 24))
    levels = {"qkv": 0.3, "o": 0.1, "gate_up": 0.0, "down": 0.5}
    embed, head = TL.Embedding(src, names), TL.Head(src, names, cfg)
    got = A.evaluate(src, names, cfg, ids, embed, head, found, {"mix": levels, "dense": {}})
    rot = TL.Rotary(cfg, ids.shape[1])
    for name, lv in (("mix", levels), ("dense", {})):
        with torch.no_grad():
            h = embed(ids)
            for i in range(cfg.n_layer):
                t = {p: found[i][p][s] for p, s in lv.items() if s}
                h = A.layer_forward(h, TL.load_layer(src, names, i), cfg, rot, A.Sparsifier(t))
            nll = head.nll(h[:, 12:-1].reshape(-1, cfg.d_model), torch.from_numpy(ids[:, 13:].reshape(-1))).mean()
        # the same float32 operations in batches of 4 sequences against all 3 at once: the order of
        # the matmuls' sums may differ, far under what a level moves (0.1% or more here)
        assert got[name][0] == pytest.approx(float(nll), rel=1e-5)
    assert got["mix"][1]["gate_up"] == 0 and 0.45 < got["mix"][1]["down"] < 0.55


def test_activation_sparsity_auto_runs_the_chosen_levels(act_file, silu_file):
    """--activation-sparsity auto reads each projection's chosen level: the FFN's thresholds are
    those levels' thresholds, the path note names them; a file without a choice gets one sentence."""
    from pinfer.formats.reader import PinfReader
    from pinfer.runtime.model import Model, RuntimeOptions
    header = PinfReader(act_file).header
    chosen = header["sparsity"]["activation"]["chosen"]
    m = Model(act_file, RuntimeOptions(activation="auto", kernels="on", sparsity="dense", threads=1))
    for i, f in enumerate([L.ffn for L in m.layers]):
        th = header["layers"][i]["input_thresholds"]
        want_x = th["gate_up"][f"{chosen['gate_up']:g}"] if chosen["gate_up"] else 0.0
        assert f.kernel.thr_x == pytest.approx(want_x)
        assert float(f.threshold) == pytest.approx(th["down"][f"{chosen['down']:g}"] if chosen["down"] else 0.0)
    said = "\n".join(n.describe() for n in m.notes)
    assert "activation sparsity auto (qkv " in said, said
    loud = [n.describe() for n in m.notes if not n.quiet]      # said without -v
    assert any(t.startswith("activation sparsity auto (qkv ") and "the converter's choice within +1.0% held-out "
               "perplexity" in t for t in loud), loud
    assert np.isfinite(_decode(m, [5, 6, 7])).all()
    with pytest.raises(ValueError, match="records no activation sparsity level per projection"):
        Model(silu_file, RuntimeOptions(activation="auto", kernels="on", sparsity="dense"))


@pytest.mark.parametrize("record", [{"chosen": {"qkv": "x"}}, {"chosen": [0.2]}, {"chosen": {"qkv": 2.0, "o": 0.2,
                                    "gate_up": 0.2, "down": 0.2}}, "junk", {"chosen": None}])
def test_a_malformed_activation_record_gets_one_sentence(record, capsys):
    """A stranger's file may say anything in sparsity.activation: --activation-sparsity auto and
    pinfer inspect answer with one sentence, never a traceback."""
    from pinfer.cli.inspect import _activation
    from pinfer.runtime.sparse import activation_levels
    with pytest.raises(ValueError, match="records no activation sparsity level per projection"):
        activation_levels({"sparsity": {"activation": record}}, "auto")
    _activation(record)
    assert capsys.readouterr().out.strip() == "activation (the file's record of it is malformed)"


@pytest.mark.parametrize("record", [
    {"chosen": {"qkv": 0.2}, "max_ppl_increase": 10 ** 400, "dense_ppl": 1},        # JSON's unbounded ints
    {"chosen": {"qkv": 0.2}, "max_ppl_increase": 0.01, "dense_ppl": 17.0,
     "curve": [{"levels": {"qkv": 0.2}, "ppl_increase": 0.1}, {"levels": 5}]}])     # a bad row after a good one
def test_inspect_prints_a_malformed_record_as_one_line_only(record, capsys):
    from pinfer.cli.inspect import _activation
    _activation(record)
    assert capsys.readouterr().out.strip() == "activation (the file's record of it is malformed)"


def test_cli_inspect_and_generate_with_auto(act_file):
    """pinfer inspect shows the chosen levels and the curve; generate runs them; a level that is
    not a number is refused in one line."""
    import subprocess
    import sys

    def pinfer(*args):
        return subprocess.run([sys.executable, "-m", "pinfer", *map(str, args)], capture_output=True, text=True,
                              timeout=300)
    r = pinfer("inspect", act_file)
    assert r.returncode == 0 and "(--activation-sparsity auto), within +1.0% of held-out PPL" in r.stdout, r.stdout
    assert "levels 0.5 0.5 0.5 0.5" in r.stdout
    r = pinfer("-v", "generate", act_file, "-p", "Hello", "-n", "4", "--temp", "0", "--activation-sparsity", "auto")
    assert r.returncode == 0, r.stderr
    # no timing against ONNX Runtime's graphs, which compute something else: prompts by columns too
    assert "untimed: with activation sparsity every layer runs through the C kernels" in r.stderr, r.stderr
    assert "dense graphs" not in r.stderr and "FFN: columns, activation sparsity auto (qkv" in r.stderr
    r = pinfer("bench", act_file, "-p", "0", "-n", "4", "-r", "1", "-t", "1", "-o", "json", "--activation-sparsity", "auto")
    assert r.returncode == 0 and '"sparsity": "' in r.stdout and ', activation auto"' in r.stdout, r.stdout
    r = pinfer("generate", act_file, "-p", "Hello", "-n", "4", "--activation-sparsity", "most")
    assert r.returncode != 0 and "'most' is not a share of inputs such as 0.2, or auto" in r.stderr
    assert "Traceback" not in r.stderr


def _with_chosen(src, dst, chosen):
    """A copy of src whose header's chosen levels are `chosen`, in place (padded to the same length,
    the preamble's digest made again), every tensor where it was."""
    import hashlib
    import json
    import re

    from pinfer.formats import schema as S
    data = bytearray(src.read_bytes())
    magic, ver, res, off, length, _ = S.PREAMBLE.unpack_from(data, 0)
    blob = data[off:off + length].decode()
    m = re.search(r'"chosen":\s*\{[^}]*\}', blob[blob.index('"activation":'):])
    start = blob.index('"activation":')
    new = '"chosen":' + json.dumps(chosen, separators=(",", ":"))
    assert len(new) <= len(m.group(0))
    blob = blob[:start + m.start()] + new.ljust(len(m.group(0))) + blob[start + m.end():]
    data[off:off + length] = blob.encode()
    S.PREAMBLE.pack_into(data, 0, magic, ver, res, off, length, hashlib.sha256(blob.encode()).digest())
    dst.write_bytes(bytes(data))
    return dst


def test_a_projection_at_level_0_runs_by_rows(act_file, tmp_path):
    """Under auto, a projection the converter left at level 0 reads its rows as dense decode does:
    the FFN through the fused kernel's dense mode, the attention's projections without transposes."""
    from pinfer.kernels import ColumnFFN, SparseFFN
    from pinfer.runtime.model import Model, RuntimeOptions
    opts = RuntimeOptions(activation="auto", kernels="on", sparsity="dense", threads=1)
    attn = Model(_with_chosen(act_file, tmp_path / "attn.pinf", {"qkv": 0.3, "o": 0.3, "gate_up": 0, "down": 0}), opts)
    assert all(isinstance(f.kernel, SparseFFN) and f.mode == "dense" for f in [L.ffn for L in attn.layers])
    assert all(s.cols[0].q and s.cols[1].q for s in [L.native for L in attn.layers])
    said = "\n".join(n.describe() for n in attn.notes)
    assert "attention: C kernels, by columns; FFN: fused kernel, dense" in said, said
    # the file's own down rule is what activation sparsity replaces: the FFN at 0 is dense, not down:S
    assert {r.rule.mode for r in [L.rule for L in attn.layers]} <= {"dense", "down"}
    own = Model(tmp_path / "attn.pinf", RuntimeOptions(activation="auto", kernels="on", threads=1))
    assert any(r.rule.mode == "down" for r in [L.rule for L in own.layers]), [r.rule.name for r in [L.rule for L in own.layers]]
    assert all(f.mode == "dense" for f in [L.ffn for L in own.layers])
    ffn = Model(_with_chosen(act_file, tmp_path / "ffn.pinf", {"qkv": 0, "o": 0, "gate_up": 0.3, "down": 0.3}), opts)
    assert all(isinstance(f.kernel, ColumnFFN) for f in [L.ffn for L in ffn.layers])
    assert not any(s.cols[0].q or s.cols[1].q for s in [L.native for L in ffn.layers])
    ids = [5, 6, 7, 8]
    # each is the dense model in the part at level 0: dense decode's logits (C attention, the fused
    # kernel's dense mode: --ffn-kernel auto) where every projection is at 0
    dense = Model(act_file, RuntimeOptions(sparsity="dense", threads=1))
    zero = Model(_with_chosen(act_file, tmp_path / "zero.pinf", {"qkv": 0, "o": 0, "gate_up": 0, "down": 0}), opts)
    assert np.array_equal(_decode(zero, ids), _decode(dense, ids))
    assert np.isfinite(_decode(attn, ids)).all() and np.isfinite(_decode(ffn, ids)).all()
