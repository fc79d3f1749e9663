"""The real model, SmolLM2-135M-Instruct Q4_1, converted and run end to end.

References: tests/reference.py (an independent PyTorch forward over the GGUF's dequantized
weights) and llama.cpp's greedy continuations in tests/data."""

import contextlib
import io
import json

import numpy as np
import pytest
from models import DATA, smollm2_gguf
from reference import reference_logits

from pinfer.converter.passes import DENSE
from pinfer.converter.convert import ConvertOptions, convert
from pinfer.runtime.generate import GenerateOptions, Session
from pinfer.runtime.model import RuntimeOptions
from pinfer.runtime.sample import SamplerConfig

pytestmark = pytest.mark.real_model

GREEDY = DATA / "llamacpp-greedy-public.json"
WIKI = DATA / "wikitext-2-raw-test.txt"


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    src = smollm2_gguf()
    out = tmp_path_factory.mktemp("smol") / "smollm2.pinf"
    with contextlib.redirect_stderr(io.StringIO()):
        convert(ConvertOptions(src, out, passes=DENSE))
    return Session(out, RuntimeOptions(threads=1, n_ctx=512))


@pytest.fixture(scope="module")
def windows(session):
    """4 windows of 500 tokens of the wikitext test text and the exact float reference's logits of
    each (tests/reference.py)."""
    ids = session.tokenizer.encode(WIKI.read_text(encoding="utf-8")[:40000], parse_special=False)
    wins = [ids[w * 500:(w + 1) * 500] for w in range(4)]
    return [(window, reference_logits(smollm2_gguf(), window)) for window in wins]


def _agreement(windows, logits_of):
    agree, total, worst, sq, n = 0, 0, 0.0, 0.0, 0
    for window, ref in windows:
        ours = logits_of(window)
        agree += int((ours.argmax(1) == ref.argmax(1)).sum())
        total += len(window)
        worst = max(worst, float(np.abs(ours - ref).max()))
        sq, n = sq + float(((ours - ref) ** 2).sum()), n + ours.size
    rms = (sq / n) ** 0.5
    print(f"top-1 agreement {agree}/{total} = {agree / total:.4f}; max |logit difference| {worst:.3f}, "
          f"RMS {rms:.3f}")
    return agree / total, rms


# int8 activations (as llama.cpp quantizes them: per group of 32) flip near-ties of the exact
# model's top two: llama.cpp itself agrees 96.3% (2-core EPYC, AVX-512) and 96.35% (AVX2-only
# Zen 2, 1927 of 2000) with the reference on these windows. The flip count, about 70 of 2000, varies
# with the rounding's details by about its square root (0.4%): the bounds sit two of those below
# each path's measured agreement. The exact-activation path would reach 98%.

@pytest.mark.slow
def test_teacher_forced_top1_agreement_with_reference(session, windows):
    """Each window as one prompt, through ONNX Runtime's graphs (MatMulNBits, accuracy level 4):
    96.5% on the AVX-512 EPYC; 95.5% (1910 of 2000) with ONNX Runtime 1.32's AVX2 int8 path on the
    AVX2-only one. Bound 95%."""
    def prompt(window):
        session.model.reset()
        return session.model.forward(window, logits_from=0)
    agree, rms = _agreement(windows, prompt)
    assert agree >= 0.95
    assert rms < 0.5


@pytest.mark.slow
def test_decode_kernels_top1_agreement_with_reference(session, windows):
    """The same windows token by token, through pinfer's decode path (the C attention and head, the
    FFN as autotune chose): 96.35% (1927 of 2000) on the AVX2-only EPYC, as llama.cpp. Bound 95.5%."""
    model = session.model

    def decode(window):
        model.reset()
        return np.concatenate([model.forward([t]) for t in window])
    assert all(s is not None for s in [L.native for L in model.layers]) and model.native_head is not None    # the C kernels run
    agree, rms = _agreement(windows, decode)
    assert agree >= 0.955
    assert rms < 0.5


def test_greedy_continuations_against_llamacpp(session):
    """Reports how far pinfer's greedy output follows llama.cpp's. An exact float reference
    (tests/reference.py, and transformers) follows it for 5, 16 and 25 tokens: past those points
    llama.cpp's own int8 rounding decides near-ties (the exact model prefers another token at step
    6 of the first prompt by 0.22 logits). pinfer measured 14, 16 and 13 (5, 8 and 25 before its C attention
    and head)."""
    data = json.loads(GREEDY.read_text())
    lengths = []
    for p in data["prompts"]:
        session.reset()
        out = [s.token for s in session.generate(p["prompt_ids"], GenerateOptions(
            n_predict=64, ignore_eos=True, sampler=SamplerConfig(temp=0)))]
        ref = p["generated_ids_new"]
        lengths.append(next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), len(ref)))
    print("greedy agreement with llama.cpp (tokens):", lengths,
          "builds agree for:", [p["builds_agree_for"] for p in data["prompts"]])
    assert lengths[0] >= 5 and lengths[1] >= 8 and lengths[2] >= 13


def test_chat_reply_is_sensible(session):
    from pinfer.runtime.chat import render_messages

    session.reset()
    text = render_messages(session, [{"role": "user",
                                      "content": "What is the capital of France? Answer in one sentence."}])
    ids = session.tokenizer.encode(text)
    steps = list(session.generate(ids, GenerateOptions(n_predict=32, sampler=SamplerConfig(temp=0))))
    reply = "".join(s.text for s in steps)
    assert "Paris" in reply
    assert steps[-1].finish_reason == "stop"


@pytest.mark.slow
def test_convert_with_calibration_on_the_real_model(tmp_path):
    """The whole pass pipeline on SmolLM2 with a short calibration (the default uses 24k tokens;
    its figures are in the report of `pinfer convert`). Every measured point is reported, the
    choice keeps the budget on held-out text, and the file verifies against the source."""
    from pinfer.converter.passes import PassOptions
    from pinfer.formats import PinfReader

    out = tmp_path / "cal.pinf"
    with contextlib.redirect_stderr(io.StringIO()):
        convert(ConvertOptions(smollm2_gguf(), out, passes=PassOptions(calib_tokens=4096, heldout_tokens=2048,
                                                                          early_check=False)))
    h = PinfReader(out).header
    points = {r["point"]: r for r in h["sparsity"]["heldout"]["points"]}
    assert {"dense", "down:0.2", "down:0.3", "down:0.4", "predicted:0.95", "predicted:0.99"} <= set(points)
    for lay in h["layers"]:
        name = lay["mode"] if lay["mode"] == "dense" else f"{lay['mode']}:{lay['value']:g}"
        assert points[name]["increase"] <= h["sparsity"]["max_ppl_increase"]
    report = json.loads((tmp_path / "cal.pinf.report.json").read_text())
    tf = report["verification"]["teacher_forced"]
    print(h["sparsity"]["reason"], tf, report["verification"]["runtime_heldout"])
    assert tf["top1_agreement"] >= 0.9 and tf["rms_diff"] < 0.5
    # down_t keeps GGUF's Q4_1 groups exactly wherever the source order is kept
    for i, lay in enumerate(h["layers"]):
        if lay["order"] == "source":
            assert h["weights"][f"blk.{i}.ffn_down_t"] == "q4r"
