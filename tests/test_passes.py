"""The converter's passes: calibration, sparsity modes, predictors, hot-first order, golden output.

Fixtures are tiny LLaMA GGUFs: the SiLU one of conftest.py (silu_file, silu_gguf), and ReLU ones
built here (the same kind of weights with pinfer's activation key), whose activations are exactly
sparse."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fixtures import make_tiny_llama_gguf
from pinfer.converter.convert import ConvertError, ConvertOptions, convert
from pinfer.converter.passes import PassOptions
from pinfer.formats import PinfReader
from pinfer.formats import schema as S
from pinfer.runtime.model import Model, RuntimeOptions

RELU = {"pinfer.feed_forward_activation": "relu"}
QUICK = dict(calib_tokens=4096, heldout_tokens=2048, seq_len=128, early_check=False)   # the full passes
GOLDEN = Path(__file__).parent / "golden" / "converter_tiny.json"
TEXT = ("The quick brown fox jumps over the lazy dog while the mountains watch the sea, "
        "and stories about forests are told again.")


def _ids(model, n=96):
    from pinfer.runtime.tokenizer import Tokenizer
    tok = Tokenizer.from_spec(model.tokenizer_spec)
    ids = tok.encode(TEXT * 4, add_bos=False)
    return ids[:n]


# Three calibrated conversions (half a minute on a 2-core machine): the tests that use them are
# marked slow, so that `pytest -m "not slow"` stays a quick run.
@pytest.fixture(scope="module")
def relu_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("relu")
    src = make_tiny_llama_gguf(d / "relu.gguf", qtype="F32", n_layer=2, d_model=64, n_ff=256, extra_kv=RELU, seed=3)
    out = {}
    for order in ("hot-first", "source"):     # the source-order file unverified, its report written
        out[order] = convert(ConvertOptions(src, d / f"{order}.pinf", report=order == "source", verify=order != "source",
                                            passes=PassOptions(sparsity="relu:0.99", order=order, **QUICK)))
    out["auto"] = convert(ConvertOptions(src, d / "auto.pinf", passes=PassOptions(**QUICK)))
    return out


@pytest.mark.slow
def test_an_unverified_conversion_still_reports_its_calibration(relu_files):
    body = json.loads(Path(str(relu_files["source"]) + ".report.json").read_text())
    assert body["verification"] is None
    assert [lay["predictor"]["rank"] for lay in body["layers"]] == \
        [lay["predictor"]["rank"] for lay in PinfReader(relu_files["source"]).header["layers"]]


@pytest.mark.slow
def test_relu_with_a_perfect_mask_equals_dense(relu_files):
    dense = Model(relu_files["hot-first"], RuntimeOptions(kernels="off", sparsity="dense"))
    sparse = Model(relu_files["hot-first"], RuntimeOptions(kernels="off", sparsity="relu:0.99"))
    for rule in [L.rule for L in sparse.layers]:       # every neuron a candidate: the exact rule h > 0 alone decides
        rule.pred = (*rule.pred[:3], np.float32(-np.inf))
    ids = _ids(dense)
    a = dense.forward(ids, logits_from=0)
    b = sparse.forward(ids, logits_from=0)
    assert np.array_equal(a, b)
    gu, down = sparse.counters.fractions()
    assert gu == 1.0 and 0.3 < down < 0.7, (gu, down)     # ReLU: about half the neurons are zero


@pytest.mark.slow
def test_relu_predictor_keeps_mass_on_heldout_tokens(relu_files):
    h = PinfReader(relu_files["hot-first"]).header
    for i, lay in enumerate(h["layers"]):
        t = next(t for t in lay["predictor"]["thresholds"] if t["recall_target"] == 0.99)
        print(f"layer {i}: rank {lay['predictor']['rank']}, mass recall {t['mass_recall']:.4f}, "
              f"count recall {t['count_recall']:.4f}, candidates {t['candidate_fraction']:.3f}")
        assert t["mass_recall"] >= 0.99
        assert t["candidate_fraction"] < 1.0
    dense = Model(relu_files["hot-first"], RuntimeOptions(kernels="off", sparsity="dense"))
    sparse = Model(relu_files["hot-first"], RuntimeOptions(kernels="off"))   # the file's mode: relu:0.99
    ids = _ids(dense)
    a, b = dense.forward(ids, logits_from=0), sparse.forward(ids, logits_from=0)
    agree = (a.argmax(1) == b.argmax(1)).mean()
    gu, down = sparse.counters.fractions()
    print(f"relu:0.99 vs dense: top-1 {agree:.1%}, gate/up rows read {gu:.1%}, down rows {down:.1%}")
    assert agree >= 0.9 and gu < 1.0


@pytest.mark.slow
def test_each_layer_keeps_the_predictor_format_that_reads_fewest_bytes(relu_files):
    """The calibration stores every trained rank in q8 and q4 and keeps the pair that reads the
    fewest bytes per token at 0.99 mass recall (the predictor, then the candidates' share of the
    layer's FFN bytes); the file's predictor tensors are in the format the header names."""
    r = PinfReader(relu_files["source"])
    cfg, body = r.header["config"], json.loads(Path(str(relu_files["source"]) + ".report.json").read_text())
    d, n = cfg["d_model"], cfg["n_ff"]
    per_weight = {"q8": 1 + 2 / 32, "q4": 0.5 + 4 / 32}     # q8: q and a scale; q4: nibbles, scale and min
    ffn_bytes = 3 * d * n * 4       # the source's FFN (an F32 GGUF), which the candidates' share is of
    for i, lay in enumerate(body["layers"]):
        p = lay["predictor"]
        tried = {tuple(k.split()): v for k, v in p["ranks_tried"].items()}
        assert {f for _, f in tried} == {"q8", "q4"}
        cost = {(int(rk), f): rk_bytes + share * ffn_bytes
                for (rk, f), share in tried.items() for rk_bytes in [int(rk) * (d + n) * per_weight[f] + 4 * n]}
        assert min(cost, key=cost.get) == (p["rank"], p["format"]), cost
        assert p["bytes"] == p["rank"] * (d + n) * per_weight[p["format"]] + 4 * n
        for name in (S.FFN_PRED_W1, S.FFN_PRED_W2):
            assert r.block(name.format(i))[0] == p["format"]
        print(f"layer {i}: " + ", ".join(f"rank {rk} {f}: {share:.1%} candidates" for (rk, f), share in tried.items()))


@pytest.mark.slow
def test_hot_first_order_is_sorted_and_changes_nothing(relu_files):
    hot, src = PinfReader(relu_files["hot-first"]), PinfReader(relu_files["source"])
    f_hot, f_src = hot.tensor(S.FFN_FREQ), src.tensor(S.FFN_FREQ)
    assert all(np.all(np.diff(row) <= 0) for row in f_hot)
    assert not all(np.all(np.diff(row) <= 0) for row in f_src)
    np.testing.assert_array_equal(f_hot, -np.sort(-f_src, axis=1))
    assert [lay["order"] for lay in hot.header["layers"]] == ["hot-first"] * 2
    for mode in ("dense", "relu:0.99"):      # gate/up rows, down rows and predictor outputs move together
        a = Model(relu_files["hot-first"], RuntimeOptions(kernels="off", sparsity=mode))
        b = Model(relu_files["source"], RuntimeOptions(kernels="off", sparsity=mode))
        ids = _ids(a)
        np.testing.assert_allclose(a.forward(ids, logits_from=0), b.forward(ids, logits_from=0), atol=1e-4)


@pytest.mark.slow
def test_auto_measures_every_point_and_keeps_its_budget(relu_files):
    h = PinfReader(relu_files["auto"]).header
    sp = h["sparsity"]
    names = [row["point"] for row in sp["heldout"]["points"]]
    assert names[0] == "dense" and sum(n.startswith("relu:") for n in names) >= 3
    chosen = [lay["mode"] if lay["mode"] == "dense" else f"{lay['mode']}:{lay['value']:g}" for lay in h["layers"]]
    row = {r["point"]: r for r in sp["heldout"]["points"]}
    for name in set(chosen):
        assert row[name]["increase"] <= sp["max_ppl_increase"]
    print(sp["reason"])
    report = Path(str(relu_files["auto"]) + ".report.json")
    body = json.loads(report.read_text())
    assert body["verification"]["teacher_forced"]["max_abs_diff"] < 1e-3      # F32 weights
    for kind in ("frequency", "modes", "predictors", "placement"):
        png = Path(f"{relu_files['auto']}.{kind}.png")
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_gated_modes_run_in_the_runtime(silu_file):
    path = silu_file
    h = PinfReader(path).header
    assert {r["point"] for r in h["sparsity"]["heldout"]["points"]} >= {
        "dense", "down:0.2", "down:0.3", "down:0.4", "predicted:0.95", "predicted:0.99", "predicted:0.999"}
    dense = Model(path, RuntimeOptions(kernels="off", sparsity="dense"))
    ids = _ids(dense)
    ref = dense.forward(ids, logits_from=0)
    for mode, lo, hi in (("down:0.3", 0.6, 0.8), ("down:0.5", 0.4, 0.6)):
        m = Model(path, RuntimeOptions(kernels="off", sparsity=mode))
        m.forward(ids, logits_from=0)
        gu, down = m.counters.fractions()
        assert gu == 1.0 and lo < down < hi, (mode, down)
    m = Model(path, RuntimeOptions(kernels="off", sparsity="predicted:0.999"))
    got = m.forward(ids, logits_from=0)
    gu, down = m.counters.fractions()
    assert gu < 1.0 and down <= gu
    assert (got.argmax(1) == ref.argmax(1)).mean() > 0.8
    with pytest.raises(ValueError, match="calibrated"):
        Model(path, RuntimeOptions(kernels="off", sparsity="down:0.33"))
    with pytest.raises(ValueError, match="not one of"):
        Model(path, RuntimeOptions(kernels="off", sparsity="sparse:0.5"))


@pytest.mark.parametrize("which, sparsity", [("silu", "down:0.3"), ("silu", "predicted:0.99"),
                                             ("relu", "relu:0.99")])
@pytest.mark.slow
def test_kernel_decode_agrees_with_the_numpy_rules(silu_file, relu_files, which, sparsity):
    """Decode through the fused C kernel (int8 activations) against the ONNX graph + NumPy rule
    path on the same file: same tokens chosen, the same share of rows read."""
    path = silu_file if which == "silu" else relu_files["hot-first"]
    models = {k: Model(path, RuntimeOptions(sparsity=sparsity, kernels=k, threads=1)) for k in ("off", "on")}
    assert all(f is not None for f in [L.ffn for L in models["on"].layers]) and not any([L.ffn for L in models["off"].layers])
    ids = _ids(models["off"], 40)
    logits = {}
    for k, m in models.items():
        m.forward(ids[:8])
        m.counters.reset()
        logits[k] = np.stack([m.forward([t]) for t in ids[8:]])
    top1 = (logits["on"].argmax(-1) == logits["off"].argmax(-1)).mean()
    assert top1 >= 0.9, top1
    spread = np.abs(logits["off"]).max()
    assert np.abs(logits["on"] - logits["off"]).max() < 0.1 * spread
    (gu_a, dn_a), (gu_b, dn_b) = models["off"].counters.fractions(), models["on"].counters.fractions()
    assert abs(gu_a - gu_b) < 0.05 and abs(dn_a - dn_b) < 0.05, (gu_a, dn_a, gu_b, dn_b)


def test_weight_bytes_per_token_follow_the_rows_read(silu_file):
    """Decode's weight bytes: the dense tensors, predictors only where a rule runs them, and the FFN
    rows read, which on the NumPy-rule path are all of them whatever the rule keeps, and with the
    fused kernel the rows it keeps (every down row of a layer whose survivors reach the row dots)."""
    path = silu_file
    r = PinfReader(path)
    size = lambda *bases: sum(e["nbytes"] for n, e in r.tensors.items()  # noqa: E731
                              if any(n.startswith(b.format(i)) for b in bases for i in range(2)))
    gate_up, down, pred = size(S.FFN_GATE_UP), size(S.FFN_DOWN_T), size(S.FFN_PRED_W1, S.FFN_PRED_W2, S.FFN_PRED_B2)
    ids = _ids(Model(path, RuntimeOptions(kernels="off", sparsity="dense")), 16)
    got = {}
    for mode, kernels in (("dense", "off"), ("down:0.5", "off"), ("predicted:0.99", "off"), ("predicted:0.99", "on")):
        m = Model(path, RuntimeOptions(sparsity=mode, kernels=kernels, threads=1))
        m.forward(ids[:4])
        m.counters.reset()
        for t in ids[4:]:
            m.forward([t])
        got[mode, kernels] = (m.weight_bytes_per_token(), m.counters.fractions(), m.counters.read_fractions())
    dense = got["dense", "off"][0]
    _, (gu, dn), read = got["down:0.5", "off"]
    assert gu == 1.0 and dn < 0.6 and read == (1.0, 1.0)
    assert got["down:0.5", "off"][0] == pytest.approx(dense)
    assert got["predicted:0.99", "off"][0] == pytest.approx(dense + pred)
    _, (gu, dn), (read_gu, read_dn) = got["predicted:0.99", "on"]
    assert gu < 1.0 and dn < 1.0 and read_gu == gu and dn <= read_dn <= 1.0
    assert got["predicted:0.99", "on"][0] == pytest.approx(dense - gate_up * (1 - gu) - down * (1 - read_dn) + pred)


def test_bad_sparsity_and_calibration_input_get_one_sentence(silu_gguf, tmp_path):
    src = silu_gguf
    for sparsity, msg in (("relu:0.99", "ReLU-family"), ("down:1.5", "between 0 and 1"), ("magic", "is not none")):
        with pytest.raises(ConvertError, match=msg):
            convert(ConvertOptions(src, tmp_path / "x.pinf", passes=PassOptions(sparsity=sparsity)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        convert(ConvertOptions(src, tmp_path / "x.pinf", passes=PassOptions(calib=bad, **QUICK)))
    short = tmp_path / "short.txt"
    short.write_text("too short")
    with pytest.raises(ValueError, match="fewer than two sequences"):
        convert(ConvertOptions(src, tmp_path / "x.pinf", passes=PassOptions(calib=short, **QUICK)))
    assert not list(tmp_path.glob("x.pinf*"))


def test_dry_run_writes_nothing(silu_gguf, tmp_path, capfd):
    src = silu_gguf
    assert convert(ConvertOptions(src, tmp_path / "d.pinf", dry_run=True)) is None
    err = capfd.readouterr().err
    assert "peak memory" in err and "blk.0.ffn_down.weight" in err
    assert "running it on the CPU" in err and "-token KV cache" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_calibration_jsonl_is_accepted(silu_gguf, tmp_path):
    src = silu_gguf
    calib = tmp_path / "calib.jsonl"
    lines = [json.dumps({"text": TEXT * 3}), json.dumps({"messages": [{"role": "user", "content": TEXT * 3}]})]
    calib.write_text("\n".join(lines * 40) + "\n")
    out = convert(ConvertOptions(src, tmp_path / "j.pinf", report=False,
                                 passes=PassOptions(calib=calib, calib_tokens=1024, heldout_tokens=512, seq_len=64,
                                                     early_check=False)))
    assert "calib.jsonl" in PinfReader(out).header["sparsity"]["calibration"]


# -- the FFN bundles' formats ---------------------------------------------------------------------

@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_K"])
def test_the_back_end_writes_the_formats_the_planner_counts(tmp_path, qtype):
    """plan.bundle_formats is the one decision of the FFN formats: the planner's byte model reads it
    and the back end writes it, for each source type and --quant (formats and the optional min)."""
    from gguf import GGMLQuantizationType as QT

    from pinfer.converter.passes import plan as PL
    src = make_tiny_llama_gguf(tmp_path / "b.gguf", qtype=qtype, d_model=256, n_ff=256)   # K-quants: rows of 256
    for quant in ("auto", "int4", "fp16"):
        out = convert(ConvertOptions(src, tmp_path / f"{quant}.pinf", quant=quant, report=False,
                                     passes=PassOptions(sparsity="none")))
        want = PL.bundle_formats([QT[qtype]] * 2, QT[qtype], quant, permuted=False)
        r = PinfReader(out)
        for i in range(2):
            got = [(f, "min" in parts) for f, parts in (r.block(S.FFN_GATE_UP.format(i)), r.block(S.FFN_DOWN_T.format(i)))]
            assert got == [want.gate_up, want.down], (quant, got, want)


def test_q4_with_and_without_min_meet_as_q4_with_min():
    """Gate in Q4_0 and up in Q4_1 carry over as one q4 bundle with a min (exact: min = -8 scale)
    rather than being re-quantized to 8 bits; a type without an exact format re-quantizes both."""
    from gguf import GGMLQuantizationType as QT

    from pinfer.converter.passes import plan as PL
    f = PL.bundle_formats([QT.Q4_0, QT.Q4_1], QT.Q4_0, "auto", permuted=False)
    assert (f.gate_up, f.gate_up_carried, f.down, f.down_carried) == (("q4", True), True, ("q4r", False), True)
    f = PL.bundle_formats([QT.Q4_0, QT.Q5_0], QT.Q4_0, "auto", permuted=True)
    assert (f.gate_up, f.gate_up_carried, f.down, f.down_carried) == (("q8", False), False, ("q8", False), False)


# -- mixed quantization ---------------------------------------------------------------------------

def test_mixed_keeps_the_planned_hot_prefix_in_fp16(tmp_path):
    """--quant mixed: the neurons the plan puts in VRAM stay fp16 (the fp16 file's rows, bit for
    bit), the rest int4 (the int4 file's rows); the runtime joins both and lands nearer fp16."""
    src = make_tiny_llama_gguf(tmp_path / "m.gguf", qtype="Q4_1", n_layer=2, d_model=64, n_ff=512, seed=5)
    dense = PassOptions(sparsity="none")
    files = {q: convert(ConvertOptions(src, tmp_path / f"{q}.pinf", quant=q, report=False, passes=dense))
             for q in ("fp16", "int4")}
    plan = PinfReader(files["int4"]).header["plan"]
    fixed = sum(v for k, v in plan["reserved"].items() if k.endswith("_bytes"))
    fp16_neuron = 3 * 2 * 64
    target = (fixed + 3 * 256 * fp16_neuron + 1000) / 2 ** 30    # three of the four 256-neuron blocks
    files["mixed"] = convert(ConvertOptions(src, tmp_path / "mixed.pinf", quant="mixed", target_vram_gib=target,
                                            report=False, passes=dense))
    r = {q: PinfReader(p) for q, p in files.items()}
    hot_rows = r["mixed"].header["ffn"]["hot_rows"]
    assert sorted(hot_rows) == [256, 512] and r["mixed"].header["plan"]["hot_neurons"] == hot_rows
    for i, hot in enumerate(hot_rows):
        w = r["mixed"].header["weights"]
        assert w[S.FFN_GATE_UP.format(i)] == "f16" and w[S.FFN_DOWN_T.format(i)] == "f16"
        for base, other in ((S.FFN_GATE_UP, S.FFN_GATE_UP_COLD), (S.FFN_DOWN_T, S.FFN_DOWN_T_COLD)):
            hot_part = r["mixed"].tensor(S.part_name(base.format(i), "w"))
            assert np.array_equal(hot_part, r["fp16"].tensor(S.part_name(base.format(i), "w"))[:hot])
            if hot == 512:
                assert other.format(i) not in w
                continue
            fmt, cold = r["mixed"].block(other.format(i))
            ref_fmt, ref = r["int4"].block(base.format(i))
            assert fmt == ref_fmt
            # the cold rows are the int4 file's rows from `hot` on; q4r's scales come per 32 rows
            per = {p: S.GROUP if fmt == "q4r" and p != "q" else 1 for p in cold}
            assert all(np.array_equal(cold[p], ref[p][hot // per[p]:]) for p in cold)
    logits = {q: Model(p, RuntimeOptions(kv_type="f32")).forward(list(range(1, 40)), logits_from=0)
              for q, p in files.items()}
    err = {q: np.abs(logits[q] - logits["fp16"]).max() for q in ("mixed", "int4")}
    assert np.isfinite(logits["mixed"]).all() and 0 < err["mixed"] < err["int4"], err
    # decode (one row: the split binds views) and prefill (copies) agree (f32 caches here: an f16
    # one rounds decode's K and V, which moves this random model's logits by about 1%)
    m = Model(files["mixed"], RuntimeOptions(kv_type="f32"))
    step = [m.forward([t]) for t in range(1, 40)][-1]
    assert np.allclose(step[0], logits["mixed"][-1], atol=1e-3)


# -- golden output --------------------------------------------------------------------------------
# Two parts. "exact": hashes of everything that follows from the source weights by deterministic
# code (config, format, quantized and permuted tensors). "measured": the figures that come
# from floating-point calibration and predictor training, which differ in their last bits between
# CPUs (AVX-512 on Intel and on AMD reduce in different orders); they are compared with tolerances.

GOLDEN_PASSES = PassOptions(sparsity="down:0.3", order="hot-first", **QUICK)
# The predictor tensors are trained: their figures are pinned under "measured", not their bytes.
# Trained or calibrated float tensors: their bits follow float reductions whose order differs
# between CPUs (AVX-512 or AVX2 kernels), so only their dtype and shape are pinned exactly.
TRAINED = ("ffn_pred_w1", "ffn_pred_w2", "ffn_pred_b2", "ffn_freq")
LAYER_EXACT = ("mode", "value", "order", "bundle_formats")


def _digest(value):
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _fingerprint(path):
    h = PinfReader(path).header
    sparsity = {k: h["sparsity"][k] for k in ("mode", "chosen", "max_ppl_increase", "predictor_sparsity",
                                              "calibration")}
    layers = [{k: info[k] for k in LAYER_EXACT} | {"rank": info["predictor"]["rank"],
                                                   "predictor_bytes": info["predictor"]["bytes"]}
              for info in h["layers"]]
    entries = {"config": h["config"], "tokenizer": h["tokenizer"], "weights": h["weights"], "ffn": h["ffn"],
               "sparsity": sparsity, "layers": layers, "plan": h["plan"]}
    exact = {f"header.{k}": _digest(v) for k, v in entries.items()}
    for name, e in sorted(h["tensors"].items()):
        trained = any(t in name for t in TRAINED)
        exact[f"tensor.{name}"] = _digest([e["dtype"], e["shape"]]) if trained else e["sha256"][:16]
    measured = {"heldout_dense_ppl": h["sparsity"]["heldout"]["dense_ppl"]}
    freq = PinfReader(path).tensor("ffn_freq")
    measured["ffn_freq"] = [[float(f.mean()), float(f.max())] for f in freq]     # per layer
    for i, info in enumerate(h["layers"]):
        measured[f"layer.{i}.thresholds"] = info["thresholds"]
        measured[f"layer.{i}.active_fraction"] = info["active_fraction"]
        measured[f"layer.{i}.predictor"] = [{k: t[k] for k in ("mass_recall", "count_recall", "candidate_fraction")}
                                            for t in info["predictor"]["thresholds"]]
    return {"exact": exact, "measured": measured}


def _close(want, got, rel=0.02, abs_=0.02):
    """Same structure; numbers within rel (thresholds, perplexity) or abs_ (fractions)."""
    if isinstance(want, dict):
        return set(want) == set(got) and all(_close(want[k], got[k], rel, abs_) for k in want)
    if isinstance(want, list):
        return len(want) == len(got) and all(_close(w, g, rel, abs_) for w, g in zip(want, got))
    return abs(want - got) <= max(abs_, rel * abs(want))


def test_golden_converter_output(tmp_path):
    """Pins the converter's output on a fixture: an unintended change to the format or the passes
    fails here. After an intended change: PINFER_UPDATE_GOLDEN=1 pytest tests/test_passes.py."""
    import torch
    src = make_tiny_llama_gguf(tmp_path / "g.gguf", qtype="Q4_1", n_layer=2, d_model=64, n_ff=128, seed=11)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = convert(ConvertOptions(src, tmp_path / "g.pinf", report=False, verify=False, passes=GOLDEN_PASSES))
    finally:
        torch.set_num_threads(threads)
    got = _fingerprint(out)
    if os.environ.get("PINFER_UPDATE_GOLDEN"):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    want = json.loads(GOLDEN.read_text())
    changed = sorted(k for k in set(want["exact"]) | set(got["exact"])
                     if want["exact"].get(k) != got["exact"].get(k))
    assert not changed, f"converter output changed in: {', '.join(changed[:12])}"
    drifted = [k for k in want["measured"] if k not in got["measured"]
               or not _close(want["measured"][k], got["measured"][k])]
    assert not drifted, "calibrated figures moved: " + "; ".join(
        f"{k}: {want['measured'][k]} -> {got['measured'].get(k)}" for k in drifted[:4])


# -- memory --------------------------------------------------------------------------------------

_RSS_SCRIPT = """
import sys
from pinfer.converter.frontend.gguf_source import GGUFSource
from pinfer.converter.frontend import arch
from pinfer.converter.passes import calib_data, calibrate, torch_llama as TL
from pinfer.runtime.tokenizer import Tokenizer

def hwm():
    # VmHWM belongs to this process image; ru_maxrss would also count the parent's peak from
    # before exec (Linux carries it over), i.e. pytest's own memory.
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))

src = GGUFSource(sys.argv[1])
mod = arch.get(src.architecture)
cfg = mod.config_from_gguf(src.meta, src.tensor_names())
T = arch.roles(mod.TENSORS, src.tensor_names(), cfg)
cs = calib_data.build(Tokenizer.from_spec(src.tokenizer_spec()), None, 128, 2048, 1024)
before = hwm()
calibrate.run(src, T, cfg, cs, TL.Embedding(src, T), TL.Head(src, T, cfg), [1e6] * cfg.n_layer)
print(before, hwm())
"""


@pytest.mark.slow
def test_calibration_peak_memory_is_flat_in_layer_count(tmp_path):
    """4 and 16 layers of 67 MB (f32) each: holding every layer would add ~800 MB for 16. (Layers of
    17 MB were too small: allocator noise moved the 16-layer peak by +-80 MB, a flaky 1.2x.)"""
    peaks = {}
    for n_layer in (4, 16):
        src = make_tiny_llama_gguf(tmp_path / f"l{n_layer}.gguf", qtype="F16", n_layer=n_layer, d_model=1024,
                                   n_ff=4096, n_head=8, n_head_kv=4, seed=1)
        r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(src)], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        before, peak = map(int, r.stdout.split()[-2:])
        peaks[n_layer] = peak / 1024
        print(f"{n_layer} layers: peak RSS {peak / 1024:.0f} MB ({(peak - before) / 1024:.0f} MB above the start)")
    assert peaks[16] <= 1.2 * peaks[4], peaks
