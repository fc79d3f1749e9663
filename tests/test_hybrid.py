"""Hybrid GPU/CPU execution (issue 8), the parts that run without a GPU: every CUDA kernel compiles
through NVRTC for sm_75 and sm_90; the planner's byte accounting, budget and monotonicity on tiny
and 70B-shaped layers; the hybrid step's split and merge with both halves on the CPU kernels.

The tests that need an NVIDIA GPU are at the end, skipped (with the reason) where none is found;
benchmarks/gpu_check.sh runs them with the GPU benchmark on a machine that has one."""

import numpy as np
import pytest

from pinfer import kernels
from pinfer.runtime import hybrid, placement
from pinfer.runtime.model import Model, RuntimeOptions
from test_sparse_kernels import down, gap_threshold, gate_up, predictor, scores

gpu_mod = pytest.importorskip("pinfer.kernels.gpu")
RNG = np.random.default_rng(11)


def _nvrtc_or_skip():
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed (pip install '.[test]')")


# -- NVRTC -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", [75, 90])
def test_every_kernel_compiles_for_the_architecture(arch, tmp_path):
    _nvrtc_or_skip()
    c = gpu_mod.compile_kernels(arch, cache=tmp_path)
    assert (c.kind, c.arch, c.cached) == ("cubin", arch, False)
    assert c.image[:4] == b"\x7fELF"
    assert b" "[0] == 32 and (b" " * 1)[0] == 32    # NVRTC once wrote its empty log into Python's shared b" "
    missing = [k for k in gpu_mod.KERNELS if k.encode() not in c.image]
    assert not missing, missing
    print(f"sm_{arch}: {len(c.image)} byte cubin, NVRTC {gpu_mod.nvrtc_version()}")
    again = gpu_mod.compile_kernels(arch, cache=tmp_path)
    assert again.cached and again.image == c.image and again.path == c.path


