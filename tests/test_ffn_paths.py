"""--ffn-kernel auto: the runtime times the fused kernel under each rule, the kernel's dense mode
and ONNX Runtime's dense path at load, and keeps the rule only where it is clearly faster
(runtime/autotune.py). The timing itself is the machine's; these tests check what
follows from it, whichever way it goes, and force the ways."""

import numpy as np
import pytest

from fixtures import convert_tiny_silu
from pinfer.runtime import autotune
from pinfer.runtime.autotune import choose_path, timing_tokens
from pinfer.runtime.model import Model, RuntimeOptions

IDS = list(range(5, 37))


def _decode(model):
    model.reset()
    model.forward(IDS[:8])
    return np.stack([model.forward([t]) for t in IDS[8:]])


def _opts(**kw):
    """f32 KV caches: these tests compare paths that round an f16 cache at different points (the C
    attention each token's K and V as it writes them, ONNX Runtime's the call's tokens after it)."""
    return RuntimeOptions(threads=1, device="cpu", **{"kv_type": "f32", **kw})


@pytest.mark.parametrize("sparsity", ["down:0.3", "predicted:0.99"])
def test_auto_runs_what_it_reports(silu_file, sparsity, capfd):
    """Whatever the timing chose, the model decodes as the way it names; the choice is a record in
    the model's notes, and the runtime prints nothing."""
    m = Model(silu_file, _opts(sparsity=sparsity))
    assert capfd.readouterr().err == ""
    [choice] = m.path_choices
    assert choice in m.notes and not choice.quiet
    assert choice.rule == sparsity and choice.layers == 2 and choice.tokens >= 3
    assert choice.kernel_over_dense > 0 and choice.kernel_dense_over_dense > 0
    assert f"ffn: {sparsity} on 2 layers, time against ONNX Runtime's dense path" in choice.describe()
    assert choice.path == choose_path(choice.kernel_over_dense, choice.kernel_dense_over_dense)
    got = _decode(m)
    if choice.path == "kernel":
        want = _decode(Model(silu_file, _opts(sparsity=sparsity, kernels="on")))
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), choice
        return
    assert m.sparsity_names == ["dense"]          # the rule is dropped
    want = _decode(Model(silu_file, _opts(sparsity="dense", kernels="off")))
    if choice.path == "dense":
        assert not any([L.ffn for L in m.layers])
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), choice
    else:                                         # the kernel's int8 activations against MatMulNBits'
        assert all(f.mode == "dense" for f in [L.ffn for L in m.layers])
        assert np.abs(got - want).max() < 0.05 * np.abs(want).max(), choice
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_the_choice_prefers_the_exact_ways():
    assert choose_path(0.5, 1.2, 0.95) == "kernel"           # the rule pays
    assert choose_path(0.5, 0.6, 0.95) == "kernel"
    assert choose_path(0.58, 0.6, 0.95) == "kernel-dense"    # no clear gain over the kernel's dense mode
    assert choose_path(0.97, 1.3, 0.95) == "dense"           # inside the margin: exact
    assert choose_path(1.4, 0.96, 0.95) == "dense"
    assert choose_path(1.4, 0.8, 0.95) == "kernel-dense"


@pytest.mark.parametrize("keep_below, path", [(0.0, "dense"), (1e9, "kernel")])
def test_each_way_of_the_choice(silu_file, monkeypatch, keep_below, path):
    monkeypatch.setattr(autotune, "KEEP_BELOW", keep_below)
    m = Model(silu_file, _opts(sparsity="down:0.3"))
    assert [c.path for c in m.path_choices] == [path]
    assert all([L.ffn for L in m.layers]) == (path == "kernel") and any([L.ffn for L in m.layers]) == (path == "kernel")
    assert m.n_past == 0 and m.counters.full == 0      # the timing leaves no trace
    m.forward(IDS[:8])
    gu, down = m.counters.fractions()
    assert (down < 1.0) == (path == "kernel")           # dense: the rule is dropped, not just slower
    if path == "kernel":     # about 60% survive: mostly over ROWS_FROM, where the row dots read every down row
        assert down < m.counters.read_fractions()[1] <= 1.0


