"""The dense part's GPU code path (device buffers, KV cache, positions, RoPE tables, the head, the
FFN steps' copies and the hybrid merge) run on the CPU under DeviceEmulation (dense_device
"emulated-gpu"): host inputs are copied when bound, as ONNX Runtime's CUDA provider copies a host
input a CUDA kernel consumes, and device memory starts as NaN. On an H200 the host `seqlens_k`
bound once gave every token position 0 (0% top-1); here the same code does the same, and the fix
(lengths in device memory, written once per call) passes.

Tolerances: the emulated path runs the FP16 graphs, so against the FP32 CPU path it is held to
what the FP16 graphs on the CPU provider get (tests/test_hybrid.py::test_fp16_graphs_agree_with_fp32:
5% of the largest logit, 90% top-1). Against those same FP16 graphs fed token by token through the
same kernels the only difference is where the buffers live, so the logits are the same to 1e-5 of
the largest (the kernels' sums do not depend on the buffers' addresses)."""

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from pinfer.formats import PinfReader
from pinfer.formats import schema as S
from pinfer.formats.config import ModelConfig
from pinfer.runtime import graphs, placement
from pinfer.runtime import model as model_mod
from pinfer.runtime.kv import AttentionState
from pinfer.runtime.model import Model, RuntimeOptions
from pinfer.runtime.ort import Bound, Buf, DeviceEmulation

IDS = list(range(5, 41))
PROMPT = 8


def _run(model, by_token=False):
    """(prefill logits of every prompt position, decode logits), from a fresh context."""
    model.reset()
    if by_token:
        prefill = np.concatenate([model.forward([t]) for t in IDS[:PROMPT]])
    else:
        prefill = model.forward(IDS[:PROMPT], logits_from=0)
    return prefill, np.concatenate([model.forward([t]) for t in IDS[PROMPT:]])


def _top1(a, b):
    return float((a.argmax(-1) == b.argmax(-1)).mean())


