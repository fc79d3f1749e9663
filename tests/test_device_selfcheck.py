"""The device's self-check at load (runtime/selfcheck.py) on the emulated device: the hot half on a
second CPU kernel (--device cpu-split) and the dense part through the GPU's code path on the CPU
(dense_device emulated-gpu). Unperturbed it passes and nothing moves; a device result with one
survivor flipped, or one output off by more than the tolerance, puts the model on the CPU with a
Note giving the figures, and the model then decodes as the CPU one does."""

import numpy as np
import pytest

from pinfer.runtime import selfcheck
from pinfer.runtime.model import Model, RuntimeOptions

DEVICE_FFN, DEVICE_DENSE = selfcheck.device_ffn, selfcheck.device_dense     # the unperturbed runs
EMULATED = dict(kernels="on", threads=1, device="cpu-split", vram_budget=1.0, dense_device="emulated-gpu")


def _said(model):
    return "\n".join(n.describe() for n in model.notes if not n.quiet)


def _on_the_cpu(model):
    dv = model.devices
    return (dv.ffn, dv.dense, dv.on_device, dv.act_dtype, model.plan) == ("cpu", "cpu", False, np.float32, None)


@pytest.mark.parametrize("sparsity", ["dense", "down:0.3", "predicted:0.99"])
@pytest.mark.parametrize("dense_device", ["emulated-gpu", "cpu"])
def test_unperturbed_the_check_passes_and_nothing_moves(silu_file, sparsity, dense_device, monkeypatch):
    seen = []
    checks = selfcheck.self_check
    monkeypatch.setattr(selfcheck, "self_check", lambda *a: seen.append(checks(*a)) or seen[-1])
    m = Model(silu_file, RuntimeOptions(**{**EMULATED, "dense_device": dense_device}, sparsity=sparsity))
    assert (m.devices.ffn, m.devices.dense) == ("cpu-split", dense_device) and min(m.plan.hot) > 0
    [checks] = seen
    assert [c.what.split("'s ")[1].split(" ")[0] for c in checks] == ["FFN"] + ["attention"] * (dense_device != "cpu")
    ffn = checks[0]
    assert ffn.diff == 0 and ffn.tol > 0 and ffn.differing == 0 and sparsity.split(":")[0] in ffn.what
    for c in checks[1:]:
        assert 0 < c.diff < c.tol / 2, c.describe()     # FP16 against FP32: a difference, well inside
    assert "running on the CPU" not in _said(m)
    [passed] = [n for n in m.notes if "self-check at load passed" in n.describe()]
    assert passed.quiet


def test_no_check_where_everything_runs_on_the_cpu(silu_file, monkeypatch):
    monkeypatch.setattr(selfcheck, "check_ffn", None)       # called, it would raise
    monkeypatch.setattr(selfcheck, "check_dense", None)
    for dense_device in ("cpu", "cpu-fp16"):
        m = Model(silu_file, RuntimeOptions(device="cpu", dense_device=dense_device, threads=1))
        assert not any("self-check" in n.describe() for n in m.notes)


def _flip(change):
    real = DEVICE_FFN

    def run(hot, x, *rule):
        y, surv = real(hot, x, *rule)
        k = hot.ffn.n_ff
        if change == "drop":
            surv = surv[1:]
        else:
            surv = np.union1d(surv, [next(j for j in range(k) if j not in set(surv))]).astype(np.int32)
        return y, surv
    return run


@pytest.mark.parametrize("change", ["drop", "add"])
def test_a_flipped_survivor_puts_the_model_on_the_cpu(silu_file, change, monkeypatch):
    monkeypatch.setattr(selfcheck, "device_ffn", _flip(change))
    m = Model(silu_file, RuntimeOptions(**EMULATED, sparsity="down:0.3"))
    assert _on_the_cpu(m)
    said = _said(m)
    assert "running on the CPU: the device's self-check at load" in said, said
    assert "layer 0's FFN (128 hot neurons, down): max |diff| 0 against a tolerance of" in said
    assert "1 survivor differing" in said


def _off_by(times):
    real = DEVICE_FFN

    def run(hot, x, *rule):
        y, surv = real(hot, x, *rule)
        y = y.copy()
        y[7] += times * selfcheck.FFN_TOL * np.abs(y).max()
        return y, surv
    return run


