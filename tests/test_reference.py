"""The oracle itself: tiny GGUF fixtures and the PyTorch reference forward, checked against
gguf-py, transformers and llama.cpp's greedy output on SmolLM2."""

import json

import gguf
import numpy as np
import pytest
import torch

from fixtures import (CONTROL_TOKENS, QTYPES, make_tiny_llama_gguf, quantize_q4_k, quantize_q5_k, quantize_q6_k,
                      tiny_bpe_vocab)
from models import DATA, smollm2_gguf
from reference import load_reference, reference_greedy, reference_logits

# Token ids that cover the fixture vocab: bytes, merges and a control token.
IDS = [318, 84, 104, 101, 32, 99, 266, 271, 300, 17, 255, 0, 290, 319, 5, 260]


def _fields(path) -> dict:
    r = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensors(path) -> dict:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    return make_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf")


# ---------------------------------------------------------------------------------------------
# Fixtures


def test_fixture_metadata_matches_convert_hf_to_gguf(tiny_f32):
    kv = _fields(tiny_f32)
    assert kv["general.architecture"] == "llama"
    assert {k: kv[f"llama.{k}"] for k in (
        "block_count", "context_length", "embedding_length", "feed_forward_length",
        "attention.head_count", "attention.head_count_kv", "rope.dimension_count", "vocab_size",
    )} == {
        "block_count": 2, "context_length": 256, "embedding_length": 64, "feed_forward_length": 128,
        "attention.head_count": 4, "attention.head_count_kv": 2, "rope.dimension_count": 16,
        "vocab_size": 320,
    }
    assert kv["llama.rope.freq_base"] == 10000.0
    assert kv["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    tokens = kv["tokenizer.ggml.tokens"]
    assert len(tokens) == 320
    assert kv["tokenizer.ggml.model"] == "gpt2" and kv["tokenizer.ggml.pre"] == "default"
    assert tokens[32] == "Ġ" and tokens[10] == "Ċ" and tokens[65] == "A"
    assert tokens[kv["tokenizer.ggml.bos_token_id"]] == "<|im_start|>"
    assert tokens[kv["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    assert kv["tokenizer.ggml.add_bos_token"] is False
    assert [t for t, ty in zip(tokens, kv["tokenizer.ggml.token_type"]) if ty == 3] == list(CONTROL_TOKENS)
    assert set(kv["tokenizer.ggml.token_type"]) == {1, 3}
    assert "<|im_start|>" in kv["tokenizer.chat_template"]

    t = _tensors(tiny_f32)
    assert len(t) == 3 + 9 * 2
    # GGUF shapes are (in_features, out_features); numpy data is (out_features, in_features).
    assert t["blk.0.attn_k.weight"].data.shape == (32, 64)
    assert t["blk.1.ffn_down.weight"].data.shape == (64, 128)
    assert t["token_embd.weight"].data.shape == (320, 64)
    assert list(t["token_embd.weight"].shape) == [64, 320]


def test_fixture_arch_override_extra_kv_and_tied(tmp_path):
    path = make_tiny_llama_gguf(
        tmp_path / "g.gguf", arch_name="gemma3", tied_embeddings=True, n_ff=96,
        extra_kv={"gemma3.context_length": None, "general.name": "renamed", "x.list": [1, 2]},
    )
    kv = _fields(path)
    assert kv["general.architecture"] == "gemma3" and kv["gemma3.block_count"] == 2
    assert "gemma3.context_length" not in kv and "llama.block_count" not in kv
    assert kv["general.name"] == "renamed" and kv["x.list"] == [1, 2]
    assert "output.weight" not in _tensors(path)
    with pytest.raises(ValueError, match="gemma3"):
        reference_logits(path, [1, 2])


def test_bpe_vocab_is_consistent():
    tokens, types, merges = tiny_bpe_vocab(300)
    assert len(tokens) == len(types) == 300 and len(set(tokens)) == 300
    known = set(tokens)
    for m in merges:
        a, b = m.split(" ")
        assert a in known and b in known and a + b in known
    with pytest.raises(ValueError):
        tiny_bpe_vocab(200)


def test_bpe_vocab_tokenizes_with_hf_tokenizers():
    tk = pytest.importorskip("tokenizers")
    tokens, _, merges = tiny_bpe_vocab(320)
    bpe = tk.models.BPE({t: i for i, t in enumerate(tokens)}, [tuple(m.split(" ")) for m in merges])
    tok = tk.Tokenizer(bpe)
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    text = "The capital of France is Paris."
    ids = tok.encode(text).ids
    assert len(ids) < len(text.encode()) and max(ids) >= 256  # merges apply
    assert tok.decode(ids) == text


@pytest.mark.parametrize("qtype", QTYPES)
def test_fixture_qtypes_quantize_the_same_weights(tmp_path, qtype):
    # K-quants need 256-value rows.
    dims = dict(d_model=256, n_ff=512, n_head=8, n_head_kv=2) if qtype.endswith("_K") else dict(n_ff=96)
    ref = _tensors(make_tiny_llama_gguf(tmp_path / "f32.gguf", **dims))
    got = _tensors(make_tiny_llama_gguf(tmp_path / f"{qtype}.gguf", qtype=qtype, **dims))
    rel_rms = {"F32": 0, "F16": 1e-3, "Q8_0": 1e-2, "Q6_K": 3e-2, "Q5_0": 5e-2, "Q5_1": 5e-2,
               "Q5_K": 5e-2, "Q4_0": 1e-1, "Q4_1": 1e-1, "Q4_K": 1e-1}[qtype]
    for name, t in got.items():
        want = ref[name].data
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        assert w.shape == want.shape, name
        if want.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32
            np.testing.assert_array_equal(w, want)
        else:
            assert t.tensor_type.name == qtype, name
            err = np.sqrt(np.mean((w - want) ** 2) / np.mean(want**2))
            assert err <= rel_rms, (name, err)


@pytest.mark.parametrize("encode,qtype", [(quantize_q4_k, "Q4_K"), (quantize_q5_k, "Q5_K"), (quantize_q6_k, "Q6_K")])
def test_kquant_encoders_round_trip_through_gguf(encode, qtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0, :256] = 0.0  # all-zero block
    x[1] += 5.0  # all-positive block
    x[2] = -np.abs(x[2])  # all-negative block
    x[3, 7] = 40.0  # outlier
    y = gguf.quants.dequantize(encode(x), gguf.GGMLQuantizationType[qtype])
    assert y.shape == x.shape
    amax = np.abs(x.reshape(-1, 256)).max(axis=1, keepdims=True)
    err = np.abs(y - x).reshape(-1, 256) / np.maximum(amax, 1e-12)
    bound = {"Q4_K": 0.14, "Q5_K": 0.07, "Q6_K": 0.03}[qtype]  # half a step at worst, plus 6-bit scale rounding
    assert err.max() < bound
    np.testing.assert_array_equal(y[0, :256], 0.0)


# ---------------------------------------------------------------------------------------------
# Reference forward


def test_logits_are_finite_and_not_degenerate(tiny_f32):
    logits = reference_logits(tiny_f32, IDS)
    assert logits.shape == (len(IDS), 320) and logits.dtype == np.float32
    assert np.isfinite(logits).all()
    assert 0.3 < logits.std(axis=-1).mean() < 5.0
    assert len(set(logits.argmax(axis=-1).tolist())) >= len(IDS) // 3


def test_reference_is_causal_and_f64_agrees(tiny_f32):
    full = reference_logits(tiny_f32, IDS)
    np.testing.assert_allclose(reference_logits(tiny_f32, IDS[:5]), full[:5], atol=1e-5)
    np.testing.assert_allclose(reference_logits(tiny_f32, IDS, float64=True), full, atol=1e-4)


def test_kv_cache_greedy_matches_full_recompute(tiny_f32):
    ids = IDS[:4]
    for _ in range(12):
        ids.append(int(reference_logits(tiny_f32, ids)[-1].argmax()))
    assert reference_greedy(tiny_f32, IDS[:4], 12) == ids[4:]


def test_ggml_numerics_stays_close(tmp_path):
    path = make_tiny_llama_gguf(tmp_path / "q4.gguf", qtype="Q4_0")
    exact = reference_logits(path, IDS)
    ggml = reference_logits(path, IDS, ggml_numerics=True)
    diff = np.abs(exact - ggml).max()
    assert 0 < diff < 0.1 * np.abs(exact).max()


@pytest.mark.parametrize("tied,n_head_kv", [(False, 2), (True, 2), (False, 4)])
def test_reference_matches_transformers(tmp_path, tied, n_head_kv):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    transformers = pytest.importorskip("transformers")
    path = make_tiny_llama_gguf(tmp_path / "m.gguf", tied_embeddings=tied, n_head_kv=n_head_kv,
                                n_ff=96, seed=1)
    # transformers un-permutes attn_q / attn_k into HF's rotate-half order while loading.
    model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert model.config.tie_word_embeddings == tied
    with torch.no_grad():
        hf = model(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(reference_logits(path, IDS), hf, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# The real model

# Leading tokens of llama.cpp's greedy output each mode reproduces on these machines:
# exact 5 / 16 / 25, ggml_numerics 64 / 16 / 25. What the tests ask is below that, because past
# the first near-tie (top-2 logits within ~0.2) any rounding difference can flip the argmax;
# the ggml mode is what gets prompt 0 past " Paris.\n\nThe" to " United" (1797) as llama.cpp does.
MIN_PREFIX = {False: (5, 16, 13), True: (6, 16, 13)}


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_gguf()


def _llamacpp_prompts():
    return json.loads((DATA / "llamacpp-greedy-public.json").read_text())["prompts"]


@pytest.mark.parametrize("ggml_numerics", [False, True], ids=["exact", "ggml"])
@pytest.mark.parametrize("k", range(3))
@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_greedy_matches_llamacpp(smollm2, k, ggml_numerics):
    p = _llamacpp_prompts()[k]
    want = p["generated_ids_new"]
    got = reference_greedy(smollm2, p["prompt_ids"], len(want), ggml_numerics=ggml_numerics)
    prefix = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), len(want))
    assert prefix >= MIN_PREFIX[ggml_numerics][k], (prefix, got, want)


@pytest.mark.real_model
@pytest.mark.slow
def test_smollm2_matches_transformers(smollm2):
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF")
    transformers = pytest.importorskip("transformers")
    ids = _llamacpp_prompts()[0]["prompt_ids"] + [7042, 30, 198, 198, 504]
    model = transformers.LlamaForCausalLM.from_pretrained(smollm2.parent, gguf_file=smollm2.name,
                                                          dtype=torch.float32)
    with torch.no_grad():
        hf = model(torch.tensor([ids])).logits[0].numpy()
    ours = reference_logits(smollm2, ids)
    np.testing.assert_allclose(ours, hf, atol=2e-4 * np.abs(hf).max(), rtol=0)
    assert (ours.argmax(-1) == hf.argmax(-1)).all()
    hp = load_reference(smollm2).hp
    assert (hp.n_layer, hp.d_model, hp.n_head, hp.n_head_kv, hp.vocab) == (30, 576, 9, 3, 49152)
