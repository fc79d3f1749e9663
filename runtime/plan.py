"""The planner: what runs each layer and why. decide() is the one function that chooses a layer's
path (a LayerPlan: where its attention and FFN run, with the reason); a Layer holds that plan and
the objects that run it, one per layer in model.layers. The load builds the layers here, and every
later change (the rules, the load's timing, the graphs kept or let go) makes new Layers here: no
other module assigns a model's layers (tests/test_imports.py), the objects follow the plans (a
C attention step only where the plan runs the attention through the kernels), and what decide()
says is what the path note says (note()). Two choices are the model's, not a layer's: whether it
holds one copy of its weights (loading.one_copy) and which prompts take the kernels' batch calls
(autotune.choose_prefill, drop_graphs)."""

import math
from dataclasses import dataclass, replace

import numpy as np

from pinfer.formats import schema as S

from . import autotune, ffn, native
from .loading import map_weights, one_copy, trim_heap
from .options import Note
from .placement import kernel_refusal
from .sparse import LayerFfn, LayerRule, Rule, activation_label, activation_levels

# how the C attention's projections run under activation sparsity, from (q/k/v by columns, output by columns)
_COLUMNS = {(True, True): "by columns", (True, False): "q/k/v by columns, the output by rows (not q4, or level 0)",
            (False, True): "q/k/v by rows (not q4, or level 0), the output by columns",
            (False, False): "by rows (not q4, or level 0)"}


@dataclass(frozen=True)
class LayerPlan:
    """Where a layer runs and why. attention: "kernels" (pinfer's C kernels) or "graph" (ONNX
    Runtime); ffn: "columns" (activation sparsity), "kernel" (the fused kernel under `mode`) or
    "graph" (ONNX Runtime's graph, then the NumPy rule `mode` and the down projection). The whys:
    for a graph, why not the kernels; otherwise how they run, or ""."""
    attention: str
    attention_why: str
    ffn: str
    mode: str
    ffn_why: str

    def describe(self):
        attn = ("C kernels" + f", {self.attention_why}" * bool(self.attention_why) if self.attention == "kernels"
                else f"ONNX Runtime ({self.attention_why})")
        ffn = (f"columns, {self.ffn_why}" if self.ffn == "columns" else
               f"fused kernel, {self.mode}" + f" ({self.ffn_why})" * bool(self.ffn_why) if self.ffn == "kernel"
               else f"ONNX Runtime's graph ({self.ffn_why})")
        return f"attention: {attn}; FFN: {ffn}"


@dataclass(frozen=True)
class Layer:
    """One layer: its plan; its rule (sparse.LayerRule); its fused FFN (sparse.LayerFfn) or None;
    its C attention step (native.py) or None; ONNX Runtime's layer graph (`graph`; attention only
    with the dense part on a device), the ONNX path's down projection (`down`) and the
    attention-only session (`attn`), each None where not made or let go; `refusal`: why the FFN
    kernel refused the layer when built; `chosen`: the path the load's timing chose, or None."""
    plan: LayerPlan = None
    rule: object = None
    ffn: object = None
    native: object = None
    graph: object = None
    down: object = None
    attn: object = None
    refusal: str = None
    chosen: str = None


def attention_refusal(model, i=None):
    """Why layer i's attention (None: the head) cannot run through the C kernels, or None."""
    dv = model.devices
    if model.options.dense_kernel != "on":
        return "--dense-kernel off"
    why = native.refusal(model.reader, model.cfg, i)
    if why is None and (dv.act_at != "cpu" or dv.act_dtype != np.float32):
        return "the dense part is not on the CPU in float32"
    return why


def head(model):
    """The head through the C kernels (native.Head), or None where attention_refusal says why not."""
    return None if attention_refusal(model) else native.head(model.reader, model.cfg, model.threads)


def decide(model, i, layer):
    """Layer i's LayerPlan from the options, the file, its rule, the load's timing (layer.chosen) and
    what its kernel refused (layer.refusal): the one place a layer's path is chosen. A layer whose
    FFN runs in its ONNX graph runs its attention there too (the graph computes both). Raises
    ValueError, one sentence, for options that cannot run together."""
    ffn_path = _ffn_path(model, i, layer)
    why = attention_refusal(model, i)
    if why is None and ffn_path[0] == "graph":
        why = "the layer's FFN runs in its ONNX graph, which computes the attention too"
    attn = ("graph", why) if why else ("kernels", _columns_said(model, i))
    return LayerPlan(*attn, *ffn_path)


