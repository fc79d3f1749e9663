"""One copy of the weights (runtime/loading.one_copy): where pinfer's C kernels take every step of a
dense model on the CPU, no ONNX Runtime layer graph is built, prompts go through the kernels' batch
calls, and the process holds each weight once.

loading.ONE_COPY_MIN_BYTES keeps small models on the graphs; the tests lower it to 0 to take the
path with small files."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import map_rss

from pinfer.runtime import accounting, autotune, loading
from pinfer.runtime.model import Model, RuntimeOptions
from pinfer.runtime.sparse import Rule

IDS = [int(i) for i in np.random.default_rng(5).integers(3, 300, 40)]


def _run(m, prompt=24):
    m.reset()
    out = [m.forward(IDS[:prompt], logits_from=0)]
    out += [m.forward([t]) for t in IDS[prompt:]]
    return np.concatenate(out)


def _load(path, one_copy, monkeypatch, **kw):
    """The tiny SiLU model (calibrated down:0.4 per layer) run dense unless kw says otherwise."""
    monkeypatch.setattr(loading, "ONE_COPY_MIN_BYTES", 0 if one_copy else 1 << 60)
    return Model(path, RuntimeOptions(threads=2, n_ctx=128, kv_type="f32", **{"sparsity": "dense", **kw}))


def test_one_copy_builds_no_layer_graph_and_gives_the_graphs_results(silu_file, monkeypatch):
    """The tiny SiLU model one copy: no layer session and no down projection of the ONNX path, the
    prompt timing untimed (said only with -v), every prompt through the batch calls; its logits
    against the same model with the graphs (prompt and decode): the graphs' prompt quantizes each
    matmul's x on its own, so as in test_native: float rounding for most tokens, one int8 step of
    x (1e-2 of the largest logit) for all, and the same greedy token."""
    graphs = _load(silu_file, False, monkeypatch)
    graphs.prefill_through_kernel(0)        # every prompt through the layer graphs
    want = _run(graphs)
    assert not graphs.one_copy and all(s is not None for s in [L.graph for L in graphs.layers] + [L.down for L in graphs.layers])
    m = _load(silu_file, True, monkeypatch)
    assert m.one_copy
    assert [L.graph for L in m.layers] == [None] * m.cfg.n_layer and [L.down for L in m.layers] == [None] * m.cfg.n_layer and all(L.attn is None for L in m.layers)
    assert all(f is not None for f in [L.ffn for L in m.layers]) and all(s is not None for s in [L.native for L in m.layers])
    choice = [c for c in m.notes if isinstance(c, autotune.PrefillChoice)]
    assert len(choice) == 1 and choice[0].untimed and choice[0].quiet and "held once" in choice[0].describe()
    assert m.batches(24) and autotune.chunk_size(m, 100) == 50     # two equal batch calls
    held = sum(e["nbytes"] for name, e in m.reader.tensors.items() if not name.startswith("token_embd."))
    assert not m.cfg.tied_embeddings       # the embedding's rows are read from the file's map, not held
    expected = accounting.expected_bytes(m.reader.tensors, m.cfg.tied_embeddings, m.attention.kv_bytes)
    assert expected == held + m.attention.kv_bytes + accounting.PROCESS_BYTES
    assert any(f"about {expected / 1e9:.2f} GB in all" in n.describe() for n in m.notes)
    got = _run(m)
    assert [L.graph for L in m.layers] == [None] * m.cfg.n_layer       # no call built a graph
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    assert np.median(err) <= 1e-5 and err.max() <= 1e-2, err
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_a_sparse_rule_brings_the_graphs_back(silu_file, monkeypatch):
    """A sparse rule is timed against the dense graphs: set_sparsity builds them, times the three
    ways and decodes (which way wins on the tiny model depends on the moment, so only that it runs).
    The model no longer reads from the map: the new kernels hold copies."""
    m = _load(silu_file, True, monkeypatch)
    assert m.one_copy and m.reader.mapped
    m.set_sparsity("down:0.3")
    assert not m.reader.mapped
    assert all([L.ffn for L in m.layers])      # the kernel takes down:0.3, over copies now
    gu = [L.ffn for L in m.layers][0].kernel.keep[0][1]["q"]
    assert not np.shares_memory(gu, m.reader.tensor("blk.0.ffn_gate_up.q"))
    # timed against the layer graphs, so they were made (whether they stay after the load depends on
    # which prompt route wins the timing: plan.drop_graphs)
    assert not m.one_copy and m.path_choices and all(c.tokens > 0 for c in m.path_choices)
    assert np.isfinite(_run(m)).all()


def test_a_layer_the_kernel_refuses_after_all_brings_the_graphs_back(silu_file, monkeypatch, refuse_layer):
    """loading.one_copy reads the file; the kernel may still refuse a layer when it is built (a
    format it lacks: the planner then plans the graph). The graphs are made, and that layer runs on them."""
    refuse_layer(1, "a format the kernel lacks")
    m = _load(silu_file, True, monkeypatch)
    assert not m.one_copy and [L.ffn for L in m.layers][1] is None and all(s is not None for s in [L.graph for L in m.layers])
    assert not any("the weights once" in n.describe() for n in m.notes)     # no one-copy memory note
    [paths] = [n.describe() for n in m.notes if n.describe().startswith("paths:")]
    assert ("layer 1: attention: ONNX Runtime (the layer's FFN runs in its ONNX graph, which computes the attention "
            "too); FFN: ONNX Runtime's graph (a format the kernel lacks)") in paths, paths
    assert np.isfinite(_run(m)).all()


@pytest.mark.parametrize("options, why", [(dict(kernels="on"), "--ffn-kernel"),
                                          (dict(dense_kernel="off"), "--ffn-kernel"),
                                          (dict(sparsity="down:0.3"), "sparse rules")])
def test_one_copy_says_why_not(silu_file, monkeypatch, options, why):
    m = _load(silu_file, True, monkeypatch, **options)
    assert not m.one_copy
    modes = [Rule.of_layer(m.reader.header, i, m.options.sparsity).mode for i in range(m.cfg.n_layer)]
    assert why in loading.one_copy(m, modes)


MEASURE = textwrap.dedent("""
    import json, sys
    from pinfer.runtime import loading
    from pinfer.runtime.model import Model, RuntimeOptions

    def anon():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024

    loading.ONE_COPY_MIN_BYTES = int(sys.argv[2])
    mmap = {"auto": None, "off": False}[sys.argv[3]]
    Model(sys.argv[1], RuntimeOptions(threads=1, n_ctx=64, mmap=mmap)).forward([1, 2, 3])   # warms ORT and the pool
    before = anon()
    m = Model(sys.argv[1], RuntimeOptions(threads=1, n_ctx=64, mmap=mmap))
    m.forward([1, 2, 3])
    print(json.dumps({"grew": anon() - before, "kv": m.attention.kv_bytes, "one_copy": m.one_copy}))
