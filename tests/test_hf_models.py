"""Hugging Face folders in: a tiny random model of every supported architecture, made here with
transformers (config + save_pretrained to safetensors, a real tokenizer.json), converted by
`pinfer convert DIR`, run by pinfer's runtime and compared with transformers' own forward pass on
the same weights.

Stated tolerance: max |logit difference| / max |logit| <= 1e-4 (float32 weights are carried over
exactly; only the order of float32 arithmetic differs), teacher-forced top-1 agreement >= 99%,
and greedy generation equal token for token. transformers has no FATReLU (ProSparse) or dReLU
(Bamboo) model class: those references are its Llama with the MLP's activation replaced, which is
what those models' own modeling code does.
"""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
tf = pytest.importorskip("transformers")

from fixtures import make_tiny_llama_gguf  # noqa: E402
from hf_tokenizers import write_tokenizer  # noqa: E402

from pinfer.converter.convert import ConvertError, ConvertOptions, convert  # noqa: E402
from pinfer.converter.passes import DENSE, PassOptions  # noqa: E402
from pinfer.runtime.model import Model, RuntimeOptions  # noqa: E402
from pinfer.runtime.tokenizer import Tokenizer  # noqa: E402

TOL = 1e-4
TOP1 = 0.99
N_TOKENS = 48          # teacher-forced positions; longer than Mistral's window below
GREEDY = 12
FATRELU_THRESHOLD = 0.05
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256)
TEXT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. Ships passed "
        "far out at sea, and the fishermen in the harbour told stories about storms, lost boats and "
        "the long winters when the ice closed the bay for months.")
GATED = dict(SHAPE, intermediate_size=128, num_key_value_heads=2)


class FATReLU(torch.nn.Module):
    """ProSparse's activation: x where x > threshold, else 0."""

    def __init__(self, threshold):
        super().__init__()
        self.threshold = threshold

    def forward(self, x):
        return torch.where(x > self.threshold, x, torch.zeros_like(x))


def _drelu(model):
    """Bamboo's MLP: relu on the gate and on up."""
    for layer in model.model.layers:
        m = layer.mlp
        m.forward = lambda x, m=m: m.down_proj(torch.relu(m.gate_proj(x)) * torch.relu(m.up_proj(x)))


def _fatrelu(model):
    for layer in model.model.layers:
        layer.mlp.act_fn = FATReLU(FATRELU_THRESHOLD)


# name -> (config class, config arguments, patch of the reference model, config.json edits)
CASES = {
    "llama": (tf.LlamaConfig, dict(GATED), None, {}),
    "llama-tied": (tf.LlamaConfig, dict(GATED, tie_word_embeddings=True), None, {}),
    "llama3.1": (tf.LlamaConfig, dict(GATED, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), None, {}),
    "relullama": (tf.LlamaConfig, dict(GATED, hidden_act="relu"), None, {}),
    "prosparse": (tf.LlamaConfig, dict(GATED, hidden_act="relu"), _fatrelu,
                  {"hidden_act": "fatrelu", "hidden_act_param": FATRELU_THRESHOLD}),
    "mistral": (tf.MistralConfig, dict(GATED, sliding_window=16), None, {}),
    "qwen2": (tf.Qwen2Config, dict(GATED), None, {}),
    # head_dim 32 with 4 heads of a 64-wide model: Qwen3's heads are not hidden_size / heads wide
    "qwen3": (tf.Qwen3Config, dict(GATED, head_dim=32), None, {}),
    # fused qkv_proj and gate_up_proj; RoPE over the first half of each head (32 wide: ONNX Runtime
    # takes partial rotary tables in multiples of 8)
    "phi3": (tf.Phi3Config, dict(GATED, num_attention_heads=2, num_key_value_heads=1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                  "partial_rotary_factor": 0.5}), None, {}),
    # GeGLU, norms after attention and the FFN, sqrt(d) embeddings, a 16-token window on every other
    # layer, an attention scale of 24^-0.5 (not head_dim's), soft caps small enough to bite
    "gemma2": (tf.Gemma2Config, dict(GATED, head_dim=16, sliding_window=16, query_pre_attn_scalar=24,
                                     attn_logit_softcapping=2.0, final_logit_softcapping=3.0), None, {}),
    # five windowed layers rotating with base 10000, then a global one with base 1e6; q/k norms
    "gemma3": (tf.Gemma3TextConfig, dict(GATED, num_hidden_layers=6, head_dim=16, sliding_window=16,
                                         query_pre_attn_scalar=24), None, {}),
    "bamboo": (tf.LlamaConfig, dict(GATED, hidden_act="relu"), _drelu,
               {"model_type": "bamboo", "architectures": ["BambooForCausalLM"]}),
    "opt": (tf.OPTConfig, dict(SHAPE, ffn_dim=128, word_embed_proj_dim=64, do_layer_norm_before=True), None, {}),
}


