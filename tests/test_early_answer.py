"""--sparsity auto's early answer (converter/passes/early.py): the oracle shares against a brute
force, the real kernel timed at a model's shapes, and both outcomes of the check through a real
conversion (the timing itself is replaced there, so that the outcome does not depend on this CPU)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from fixtures import QUICK_PASSES, make_tiny_llama_gguf

from pinfer import kernels
from pinfer.converter.convert import ConvertOptions, convert
from pinfer.converter.passes import PassOptions, early
from pinfer.converter.passes import plan as PL
from pinfer.converter.passes.calibrate import Point
from pinfer.formats import PinfReader
from pinfer.formats import schema as S
from pinfer.runtime.model import Model, RuntimeOptions

EARLY = {**QUICK_PASSES, "early_check": True}


def _cfg(d=64, n_ff=128):
    """The fields of ModelConfig that early.py reads, of a gated SiLU model."""
    return SimpleNamespace(d_model=d, n_ff=n_ff, ffn_act="silu", exact_sparse=False, ffn_gated=True)


def test_oracle_thresholds_keep_the_fewest_entries_reaching_each_target():
    """predicted:R's best case keeps the largest |h| entries until R of the active mass (|h| over
    the 0.3 quantile, as the predictor counts it); down:S keeps |h| over its S quantile."""
    cfg = _cfg()
    g = torch.Generator().manual_seed(1)
    hact = torch.randn(200, cfg.n_ff, generator=g) * torch.rand(cfg.n_ff, generator=g) ** 3
    points = [Point("predicted", 0.5), Point("predicted", 0.9), Point("predicted", 0.99), Point("down", 0.4)]
    thr, freq = early.layer_rules(cfg, hact, points)
    habs = hact.abs().numpy().astype(np.float32)
    active = habs > np.quantile(habs, 0.3)
    assert np.allclose(freq, active.mean(0), atol=0.02)
    mass = np.sort(habs[active].astype(np.float64))[::-1]
    cum = np.cumsum(mass) / mass.sum()
    kept = {p.name: int((habs >= thr[p.name]).sum()) for p in points}
    for p in points[:3]:
        k = kept[p.name]
        assert cum[k - 1] >= p.value - 1e-9 and (k == 1 or cum[k - 2] < p.value), (p, k)
    assert kept["predicted:0.5"] < kept["predicted:0.9"] < kept["predicted:0.99"] <= active.sum()
    assert kept["down:0.4"] / habs.size == pytest.approx(0.6, abs=1e-3)


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_the_kernel_is_timed_at_the_models_shapes(act):
    """Real SparseFFN calls with the model's activation (Gemma's GeGLU too), a finite ratio to its
    dense mode per point (which way the ratios go is the machine's: no time is asserted); a model
    the kernel cannot take (no gate) gets no ratio: its layers run dense."""
    cfg = SimpleNamespace(**{**_cfg(d=256, n_ff=1024).__dict__, "ffn_act": act})
    fm = PL.BundleFormats(("q4", True), ("q8", False))
    points = [Point("down", 0.4), Point("predicted", 0.95)]
    ratios = early.time_points(cfg, points, {"down:0.4": 0.6, "predicted:0.95": 0.05}, lambda p: fm, 32, 1)
    assert set(ratios) == {"down:0.4", "predicted:0.95"} and all(0 < r < float("inf") for r in ratios.values())
    gateless = SimpleNamespace(**{**cfg.__dict__, "ffn_gated": False})
    assert all(r == float("inf") for r in early.time_points(gateless, points, {"down:0.4": 0.6, "predicted:0.95": 0.05},
                                                              lambda p: fm, 32, 1).values())


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("early")
    return d, make_tiny_llama_gguf(d / "silu.gguf", qtype="Q4_1", n_layer=2, d_model=64, n_ff=128, seed=5)


def _times(ratio):
    return lambda cfg, points, rows, *a, **k: {p.name: ratio for p in points}


@pytest.mark.slow
def test_no_faster_point_writes_the_dense_file_at_once(source, monkeypatch):
    """Every point as slow as dense: the dense file, as --sparsity none writes it but with the
    sample's frequencies, the reason and the measurements in the header and the report, and a
    teacher-forced check against PyTorch."""
    d, src = source
    monkeypatch.setattr(early, "time_points", _times(1.0))
    out = convert(ConvertOptions(src, d / "early.pinf", passes=PassOptions(**EARLY)))
    none = convert(ConvertOptions(src, d / "none.pinf", report=False, passes=PassOptions(sparsity="none")))
    h, ref = PinfReader(out).header, PinfReader(none)
    sp = h["sparsity"]
    assert sp["chosen"] == ["dense"] and "no sparse point can be within +1.0% perplexity" in sp["reason"]
    assert {p["point"] for p in sp["early"]["points"]} == {"down:0.2", "down:0.3", "down:0.4", "predicted:0.95",
                                                           "predicted:0.99", "predicted:0.999"}
    assert all(p["ppl_increase"] is None for p in sp["early"]["points"])     # none fast enough to ask
    assert sp["early"]["tokens"] >= 1024 and all(lay["mode"] == "dense" for lay in h["layers"])
    r = PinfReader(out)
    for name in ref.tensors:
        if not name.startswith("graph."):
            assert np.array_equal(r.tensor(name), ref.tensor(name)), name
    freq = r.tensor(S.FFN_FREQ)
    assert freq.shape == (2, 128) and 0 < freq.mean() < 1
    report = json.loads((d / "early.pinf.report.json").read_text())
    assert report["sparsity"]["reason"] == sp["reason"]
    assert report["verification"]["teacher_forced"]["top1_agreement"] >= 0.9
    ids = list(range(5, 40))
    a, b = (Model(p, RuntimeOptions(threads=1)).forward(ids, logits_from=0) for p in (out, none))
    assert np.array_equal(a, b)


@pytest.mark.slow
def test_a_fast_point_over_the_budget_still_gives_the_dense_file(source, monkeypatch):
    d, src = source
    monkeypatch.setattr(early, "time_points", _times(0.5))
    monkeypatch.setattr(early, "ppl_increases", lambda src, names, cfg, smp, model, points, **k: {p.name: 0.02 for p in points})
    h = PinfReader(convert(ConvertOptions(src, d / "costly.pinf", report=False, passes=PassOptions(**EARLY)))).header
    assert h["sparsity"]["chosen"] == ["dense"]
    assert {p["ppl_increase"] for p in h["sparsity"]["early"]["points"]} == {0.02}


@pytest.mark.slow
def test_a_point_that_may_pass_goes_on_to_the_full_calibration(source, monkeypatch):
    d, src = source
    monkeypatch.setattr(early, "time_points", _times(0.5))
    monkeypatch.setattr(early, "ppl_increases", lambda src, names, cfg, smp, model, points, **k: {p.name: 0.0 for p in points})
    h = PinfReader(convert(ConvertOptions(src, d / "full.pinf", report=False, passes=PassOptions(**EARLY)))).header
    assert "early" not in h["sparsity"] and {r["point"] for r in h["sparsity"]["heldout"]["points"]} >= {"dense", "down:0.3"}


def test_the_sample_perplexity_under_a_rule(source):
    """The real passes on the tiny model: a rule that keeps every entry costs exactly nothing, a
    stricter rule costs more than a looser one."""
    from pinfer.converter.convert import _front_end
    from pinfer.converter.passes import torch_llama as TL
    d, src = source
    fe = _front_end(ConvertOptions(src, d / "x.pinf"))
    model = (TL.Embedding(fe.src, fe.roles), TL.Head(fe.src, fe.roles, fe.cfg), None)
    seqs = np.random.default_rng(0).integers(0, fe.cfg.vocab, (2, 64))
    points = [Point("down", 0.2), Point("down", 0.6)]
    smp = early.sample(fe.src, fe.roles, fe.cfg, seqs, model, points, 32)
    assert smp.tokens == 128 and len(smp.thresholds) == 2 and smp.reference_logits.shape == (64, fe.cfg.vocab)
    assert smp.shares == {"down:0.2": pytest.approx(0.8), "down:0.6": pytest.approx(0.4)}
    up = early.ppl_increases(fe.src, fe.roles, fe.cfg, smp, model, points)
    for t in smp.thresholds:
        t["keep all"] = 0.0
    same = early.ppl_increases(fe.src, fe.roles, fe.cfg, smp, model, [SimpleNamespace(name="keep all")])
    assert abs(same["keep all"]) < 1e-6 and up["down:0.6"] > up["down:0.2"]


@pytest.mark.parametrize("down", [("q4r", True), ("q4r", False), ("q8r", False), ("q8", False), ("f16", False)])
def test_every_down_format_the_planner_gives_can_be_timed(down):
    cfg = _cfg(d=64, n_ff=128)
    fm = PL.BundleFormats(("q4", True), down)
    ratios = early.time_points(cfg, [Point("down", 0.3)], {"down:0.3": 0.7}, lambda p: fm, 32, 1)
    if down[0] in kernels.SPARSE_DOWN:
        assert 0 < ratios["down:0.3"] < float("inf")
    else:                   # the runtime runs such layers dense: never faster
        assert ratios["down:0.3"] == float("inf")


@pytest.mark.slow
def test_a_predictor_trained_on_the_sample_selects_no_fewer_than_the_oracle():
    """Candidates of the quick predictor: shares that grow with the recall target, and, as no
    predictor can, never fewer than the oracle's at the same target (a few points of slack: the
    predictor's thresholds come from other tokens than the ones its share is measured on)."""
    cfg = _cfg()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4096, cfg.d_model, generator=g)
    hact = (x @ torch.randn(cfg.d_model, cfg.n_ff, generator=g) / 8) * torch.rand(cfg.n_ff, generator=g) ** 2
    got = early.predictor_shares(cfg, x, hact, 32, (0.9, 0.99))
    thr, _ = early.layer_rules(cfg, hact, [Point("predicted", 0.9), Point("predicted", 0.99)])
    oracle = {t: float((hact.abs() >= thr[f"predicted:{t:g}"]).float().mean()) for t in (0.9, 0.99)}
    assert 0 < got[0.9] < got[0.99] <= 1.0
    assert got[0.9] >= oracle[0.9] - 0.03 and got[0.99] >= oracle[0.99] - 0.03