""")


@pytest.mark.real_model
def test_one_copy_holds_each_weight_once(tmp_path):
    """SmolLM2 (98 MB) loaded a second time in a fresh process, after a first load warmed ONNX Runtime
    and the thread pool: the process's anonymous memory grows by the KV cache, 24 MB for scratch
    buffers and allocator slack (no ONNX Runtime session is made under one copy), and the weights
    the kernels copy: by default (the map) only W_down, which the dense row dots read and the file
    holds as down_t; with --no-mmap every weight, the whole file at most. With the layer graphs
    built as well it grows by a second copy of the layers' weights, which that bound does not admit."""
    import contextlib
    import io

    from models import smollm2_gguf

    from pinfer.converter.convert import ConvertOptions, convert
    from pinfer.converter.passes import DENSE
    from pinfer.formats import PinfReader
    path = tmp_path / "smollm2.pinf"
    with contextlib.redirect_stderr(io.StringIO()):
        convert(ConvertOptions(smollm2_gguf(), path, passes=DENSE, verify=False))
    out = {}
    for key, floor, mmap in (("map", 0, "auto"), ("copies", 0, "off"), ("graphs", 1 << 60, "auto")):
        res = subprocess.run([sys.executable, "-c", MEASURE, str(path), str(floor), mmap], capture_output=True,
                             text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        out[key] = json.loads(res.stdout.strip().splitlines()[-1])
        assert out[key]["one_copy"] == (key != "graphs")
    down_t = sum(e["nbytes"] for name, e in PinfReader(path).tensors.items() if ".ffn_down_t." in name)
    slack = out["map"]["kv"] + (24 << 20)
    assert out["map"]["grew"] <= down_t + slack, (out, down_t)
    bound = path.stat().st_size + slack
    assert out["map"]["grew"] < out["copies"]["grew"] <= bound, (out, bound)
    assert out["graphs"]["grew"] > bound, (out, bound)


def test_by_default_one_copy_reads_the_map_and_gives_the_copies_results(silu_file, monkeypatch):
    """RuntimeOptions.mmap None (the default) under one copy: the kernels read gate/up, the
    attention's weights and the head from the file's map (no copy), W_down is made from down_t as
    with copies, and the logits are the copies' to the bit (the same kernels over the same bytes,
    each kernel's order of sums fixed by its thread count)."""
    want = _run(_load(silu_file, True, monkeypatch, mmap=False))
    m = _load(silu_file, True, monkeypatch)
    assert m.one_copy and m.reader.mapped
    r = m.reader
    for i, entry in enumerate([L.ffn for L in m.layers]):
        (_, gu), _ = entry.kernel.keep[:2]
        assert np.shares_memory(gu["q"], r.tensor(f"blk.{i}.ffn_gate_up.q"))
        assert entry.kernel.keep[3] is not None     # W_down, made
    np.testing.assert_array_equal(_run(m), want)
    copies = _load(silu_file, True, monkeypatch, mmap=False)
    assert not copies.reader.mapped
    gu = [L.ffn for L in copies.layers][0].kernel.keep[0][1]["q"]
    assert not np.shares_memory(gu, copies.reader.tensor("blk.0.ffn_gate_up.q"))
    small = _load(silu_file, False, monkeypatch)        # not one copy: the graphs, and copies for the kernels
    assert not small.one_copy and not small.reader.mapped


def test_mmap_reads_the_map_and_gives_the_copies_results(silu_file, monkeypatch):
    """--mmap: the kernels read the file's map (no copy of a layer's weights), and the logits are
    the copies' but for the down projection, which reads down_t (an axpy of h in float32) where the
    copies' W_down row dots quantize h to int8 per group of 32: one int8 step of h, about 1e-2 of
    the largest logit (up to 1.4e-2 measured). Greedy tokens differ only where the random model's
    best two logits are closer than that."""
    want = _run(_load(silu_file, True, monkeypatch))
    m = _load(silu_file, True, monkeypatch, mmap=True)
    assert m.one_copy and m.reader.mapped
    r = m.reader
    for i, entry in enumerate([L.ffn for L in m.layers]):
        (_, gu), (_, dn) = entry.kernel.keep[:2]
        assert np.shares_memory(gu["q"], r.tensor(f"blk.{i}.ffn_gate_up.q"))
        assert np.shares_memory(dn["q"], r.tensor(f"blk.{i}.ffn_down_t.q"))
        assert entry.kernel.keep[3] is None         # no W_down made
    got = _run(m)
    err = np.abs(got - want).max(axis=-1) / np.abs(want).max()
    assert err.max() <= 2e-2, err
    rows = np.arange(len(want))
    gap = want.max(-1) - want[rows, got.argmax(-1)]    # 0 where the greedy token is the same
    assert (gap <= 2 * err * np.abs(want).max()).all() and (gap == 0).mean() >= 0.8, gap


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_streamed_layers_let_each_layer_go_after_it_runs(silu_file, monkeypatch):
    """loading.stream_layers (the converter's verification of a large file): a mapped model's call
    leaves none of its layers' pages in the process, where a plain call leaves every layer's; the
    logits are the same bits (the same kernels over the same bytes)."""
    layer_bytes = sum(e["nbytes"] for n, e in _load(silu_file, True, monkeypatch).reader.tensors.items()
                      if n.startswith("blk."))
    plain = _load(silu_file, True, monkeypatch, mmap=True)
    want = plain.forward(IDS[:24], logits_from=0)
    assert map_rss(plain.reader) >= layer_bytes
    m = _load(silu_file, True, monkeypatch, mmap=True)
    loading.stream_layers(m, 24)
    got = m.forward(IDS[:24], logits_from=0)
    np.testing.assert_array_equal(got, want)
    others = m.reader.size - layer_bytes            # the head, embedding and norms may stay
    assert map_rss(m.reader) <= others, (map_rss(m.reader), others, layer_bytes)