def make_hf_model(folder, case, seed=0):
    """Write a random model of `case` to `folder`; returns the transformers reference model."""
    config_cls, kwargs, patch, edits = CASES[case]
    folder.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(folder)
    config = config_cls(vocab_size=vocab, **kwargs)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():     # weights large enough that logits have clear winners
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.ndim == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    if case == "opt":
        with torch.no_grad():
            model.model.decoder.embed_tokens.weight.mul_(4.0)   # tied head: logits of std ~4
    model.eval()
    model.save_pretrained(folder)
    if edits:
        path = folder / "config.json"
        path.write_text(json.dumps(json.loads(path.read_text()) | edits, indent=2))
    if patch:
        patch(model)
    return model


def _convert(folder, out, passes=DENSE):
    with contextlib.redirect_stderr(io.StringIO()):
        return convert(ConvertOptions(folder, out, passes=passes))


def _reference(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def _greedy_hf(model, ids, n):
    seq = list(ids)
    for _ in range(n):
        seq.append(int(_reference(model, seq)[-1].argmax()))
    return seq[len(ids):]


def _greedy_pinfer(m, ids, n):
    m.reset()
    logits, out = m.forward(list(ids)), []
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = m.forward([out[-1]])
    return out


def _gguf_from(c, path, arch, weights, **kw):
    """A GGUF of `weights` (GGUF names) in the shape of the transformers config c."""
    return make_tiny_llama_gguf(path, arch_name=arch, weights=weights, n_layer=c.num_hidden_layers,
                                d_model=c.hidden_size, n_ff=c.intermediate_size, n_head=c.num_attention_heads,
                                n_head_kv=c.num_key_value_heads, vocab=c.vocab_size, eps=c.rms_norm_eps,
                                ctx=c.max_position_embeddings, **kw)


def _assert_matches(label, m, model, ids):
    """pinfer's logits against transformers' within TOL, top-1 within TOP1, greedy tokens equal."""
    got, ref = m.forward(ids, logits_from=0), _reference(model, ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"{label}: max |dlogit| / max |logit| = {rel:.2e} (tolerance {TOL:.0e})")
    assert rel <= TOL and (got.argmax(1) == ref.argmax(1)).mean() >= TOP1
    assert _greedy_pinfer(m, ids[:8], GREEDY) == _greedy_hf(model, ids[:8], GREEDY)


@pytest.mark.parametrize("case", list(CASES))
def test_hf_folder_converts_and_matches_transformers(tmp_path, case):
    model = make_hf_model(tmp_path / case, case)
    out = _convert(tmp_path / case, tmp_path / f"{case}.pinf")
    m = Model(out, RuntimeOptions(threads=1, n_ctx=128))
    ids = [int(i) for i in np.random.default_rng(1).integers(0, m.cfg.vocab, N_TOKENS)]
    got, ref = m.forward(ids, logits_from=0), _reference(model, ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    top1 = (got.argmax(1) == ref.argmax(1)).mean()
    print(f"{case}: max |dlogit| / max |logit| = {rel:.2e} (tolerance {TOL:.0e}), top-1 {top1:.1%}")
    assert rel <= TOL
    assert top1 >= TOP1
    assert _greedy_pinfer(m, ids[:8], GREEDY) == _greedy_hf(model, ids[:8], GREEDY)


@pytest.mark.parametrize("case,sparsity", [("opt", "relu:0.99"), ("qwen2", "down:0.3"), ("qwen3", "predicted:0.99"),
                                         ("phi3", "down:0.3"), ("gemma2", "down:0.3"), ("gemma3", "down:0.3"),
                                         ("bamboo", "relu:0.99")])
@pytest.mark.slow
def test_hf_folder_calibrates_with_biases_and_without_a_gate(tmp_path, case, sparsity):
    """The passes (calibration, predictors, hot-first reordering) on the biased and gate-less
    layouts: dense logits still match transformers, and the planned mode stays close."""
    model = make_hf_model(tmp_path / case, case)
    out = _convert(tmp_path / case, tmp_path / f"{case}.pinf",
                   PassOptions(sparsity=sparsity, order="hot-first", calib_tokens=2048, heldout_tokens=1024, seq_len=64))
    m = Model(out, RuntimeOptions(threads=1, n_ctx=128, sparsity="dense", kernels="off"))
    assert m.reader.header["ffn"]["neuron_order"] == "hot-first"
    # the calibration's own PyTorch model (converter/passes/torch_llama.py) against the runtime, dense:
    # the converter's verification, teacher-forced over its held-out text
    tf_check = json.loads(Path(str(out) + ".report.json").read_text())["verification"]["teacher_forced"]
    print(f"{case}: calibration model vs runtime, max |dlogit| {tf_check['max_abs_diff']:.2e}")
    assert tf_check["max_abs_diff"] <= 1e-3 and tf_check["top1_agreement"] == 1.0
    # text, not random ids: the predictors learned the calibration text's activations
    ids = Tokenizer.from_spec(m.tokenizer_spec).encode(TEXT)[:N_TOKENS]
    assert len(ids) == N_TOKENS
    got, ref = m.forward(ids, logits_from=0), _reference(model, ids)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"{case} reordered: max |dlogit| / max |logit| = {rel:.2e}")
    assert rel <= TOL
    m.set_sparsity("")
    m.reset()
    m.counters.reset()
    planned = m.forward(ids, logits_from=0)
    gu, down = m.counters.fractions()
    print(f"{case} {sparsity}: top-1 as planned {(planned.argmax(1) == ref.argmax(1)).mean():.1%}, rows kept {gu:.1%} gate/up {down:.1%} down")
    assert down < 0.9      # the planned rule runs: it skips rows
    assert (planned.argmax(1) == ref.argmax(1)).mean() >= 0.8
    # the same rule in pinfer's fused kernel (its activation: silu, relu or Gemma's gelu), one token
    # at a time: the same survivors but where float order moves an |h| across the threshold
    fused = Model(out, RuntimeOptions(threads=1, n_ctx=128, kernels="on"))
    assert any(f is not None for f in [L.ffn for L in fused.layers]) or case in ("opt", "bamboo")   # no gate / dReLU: not the kernel's
    by_token = np.stack([fused.forward([t])[0] for t in ids])
    agree = (by_token.argmax(1) == planned.argmax(1)).mean()
    print(f"{case} {sparsity}: the fused kernel's top-1 against the NumPy rule's {agree:.1%}")
    assert agree >= 0.95


def test_llama_through_both_front_ends_gives_the_same_logits(tmp_path):
    """The same weights as a Hugging Face folder and as a GGUF written from it (Q/K rows permuted
    as llama.cpp's converter does): the two .pinf files agree."""
    model = make_hf_model(tmp_path / "hf", "llama")
    c = model.config
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    hd = c.hidden_size // c.num_attention_heads

    def permute(w, heads):      # rotate-half rows -> GGML's adjacent pairs
        return w.reshape(heads, 2, hd // 2, -1).swapaxes(1, 2).reshape(w.shape)

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.o_proj": "attn_output", "self_attn.v_proj": "attn_v",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    w = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w[f"blk.{i}.attn_q.weight"] = permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads)
        w[f"blk.{i}.attn_k.weight"] = permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads)
        for hf, gg in names.items():
            w[f"blk.{i}.{gg}.weight"] = sd[p + hf + ".weight"]
    gguf_path = _gguf_from(c, tmp_path / "same.gguf", "llama", w)
    a = Model(_convert(tmp_path / "hf", tmp_path / "hf.pinf"), RuntimeOptions(threads=1, n_ctx=128))
    b = Model(_convert(gguf_path, tmp_path / "gguf.pinf"), RuntimeOptions(threads=1, n_ctx=128))
    assert a.cfg.rope_interleaved is False and b.cfg.rope_interleaved is True
    ids = [int(i) for i in np.random.default_rng(3).integers(0, c.vocab_size, N_TOKENS)]
    la, lb = a.forward(ids, logits_from=0), b.forward(ids, logits_from=0)
    rel = np.abs(la - lb).max() / np.abs(la).max()
    print(f"HF folder vs GGUF of the same weights: max |dlogit| / max |logit| = {rel:.2e}")
    assert rel <= 1e-5
    assert (la.argmax(1) == lb.argmax(1)).all()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_gguf_converts_and_matches_transformers(tmp_path, arch):
    """A qwen2/qwen3 GGUF as llama.cpp's converter writes one (Hugging Face's Q/K row order,
    arch-prefixed keys; qwen2's q/k/v biases, qwen3's per-head q/k norms and its own head width):
    rotate-half RoPE, and the logits of transformers' model on the same weights."""
    model = make_hf_model(tmp_path / "hf", arch)
    c = model.config
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
             "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
             "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
    names |= {f"self_attn.{x}_proj.{kind}": f"attn_{x}.{kind}" for x in "qkv" for kind in ("weight", "bias")}
    names = {hf: gg for hf, gg in names.items() if f"model.layers.0.{hf}" in sd}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if "lm_head.weight" in sd and not c.tie_word_embeddings:
        w["output.weight"] = sd["lm_head.weight"]
    for i in range(c.num_hidden_layers):
        w |= {f"blk.{i}.{gg}": sd[f"model.layers.{i}.{hf}"] for hf, gg in names.items()}
    gguf_path = _gguf_from(c, tmp_path / f"{arch}.gguf", arch, w,
                           extra_kv={"tokenizer.ggml.pre": "qwen2", f"{arch}.attention.key_length": head_dim,
                                     f"{arch}.attention.value_length": head_dim,
                                     f"{arch}.rope.dimension_count": head_dim})
    m = Model(_convert(gguf_path, tmp_path / f"{arch}.pinf"), RuntimeOptions(threads=1, n_ctx=128))
    assert m.cfg.arch == arch and m.cfg.rope_interleaved is False and m.cfg.head_dim == head_dim
    assert ("blk.0.attn_q_norm.weight" in m.reader.header["tensors"]) == (arch == "qwen3")
    ids = [int(i) for i in np.random.default_rng(4).integers(0, c.vocab_size, N_TOKENS)]
    _assert_matches(f"{arch} GGUF", m, model, ids)


@pytest.mark.parametrize("qtype", ["F32", "Q8_0", "Q4_0"])
def test_phi3_gguf_converts_and_matches_transformers(tmp_path, qtype):
    """A phi3 GGUF as llama.cpp's converter writes one: q, k, v in one attn_qkv and gate, up in one
    ffn_up of 2 n_ff rows, each quantized as a whole; pinfer offers their row ranges as the llama
    roles, blocks carried over. F32 against transformers' Phi3; the quantized files against a GGUF
    of the same weights with the parts stored apart (qwen2's layout: rotate-half RoPE too), whose
    blocks are the same rows: the same runtime numerics, so the same logits to float rounding."""
    model = make_hf_model(tmp_path / "hf", "phi3")
    c = model.config
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.o_proj.weight": "attn_output.weight", "self_attn.qkv_proj.weight": "attn_qkv.weight",
             "mlp.gate_up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}
    w = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        w |= {f"blk.{i}.{gg}": sd[f"model.layers.{i}.{hf}"] for hf, gg in names.items()}
    head_dim, n_ff = c.hidden_size // c.num_attention_heads, c.intermediate_size
    gguf_path = _gguf_from(c, tmp_path / "phi3.gguf", "phi3", w, qtype=qtype,
                           extra_kv={"phi3.rope.dimension_count": head_dim // 2})
    m = Model(_convert(gguf_path, tmp_path / "phi3.pinf"), RuntimeOptions(threads=1, n_ctx=128))
    assert m.cfg.arch == "phi3" and m.cfg.rope_interleaved is False and m.cfg.rotary_dim == head_dim // 2
    ids = [int(i) for i in np.random.default_rng(5).integers(0, c.vocab_size, N_TOKENS)]
    got = m.forward(ids, logits_from=0)
    if qtype == "F32":
        ref = _reference(model, ids)
    else:
        assert m.reader.header["tensors"]["blk.0.attn_qkv.q"]["dtype"] in ("i8", "u8")   # blocks carried over
        q = c.num_attention_heads * head_dim
        kv = c.num_key_value_heads * head_dim
        apart = {k: v for k, v in w.items() if not k.endswith(("attn_qkv.weight", "ffn_up.weight"))}
        for i in range(c.num_hidden_layers):
            qkv, gu = w[f"blk.{i}.attn_qkv.weight"], w[f"blk.{i}.ffn_up.weight"]
            apart |= {f"blk.{i}.attn_q.weight": qkv[:q], f"blk.{i}.attn_k.weight": qkv[q:q + kv],
                      f"blk.{i}.attn_v.weight": qkv[q + kv:], f"blk.{i}.ffn_gate.weight": gu[:n_ff],
                      f"blk.{i}.ffn_up.weight": gu[n_ff:]}
        other = _gguf_from(c, tmp_path / "apart.gguf", "qwen2", apart, qtype=qtype,
                           extra_kv={"qwen2.rope.dimension_count": head_dim // 2})
        ref = Model(_convert(other, tmp_path / "apart.pinf"), RuntimeOptions(threads=1, n_ctx=128)).forward(
            ids, logits_from=0)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    print(f"phi3 GGUF {qtype}: max |dlogit| / max |logit| = {rel:.2e} (tolerance {TOL:.0e})")
    assert rel <= TOL and (got.argmax(1) == ref.argmax(1)).mean() >= TOP1


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_converts_and_matches_transformers(tmp_path, arch):
    """A gemma2/gemma3 GGUF as llama.cpp's converter writes one: every norm stored as 1 + w, the
    post-attention and post-FFN norms under their GGUF names, the window and soft caps as keys, the
    head tied to the embedding, and the sliding pattern and Gemma 3's local RoPE base implied by the
    architecture. GGUF has no query_pre_attn_scalar (1/sqrt(head_dim), as llama.cpp), so the
    reference's attention is given that scale."""
    model = make_hf_model(tmp_path / "hf", arch)
    c = model.config
    for layer in model.model.layers:
        layer.self_attn.scaling = c.head_dim ** -0.5
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    w = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"] + 1}
    for i in range(c.num_hidden_layers):
        for hf, gg in names.items():
            a = sd.get(f"model.layers.{i}.{hf}.weight")
            if a is not None:
                w[f"blk.{i}.{gg}.weight"] = a + 1 if "norm" in hf else a
    keys = {f"{arch}.attention.key_length": c.head_dim, f"{arch}.attention.value_length": c.head_dim,
            f"{arch}.rope.dimension_count": c.head_dim, f"{arch}.attention.sliding_window": c.sliding_window,
            f"{arch}.rope.freq_base": 1e6 if arch == "gemma3" else 10000.0}
    if arch == "gemma2":
        keys |= {"gemma2.attn_logit_softcapping": c.attn_logit_softcapping,
                 "gemma2.final_logit_softcapping": c.final_logit_softcapping}
    gguf_path = _gguf_from(c, tmp_path / f"{arch}.gguf", arch, w, extra_kv=keys)
    m = Model(_convert(gguf_path, tmp_path / f"{arch}.pinf"), RuntimeOptions(threads=1, n_ctx=128))
    assert m.cfg.arch == arch and m.cfg.ffn_act == "gelu" and m.cfg.tied_embeddings
    ids = [int(i) for i in np.random.default_rng(6).integers(0, c.vocab_size, N_TOKENS)]
    _assert_matches(f"{arch} GGUF", m, model, ids)


def test_a_rope_width_the_attention_kernel_lacks_is_refused_in_a_sentence(tmp_path):
    """RoPE over 8 values of a head (ONNX Runtime's GroupQueryAttention wants multiples of 16):
    refused before any tensor is written, not after a failed verification."""
    make_hf_model(tmp_path / "p", "phi3")
    path = tmp_path / "p" / "config.json"
    c = json.loads(path.read_text())
    c["rope_parameters"]["partial_rotary_factor"] = 0.25
    path.write_text(json.dumps(c))
    with pytest.raises(ConvertError, match="RoPE over 8 of each head's 32 values is not supported"):
        _convert(tmp_path / "p", tmp_path / "p.pinf")
    assert not (tmp_path / "p.pinf").exists()


def test_phi3_longrope_is_refused_before_reading_tensors(tmp_path):
    d = tmp_path / "long"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
                                               "rope_scaling": {"type": "longrope", "long_factor": [1.0]}}))
    (d / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConvertError, match="longrope RoPE scaling"):
        _convert(d, tmp_path / "x.pinf")


@pytest.mark.parametrize("config", [
    {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_size": 64},
    {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {}},
    {"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"], "text_config": {}},
])
def test_unsupported_architecture_fails_before_reading_tensors(tmp_path, config):
    d = tmp_path / "unsupported"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    (d / "model.safetensors").write_bytes(b"not a safetensors file: reading it would fail differently")
    with pytest.raises(ConvertError) as e:
        _convert(d, tmp_path / "x.pinf")
    msg = str(e.value)
    assert repr(config["model_type"]) in msg and config["architectures"][0] in msg
    assert "llama, mistral, opt, phi3, qwen2, qwen3" in msg.replace("bamboo, ", "")
    assert not (tmp_path / "x.pinf").exists()


def test_folder_without_safetensors_names_the_pickles(tmp_path):
    d = tmp_path / "pickled"
    make_hf_model(d, "llama")
    for f in d.glob("*.safetensors"):
        f.rename(d / "pytorch_model.bin")
    with pytest.raises(ConvertError, match="pickled checkpoints"):
        _convert(d, tmp_path / "x.pinf")


def test_cli_converts_a_folder_and_generates(tmp_path):
    make_hf_model(tmp_path / "qwen", "qwen2")
    r = subprocess.run([sys.executable, "-m", "pinfer", "convert", str(tmp_path / "qwen"), "--sparsity", "none"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = tmp_path / "qwen.pinf"
    assert out.exists()
    r = subprocess.run([sys.executable, "-m", "pinfer", "generate", str(out), "-p", "hello", "-n", "8",
                        "--temp", "0", "-t", "1", "--ignore-eos"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hello") and len(r.stdout) > len("hello")


def test_fixtures_exercise_the_window_and_the_threshold(tmp_path):
    """The Mistral window and the ProSparse threshold change transformers' logits well beyond TOL,
    so the comparisons above would catch pinfer ignoring them."""
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 300, N_TOKENS)]
    model = make_hf_model(tmp_path / "mistral", "mistral")
    windowed = _reference(model, ids)
    model.config.sliding_window = None
    assert np.abs(windowed - _reference(model, ids)).max() > 100 * TOL * np.abs(windowed).max()
    model = make_hf_model(tmp_path / "prosparse", "prosparse")
    fat = _reference(model, ids)
    for layer in model.model.layers:
        layer.mlp.act_fn.threshold = 0.0
    assert np.abs(fat - _reference(model, ids)).max() > 10 * TOL * np.abs(fat).max()


def test_fixture_exercises_llama3_rope_scaling(tmp_path):
    """Llama 3.1's frequency scaling changes transformers' logits well beyond TOL at this fixture's
    short original context, so the llama3.1 comparison above tests it."""
    import copy

    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    ids = [int(i) for i in np.random.default_rng(1).integers(0, 300, N_TOKENS)]
    model = make_hf_model(tmp_path / "llama3", "llama3.1")
    scaled = _reference(model, ids)
    plain = copy.deepcopy(model.config)
    plain.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    model.model.rotary_emb = LlamaRotaryEmbedding(plain)
    assert np.abs(scaled - _reference(model, ids)).max() > 100 * TOL * np.abs(scaled).max()