def test_prompts_up_to_the_crossover_take_the_kernels_batch_call(silu_file, monkeypatch, capfd):
    """A prompt up to prefill_by_token runs each layer's FFN as one batch call of the kernel, which
    gives each token its decode call's FFN: the logits match decoding the prompt token by token."""
    monkeypatch.setattr(autotune, "KEEP_BELOW", 1e9)
    m = Model(silu_file, _opts(sparsity="down:0.3"))
    assert m.prefill_by_token in (0, 2, 4, 8, 16, 32, 64)
    lengths = [n for n, _ in m.prefill_times]      # timed from the first size up, some answered by the bound
    assert lengths == sorted(set(lengths)) and set(lengths) <= set(autotune.PREFILL_SIZES)
    assert lengths[0] == autotune.PREFILL_SIZES[0] and all(r > 0 for _, r in m.prefill_times)
    for (n, r), later in zip(m.prefill_times, lengths[1:] + [None]):
        if later is not None:       # a size is timed only where the wins before it do not answer it
            assert r < 1 and later > autotune.covered_by(n, r, m.n_ctx)
    [said] = [n for n in m.notes if isinstance(n, autotune.PrefillChoice)]
    assert said.up_to == m.prefill_by_token and said.times == tuple(m.prefill_times)
    assert "ffn: prompt time of the kernel's batch call against the dense graphs (2: " in said.describe()
    ref = Model(silu_file, _opts(sparsity="down:0.3", kernels="on"))
    m.prefill_through_kernel(4)
    ref.reset()
    want = np.concatenate([ref.forward([t]) for t in IDS[:4]])
    m.reset()
    got = m.forward(IDS[:4], logits_from=0)
    assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    m.reset()
    m.counters.reset()
    # the head over 1 row here, over 4 above: ONNX Runtime's GEMM may take another kernel, and so
    # another order of float sums, for one row (on AVX2-only CPUs it does)
    last = m.forward(IDS[:4])
    assert np.abs(last - got[-1:]).max() <= 1e-5 * np.abs(got).max()
    assert m.counters.full == 4 * 2 * m.cfg.n_ff and m.counters.fractions()[1] < 1.0   # the rule ran, per token
    m.reset()
    longer = m.forward(IDS[:6], logits_from=0)       # past the crossover: the dense graphs, batched
    assert longer.shape[0] == 6


def test_prompts_longer_than_a_batch_call_go_through_it_in_chunks(silu_file):
    """Where the batch call won at its most tokens, a longer prompt runs as equal chunks of it:
    every row's logits as decoding token by token gives them, and the cache as long as the prompt."""
    m = Model(silu_file, _opts(sparsity="down:0.3", kernels="on", n_ctx=256))
    ids = [5 + (7 * i) % 200 for i in range(150)]
    m.prefill_through_kernel(autotune.PREFILL_SIZES[-1])
    chunk = autotune.chunk_size
    assert chunk(m, 150) == 50 and chunk(m, 64) == 64 and chunk(m, 65) == 33
    got = m.forward(ids, logits_from=100)
    assert got.shape == (50, m.cfg.vocab) and m.n_past == 150
    m.reset()
    want = np.concatenate([m.forward([t]) for t in ids])[100:]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    m.prefill_through_kernel(32)            # the batch call lost at 64: one call through the graphs
    assert chunk(m, 150) == 150


def test_graphs_no_call_takes_are_let_go_and_made_again_when_one_does(silu_file):
    """Where every layer decodes through the C attention and a fused kernel and prompts take the
    batch call at its most tokens, ONNX Runtime's layer sessions and the ONNX path's down
    projections are dropped; a call through the graphs later makes them again, and gives what a
    model that never dropped them gives."""
    from pinfer.runtime.plan import drop_graphs
    m = Model(silu_file, _opts(sparsity="down:0.3", kernels="on", n_ctx=256))
    ref = Model(silu_file, _opts(sparsity="down:0.3", kernels="on", n_ctx=256))
    assert all(s is not None for s in [L.native for L in m.layers]) and all([L.ffn for L in m.layers])
    drop_graphs(m)                          # prompts still through the graphs: nothing to drop
    assert all(s is not None for s in [L.graph for L in m.layers])
    m.prefill_through_kernel(autotune.PREFILL_SIZES[-1])
    drop_graphs(m)
    assert all(s is None for s in [L.graph for L in m.layers]) and all(d is None for d in [L.down for L in m.layers])
    m.forward(IDS[:20])
    m.forward(IDS[20:21])
    assert all(s is None for s in [L.graph for L in m.layers])     # neither a prompt nor a token took them
    m.prefill_through_kernel(0)
    for model in (m, ref):
        model.prefill_through_kernel(0)
        model.reset()
    got, want = m.forward(IDS[:8], logits_from=0), ref.forward(IDS[:8], logits_from=0)
    assert all(s is not None for s in [L.graph for L in m.layers]) and all(d is not None for d in [L.down for L in m.layers])
    np.testing.assert_array_equal(got, want)    # the same sessions, made again, on the same inputs


