"""Decode speed of a LLaMA-7B-shaped INT4 model whose FFN active sets follow a power law: pinfer
sparse vs pinfer dense vs llama.cpp on the same GGUF, in one run.

    python benchmarks/synthetic_decode.py [--shape 7b] [--layers 32] [--active 0.10,0.25]
        [--threads 1,2] [--tokens 16] [--repeats 2] [--llama-python VENV/bin/python]

The model is random Q4_0 weights in LLaMA-7B's shapes (d_model 4096, n_ff 11008, 32 heads, vocab
32000), written once as a GGUF under ~/.cache/pinfer/synthetic and converted with
`--sparsity none`; nothing about it is trained. ReLU-family models (ReluLLaMA, ProSparse), which
cannot be downloaded here, fire few FFN neurons per token and a few of them often: neuron j of
the hot-first file order fires with probability p_j = min(1, c (j + 1)^-alpha), c set so that the
mean is the active fraction. Each token's active set per layer is drawn from that profile before
timing and handed to pinfer's fused FFN kernel (Model.set_active_sets), which reads only those
neurons' gate/up and down rows; attention, norms and the head run in ONNX Runtime as always. The
dense path is pinfer's default (MatMulNBits for gate/up and down); llama.cpp runs the
GGUF dense through llama-cpp-python in its own environment (benchmarks/llamacpp_side.py).

The bytes column is weight bytes read per token; with attention dense, it bounds what any FFN
sparsity can gain: at LLaMA-7B's shapes attention is a third of the weights.

`--build-relu` writes another model instead, one with trained predictors (write_relu_gguf,
relu_model): a ReLU FFN whose neurons fire about `--active` of the time from a learnable
low-rank gate, converted with calibration on pinfer's text. Its decode, predictors included,
against llama.cpp on the same GGUF (llama.cpp reads the FFN as SiLU: the pinfer key is its own,
and the bytes and time are the same):

    python benchmarks/synthetic_decode.py --build-relu --active 0.10
    python benchmarks/smollm2_vs_llamacpp.py --model ~/.cache/pinfer/synthetic/synthetic-7b-32L-relu10.Q4_0.gguf \
        --pinf ~/.cache/pinfer/synthetic/synthetic-7b-32L-relu10.Q4_0.pinf --tokens 16 --feed-text \
        --llama-python .venv-llama/bin/python [--isa avx2]

`--build-family qwen3-0.6b|gemma3-270m` writes random Q4_0 files of other families' real shapes and
layer kinds (FAMILIES: Qwen3's per-head q/k norms and 152k vocabulary; Gemma 3's post norms, q/k
norms, 512-position window on 5 of 6 layers, GeLU and 262k vocabulary, both heads tied), for the
same comparison:

    python benchmarks/synthetic_decode.py --build-family gemma3-270m
    python benchmarks/smollm2_vs_llamacpp.py --model ~/.cache/pinfer/synthetic/synthetic-gemma3-270m.Q4_0.gguf \
        --pinf ~/.cache/pinfer/synthetic/synthetic-gemma3-270m.Q4_0.pinf --tokens 64 --llama-python .venv-llama/bin/python
"""

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import engines  # benchmarks/ is on sys.path (benchmarks/__init__.py)

SHAPES = {  # d_model, n_ff, n_head, vocab
    "7b": (4096, 11008, 32, 32000),
    "13b": (5120, 13824, 40, 32000),
    "tiny": (256, 704, 4, 1000),     # for a quick check of the script itself
}
CACHE = Path.home() / ".cache" / "pinfer" / "synthetic"


