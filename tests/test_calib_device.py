"""`--calib-device`: calibration and predictor training on the device PyTorch is given.

On a machine without CUDA: the device-agnostic code runs a layer on PyTorch's "meta" device (shapes
only, no values), where any tensor left on the CPU by mistake meets a meta tensor and raises; the
refusal of `--calib-device cuda`; and the GPU's bound (the same choices as the CPU's) runs where CUDA is
available and says why it is skipped elsewhere."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from fixtures import QUICK_PASSES, make_tiny_llama_gguf

from pinfer.converter.convert import ConvertOptions, _front_end, convert
from pinfer.converter.passes import PassOptions, calib_device, calibrate, early
from pinfer.converter.passes import predictor as P
from pinfer.converter.passes import torch_llama as TL
from pinfer.formats import PinfReader

RELU = {"llama.feed_forward_activation": "relu"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("calibdev")
    src = make_tiny_llama_gguf(d / "t.gguf", qtype="Q8_0", n_layer=2, d_model=64, n_ff=256, n_head=4, n_head_kv=2,
                               seed=5)
    return d, src


def test_a_layer_of_calibration_runs_on_the_meta_device(tiny):
    """Embedding, rotary tables, a layer's weights, the batched forward with its held-out tensors,
    the sliding-window mask, the predictor's scores and the head's logits, all on "meta": a CPU tensor
    anywhere in them would raise "expected device meta"."""
    d, src = tiny
    fe = _front_end(ConvertOptions(src, d / "x.pinf"))
    cfg, meta = fe.cfg, torch.device("meta")
    embed, head = TL.Embedding(fe.src, fe.roles, meta), TL.Head(fe.src, fe.roles, cfg, device=meta)
    seqs = np.zeros((3, 32), np.int64)
    h = embed(seqs)
    rot = TL.Rotary(cfg, 32, None, meta)
    w = TL.load_layer(fe.src, fe.roles, 0, meta)
    assert h.device == meta and w.up.device == meta and rot.cos.device == meta
    with torch.no_grad():
        a, x, hact = calibrate._dense_heldout(h, w, cfg, rot, 2)
        assert a.device == x.device == hact.device == meta and hact.shape == (3, 32, cfg.n_ff)
        windowed = type(cfg)(**{**cfg.__dict__, "sliding_window": 8})
        assert TL.attention(h, w, windowed, rot).device == meta
        assert head.logits(x[0]).device == meta
    x2 = torch.randn(5, cfg.d_model, generator=torch.Generator().manual_seed(0))
    pred = P.train(x2, torch.ones(5, cfg.n_ff, dtype=torch.bool), 32, epochs=1, batch=5)   # trained on the CPU
    assert pred.scores(x.view(-1, cfg.d_model)).device == meta
    # the sample pass's layer loop takes its device from the streams
    seen = []
    early._layers(fe.src, fe.roles, cfg, {"dense": embed(seqs)}, None,
                  lambda i, name, x, hact: seen.append(hact.device) or hact)
    assert seen == [meta] * cfg.n_layer


def test_auto_is_the_cpu_without_cuda_and_cuda_is_refused_in_a_sentence(tiny, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: auto is the GPU and --calib-device cuda is accepted")
    assert calib_device("auto") == "cpu" and calib_device("cpu") == "cpu"
    _, src = tiny
    out = tmp_path / "x.pinf"
    r = subprocess.run([sys.executable, "-m", "pinfer", "convert", str(src), "-o", str(out), "--sparsity",
                        "down:0.3", "--calib-device", "cuda"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "--calib-device cuda: PyTorch sees no CUDA GPU here" in r.stderr
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU that PyTorch sees (the CPU-side "
                                                            "checks are the meta-device test above)")
@pytest.mark.gpu
def test_the_gpu_calibration_makes_the_cpus_choices(tmp_path):
    """The same relu model calibrated on both devices: every layer's operating point within one step of
    the CPU's, and the predictors' held-out mass recall within 0.005 (float summation differs)."""
    src = make_tiny_llama_gguf(tmp_path / "r.gguf", qtype="F32", n_layer=2, d_model=64, n_ff=256,
                               extra_kv=RELU, seed=3)
    heads = {}
    for dev in ("cpu", "cuda"):
        out = convert(ConvertOptions(src, tmp_path / f"{dev}.pinf",
                                     passes=PassOptions(calib_device=dev, **QUICK_PASSES)))
        heads[dev] = PinfReader(out).header
    from pinfer.converter.passes.calibrate import RELU_POINTS
    steps = [0.0, *RELU_POINTS]
    for lc, lg in zip(heads["cpu"]["layers"], heads["cuda"]["layers"]):
        assert abs(steps.index(lc["value"]) - steps.index(lg["value"])) <= 1, (lc["value"], lg["value"])
        rc = {t["recall_target"]: t["mass_recall"] for t in lc["predictor"]["thresholds"]}
        rg = {t["recall_target"]: t["mass_recall"] for t in lg["predictor"]["thresholds"]}
        assert rc.keys() == rg.keys() and all(abs(rc[k] - rg[k]) <= 0.005 for k in rc), (rc, rg)
    assert "CUDA" in heads["cuda"]["sparsity"]["device"], json.dumps(heads["cuda"]["sparsity"])[:300]


@pytest.mark.slow
def test_the_adaptive_calibration_length_follows_its_rule(tiny, tmp_path):
    """No --calib-tokens: the first layer's predictor at 4096, 8192, ... training tokens; the search
    stops at the first doubling that improves the share needed for 0.99 mass recall by under 2%, or
    at all the tokens, and every layer is calibrated on the last length tried. The report states
    the calibration's cost over the layers' own forward pass."""
    _, src = tiny
    opts = {**QUICK_PASSES, "calib_tokens": None, "sparsity": "predicted:0.99"}
    out = convert(ConvertOptions(src, tmp_path / "a.pinf", passes=PassOptions(**opts)))
    sp = PinfReader(out).header["sparsity"]
    search = sp["length_search"]
    tokens = [n for n, _ in search]
    assert tokens[0] == calibrate.ADAPTIVE_START and all(b == min(2 * a, tokens[-1]) for a, b in zip(tokens, tokens[1:]))
    for (_, a), (_, b) in zip(search[:-2], search[1:-1]):
        assert a - b >= calibrate.ADAPTIVE_GAIN * a           # every doubling but the last improved enough
    last_gain = search[-2][1] - search[-1][1] if len(search) > 1 else None
    from pinfer.converter.passes import CALIB_TOKENS_MAX
    assert tokens[-1] == CALIB_TOKENS_MAX or (last_gain is not None and last_gain < calibrate.ADAPTIVE_GAIN * search[-2][1])
    assert sp["train_tokens"] == tokens[-1] and sp["cost_over_forward"] > 1
    fixed = convert(ConvertOptions(src, tmp_path / "f.pinf", passes=PassOptions(**QUICK_PASSES)))
    assert PinfReader(fixed).header["sparsity"]["length_search"] == []