def test_new_rules_after_the_graphs_were_let_go_make_them_again_first(silu_file, monkeypatch):
    """set_sparsity under auto times the graphs and builds kernels that share W_down's rows with
    the down projections: after drop_graphs it makes them again first, then decodes as a model
    loaded with that rule does. (The timing is made to keep the rule's kernel, whatever this
    machine measures, so that there is something to let go.)"""
    from pinfer.runtime import plan
    from pinfer.runtime.plan import drop_graphs, ensure_graphs
    monkeypatch.setattr(autotune, "KEEP_BELOW", 1e9)
    m = Model(silu_file, _opts(sparsity="down:0.3"))
    assert all([L.ffn for L in m.layers])
    m.prefill_through_kernel(autotune.PREFILL_SIZES[-1])
    drop_graphs(m)
    assert all(s is None for s in [L.graph for L in m.layers])
    made = []

    def ensure(model):      # the graphs exist again before the timing and the new kernels
        ensure_graphs(model)
        made.append(all(s is not None for s in [L.graph for L in model.layers]) and all(d is not None for d in [L.down for L in model.layers]))
    monkeypatch.setattr(plan, "ensure_graphs", ensure)
    m.set_sparsity("dense")
    assert made == [True]
    ref = Model(silu_file, _opts(sparsity="dense", kernels="on"))
    for model in (m, ref):
        model.prefill_through_kernel(0)     # the same prompt path both ways: the dense graphs
        model.reset()
    got, want = m.forward(IDS[:8], logits_from=0), ref.forward(IDS[:8], logits_from=0)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    step, want_step = m.forward(IDS[8:9]), ref.forward(IDS[8:9])     # on caches within the bound above
    assert np.abs(step - want_step).max() <= 1e-5 * np.abs(want_step).max()


def test_logits_outside_the_call_are_refused_in_a_sentence(silu_file):
    m = Model(silu_file, _opts(kernels="off"))
    for bad in (4, -1):
        m.reset()
        with pytest.raises(ValueError, match=f"logits_from {bad} is outside this call's 4 tokens"):
            m.forward(IDS[:4], logits_from=bad)


def test_a_prompt_win_answers_longer_prompts_by_the_bound():
    """A win at n tokens by ratio r answers every size m with m * r <= n * KEEP_BELOW (the batch
    call's time grows at most in proportion to its tokens, the graphs' does not fall), n_ctx capping:
    the ReLU 7B-shaped model's 0.10 at 2 tokens answers 16."""
    assert autotune.covered_by(2, 0.104, 512) == 16
    assert autotune.covered_by(2, 0.6, 512) == 2 and autotune.covered_by(4, 0.95, 512) == 4
    assert autotune.covered_by(8, 0.1, 32) == 32 and autotune.covered_by(64, 0.01, 4096) == 64
    said = autotune.PrefillChoice(((2, 0.104),), 16).describe()
    assert "(2: 0.10x; up to 16 by the bound on the growth of both times): prompts of up to 16" in said
    said = autotune.PrefillChoice(((2, 0.104), (16, 0.2)), 64).describe()
    assert "up to 64 by the bound on the growth of both times): prompts go through the kernel, 64 tokens a call" in said


def test_off_and_on_time_nothing(silu_file, capfd):
    for opts in (_opts(sparsity="down:0.3", kernels="off"), _opts(sparsity="down:0.3", kernels="on"),
                 _opts(sparsity="dense", kernels="on"), _opts(sparsity="dense", kernels="off")):
        m = Model(silu_file, opts)
        assert m.path_choices == [] and m.prefill_by_token == 0
        assert not any("ffn:" in n.describe() for n in m.notes)
        assert any([L.ffn for L in m.layers]) == (opts.sparsity == "down:0.3" and opts.kernels == "on")
    assert "ffn:" not in capfd.readouterr().err
    for bad in ("sometimes", True):         # checked when the options are made, not at load
        with pytest.raises(ValueError, match="not one of auto, on, off"):
            _opts(kernels=bad)