def q4_0_blocks(rng, rows, k, scale):
    """Random Q4_0 bytes (rows, k/32 * 18): every block's f16 scale is `scale`."""
    b = rng.integers(0, 256, size=(rows, k // 32, 18), dtype=np.uint8)
    b[..., :2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
    return b.reshape(rows, -1)


def spm_vocab(n):
    """(tokens, scores, types) of a SentencePiece-style vocabulary llama.cpp and pinfer both load."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    tokens += ["\u2581"] + [chr(c) for c in range(33, 127)]
    tokens += [f"\u2581w{i}" for i in range(n - len(tokens))]
    types += [1] * (n - len(types))
    scores = [0.0] * 259 + [-float(i) for i in range(n - 259)]
    return tokens, scores, types


def _writer(path, shape, n_layer, ffn_act=None):
    """A GGUFWriter with LLaMA's header for `shape` and a SentencePiece-style vocabulary."""
    import gguf
    d, n_ff, n_head, vocab = SHAPES[shape]
    w = gguf.GGUFWriter(str(path.with_suffix(".part")), arch="llama")
    w.add_name(f"synthetic-{shape}-{n_layer}L")
    w.add_block_count(n_layer)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(d // n_head)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    if ffn_act:
        w.add_string("pinfer.feed_forward_activation", ffn_act)
    add_vocab(w, vocab)
    return w


def add_vocab(w, n):
    """spm_vocab(n) into GGUFWriter w, as llama.cpp's SentencePiece header, BOS 1 and EOS 2."""
    tokens, scores, types = spm_vocab(n)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _finish(w, path):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path.with_suffix(".part").rename(path)


def write_gguf(path, shape, n_layer, seed=0, ffn_act=None):
    """Random Q4_0 weights in `shape`; ffn_act "relu" marks a ReLU-family FFN (pinfer's own key)."""
    import gguf
    d, n_ff, n_head, vocab = SHAPES[shape]
    rng = np.random.default_rng(seed)
    w = _writer(path, shape, n_layer, ffn_act)
    Q = gguf.GGMLQuantizationType.Q4_0

    def q4(name, rows, k):   # scale ~ 1/(4.6 sqrt(k)): unit-variance outputs for unit inputs
        w.add_tensor(name, q4_0_blocks(rng, rows, k, 1 / (4.6 * np.sqrt(k))), raw_dtype=Q)

    q4("token_embd.weight", vocab, d)
    q4("output.weight", vocab, d)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    for i in range(n_layer):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            q4(f"blk.{i}.{name}.weight", d, d)
        q4(f"blk.{i}.ffn_gate.weight", n_ff, d)
        q4(f"blk.{i}.ffn_up.weight", n_ff, d)
        q4(f"blk.{i}.ffn_down.weight", d, n_ff)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    _finish(w, path)


# Real shapes of small models of other families (issue 38), in Q4_0 with random weights: the
# layers' kinds as their GGUF files have them (per-head q/k norms, Gemma's post norms and sliding
# window, tied heads of large vocabularies), for speed only.
FAMILIES = {
    "qwen3-0.6b": dict(arch="qwen3", d=1024, n_ff=3072, n_head=16, n_kv=8, hd=128, vocab=151936, n_layer=28,
                       rope_base=1e6),
    "gemma3-270m": dict(arch="gemma3", d=640, n_ff=2048, n_head=4, n_kv=1, hd=256, vocab=262144, n_layer=18,
                        rope_base=1e6, window=512),
}


def write_family_gguf(path, family, seed=0):
    """A random Q4_0 GGUF of FAMILIES[family]'s shape and layer kinds, as llama.cpp's converter
    names them; the norms are ones (Gemma's GGUF norms hold 1 + w already)."""
    import gguf
    f = FAMILIES[family]
    d, hd, n_ff = f["d"], f["hd"], f["n_ff"]
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path.with_suffix(".part")), arch=f["arch"])
    w.add_name(f"synthetic-{family}")
    w.add_block_count(f["n_layer"])
    w.add_context_length(32768)
    w.add_embedding_length(d)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(f["n_head"])
    w.add_head_count_kv(f["n_kv"])
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(f["rope_base"])
    w.add_layer_norm_rms_eps(1e-6)
    if "window" in f:
        w.add_sliding_window(f["window"])
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    add_vocab(w, f["vocab"])
    Q = gguf.GGMLQuantizationType.Q4_0

    def q4(name, rows, k):
        w.add_tensor(name, q4_0_blocks(rng, rows, k, 1 / (4.6 * np.sqrt(k))), raw_dtype=Q)

    def ones(name, n):
        w.add_tensor(name, np.ones(n, np.float32))

    q4("token_embd.weight", f["vocab"], d)      # tied: the head
    ones("output_norm.weight", d)
    for i in range(f["n_layer"]):
        q4(f"blk.{i}.attn_q.weight", f["n_head"] * hd, d)
        q4(f"blk.{i}.attn_k.weight", f["n_kv"] * hd, d)
        q4(f"blk.{i}.attn_v.weight", f["n_kv"] * hd, d)
        q4(f"blk.{i}.attn_output.weight", d, f["n_head"] * hd)
        q4(f"blk.{i}.ffn_gate.weight", n_ff, d)
        q4(f"blk.{i}.ffn_up.weight", n_ff, d)
        q4(f"blk.{i}.ffn_down.weight", d, n_ff)
        for name in ("attn_norm", "ffn_norm") + (("post_attention_norm", "post_ffw_norm") if f["arch"] == "gemma3" else ()):
            ones(f"blk.{i}.{name}.weight", d)
        for name in ("attn_q_norm", "attn_k_norm"):
            ones(f"blk.{i}.{name}.weight", hd)
    _finish(w, path)


def family_model(family, cache):
    """(GGUF, .pinf) of FAMILIES[family], written and converted (--sparsity none) on first use."""
    from pinfer.converter.passes import DENSE
    return _cached(cache / f"synthetic-{family}.Q4_0.gguf", lambda p: write_family_gguf(p, family), passes=DENSE)


RELU_RANK = 96        # rank of the gate's learnable part (the predictor's ranks tried are 224 and 448 at 7B)
RELU_NOISE = 0.2      # full-rank part of the gate, relative to the low-rank part's scale
RELU_UPDATE = 0.02    # variance each attention or FFN output adds to the residual, per dimension


def _rms(x):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5)


def _attend(x, wq, wk, wv, n_head):
    """Causal multi-head attention of the rows of x (no rotary embedding: it changes which
    positions a head weighs, not the spread of its output, which is what the generator needs)."""
    t, d = x.shape
    hd = d // n_head
    q, k, v = ((x @ m.T).reshape(t, n_head, hd).transpose(1, 0, 2) for m in (wq, wk, wv))
    s = q @ k.transpose(0, 2, 1) / np.sqrt(hd) + np.triu(np.full((t, t), -np.inf, np.float32), 1)
    p = np.exp(s - s.max(-1, keepdims=True))
    return ((p / p.sum(-1, keepdims=True)) @ v).transpose(1, 0, 2).reshape(t, d)


def write_relu_gguf(path, shape, n_layer, active=0.10, alpha=1.0, seed=0, tokens=32):
    """A ReLU-FFN model in `shape` whose neurons fire as ReLU models' do: few per token, a few of
    them often, and predictably from the layer's input. Returns each layer's firing fraction over
    `tokens` simulated positions.

    Dimension 0 of the residual stream is a constant (every embedding has sqrt(d) there; no output
    matrix writes it) that only the gate reads: its gate column is each neuron's bias. The rest of
    each gate row is a rank-RELU_RANK product plus a RELU_NOISE full-rank part, so a trained
    low-rank predictor can learn it, as in ReLU LLMs. Neuron j's bias is set so that it fires with
    probability p_j (power_law(n_ff, active, alpha), shuffled), from the spread of the layer's input
    measured by running the float model over `tokens` random token ids while it is generated.
    Outputs add RELU_UPDATE of variance per layer, so inputs change slowly with depth, as they do in
    trained models. Weights are rounded to Q4_0 by gguf.quants."""
    import gguf
    from gguf import quants
    d, n_ff, n_head, vocab = SHAPES[shape]
    rng = np.random.default_rng(seed)
    w = _writer(path, shape, n_layer, "relu")
    Q = gguf.GGMLQuantizationType.Q4_0

    def randn(rows, k, std, zero_row0=False, zero_col0=False):
        m = rng.standard_normal((rows, k), dtype=np.float32) * np.float32(std)
        if zero_row0:
            m[0] = 0
        if zero_col0:
            m[:, 0] = 0
        return m

    def put(name, m):
        w.add_tensor(name, quants.quantize(m, Q), raw_dtype=Q)

    embd = randn(vocab, d, 1.0)
    embd[:, 0] = np.sqrt(d)
    put("token_embd.weight", embd)
    put("output.weight", randn(vocab, d, 1 / np.sqrt(d), zero_col0=True))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    inv = statistics.NormalDist().inv_cdf
    p = np.clip(power_law(n_ff, active, alpha), 1e-4, 0.999)[rng.permutation(n_ff)]
    z = np.array([-inv(q) for q in p], np.float32)    # fires when its input's part exceeds z spreads
    h = embd[rng.integers(259, vocab, tokens)]
    fired = []
    for i in range(n_layer):
        wq, wk, wv = (randn(d, d, 1 / np.sqrt(d), zero_col0=True) for _ in range(3))
        wo = randn(d, d, np.sqrt(RELU_UPDATE / d), zero_row0=True)
        h = h + _attend(_rms(h), wq, wk, wv, n_head) @ wo.T
        x = _rms(h)
        gate = (randn(n_ff, RELU_RANK, 1 / np.sqrt(RELU_RANK)) @ randn(RELU_RANK, d, 1 / np.sqrt(d))
                + randn(n_ff, d, RELU_NOISE / np.sqrt(d)))
        gate[:, 0] = 0
        spread = np.linalg.norm(gate, axis=1) * np.sqrt(np.mean(x[:, 1:] ** 2))
        gate[:, 0] = -z * spread / np.mean(x[:, 0])
        up = randn(n_ff, d, 1 / np.sqrt(d), zero_col0=True)
        pre = x @ gate.T
        fired.append(float(np.mean(pre > 0)))
        act = np.maximum(pre, 0) * (x @ up.T)
        down = randn(d, n_ff, 1.0, zero_row0=True)
        down *= np.sqrt(RELU_UPDATE / max(float(np.mean((act @ down.T)[:, 1:] ** 2)), 1e-12))
        h = h + act @ down.T
        for name, m in (("attn_q", wq), ("attn_k", wk), ("attn_v", wv), ("attn_output", wo),
                        ("ffn_gate", gate), ("ffn_up", up), ("ffn_down", down)):
            put(f"blk.{i}.{name}.weight", m)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
    _finish(w, path)
    return fired


def power_law(n, active, alpha):
    """p_j = min(1, c (j+1)^-alpha) with mean `active`."""
    base = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    lo, hi = 0.0, float(n)
    for _ in range(100):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if np.minimum(1.0, c * base).mean() < active else (lo, c)
    return np.minimum(1.0, c * base)


def draws(p, n_layer, n_tokens, rng):
    """A draw(layer) for Model.set_active_sets that hands out pre-drawn sets token after token,
    from the start again when they run out (prompts processed token by token draw too)."""
    sets = [np.flatnonzero(rng.random(len(p)) < p).astype(np.int32) for _ in range(n_layer * n_tokens)]
    it = itertools.cycle(sets)
    return lambda layer: next(it), float(np.mean([len(s) for s in sets])) / len(p)


def decode_rate(model, tokens):
    """tok/s of `tokens` steps fed ids 300, 301, ... after a 4-token prompt (runtime.bench's loop;
    the model's counters, so the bytes column, count the decode steps only)."""
    from pinfer.runtime.bench import decode_rate as steps
    return steps(model, tokens, [1, 500, 600, 700], [300 + k for k in range(tokens)])


def prompt_rate(model, n, kernel):
    """Tokens per second of an n-token prompt, its FFN through the kernel's batch call or the dense
    graphs (best of two)."""
    model.prefill_through_kernel(n if kernel else 0)
    best = np.inf
    for _ in range(2):
        model.reset()
        t = time.perf_counter()
        model.forward([300 + k for k in range(n)])
        best = min(best, time.perf_counter() - t)
    return n / best


def llamacpp_rate(py, gguf_path, threads, n):
    return engines.llamacpp(py, "decode", gguf_path, threads, n=n)["tok_s"]


def _cached(gguf_path, write, **convert_options):
    """(GGUF, .pinf): the GGUF written by write(path) (which may return a note for the log line) and
    converted with convert_options, each on first use."""
    from pinfer.converter.convert import ConvertOptions, convert

    gguf_path.parent.mkdir(parents=True, exist_ok=True)
    if not gguf_path.exists():
        t = time.perf_counter()
        note = write(gguf_path) or ""
        print(f"wrote {gguf_path} ({gguf_path.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t:.0f} s{note}",
              file=sys.stderr)
    pinf = gguf_path.with_suffix(".pinf")
    if not pinf.exists():
        convert(ConvertOptions(gguf_path, pinf, **convert_options))
    return gguf_path, pinf


def synthetic_model(shape, n_layer, cache):
    """(GGUF, .pinf) of the synthetic model, written and converted (--sparsity none) on first use."""
    from pinfer.converter.passes import DENSE
    return _cached(cache / f"synthetic-{shape}-{n_layer}L.Q4_0.gguf",
                   lambda p: write_gguf(p, shape, n_layer), passes=DENSE)


RELU_CALIB = dict(sparsity="relu:0.99", calib_tokens=8192, heldout_tokens=2048)


def relu_model(shape, n_layer, cache, active=0.10):
    """(GGUF, .pinf) of the trained-predictor ReLU model (write_relu_gguf), written and converted
    on first use: calibration on pinfer's built-in text, predictors trained per layer, relu at 0.99
    held-out mass recall (RELU_CALIB; the file is not reloaded to verify: at 32 layers that would
    take as long again on a CPU; the report beside it still gives the calibration's figures)."""
    from pinfer.converter.passes import PassOptions

    def write(path):
        fired = write_relu_gguf(path, shape, n_layer, active)
        return f"; simulated firing per layer {min(fired):.1%}-{max(fired):.1%}"
    return _cached(cache / f"synthetic-{shape}-{n_layer}L-relu{round(active * 100)}.Q4_0.gguf", write,
                   passes=PassOptions(**RELU_CALIB), verify=False)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=list(SHAPES), default="7b")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--active", default="0.10,0.25")
    ap.add_argument("--alpha", type=float, default=1.0, help="power-law exponent of the firing profile")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--llama-python", help="python of an environment with llama-cpp-python")
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--prompt", type=int, default=32,
                    help="also time a prompt of this many tokens (at most 64; 0: no prompt rows)")
    ap.add_argument("--build-family", choices=list(FAMILIES),
                    help="write and convert a synthetic file of another family's real shapes, print its paths and stop")
    ap.add_argument("--build-relu", action="store_true",
                    help="write and convert the trained-predictor ReLU model (relu_model), print its paths and stop")
    a = ap.parse_args(argv)
    if a.build_family:
        print(*family_model(a.build_family, a.cache))
        return
    if a.build_relu:
        print(*relu_model(a.shape, a.layers, a.cache, float(a.active.split(",")[0])))
        return

    from pinfer.runtime.model import Model, RuntimeOptions

    gguf_path, pinf = synthetic_model(a.shape, a.layers, a.cache)
    actives = [float(x) for x in a.active.split(",")]
    rows, prompts = [], []
    for threads in (int(x) for x in a.threads.split(",")):
        m = Model(pinf, RuntimeOptions(threads=threads, n_ctx=256, device="cpu"))
        rng = np.random.default_rng(threads)
        profiles = {f: power_law(m.cfg.n_ff, f, a.alpha) for f in actives}
        rates = {name: [] for name in ["dense"] + [f"sparse {f:.0%}" for f in actives]}
        prompt = {}
        drawn, mb = {}, {}
        for _ in range(a.repeats):
            m.set_sparsity("dense")
            rates["dense"].append(decode_rate(m, a.tokens))
            mb["dense"] = m.weight_bytes_per_token() / 1e6
            for f in actives:
                draw, share = draws(profiles[f], m.cfg.n_layer, a.tokens, rng)
                m.set_active_sets(draw)
                name = f"sparse {f:.0%}"
                rates[name].append(decode_rate(m, a.tokens))
                drawn[name], mb[name] = share, m.weight_bytes_per_token() / 1e6
                if a.prompt:
                    draw, _ = draws(profiles[f], m.cfg.n_layer, 4 * a.prompt, rng)
                    m.set_active_sets(draw)
                    prompt.setdefault(f"{f:.0%}", []).append((prompt_rate(m, a.prompt, False),
                                                               prompt_rate(m, a.prompt, True)))
        llama = llamacpp_rate(a.llama_python, gguf_path, threads, a.tokens) if a.llama_python else None
        dense = statistics.median(rates["dense"])
        for name, r in rates.items():
            tok_s = statistics.median(r)
            rows.append((threads, name, drawn.get(name, 1.0), mb[name], tok_s, tok_s / dense,
                         tok_s / llama if llama else None))
        if llama:
            rows.append((threads, "llama.cpp (dense)", 1.0, None, llama, llama / dense, 1.0))
        for f, pairs in prompt.items():
            prompts.append((threads, f, *(statistics.median(p[k] for p in pairs) for k in (0, 1))))
        del m
    print(f"\n{a.shape}-shaped, {a.layers} layers, Q4_0; power-law alpha {a.alpha}; {a.tokens} tokens x "
          f"{a.repeats} repeats (median)\n")
    print("| threads | path | FFN rows drawn | weight MB/token | tok/s | vs pinfer dense | vs llama.cpp |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for t, name, share, mbt, tok_s, vs_dense, vs_llama in rows:
        print(f"| {t} | {name} | {share:.1%} | {'' if mbt is None else f'{mbt:.0f}'} | {tok_s:.2f} | "
              f"{vs_dense:.2f}x | {'' if vs_llama is None else f'{vs_llama:.2f}x'} |")

    if prompts:
        print(f"\nPrompt of {a.prompt} tokens, the same power-law active sets: the FFN through the kernel's batch "
              "call (the union of the tokens' sets read once) against the dense graphs\n")
        print("| threads | active | dense graphs tok/s | kernel batch tok/s | ratio |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for t, f, dense_r, kernel_r in prompts:
            print(f"| {t} | {f} | {dense_r:.2f} | {kernel_r:.2f} | {kernel_r / dense_r:.2f}x |")


if __name__ == "__main__":
    main()