class HostLengths(AttentionState):
    """The attention state before the fix: seqlens_k in host memory, bound once and updated in place."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seqlens = Buf((1,), np.int32, "cpu")


def _host_lengths(monkeypatch, path, options):
    with monkeypatch.context() as m:
        m.setattr(model_mod, "AttentionState", HostLengths)
        return Model(path, options)


def _identity_session():
    x = helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1])
    y = helper.make_tensor_value_info("y", TensorProto.INT32, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["seqlens_k"], ["y"])], "g", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_a_host_input_keeps_the_value_it_had_when_bound():
    """What ONNX Runtime's CUDA provider does to a host input of a CUDA kernel, and what a device
    buffer written through Buf.write does instead."""
    for snapshot, want in ((set(), 3), (None, 7), ({"seqlens_k"}, 7)):   # emulated, plain CPU, read on the host
        b = Bound(_identity_session(), snapshot)
        host, out = np.array([3], np.int32), np.zeros(1, np.int32)
        b.bind_in("seqlens_k", host)
        b.bind_out("y", out)
        host[0] = 7
        b.run()
        assert out[0] == want, snapshot
    b = Bound(_identity_session(), set())
    dev, out = Buf((1,), np.int32, "emulated"), np.zeros(1, np.int32)
    b.bind_in("seqlens_k", dev)
    b.bind_out("y", out)
    dev.write(np.int32(7))
    b.run()
    assert out[0] == 7


def test_device_memory_starts_unset_and_buffers_zero_it():
    raw = DeviceEmulation.allocate((2, 3), np.dtype(np.float16))
    assert np.isnan(raw).all() and (DeviceEmulation.allocate((2,), np.dtype(np.int32)) == -1).all()
    buf = Buf((2, 3), np.float16, "emulated")
    assert buf.np is None and (buf.read() == 0).all()
    host = np.arange(6, dtype=np.float16).reshape(2, 3)
    buf.write(host)
    back = DeviceEmulation.pinned(6, np.float16)
    DeviceEmulation.to_host(back, buf.ptr)
    assert (back == host.ravel()).all()


def test_only_the_attention_length_is_read_on_the_host(silu_file):
    r = PinfReader(silu_file)
    graph = graphs.build(r.path, r.header, ModelConfig.from_dict(r.header["config"]), S.LAYER_GRAPH.format(0)).graph
    assert DeviceEmulation.host_read(graph) == {"total_len"}
    assert "seqlens_k" in {i.name for i in graph.input}


@pytest.mark.parametrize("sparsity", ["dense", "predicted:0.99", "down:0.3"])
def test_the_emulation_catches_host_lengths_and_the_fix_passes(silu_file, sparsity, monkeypatch):
    """Prefill, decode and the head with the dense part's buffers in (emulated) device memory:
    the pre-fix runtime fails as it did on the H200, the fixed one agrees with the CPU path."""
    opts = dict(sparsity=sparsity, kernels="on", threads=1, device="cpu")
    want = _run(Model(silu_file, RuntimeOptions(**opts, kv_type="f32")))     # the reference: f32 throughout
    spread = np.abs(want[1]).max()
    got = _run(Model(silu_file, RuntimeOptions(**opts, dense_device="emulated-gpu")))
    broken = _run(_host_lengths(monkeypatch, silu_file, RuntimeOptions(**opts, dense_device="emulated-gpu")))
    fp16 = _run(_host_lengths(monkeypatch, silu_file, RuntimeOptions(**opts, dense_device="cpu-fp16")))
    for part, (w, g, b, h) in enumerate(zip(want, got, broken, fp16)):
        print(f"{sparsity} {('prefill', 'decode')[part]}: fixed {np.abs(w - g).max():.3f} / {_top1(w, g):.0%}, "
              f"host lengths {np.abs(w - b).max():.3f} / {_top1(w, b):.0%} (max |logit| {spread:.2f})")
        assert np.abs(w - g).max() < 0.05 * spread and _top1(w, g) >= 0.9
        assert _top1(w, h) >= 0.9      # host lengths are right where the host's memory is read
    assert _top1(want[1], broken[1]) < 0.5 and np.abs(want[1] - broken[1]).max() > 0.3 * spread


@pytest.mark.parametrize("sparsity", ["dense", "predicted:0.99", "down:0.3"])
@pytest.mark.parametrize("split", [True, False])
def test_a_split_layer_merges_into_device_memory(silu_file, sparsity, split):
    """Hot neurons on a second CPU kernel reading and writing (emulated) device buffers, the cold
    ones on the CPU kernel, merged: the same logits as the FP16 graphs with host buffers."""
    r = PinfReader(silu_file)
    modes = [sparsity.split(":")[0]] * 2
    cfg = ModelConfig.from_dict(r.header["config"])
    budget = 1 << 30
    if split:   # the smallest budget giving every layer hot neurons and some layer cold ones too
        budget = next(b for b in range(0, 1 << 20, 1024)
                      if min(hot := placement.plan(r, cfg, modes, b).hot) > 0 and min(hot) < cfg.n_ff)
    opts = dict(sparsity=sparsity, kernels="on", threads=1, device="cpu-split", vram_budget=budget / placement.GIB)
    m = Model(silu_file, RuntimeOptions(**opts, dense_device="emulated-gpu"))
    assert any(h < cfg.n_ff for h in m.plan.hot) == split and min(m.plan.hot) > 0, m.plan.hot
    got = _run(m)
    want = _run(Model(silu_file, RuntimeOptions(**opts, dense_device="cpu-fp16")), by_token=True)
    for w, g in zip(want, got):
        assert np.abs(w - g).max() <= 1e-5 * np.abs(w).max()
    [plan] = [n.describe() for n in m.notes if "placement for a VRAM budget" in n.describe()]
    assert "dense part and KV cache on the CPU, through the GPU's code path (emulated-gpu" in plan, plan


def test_the_emulated_device_refuses_what_the_gpu_refuses(silu_file):
    with pytest.raises(ValueError, match="dense device 'tpu'"):
        Model(silu_file, RuntimeOptions(device="cpu", dense_device="tpu"))
    m = Model(silu_file, RuntimeOptions(device="cpu", dense_device="emulated-gpu", threads=1))
    assert m.devices.on_device and m.devices.act_dtype == np.float16 and m.attention.kv[0][0].np is None
    assert m.prefill_by_token == 0 and not m.path_choices     # no timing of host-only paths



def _root(a):
    """The buffer at the root of `a`'s views: an array that owns its data, or what it was made from."""
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def test_a_split_layer_holds_its_cold_rows_alone(silu_file):
    """Host memory holds a split layer's cold rows in copies of their own, not views of a copy of
    the whole layer: those kept the hot rows in RAM beside the device's copy (issue 37, point 6).
    The hot half (here a second CPU kernel, cpu-split) is made from the file's map."""
    from pinfer.formats.reader import HUGE_PAGE
    r = PinfReader(silu_file)
    cfg = ModelConfig.from_dict(r.header["config"])
    budget = next(b for b in range(0, 1 << 20, 1024)
                  if min(hot := placement.plan(r, cfg, ["dense"] * 2, b).hot) > 0 and min(hot) < cfg.n_ff)
    m = Model(silu_file, RuntimeOptions(sparsity="dense", kernels="on", threads=1, device="cpu-split",
                                        vram_budget=budget / placement.GIB))
    split = [(i, e.kernel) for i, e in enumerate([L.ffn for L in m.layers]) if 0 < m.plan.hot[i] < cfg.n_ff]
    assert split, m.plan.hot
    for i, ffn in split:
        assert ffn.cold.n_ff == cfg.n_ff - m.plan.hot[i]
        (_, gu), (_, dn) = ffn.cold.keep[:2]
        for a in (*gu.values(), *dn.values()):
            root = _root(a)     # small arrays are plain copies; from one huge page up, a map of their size
            held = root.nbytes if isinstance(root, np.ndarray) else len(root)
            assert (a.flags.owndata if a.nbytes < HUGE_PAGE else held <= a.nbytes + 2 * HUGE_PAGE), (i, a.shape, held)
        (_, hot_gu), _ = ffn.hot.ffn.keep[:2]
        assert np.shares_memory(hot_gu["q"], m.reader.tensor(S.part_name(S.FFN_GATE_UP.format(i), "q")))  # the map