def _columns_said(model, i):
    """How layer i's C attention runs its projections under activation sparsity, or ""."""
    act = model.options.activation
    return _COLUMNS[native.by_columns(model.reader, i, act)] if act else ""


def _ffn_path(model, i, layer):
    """(path, mode, why) of layer i's FFN (decide)."""
    r, opt, dv = model.reader, model.options, model.devices
    if layer.chosen == "given":
        return "kernel", "given", "the active sets handed in"
    mode = layer.rule.rule.mode
    act = opt.activation and activation_levels(r.header, opt.activation)
    if act:
        if opt.kernels == "off" or dv.ffn != "cpu" or dv.on_device:
            raise ValueError("activation sparsity runs through pinfer's CPU kernels; drop --ffn-kernel off and "
                             "run the FFN on the CPU (--device cpu)")
        if mode not in ("dense", "down"):
            raise ValueError(f"activation sparsity replaces the dense and down rules, not {layer.rule.rule.name}; "
                             "pass --sparsity dense with it")
        if act["gate_up"] or act["down"]:
            return "columns", "down", f"activation sparsity {activation_label(r.header, opt.activation)}"
        mode = "dense"      # level 0 by rows, the kernel's dense mode (the converter measured its levels so)
    device = (model.plan.hot[i] if model.plan else 0) or dv.on_device    # the GPU's decode has no other FFN path
    why = kernel_refusal(r, model.cfg, i) or layer.refusal
    if why:
        return "graph", mode, why
    if layer.chosen == "dense":
        return "graph", "dense", "ONNX Runtime's dense path, as the load's timing chose"
    if layer.chosen == "kernel-dense":
        return "kernel", "dense", "as the load's timing chose"
    if opt.kernels == "off" and not device:
        return "graph", mode, "--ffn-kernel off"
    if mode == "dense" and not act and not device:
        if opt.kernels == "on":
            return "graph", mode, "--ffn-kernel on takes sparse layers; dense ones run ONNX Runtime's dense path"
        if not ffn.times_dense(model, layer, attention_refusal(model, i) is None):
            return "graph", mode, ("ONNX Runtime's dense path: timing the kernel against it would hold a second copy "
                                   "of the attention weights (ffn.times_dense)")
    return "kernel", mode, ""


def _ffn(model, i, layer):
    """The objects of layer i's FFN under its plan: a Layer with its ffn (or None: the graph) and
    refusal, planned again where the kernel refuses the layer."""
    p = layer.plan
    if p.mode == "given":       # benchmarks' handed-in sets: a kernel that refuses is an error
        return replace(layer, ffn=LayerFfn(ffn.layer_kernel(model, i, "given"), "given"))
    if p.ffn == "columns":
        return replace(layer, ffn=ffn.column_ffn(model, i, activation_levels(model.reader.header, model.options.activation)))
    if p.ffn == "graph":
        return replace(layer, ffn=None)
    try:
        kernel = ffn.layer_kernel(model, i, p.mode)
    except ValueError as e:     # a format or shape the kernel lacks: the graph runs it, and the note says why
        layer = replace(layer, refusal=str(e), ffn=None)
        return replace(layer, plan=decide(model, i, layer))
    rule = layer.rule
    if p.mode != rule.rule.mode:        # level 0 under activation sparsity: the kernel's dense mode
        return replace(layer, ffn=LayerFfn(kernel, p.mode))
    thr = float(rule.threshold) if rule.threshold is not None else 0.0
    pthr = float(rule.pred[3]) if rule.pred is not None else 0.0
    return replace(layer, ffn=LayerFfn(kernel, p.mode, thr, pthr))


