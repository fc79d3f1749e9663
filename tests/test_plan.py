"""The planner (runtime/plan.py): each layer's LayerPlan says where its attention and FFN run and
why, the objects it holds are the ones its plan names, and the path note is the plans' text."""

import dataclasses

import numpy as np
import pytest

from pinfer.runtime import autotune, plan
from pinfer.runtime.model import Model, RuntimeOptions


def _paths_note(m):
    [note] = [n.describe() for n in m.notes if isinstance(n, plan.PathNote) and n.describe().startswith("paths:")]
    return note


IN_GRAPH = ("graph", "the layer's FFN runs in its ONNX graph, which computes the attention too")


@pytest.mark.parametrize("kw, attention, ffn_path, why", [
    ({"kernels": "on", "sparsity": "down:0.3"}, ("kernels", ""), "kernel", ""),
    ({"kernels": "off"}, IN_GRAPH, "graph", "--ffn-kernel off"),
    ({"kernels": "on", "sparsity": "dense"}, IN_GRAPH, "graph",
     "--ffn-kernel on takes sparse layers; dense ones run ONNX Runtime's dense path"),
    ({"kernels": "on", "sparsity": "down:0.3", "dense_kernel": "off"}, ("graph", "--dense-kernel off"), "kernel", ""),
    ({"kernels": "off", "dense_kernel": "off"}, ("graph", "--dense-kernel off"), "graph", "--ffn-kernel off"),
])
def test_each_layers_plan_names_its_path_its_reason_and_holds_its_objects(silu_file, kw, attention, ffn_path, why):
    """The objects follow the plan: a C attention step only where the plan runs the attention
    through the kernels (a layer whose FFN runs in its graph runs its attention there too, and holds
    no step), an attention-only session only where the FFN has a kernel and the attention does not."""
    m = Model(silu_file, RuntimeOptions(threads=1, **kw))
    note = _paths_note(m)
    for i, L in enumerate(m.layers):
        p = L.plan
        assert (p.attention, p.attention_why) == attention and p.ffn == ffn_path and p.ffn_why == why, p
        assert (L.native is not None) == (p.attention == "kernels")
        assert (L.attn is not None) == (p.attention == "graph" and p.ffn != "graph")
        assert (L.ffn is not None) == (p.ffn != "graph")
        assert L.ffn is None or L.ffn.mode == p.mode
        assert p.describe() in note        # the note says what the plan says
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.layers[0].ffn = None


def test_the_loads_timing_is_applied_by_the_planner_and_said(silu_file, monkeypatch):
    """A timed rule that does not pay: autotune returns its choice, the planner drops the rule, and
    the layer's plan (and the note) says the timing chose it."""
    monkeypatch.setattr(autotune, "KEEP_BELOW", 1e-9)      # the rule never pays, the kernel's dense mode never wins
    m = Model(silu_file, RuntimeOptions(threads=1, sparsity="down:0.3"))
    [choice] = m.path_choices
    assert choice.path == "dense" and choice.which == (0, 1)
    for L in m.layers:
        assert (L.plan.ffn, L.plan.mode, L.chosen, L.ffn, L.native) == ("graph", "dense", "dense", None, None)
        assert L.rule.rule.mode == "dense" and L.plan.attention == "graph"
    assert "FFN: ONNX Runtime's graph (ONNX Runtime's dense path, as the load's timing chose)" in _paths_note(m)


def test_the_kernels_dense_mode_chosen_by_the_timing_keeps_the_c_attention(silu_file, monkeypatch):
    """A timed rule that loses to the kernel's own dense mode: the rule dropped, the kernel kept
    (dense), the attention still through the C kernels."""
    monkeypatch.setattr(autotune, "choose_path", lambda rule_r, dense_r, keep_below=None: "kernel-dense")
    m = Model(silu_file, RuntimeOptions(threads=1, sparsity="down:0.3"))
    for L in m.layers:
        assert (L.plan.ffn, L.plan.mode, L.ffn.mode, L.chosen) == ("kernel", "dense", "dense", "kernel-dense")
        assert L.plan.attention == "kernels" and L.native is not None
    assert "FFN: fused kernel, dense (as the load's timing chose)" in _paths_note(m)


def test_handed_in_active_sets_are_planned_and_said(silu_file):
    m = Model(silu_file, RuntimeOptions(threads=1, kernels="on", sparsity="down:0.3"))
    m.set_active_sets(lambda i: np.arange(8, dtype=np.int32))
    assert all((L.plan.ffn, L.plan.mode, L.ffn.mode) == ("kernel", "given", "given") for L in m.layers)
    assert "FFN: fused kernel, given (the active sets handed in)" in _paths_note(m)
    m.set_sparsity("")
    assert "given" not in _paths_note(m)


def test_a_kernel_that_refuses_a_layer_carries_its_reason_to_the_note(silu_file, refuse_layer):
    """No silent fallback: the kernel's ValueError is the layer's refusal, its plan's reason and the
    note's text."""
    refuse_layer(0, "layer 0's rows are in a format made up for this test")
    m = Model(silu_file, RuntimeOptions(threads=1, kernels="on", sparsity="down:0.3"))
    L0, L1 = m.layers
    assert L0.ffn is None and L0.refusal.startswith("layer 0's rows") and L0.plan.ffn == "graph"
    assert L1.ffn is not None and L1.plan.ffn == "kernel"
    assert ("layer 0: attention: ONNX Runtime (the layer's FFN runs in its ONNX graph, which computes the attention "
            "too); FFN: ONNX Runtime's graph (layer 0's rows are in a format made up") in _paths_note(m)