@pytest.mark.parametrize("keep_below, path", [(0.0, "dense"), (1e9, "kernel-dense")])
def test_dense_layers_take_the_kernels_dense_mode_where_it_is_faster(silu_file, monkeypatch, keep_below, path):
    """Under auto, dense layers whose attention ONNX Runtime runs (here: --dense-kernel off) are timed
    too: the kernel over every neuron against ONNX Runtime's layer graph (a permuted file's q8
    down_t has no MatMulNBits form, and there the kernel's dense mode was 2.7x faster at 7B shapes,
    benchmarks/decode_profile.py). Either way it decodes as the exact dense model does, up to the
    kernel's int8 activations."""
    monkeypatch.setattr(autotune, "KEEP_BELOW", keep_below)
    m = Model(silu_file, _opts(sparsity="dense", dense_kernel="off"))
    [choice] = m.path_choices
    assert (choice.rule, choice.path, choice.layers) == ("dense", path, 2)
    said = choice.describe()
    assert said.startswith("ffn: dense on 2 layers, time against ONNX Runtime's dense path here (1 thread, fastest of ")
    assert said.endswith("running them through " + ("the kernel" if path == "kernel-dense" else "ONNX Runtime"))
    assert all([L.ffn for L in m.layers]) == (path == "kernel-dense") and all(f.mode == "dense" for f in [L.ffn for L in m.layers] if f)
    want = _decode(Model(silu_file, _opts(sparsity="dense", kernels="off")))
    got = _decode(m)
    assert np.abs(got - want).max() < 0.05 * np.abs(want).max()
    assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9


def test_timing_tokens_are_words_of_the_vocabulary():
    vocab = ["<s>", "The", "\u0120history", "\u0120of", "\u2581the", "city", "x"]
    ids = timing_tokens({"tokens": vocab}, len(vocab), 5)
    assert ids[:4] == [1, 2, 3, 4] and len(ids) == 5      # "The", "Ġhistory", "Ġof", "▁the", then "city"
    spread = timing_tokens({}, 1000, 4)                     # no vocabulary in the spec: spread ids
    assert len(spread) == 4 and all(250 <= i < 1000 for i in spread)


def test_the_cli_prints_what_loading_chose(silu_file):
    """The runtime keeps its choices as notes; pinfer prints them, the quiet ones only with -v."""
    import subprocess
    import sys

    def generate(*flags):
        r = subprocess.run([sys.executable, "-m", "pinfer", *flags, "generate", str(silu_file), "-p", "hello", "-n", "2",
                            "-t", "1", "--sparsity", "down:0.3", "--device", "auto"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stderr
    quiet, verbose = generate(), generate("-v")
    for err in (quiet, verbose):
        assert "ffn: down:0.3 on 2 layers, time against ONNX Runtime's dense path" in err
    assert "running on the CPU (" not in quiet
    assert "running on the CPU (" in verbose or "placement for a VRAM budget" in verbose   # no GPU, or a GPU's plan


def test_large_dense_models_are_not_timed_unless_the_graph_lacks_matmulnbits(tmp_path, monkeypatch):
    """With --dense-kernel off, timing a dense layer's kernel builds the attention-only sessions, a
    second copy of the attention weights: above ffn.DENSE_TIMING_MAX_ATTN_BYTES dense layers stay
    on the graphs, untimed, with no such sessions; a file whose down rows have no MatMulNBits form
    (the hot-first file here) is timed whatever its size. Where the C kernels take the attention
    there is no second copy, and every size is timed."""
    from fixtures import make_tiny_llama_gguf

    from pinfer.converter.convert import ConvertOptions, convert
    from pinfer.converter.passes import DENSE
    from pinfer.formats.reader import PinfReader
    from pinfer.runtime import ffn
    src = make_tiny_llama_gguf(tmp_path / "d.gguf", qtype="Q4_0", n_layer=2, d_model=64, n_ff=128)
    plain = convert(ConvertOptions(src, tmp_path / "d.pinf", report=False, passes=DENSE))
    assert [c.rule for c in Model(plain, _opts()).path_choices] == ["dense"]
    monkeypatch.setattr(ffn, "DENSE_TIMING_MAX_ATTN_BYTES", 0)
    m = Model(plain, _opts(dense_kernel="off"))
    assert m.path_choices == [] and not any([L.ffn for L in m.layers]) and all(L.attn is None for L in m.layers)
    assert [c.rule for c in Model(plain, _opts()).path_choices] == ["dense"]
    hot_first = convert_tiny_silu(tmp_path, order="hot-first")
    assert PinfReader(hot_first).header["weights"]["blk.0.ffn_down_t"] == "q8"
    assert [c.rule for c in Model(hot_first, _opts(sparsity="dense", dense_kernel="off")).path_choices] == ["dense"]