def build(model):
    """model.layers at load, before any rule: the layer graphs and down projections (none where the
    model holds one copy: loading.one_copy). The C attention steps follow the plans (place)."""
    r, cfg, dv, n = model.reader, model.cfg, model.devices, model.cfg.n_layer
    if model.one_copy:
        graphs = downs = [None] * n
        map_weights(model)      # and by default the kernels read the file's map
    else:
        graphs = model.load_map(lambda i: dv.session(S.LAYER_GRAPH.format(i), model.threads,
                                                     attention_only=dv.on_device), n)
        downs = [None] * n if dv.on_device else model.load_map(lambda i: ffn.down_projection(r, cfg, i, model.threads), n)
    model.layers = [Layer(graph=g, down=d, attn=g if dv.on_device else None)   # on a device the graphs are
                    for g, d in zip(graphs, downs)]                             # attention only
    model.attention.bind(graphs)


def _attention(model):
    """The C attention steps of the layers whose plans run their attention through the kernels,
    made where missing, and let go where a plan no longer does; the attention-only sessions of the
    layers whose FFN runs through a kernel but whose attention the C kernels do not take."""
    r, cfg, dv, n = model.reader, model.cfg, model.devices, model.cfg.n_layer
    want = {i for i, L in enumerate(model.layers) if L.plan.attention == "kernels" and L.native is None}
    steps = native.attention_steps(r, cfg, model.threads, model.load_map, want, model.options.activation,
                                   model.counters.attn_kept) if want else [None] * n
    model.layers = [replace(L, native=steps[i] if i in want else L.native if L.plan.attention == "kernels" else None)
                    for i, L in enumerate(model.layers)]
    sessions = {i for i, L in enumerate(model.layers) if L.attn is None and L.plan.ffn != "graph"
                and L.plan.attention == "graph"}
    if sessions and not dv.on_device and not model.one_copy:
        model.layers = model.load_map(lambda i: replace(model.layers[i], attn=dv.session(
            S.LAYER_GRAPH.format(i), model.threads, attention_only=True)) if i in sessions else model.layers[i], n)
        model.attention.bind([L.attn for L in model.layers])


def set_rules(model, override=""):
    """Every layer under the rule `override` (RuntimeOptions.sparsity), or the file's per-layer modes
    with "": their FFNs built, and with --ffn-kernel auto the paths timed and the choice applied
    (autotune), the graphs no call takes let go and the path note said."""
    n, r = model.cfg.n_layer, model.reader
    rules = [LayerRule(r, r.header, i, Rule.of_layer(r.header, i, override), model.counters) for i in range(n)]
    place(model, rules)
    model.path_choices = []      # what --ffn-kernel auto measured and chose, one PathChoice per rule
    dv = model.devices
    if model.options.kernels == "auto" and dv.ffn == "cpu" and not dv.on_device and any(L.ffn for L in model.layers):
        chosen = autotune.choose_paths(model)       # what it timed: the planner applies it
        for c in chosen:
            if c.tokens and c.path != "kernel":
                _run_dense(model, c.which, c.path)
        _attention(model)       # a layer now dense in its graph runs its attention there
        model.path_choices = list(chosen)
        model.unbind()
        if any(L.ffn for L in model.layers):
            chosen += [p for p in (autotune.choose_prefill(model),) if p is not None]
        else:       # no layer decodes through the kernel: no attention-only sessions
            model.layers = [replace(L, attn=None) for L in model.layers]
        model.notes += chosen
    drop_graphs(model)
    note(model)


def place(model, rules=None, hotness=None):
    """Plan the hot neurons for the rules' modes (where a split device is in use), then build the
    layers' FFNs and, for them, the attention-only sessions; prompts go through the dense graphs
    until autotune says so. rules: a LayerRule per layer, or None: every layer decodes the active
    sets handed in (Model.set_active_sets), its rule kept."""
    n, dv = model.cfg.n_layer, model.devices
    modes = ["given"] * n if rules is None else [rule.rule.mode for rule in rules]
    model.one_copy = model.one_copy and one_copy(model, modes) is None
    ensure_graphs(model)
    dv.release([L.ffn for L in model.layers])
    split = dv.ffn != "cpu"
    model.plan = dv.plan(modes, hotness) if split else None

    def make(i):
        layer = replace(model.layers[i], rule=model.layers[i].rule if rules is None else rules[i], ffn=None,
                        refusal=None, chosen="given" if rules is None else None)
        return _ffn(model, i, replace(layer, plan=decide(model, i, layer)))
    model.layers = model.load_map(make, n)
    if model.one_copy and not all(L.ffn for L in model.layers):    # a layer the kernel refused: the graphs run it
        model.one_copy = False
        ensure_graphs(model)
    if split:
        dv.report(model.plan)
    _attention(model)
    if rules is None:
        note(model)
    model.prefill_by_token, model.prefill_times = 0, []
    model.unbind()      # the bound steps call the rules and kernels


