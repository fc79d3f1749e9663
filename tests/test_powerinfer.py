"""PowerInfer's own files (converter/frontend/powerinfer.py): a tiny model written here in exactly
their layout (PWRI magic, blk.N.fc1/fc2 predictors, ffn_down_t, activation/activation_N.pt),
converted with no calibration, decoded against a PyTorch reference applying the same rule."""

import shutil

import numpy as np
import pytest
import torch
from fixtures import make_tiny_llama_gguf, tiny_llama_weights
from reference import reference_logits

from pinfer.converter.convert import ConvertOptions, convert
from pinfer.converter.passes import PassOptions
from pinfer.formats import PinfReader
from pinfer.formats import schema as S
from pinfer.runtime.model import Model, RuntimeOptions

SHAPE = dict(n_layer=2, d_model=64, n_ff=128, n_head=4, n_head_kv=2, vocab=320)
RANK = 32
IDS = [int(i) for i in np.random.default_rng(0).integers(0, 320, 40)]


def _q8_exact(rng, shape):
    """Weights whose Q8_0 rounding is exact: integers up to 127 times 2^-7, a 127 in every block of
    32, so the q8 predictor pinfer stores equals the file's (no threshold flips from rounding)."""
    q = rng.integers(-126, 127, shape)
    q[..., ::32] = 127
    return (q / 128.0).astype(np.float32)


def _write(d, threshold=0.0):
    """(PowerInfer file, the same model as a plain llama GGUF for the reference, fc1, fc2, counts)."""
    w = tiny_llama_weights(**SHAPE, tied_embeddings=False, seed=11)
    rng = np.random.default_rng(3)
    fc = {i: (_q8_exact(rng, (RANK, 64)) / 8, _q8_exact(rng, (128, RANK)) / 4) for i in range(2)}
    kw = dict(qtype="F32", **SHAPE)
    twin = make_tiny_llama_gguf(d / "twin.gguf", weights=w, extra_kv={"pinfer.feed_forward_activation": "relu"}, **kw)
    pw = dict(w)
    for i in range(2):
        pw[f"blk.{i}.ffn_down_t.weight"] = np.ascontiguousarray(pw.pop(f"blk.{i}.ffn_down.weight").T)
        pw[f"blk.{i}.fc1.weight"], pw[f"blk.{i}.fc2.weight"] = fc[i]
    path = make_tiny_llama_gguf(d / "tiny.powerinfer.gguf", weights=pw,
                                extra_kv={"powerinfer.sparse_threshold": threshold}, **kw)
    with open(path, "r+b") as f:
        f.write(b"PWRI")
    (d / "activation").mkdir()
    counts = [rng.integers(0, 1000, 128) for _ in range(2)]
    for i, c in enumerate(counts):
        torch.save(torch.tensor(c), d / "activation" / f"activation_{i}.pt")
    return path, twin, fc, counts


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("powerinfer")
    path, twin, fc, counts = _write(d)
    out = convert(ConvertOptions(path, d / "tiny.pinf", passes=PassOptions()))
    return path, twin, fc, counts, out


def _rule(fc, threshold=0.0):
    """PowerInfer's rule on the reference's FFN: relu(gate) * up where fc2(relu(fc1 x)) >= threshold."""
    def ffn(i, h, g, u):
        w1, w2 = (torch.from_numpy(a).to(h.dtype) for a in fc[i])
        return torch.relu(g) * u * (torch.relu(h @ w1.T) @ w2.T >= threshold)
    return ffn


def test_the_file_converts_with_its_own_predictors_and_counts(files):
    path, _, fc, counts, out = files
    r = PinfReader(out)
    h = r.header
    assert h["sparsity"]["mode"] == "powerinfer" and "no calibration" in h["sparsity"]["reason"]
    for i, lay in enumerate(h["layers"]):
        assert lay["mode"] == "relu" and lay["order"] == "hot-first" and lay["predictor"]["source"] == "powerinfer"
        perm = np.argsort(-counts[i], kind="stable")
        # hottest first by the file's counts, the predictor's rows alike, its weights exactly
        freq = r.tensor(S.FFN_FREQ)[i]
        assert np.allclose(freq, counts[i][perm] / counts[i].max())
        from pinfer.formats import blocks
        w2 = blocks.dequantize(*r.block(S.FFN_PRED_W2.format(i)))
        assert np.array_equal(w2, fc[i][1][perm]) and np.array_equal(blocks.dequantize(*r.block(S.FFN_PRED_W1.format(i))), fc[i][0])
    assert not (out.parent / "tiny.pinf.report.json").exists()      # no calibration, nothing to report


@pytest.mark.parametrize("kernels", ["off", "on"])
def test_it_decodes_as_pytorch_with_the_same_rule(files, kernels):
    """F32 weights: the ONNX path with the NumPy rule within float order of the reference (1e-4);
    the fused kernel quantizes x to int8 for the predictor's q8 rows, which can flip a neuron whose
    logit lies within that rounding of the threshold: top-1 and 5e-2 there."""
    _, twin, fc, _, out = files
    ref = reference_logits(twin, IDS, ffn=_rule(fc))
    m = Model(out, RuntimeOptions(threads=1, kernels=kernels, device="cpu"))
    got = m.forward(IDS, logits_from=0)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    gu, down = m.counters.fractions()
    print(f"kernels {kernels}: max |dlogit| / max |logit| {rel:.2e}, rows read {gu:.1%} gate/up, {down:.1%} down")
    assert rel <= (1e-4 if kernels == "off" else 5e-2)
    assert (got.argmax(1) == ref.argmax(1)).mean() >= (1.0 if kernels == "off" else 0.9)


def test_the_rule_changes_the_reference(files):
    """Without the predictor's rule the model's logits move far more than the bounds above: the
    comparison checks the rule, not only the dense model."""
    _, twin, fc, _, _ = files
    ref = reference_logits(twin, IDS, ffn=_rule(fc))
    dense = reference_logits(twin, IDS, ffn=lambda i, h, g, u: torch.relu(g) * u)
    assert np.abs(dense - ref).max() > 0.1 * np.abs(ref).max()


def test_inspect_says_what_came_from_where(files):
    """`pinfer inspect` on the PowerInfer file and on its conversion (real processes)."""
    import subprocess
    import sys
    path, _, _, _, out = files
    run = lambda f: subprocess.run([sys.executable, "-m", "pinfer", "inspect", str(f)],  # noqa: E731
                                   capture_output=True, text=True, timeout=120)
    src, conv = run(path), run(out)
    assert src.returncode == 0 and "PowerInfer GGUF (PWRI" in src.stdout, src.stderr
    assert conv.returncode == 0 and "sparsity   powerinfer: relu:0.99" in conv.stdout
    assert "own predictors" in conv.stdout and "activation/ counts" in conv.stdout and "not measured" in conv.stdout


def test_counts_are_read_safely_or_refused(tmp_path):
    path, _, _, _ = _write(tmp_path)
    act = tmp_path / "activation" / "activation_1.pt"
    import pickle
    act.write_bytes(pickle.dumps({"not": "a tensor"}))
    with pytest.raises(ValueError, match="activation_1.pt (could not be read|holds)"):
        convert(ConvertOptions(path, tmp_path / "x.pinf"))
    shutil.rmtree(tmp_path / "activation")
    with pytest.raises(ValueError, match="activation_0.pt is missing"):
        convert(ConvertOptions(path, tmp_path / "x.pinf"))
    assert not (tmp_path / "x.pinf").exists()
