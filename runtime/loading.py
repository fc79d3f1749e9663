"""Loading a model's layers: several at a time, and what loading frees handed back to the system;
and every change of a layer's path after Model builds it (which graphs it keeps, autotune's choices,
the note that says them): no other module assigns a model's per-layer lists (tests/test_imports.py)."""

import ctypes
import functools
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pinfer.formats import schema as S
from pinfer.kernels import ColumnFFN

from . import native
from .autotune import PREFILL_SIZES
from .ffn import down_projection
from .options import Note
from .placement import kernel_refusal
from .sparse import LayerRule, Rule, activation_label


def trim_heap():
    """Hand the C heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    Loading frees ONNX Runtime's and NumPy's temporaries, which glibc keeps in its arenas: 1.9 GB
    of the 7B-shaped model's 12.7 GB after load, more with layers loaded on several threads."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


# Layers loading at once, at most: each holds its weights' temporaries while ONNX Runtime packs them,
# so the peak grows with the count. 2 halved the 7B-shaped model's load on 2 cores (39 -> 17 s);
# more were not measured here.
MAX_LOAD_WORKERS = 4


def load_map(workers, reader):
    """map(fn, n) -> [fn(0), ..., fn(n - 1)], `workers` layers at a time, then the file's pages and
    the heap's free ones handed back (PinfReader.release, trim_heap), which keeps the peak during
    load down. Loading a layer is mostly ONNX Runtime packing its weights and copies of the
    kernels' weights, which run without the GIL: the 7B-shaped model loaded in 39 s on one thread.
    The first failure is raised, in layer order."""
    workers = min(workers, MAX_LOAD_WORKERS)

    def run(fn, n):
        if workers <= 1:
            out = [fn(i) for i in range(n)]
        else:
            with ThreadPoolExecutor(workers) as pool:
                out = list(pool.map(fn, range(n)))
        reader.release()
        trim_heap()
        return out
    return run


def drop_graphs(model):
    """Let the dense graphs go where no call takes them, on the CPU: every layer's attention through
    the C kernels (native), its FFN through a fused kernel, and prompts through the kernel's batch
    call at its most tokens (autotune.chunk_size). That is ONNX Runtime's packed copy of each layer's
    attention and gate/up and the ONNX path's down projections: the trained ReLU 7B-shaped model then
    holds 6.2 GB after load, not 12.0 (2 threads, n_ctx 512). ensure_graphs makes them again, before
    any timing or new kernels (Model._place), which take the graphs and the rows they share."""
    if model.options.activation and all(s is not None for s in model.native) and all(model.ffns):
        model.prefill_by_token = PREFILL_SIZES[-1]      # activation sparsity has no graph: prompts by the kernels
        model.unbind()
    if all(s is not None for s in model.native) and all(model.ffns) and model.batches(PREFILL_SIZES[-1]):
        model.layers = [None] * model.cfg.n_layer
        model.downs = [None] * model.cfg.n_layer    # a kernel sharing W_down's rows keeps them (SparseFFN.keep)
    model.reader.release()      # the pages the timing's graph calls read
    trim_heap()


def run_dense(model, layers, path):
    """Layers `layers` dense from now on, as autotune chose: their rule dropped, their FFN the
    kernel's dense mode (path "kernel-dense") or ONNX Runtime's graph ("dense")."""
    for i in layers:
        model.rules[i] = LayerRule(model.reader, model.reader.header, i, Rule("dense"), model.counters)
        model.ffns[i] = model.ffns[i].dense() if path == "kernel-dense" else None


def drop_attention_sessions(model):
    """Let the attention-only sessions go where no layer decodes through the kernel (on the CPU)."""
    if not model.devices.on_device:
        model.attn = None


def map_weights(model):
    """Whether the kernels made from now on read the file's map (RuntimeOptions.mmap): always with
    --mmap, by default where the model is one copy, never with --no-mmap."""
    model.reader.mapped = model.options.mmap is True or (model.options.mmap is None and model.one_copy)


def ensure_graphs(model):
    """The dense graphs that drop_graphs let go, made again (a call takes them, or the rules change:
    the timing runs them and new kernels share W_down's rows with the down projections). A model
    that is no longer one copy reads no more from the map by default: the kernels made from now on
    hold copies, and the graphs' build lets the map's pages go (RuntimeOptions.mmap)."""
    map_weights(model)
    if model.devices.on_device or model.one_copy or all(s is not None for s in model.layers):
        return
    layers, downs = model.layers, model.downs
    model.layers = model.load_map(lambda i: layers[i] if layers[i] is not None else model.devices.session(
        S.LAYER_GRAPH.format(i), model.threads), model.cfg.n_layer)
    model.attention.bind(model.layers)
    model.downs = model.load_map(lambda i: downs[i] if downs[i] is not None else down_projection(
        model.reader, model.cfg, i, model.threads), model.cfg.n_layer)


# Below this many bytes of layer weights ONNX Runtime's packed copy of the dense graphs costs little
# (SmolLM2: about 100 MB), and its batched prompts were faster than the kernel's batch call on small
# rows (SmolLM2, 64 tokens, 1 thread: 357 against 238 tok/s), so such models keep the graphs and
# time the two at load. Above it the graphs' copy would double the weights in memory.
ONE_COPY_MIN_BYTES = 512 << 20


def one_copy(model, modes):
    """Why the model under `modes` cannot hold one copy of its weights (every step through pinfer's
    C kernels, no ONNX Runtime layer graph built), or None where it can: everything on the CPU, the
    default kernels (--ffn-kernel auto, --dense-kernel on), every layer dense (a sparse rule is timed
    against the graphs) and of a kind the C attention and the fused FFN take, and a model large
    enough that the graphs' copy matters (ONE_COPY_MIN_BYTES)."""
    dv, opt, r, cfg = model.devices, model.options, model.reader, model.cfg
    if dv.on_device or dv.ffn != "cpu" or dv.dense != "cpu" or dv.act_at != "cpu" or dv.act_dtype != np.float32:
        return "a device takes part of the model"
    if opt.kernels != "auto" or opt.dense_kernel != "on":
        return "--ffn-kernel or --dense-kernel asks for ONNX Runtime's graphs"
    if any(mode != "dense" for mode in modes):
        return "sparse rules are timed against the dense graphs"
    layer_bytes = sum(e["nbytes"] for name, e in r.tensors.items() if name.startswith("blk."))
    if layer_bytes < ONE_COPY_MIN_BYTES:
        return f"the layers' {layer_bytes / 2**20:.0f} MB are few enough to keep the graphs' copy"
    for i in range(cfg.n_layer):
        why = native.refusal(r, cfg, i) or kernel_refusal(r, cfg, i)
        if why:
            return f"layer {i}: {why}"
    return None


def stream_layers(model, n):
    """Bind the model's steps for a call of n tokens (one batch: see autotune.chunk_size) so that
    each layer's pages of the file's map are let go once it has run. A model that reads its weights
    from the map (RuntimeOptions.mmap) then holds about one layer at a time through the call: the
    converter's verification of a large model. Decoding so would fault every page in again at each
    token, so it is for one call; the next bind_activations of another length undoes it."""
    model.bind_activations(n)
    run = []
    for i, steps in enumerate(model.steps.by_layer):
        names = [name for name in model.reader.tensors if name.startswith(f"blk.{i}.")]
        run += steps + [functools.partial(model.reader.release, *names)]
    model.steps.run = run


class PathNote(Note):
    """The note of every layer's path (path_note)."""


def path_note(model):
    """Where each layer's attention and FFN run, and why not through pinfer's C kernels where they
    do not: one line per run of layers alike (said with -v)."""
    r, cfg, opt = model.reader, model.cfg, model.options
    lines = []
    for i in range(cfg.n_layer):
        if model.native[i] is not None:     # with activation sparsity: the projections by columns, or why not
            qkv, out = (c.q is not None for c in model.native[i].cols)
            attn = "C kernels" + ("" if not opt.activation else {(True, True): ", by columns", (True, False): (
                ", q/k/v by columns, the output by rows (not q4, or level 0)"), (False, True): ", q/k/v by rows (not "
                "q4, or level 0), the output by columns", (False, False): ", by rows (not q4, or level 0)"}[qkv, out])
        else:
            why = ("--dense-kernel off" if opt.dense_kernel == "off" else native.refusal(r, cfg, i)
                   or "the dense part is not on the CPU in float32")
            attn = f"ONNX Runtime ({why})"
        entry = model.ffns[i] if model.ffns else None
        if entry is not None:
            ffn = (f"columns, activation sparsity {activation_label(r.header, opt.activation)}"
                   if isinstance(entry.kernel, ColumnFFN) else f"fused kernel, {entry.mode}")
        else:
            why = (model.rules[i].refusal or kernel_refusal(r, cfg, i)
                   or ("--ffn-kernel off" if opt.kernels == "off" else "ONNX Runtime's dense path, as the load chose"))
            ffn = f"ONNX Runtime's graph ({why})"
        line = f"attention: {attn}; FFN: {ffn}"
        if lines and lines[-1][1] == line:
            lines[-1][0][1] = i
        else:
            lines.append(([i, i], line))
    return PathNote("paths:\n" + "\n".join(f"  layer{'s' * (a != b)} {a}{f'-{b}' * (a != b)}: {line}"
                                            for (a, b), line in lines), quiet=True)


def note_paths(model):
    """The model's notes with its path_note in place of an earlier one (the rules or paths changed),
    and with activation sparsity the levels it runs (said without -v)."""
    model.notes[:] = [n for n in model.notes if not isinstance(n, PathNote)] + [path_note(model)]
    act = model.options.activation
    if act:
        rec = model.reader.header["sparsity"].get("activation") if act == "auto" else None
        said = f"activation sparsity {activation_label(model.reader.header, act)}"
        budget = rec.get("max_ppl_increase") if isinstance(rec, dict) else None
        if isinstance(budget, float) and math.isfinite(budget):     # a stranger's file: a float, or nothing said
            said += f": the converter's choice within +{budget:.1%} held-out perplexity"
        model.notes.append(PathNote(said + " (pinfer inspect shows what it measured)"))