@pytest.mark.parametrize("sparsity", ["dense", "predicted:0.99"])
def test_an_output_off_by_more_than_the_tolerance_puts_the_model_on_the_cpu(silu_file, sparsity, monkeypatch):
    ids = list(range(5, 25))
    want = Model(silu_file, RuntimeOptions(kernels="on", threads=1, device="cpu", sparsity=sparsity))
    want = [want.forward(ids[:8])] + [want.forward([t]) for t in ids[8:]]
    monkeypatch.setattr(selfcheck, "device_ffn", _off_by(0.5))       # within: no fallback
    assert Model(silu_file, RuntimeOptions(**EMULATED, sparsity=sparsity)).devices.ffn == "cpu-split"
    monkeypatch.setattr(selfcheck, "device_ffn", _off_by(2.0))
    m = Model(silu_file, RuntimeOptions(**EMULATED, sparsity=sparsity))
    assert _on_the_cpu(m)
    said = _said(m)
    [figures] = [line for line in said.splitlines() if "self-check" in line]
    diff, tol = (float(figures.split(word)[1].split()[0].rstrip(",;)")) for word in ("max |diff|", "tolerance of"))
    assert diff == pytest.approx(2 * tol, rel=1e-2) and "survivor" not in figures, figures
    got = [m.forward(ids[:8])] + [m.forward([t]) for t in ids[8:]]
    for w, g in zip(want, got):      # the CPU path, bit for bit
        assert np.array_equal(w, g)


def test_a_nan_from_the_device_puts_the_model_on_the_cpu(silu_file, monkeypatch):
    real = DEVICE_FFN
    monkeypatch.setattr(selfcheck, "device_ffn", lambda *a: (np.full_like(real(*a)[0], np.nan), real(*a)[1]))
    m = Model(silu_file, RuntimeOptions(**EMULATED))
    assert _on_the_cpu(m) and "max |diff| nan" in _said(m)


def test_a_dense_output_off_by_more_than_the_tolerance_puts_the_model_on_the_cpu(silu_file, monkeypatch):
    real = DEVICE_DENSE

    def run(dv, threads, layer, resid, delta):
        out = real(dv, threads, layer, resid, delta)
        out["ffn_x"][0, 0, 3] += 2 * selfcheck.DENSE_TOL * np.abs(out["ffn_x"]).max()
        return out
    monkeypatch.setattr(selfcheck, "device_dense", run)
    m = Model(silu_file, RuntimeOptions(**EMULATED, sparsity="down:0.3"))
    assert _on_the_cpu(m)
    said = _said(m)
    assert "layer 0's attention (ffn_x, the worst of resid_out, ffn_x, key, value): max |diff|" in said, said
    assert "FFN" not in said          # the FFN's check passed: only the failure is said


class FakeGpu:
    """Gpu's surface the load touches before any plan, with no device."""
    name, arch = "fake", 90

    def __init__(self):
        self.closed = False

    def mem_info(self):
        return 1 << 30, 1 << 30

    def close(self):
        self.closed = True


@pytest.mark.parametrize("device", ["gpu", "auto"])
def test_the_gpu_path_falls_back_and_gives_the_device_back(silu_file, device, monkeypatch):
    """--device gpu or auto with a (stand-in) GPU whose hot half loses a survivor: the model runs
    on the CPU with the Note, the check's hot half and the device given back."""
    from pinfer.kernels import SparseFFN
    from pinfer.kernels import gpu as gpu_mod
    from pinfer.runtime.hybrid import CpuHot
    made, closed = [], []

    class FakeHot(CpuHot):      # HotFFN's constructor, the CPU kernel inside
        def __init__(self, gpu, spec, k, gate_up, down, predictor, act, deterministic):
            super().__init__(SparseFFN(gate_up, down, k, spec.d, act, gpu_mod.q8_predictor(predictor)))
            made.append(gpu)

        def close(self):
            closed.append(self)
    monkeypatch.setattr(gpu_mod, "Gpu", FakeGpu)
    monkeypatch.setattr(gpu_mod, "HotFFN", FakeHot)
    monkeypatch.setattr(selfcheck, "device_ffn", _flip("drop"))
    m = Model(silu_file, RuntimeOptions(device=device, kernels="on", threads=1, sparsity="predicted:0.99"))
    assert _on_the_cpu(m) and m.devices.gpu is None
    [gpu] = made
    assert gpu.closed and len(closed) == 1
    assert "layer 0's FFN (128 hot neurons, predicted)" in _said(m) and "1 survivor differing" in _said(m)
    assert m.forward([5, 6, 7]).shape == (1, m.cfg.vocab)