def _run_dense(model, which, path):
    """Layers `which` dense from now on, as the load's timing chose: their rule dropped, their FFN
    the kernel's dense mode (path "kernel-dense") or ONNX Runtime's graph ("dense")."""
    for i in which:
        L = model.layers[i]
        L = replace(L, rule=LayerRule(model.reader, model.reader.header, i, Rule("dense"), model.counters),
                    ffn=L.ffn.dense() if path == "kernel-dense" else None, chosen=path)
        model.layers[i] = replace(L, plan=decide(model, i, L))


def drop_graphs(model):
    """Let the dense graphs go where no call takes them, on the CPU: every layer's attention through
    the C kernels (native), its FFN through a fused kernel, and prompts through the kernel's batch
    call at its most tokens (autotune.chunk_size). That is ONNX Runtime's packed copy of each layer's
    attention and gate/up and the ONNX path's down projections: the trained ReLU 7B-shaped model then
    holds 6.2 GB after load, not 12.0 (2 threads, n_ctx 512). ensure_graphs makes them again, before
    any timing or new kernels (place), which take the graphs and the rows they share."""
    kernels = all(L.native is not None and L.ffn is not None for L in model.layers)
    if model.options.activation and kernels:
        model.prefill_by_token = autotune.PREFILL_SIZES[-1]     # activation sparsity has no graph: prompts by the kernels
        model.unbind()
    if kernels and model.batches(autotune.PREFILL_SIZES[-1]):
        # a kernel sharing W_down's rows keeps them (SparseFFN.keep)
        model.layers = [replace(L, graph=None, down=None) for L in model.layers]
    model.reader.release()      # the pages the timing's graph calls read
    trim_heap()


def ensure_graphs(model):
    """The dense graphs that drop_graphs let go, made again (a call takes them, or the rules change:
    the timing runs them and new kernels share W_down's rows with the down projections). A model
    that is no longer one copy reads no more from the map by default: the kernels made from now on
    hold copies, and the graphs' build lets the map's pages go (RuntimeOptions.mmap)."""
    map_weights(model)
    if model.devices.on_device or model.one_copy or all(L.graph is not None for L in model.layers):
        return
    r, cfg, threads = model.reader, model.cfg, model.threads

    def make(i):
        L = model.layers[i]
        return replace(L, graph=model.devices.session(S.LAYER_GRAPH.format(i), threads) if L.graph is None else L.graph,
                       down=ffn.down_projection(r, cfg, i, threads) if L.down is None else L.down)
    model.layers = model.load_map(make, cfg.n_layer)
    model.attention.bind([L.graph for L in model.layers])


class PathNote(Note):
    """The note of every layer's path (note)."""


def note(model):
    """The model's notes with the path note (every layer's LayerPlan, one line per run of layers
    alike; said with -v) in place of an earlier one, and with activation sparsity the levels it
    runs (said without -v)."""
    lines = []
    for i, L in enumerate(model.layers):
        line = L.plan.describe()
        if lines and lines[-1][1] == line:
            lines[-1][0][1] = i
        else:
            lines.append(([i, i], line))
    said = "paths:\n" + "\n".join(f"  layer{'s' * (a != b)} {a}{f'-{b}' * (a != b)}: {line}" for (a, b), line in lines)
    model.notes[:] = [n for n in model.notes if not isinstance(n, PathNote)] + [PathNote(said, quiet=True)]
    act = model.options.activation
    if act:
        rec = model.reader.header["sparsity"].get("activation") if act == "auto" else None
        said = f"activation sparsity {activation_label(model.reader.header, act)}"
        budget = rec.get("max_ppl_increase") if isinstance(rec, dict) else None
        if isinstance(budget, float) and math.isfinite(budget):     # a stranger's file: a float, or nothing said
            said += f": the converter's choice within +{budget:.1%} held-out perplexity"
        model.notes.append(PathNote(said + " (pinfer inspect shows what it measured)"))
