"""Loading a model's layers: several at a time, and what loading frees handed back to the system;
whether the model holds one copy of its weights, and whether its kernels read the file's map."""

import ctypes
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from . import native
from .placement import kernel_refusal


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


def map_weights(model):
    """Whether the kernels made from now on read the file's map (RuntimeOptions.mmap): always with
    --mmap, by default where the model is one copy, never with --no-mmap."""
    model.reader.mapped = model.options.mmap is True or (model.options.mmap is None and model.one_copy)


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