def test_the_cache_key_follows_the_source(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    first = gpu_mod.compile_kernels(75, cache=tmp_path)
    changed = tmp_path / "ffn_hot.cu"
    changed.write_bytes(gpu_mod.SOURCE.read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(gpu_mod, "SOURCE", changed)
    second = gpu_mod.compile_kernels(75, cache=tmp_path)
    assert not second.cached and second.path != first.path
    newest = max(gpu_mod.supported_archs())
    ptx = gpu_mod.compile_kernels(newest + 1, cache=tmp_path)     # an architecture newer than NVRTC knows
    assert ptx.kind == "ptx" and ptx.arch == newest and b".entry pinfer_axpy" in ptx.image


def test_a_compile_error_is_one_sentence(tmp_path, monkeypatch):
    _nvrtc_or_skip()
    broken = tmp_path / "ffn_hot.cu"
    broken.write_text('extern "C" __global__ void k() { undefined_thing(); }\n')
    monkeypatch.setattr(gpu_mod, "SOURCE", broken)
    with pytest.raises(gpu_mod.GpuError, match="NVRTC could not compile ffn_hot.cu for sm_75: .*undefined"):
        gpu_mod.compile_kernels(75, cache=tmp_path)
    assert not list(tmp_path.glob("*.cubin"))


# -- the planner -----------------------------------------------------------------------------------

FORMAT_CASES = [("q4", "q4r"), ("q4-nomin", "q4r-nomin"), ("q4", "q4"), ("f16", "f16"), ("f32", "q8"),
                ("q4-nomin", "f32"), ("q5", "q4r"), ("q5-nomin", "q8")]


@pytest.mark.parametrize("gu_fmt, dn_fmt", FORMAT_CASES)
def test_the_plan_counts_the_bytes_that_are_copied(gu_fmt, dn_fmt):
    n, d, r = 128, 96, 32
    gf, gparts, _, _ = gate_up(gu_fmt, n, d)
    df, dparts, _ = down(dn_fmt, n, d)
    pred = predictor(n, d, r, "q4" if gu_fmt == "q4" else "q8")    # a q4 predictor goes to the GPU in q8
    for with_pred in (False, True):
        spec = gpu_mod.HotSpec(d, n, (gf, "min" in gparts), (df, "min" in dparts), r if with_pred else 0)
        assert spec.supported() is None
        for k in (32, 64, 128):
            gu, dn, p = hybrid.cut((gf, gparts), (df, dparts), pred if with_pred else None, 0, k)
            arrays = gpu_mod.check_arrays(spec, k, gu, dn, gpu_mod.q8_predictor(p))
            layout, total = spec.layout(k)
            scratch = dict(spec.scratch_parts(k))
            assert set(layout) == set(arrays) | set(scratch)
            want = sum(-(-a.nbytes // 256) * 256 for a in arrays.values())
            want += sum(-(-b // 256) * 256 for name, b in scratch.items() if name != "iota")
            assert total == want
            offsets = sorted(layout.values())
            assert all(o % 256 == 0 for o, _ in offsets)
            assert all(a + b <= c for (a, b), (c, _) in zip(offsets, offsets[1:]))    # no overlap
    if df in ("q4", "q4r") and "min" not in dparts:     # a part the plan counts but the layer lacks: refused, not left unset
        with pytest.raises(ValueError, match="not the planned"):
            gpu_mod.check_arrays(gpu_mod.HotSpec(d, n, (gf, "min" in gparts), (df, True)), 32,
                                 *hybrid.cut((gf, gparts), (df, dparts), None, 0, 32)[:2])
    assert gpu_mod.HotSpec(d, n, (gf, False), ("q8r", False)).supported() == "down_t in q8r"   # the CPU half lacks it
    assert "multiples of 32" in gpu_mod.HotSpec(d, n, (gf, False), (df, False), 48).supported()
    with pytest.raises(ValueError, match="not the planned|against the plan"):
        gpu_mod.check_arrays(gpu_mod.HotSpec(d, n, ("f16" if gf == "f32" else "f32", False), (df, "min" in dparts)), 32,
                             *hybrid.cut((gf, gparts), (df, dparts), None, 0, 32)[:2])


def test_a_q4_predictor_goes_to_the_gpu_in_q8_within_half_a_step():
    """The GPU kernels read q8 predictors: a q4 one is rounded to q8 from its stored values, each
    weight within half a q8 step (its group's largest magnitude / 254, plus f16's rounding of the
    scale) of the q4 weight its thresholds were chosen on; a q8 one is passed through as it is."""
    from pinfer.formats import blocks
    n, d, r = 128, 96, 32
    q4 = predictor(n, d, r, "q4")
    (f1, w1), (f2, w2), b2 = gpu_mod.q8_predictor(q4)
    assert (f1, f2) == ("q8", "q8") and b2 is q4[2]
    for (_, want_parts), parts in ((q4[0], w1), (q4[1], w2)):
        want = blocks.dequantize("q4", want_parts).reshape(-1, 32)
        got = blocks.dequantize("q8", parts).reshape(-1, 32)
        step = np.abs(want).max(axis=1, keepdims=True) / 127
        assert (np.abs(got - want) <= 0.5 * step * (1 + 2 ** -9) + 1e-7).all()
    q8 = predictor(n, d, r)
    assert all(a is b for a, b in zip(gpu_mod.q8_predictor(q8), q8))
    assert gpu_mod.q8_predictor(None) is None


def _power_law(n, active, alpha):
    base = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    return np.minimum(1.0, base * active * n / base.sum())


@pytest.mark.slow
def test_planner_on_70b_shaped_layers():
    """LLaMA-70B's FFN (80 layers, d 8192, n_ff 28672) in Q4_0 blocks with rank-1024 predictors, and
    each layer its own power-law profile: the budget holds, the bytes are the kernels' own, shares
    grow with the budget, and no block left on the CPU is worth more per byte than one placed."""
    n_layer, d, n_ff = 80, 8192, 28672
    spec = gpu_mod.HotSpec(d, n_ff, ("q4", False), ("q4r", False), 1024)
    per_neuron = 2 * (d // 2 + d // 32 * 2) + (d // 2 + d // 32 * 2)      # gate + up + down rows
    assert per_neuron == 3 * d * 18 // 32                                   # Q4_0: 18 bytes per 32
    step = spec.nbytes(28672 // 2 + 64) - spec.nbytes(28672 // 2)
    assert step == 64 * (per_neuron + 1024 + 1024 // 32 * 2 + 4 + 4 * 6)    # + predictor rows + scratch
    mass = np.stack([_power_law(n_ff, 0.1, 0.5 + l / n_layer) for l in range(n_layer)])
    reserved = 20 * placement.GIB
    last = np.zeros(n_layer)
    for gib in (0, 10, 20, 20.5, 24, 32, 48, 64, 80, 100, 200):
        budget = int(gib * placement.GIB)
        free = budget - reserved
        hot = placement.plan_hot(mass, lambda l, k: spec.nbytes(k), free) if free > 0 else np.zeros(n_layer)
        used = reserved + sum(spec.nbytes(int(h)) for h in hot)
        assert used <= budget or not hot.any(), gib
        assert (hot >= last).all(), gib
        assert (hot % 32 == 0).all() and (hot <= n_ff).all()
        last = hot
        if 0 < hot.sum() < n_layer * n_ff:
            def per_byte(l, a, b):      # a block's mass per byte of its neurons' rows
                return mass[l, a:b].sum() / (b - a)     # every layer has the same bytes per neuron
            placed = [per_byte(l, hot[l] - 64, hot[l]) for l in range(n_layer) if hot[l]]
            left = [per_byte(l, hot[l], hot[l] + 64) for l in range(n_layer) if hot[l] < n_ff]
            assert min(placed) >= max(left) * 0.999, gib        # the ranking is global
        print(f"{gib:>5} GiB: {hot.sum() / (n_layer * n_ff):6.1%} of neurons hot, "
              f"{(used - reserved) / placement.GIB:6.2f} GiB FFN, layers {hot.min()}..{hot.max()}")
    assert last.sum() == n_layer * n_ff


@pytest.mark.parametrize("profile", ["power law", "uniform"])
def test_placement_follows_the_hotness_profile(profile):
    """LLaMA-13B's FFN shapes with a budget for 30% of its neurons: under the synthetic benchmarks'
    power law (alpha 1, 10% active) every layer holds its hottest 30% and the GPU carries the mass
    that profile gives its top 30%; under a uniform profile (a file without calibration) every layer
    gets the same prefix, not whole layers in order."""
    n_layer, d, n_ff = 8, 5120, 13824
    spec = gpu_mod.HotSpec(d, n_ff, ("q4", False), ("q4r", False))
    one = _power_law(n_ff, 0.1, 1.0) if profile == "power law" else np.ones(n_ff)
    mass = np.tile(one, (n_layer, 1))
    k = int(round(0.3 * n_ff / placement.BLOCK)) * placement.BLOCK
    hot = placement.plan_hot(mass, lambda l, kk: spec.nbytes(kk), n_layer * spec.nbytes(k))
    assert (hot == k).all(), hot
    on_gpu = sum(mass[l, :h].sum() for l, h in enumerate(hot)) / mass.sum()
    assert on_gpu == pytest.approx(one[:k].sum() / one.sum(), rel=1e-12)
    if profile == "power law":
        assert on_gpu > 2 * k / n_ff   # 78.6%: PowerInfer's point, a small hot set carries most of the activations
    print(f"{profile}: {k / n_ff:.1%} of the neurons hot in every layer, {on_gpu:.1%} of the activation mass")


def test_planner_on_a_converted_file(silu_file):
    from pinfer.formats import PinfReader
    from pinfer.formats.config import ModelConfig
    r = PinfReader(silu_file)
    cfg = ModelConfig.from_dict(r.header["config"])
    modes = ["predicted", "dense"]
    specs = placement.layer_specs(r, cfg, modes)
    assert specs[0][0].rank > 0 and specs[1][0].rank == 0
    assert specs[0][0].gate_up == ("q4", True) and specs[0][0].down == ("q4r", True)
    mass = placement.activation_mass(r, cfg, modes)
    assert mass[0].max() < 1 and (mass[1] == 1).all()
    previous = [0, 0]
    for budget in (0, 10_000, 60_000, 120_000, 200_000, 1 << 30):
        p = placement.plan(r, cfg, modes, budget)
        assert p.total <= budget or not any(p.hot)
        assert p.layer_bytes == [specs[i][0].nbytes(h) for i, h in enumerate(p.hot)]
        assert all(h >= h0 for h, h0 in zip(p.hot, previous))
        previous = p.hot
    assert p.hot == [cfg.n_ff] * cfg.n_layer and p.hot_share == 1.0
    assert "placement for a VRAM budget" in p.describe()
    p = placement.plan(r, cfg, modes, 10 << 20, reserved={"dense weights": 11 << 20})
    assert p.hot == [0, 0] and "dense weights: 11.0 MiB" in p.describe()


# -- the hybrid step with both halves on the CPU ---------------------------------------------------

def _layer(gu_fmt, dn_fmt, act, n, d, r, n_cand):
    """A random layer with its rule's inputs: (parts, x, thr, pred_thr, candidates)."""
    from pinfer.kernels import SparseFFN
    gf, gparts, _, _ = gate_up(gu_fmt, n, d)
    df, dparts, _ = down(dn_fmt, n, d)
    pred = predictor(n, d, r)
    x = RNG.standard_normal(d).astype(np.float32)
    pthr = gap_threshold(scores(pred, x), 0.4)
    whole = SparseFFN((gf, gparts), (df, dparts), n, d, act, pred)
    whole(x, np.zeros(d, np.float32), "dense")
    thr = gap_threshold(np.abs(whole.survivors()[1]), 0.3)
    cand = np.sort(RNG.choice(n, n_cand, replace=False)).astype(np.int32)
    return ((gf, gparts), (df, dparts), pred), x, thr, pthr, cand


@pytest.mark.parametrize("gu_fmt, dn_fmt", [("q4", "q4r"), ("f16", "f16"), ("q4-nomin", "q8"), ("q5", "q4r")])
@pytest.mark.parametrize("mode, act", [("dense", "silu"), ("down", "silu"), ("predicted", "silu"),
                                       ("relu", "relu"), ("given", "silu")])
def test_a_split_layer_equals_the_whole(gu_fmt, dn_fmt, mode, act):
    from pinfer.kernels import SparseFFN
    n, d = 128, 96
    ((gf, gparts), (df, dparts), pred), x, thr, pthr, cand = _layer(gu_fmt, dn_fmt, act, n, d, 32, 50)
    whole = SparseFFN((gf, gparts), (df, dparts), n, d, act, pred)
    y_whole = np.zeros(d, np.float32)
    if mode == "given":
        whole.set_candidates(cand)
    counts = whole.bind(x, y_whole, mode, thr, pthr)()
    for k in (32, 64, 96, 128):
        split = hybrid.build(((gf, gparts), (df, dparts), pred), k, n, d, act, 1,
                             hybrid.cpu_hot_factory(k, d, act, 1))
        if mode == "given":
            split.set_candidates(cand)
        y = np.full(d, np.nan, np.float32)
        assert split.bind(x, y, mode, thr, pthr)() == counts, k
        np.testing.assert_allclose(y, y_whole, rtol=0, atol=1e-5 * np.abs(y_whole).max())


def test_the_merge_is_skipped_when_no_cold_neuron_survives():
    n, d, k = 128, 64, 64
    gf, gparts, _, _ = gate_up("q4", n, d)
    df, dparts, _ = down("q4r", n, d)
    split = hybrid.build(((gf, gparts), (df, dparts), None), k, n, d, "silu", 1,
                         hybrid.cpu_hot_factory(k, d, "silu", 1))
    merged = []
    inner = split.hot.bind

    def spy(*a):
        start, finish = inner(*a)
        return start, lambda cold: (merged.append(cold is not None), finish(cold))[1]
    split.hot.bind = spy
    x = RNG.standard_normal(d).astype(np.float32)
    y = np.zeros(d, np.float32)
    run = split.bind(x, y, "given")
    split.set_candidates(np.array([1, 5, 40], np.int32))          # hot neurons only
    assert run() == (3, 3)
    split.set_candidates(np.array([1, 70, 127], np.int32))        # one cold pair of rows
    assert run() == (3, 3)
    assert merged == [False, True]


def _decode(model, ids):
    model.reset()
    model.forward(ids[:8])
    model.counters.reset()
    return np.stack([model.forward([t]) for t in ids[8:]])


@pytest.mark.parametrize("sparsity", ["down:0.3", "predicted:0.99", "dense"])
def test_model_decodes_the_same_with_the_split(silu_file, sparsity, capfd, monkeypatch):
    # the whole layer's row dots over W_down (int8 h) only where every neuron survives: the split's
    # halves run the axpy, and the comparison is exact
    monkeypatch.setattr(kernels, "ROWS_FROM", 1.0)
    ids = list(range(5, 37))
    ref = Model(silu_file, RuntimeOptions(sparsity=sparsity, kernels="on", threads=1, device="cpu"))
    want = _decode(ref, ids)
    spread = np.abs(want).max()
    for budget in (0.0, 3e-5, 1e-4, 1.0):
        m = Model(silu_file, RuntimeOptions(sparsity=sparsity, kernels="on", threads=1, device="cpu-split",
                                            vram_budget=budget, verbose=True))
        got = _decode(m, ids)
        if sparsity == "dense" and any(m.plan.hot):
            # hot layers run dense in the fused kernel (int8 activations for down too), others in ONNX Runtime
            assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
            assert np.abs(got - want).max() < 0.05 * spread
        else:
            assert np.abs(got - want).max() <= 1e-5 * spread, (budget, m.plan.hot)
            assert m.counters.read_fractions() == ref.counters.read_fractions()
        assert any("placement for a VRAM budget of" in n.describe() for n in m.notes)
    assert capfd.readouterr().err == ""          # the runtime notes; the CLI prints
    with pytest.raises(ValueError, match="needs a vram_budget"):
        Model(silu_file, RuntimeOptions(device="cpu-split"))
    with pytest.raises(ValueError, match="negative"):
        Model(silu_file, RuntimeOptions(device="cpu-split", vram_budget=-1))


@pytest.mark.parametrize("sparsity, kernels", [("dense", "off"), ("down:0.3", "on"), ("predicted:0.99", "off")])
def test_fp16_graphs_agree_with_fp32(silu_file, sparsity, kernels):
    """The FP16 graphs the CUDA provider would run (runtime/fp16.py), here on the CPU provider:
    prefill and decode against the FP32 graphs of the same file."""
    ids = list(range(5, 45))
    a, b = (Model(silu_file, RuntimeOptions(sparsity=sparsity, kernels=kernels, threads=1, device="cpu",
                                             dense_device=dd)) for dd in ("cpu", "cpu-fp16"))
    assert b.devices.act_dtype == np.float16 and b.attention.kv[0][0].read().dtype == np.float16
    want, got = a.forward(ids, logits_from=0), b.forward(ids, logits_from=0)
    step_a, step_b = (np.stack([m.forward([t]) for t in ids[:12]]) for m in (a, b))
    spread = np.abs(want).max()
    print(f"{sparsity}: max |dlogit| prefill {np.abs(want - got).max():.4f}, decode {np.abs(step_a - step_b).max():.4f}"
          f" (max |logit| {spread:.2f}), top-1 {(want.argmax(1) == got.argmax(1)).mean():.1%}")
    assert got.dtype == np.float32
    assert np.abs(want - got).max() < 0.05 * spread and np.abs(step_a - step_b).max() < 0.05 * spread
    assert (want.argmax(1) == got.argmax(1)).mean() >= 0.9


def test_the_dense_part_needs_a_cuda_provider(silu_file):
    with pytest.raises(ValueError, match="dense device 'tpu'"):
        Model(silu_file, RuntimeOptions(device="cpu", dense_device="tpu"))
    with pytest.raises(gpu_mod.GpuError, match="cannot run on the GPU: the FFN runs on the CPU"):
        Model(silu_file, RuntimeOptions(device="cpu", dense_device="gpu"))
    assert Model(silu_file, RuntimeOptions(device="cpu-split", vram_budget=1.0)).devices.dense == "cpu"


def test_auto_runs_on_the_cpu_where_no_gpu_is_found(silu_file, monkeypatch):
    def no_gpu(*a, **k):
        raise gpu_mod.GpuError("no NVIDIA driver was found")
    monkeypatch.setattr(gpu_mod, "Gpu", no_gpu)
    assert Model(silu_file, RuntimeOptions()).devices.ffn == "cpu"
    with pytest.raises(gpu_mod.GpuError, match="no NVIDIA driver"):
        Model(silu_file, RuntimeOptions(device="gpu"))


# -- on a GPU --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu():
    try:
        return gpu_mod.Gpu()
    except gpu_mod.GpuError as e:
        pytest.skip(f"no usable NVIDIA GPU here: {e}")


@pytest.mark.parametrize("gu_fmt, dn_fmt", [("q4", "q4r"), ("q4-nomin", "q4r-nomin"), ("f16", "f16"),
                                            ("q4", "q4"), ("f32", "q8"), ("q5", "q4r"), ("q5-nomin", "q8")])
@pytest.mark.parametrize("mode, act", [("dense", "silu"), ("down", "silu"), ("predicted", "silu"),
                                       ("relu", "relu"), ("given", "silu")])
@pytest.mark.gpu
def test_gpu_hot_part_matches_the_cpu_kernel(gpu, gu_fmt, dn_fmt, mode, act):
    from pinfer.kernels import SparseFFN
    n, d, r = 256, 160, 64
    ((gf, gparts), (df, dparts), pred), x, thr, pthr, cand = _layer(gu_fmt, dn_fmt, act, n, d, r, 90)
    with_pred = mode in ("predicted", "relu")
    for k in (64, 256):
        spec = gpu_mod.HotSpec(d, n, (gf, "min" in gparts), (df, "min" in dparts), r if with_pred else 0)
        ys = []
        for det in (True, True, False):
            split = hybrid.build(((gf, gparts), (df, dparts), pred if with_pred else None), k, n, d, act, 1,
                                 lambda gu, dn, p: gpu_mod.HotFFN(gpu, spec, k, gu, dn, p, act, det))
            whole = SparseFFN((gf, gparts), (df, dparts), n, d, act, pred)
            if mode == "given":
                split.set_candidates(cand)
                whole.set_candidates(cand)
            want = np.zeros(d, np.float32)
            counts = whole.bind(x, want, mode, thr, pthr)()
            got = np.full(d, np.nan, np.float32)
            # both quantize x to int8 against int4 rows alike (one numerics contract): only the
            # order of the float sums differs, over at most n_ff * 2 terms of float32
            tol = 1e-4
            assert split.bind(x, got, mode, thr, pthr)() == counts
            np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(want).max())
            ys.append(got)
            split.hot.close()
        assert np.array_equal(ys[0], ys[1])          # the deterministic variant: the same bits


@pytest.mark.gpu
def test_gpu_model_decodes_as_the_cpu(gpu, silu_file, capfd):
    ids = list(range(5, 37))
    want = _decode(Model(silu_file, RuntimeOptions(sparsity="predicted:0.99", kernels="on", threads=1,
                                                   device="cpu")), ids)
    m = Model(silu_file, RuntimeOptions(sparsity="predicted:0.99", threads=1, device="gpu", vram_budget=1.0))
    assert m.plan.hot == [128, 128]
    got = _decode(m, ids)
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9
    said = "\n".join(n.describe() for n in m.notes if not n.quiet)
    assert "placement for a VRAM budget" in said and "VRAM: FFN hot neurons planned" in said


@pytest.mark.parametrize("sparsity", ["dense", "predicted:0.99"])
@pytest.mark.gpu
def test_gpu_dense_part_decodes_as_the_cpu(gpu, silu_file, sparsity):
    """The dense part on ONNX Runtime's CUDA provider (FP16), the FFN's hot neurons on the GPU:
    prefill and decode within what the FP16 graphs on the CPU provider get to the FP32 path
    (test_fp16_graphs_agree_with_fp32's bounds). tests/test_device_plumbing.py runs the same code
    path on the CPU."""
    import onnxruntime as ort
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("this onnxruntime has no CUDA provider (install onnxruntime-gpu in its place)")
    ids = list(range(5, 37))
    want_model = Model(silu_file, RuntimeOptions(sparsity=sparsity, kernels="on", threads=1, device="cpu"))
    want = want_model.forward(ids[:8], logits_from=0), _decode(want_model, ids)
    for budget in (1.0, 3e-5):
        m = Model(silu_file, RuntimeOptions(sparsity=sparsity, threads=1, device="gpu", vram_budget=budget,
                                            dense_device="gpu"))
        assert m.devices.dense == "gpu" and m.devices.on_device
        got = m.forward(ids[:8], logits_from=0), _decode(m, ids)
        for w, g in zip(want, got):
            spread = np.abs(w).max()
            print(f"{sparsity}, budget {budget} GiB (hot {m.plan.hot}): max |dlogit| {np.abs(w - g).max():.4f} "
                  f"(max |logit| {spread:.2f}), top-1 {(w.argmax(-1) == g.argmax(-1)).mean():.1%}")
            assert np.abs(w - g).max() < 0.05 * spread and (w.argmax(-1) == g.argmax(-1)).mean() >= 0.9
