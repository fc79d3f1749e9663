"""The prompt suite: prompt (prefill) speed of pinfer against llama.cpp on the same GGUF, as ratios.

    python -m benchmarks run prompt --model MODEL.gguf --pinf MODEL.pinf \
        --llama-python .venv-llama/bin/python [--tokens 100] [--threads 1,2] [--repeats 5]

Both engines take the same prompt: the first --tokens tokens of the wikitext-2 test text in the
model's vocabulary, from an empty cache. pinfer routes it as its load chose (`--ffn-kernel auto`:
the dense graphs, or the kernel's batch call, in chunks of up to 64 tokens; the rows say which);
llama.cpp evaluates it in batches of n_ubatch tokens (`--llama-ubatch`, default llama-cpp-python's
512: on AMX Xeons that build segfaults there, and the row says so). The protocol is
harness/protocol.py's; each engine is warmed up with the same prompt.
"""

import gc
import time

from . import protocol
from .record import failure, summary


def add_arguments(ap):
    ap.add_argument("--tokens", type=int, default=100, help="prompt length (default 100)")


def pinfer_prompt(model, ids):
    model.reset()
    t0 = time.perf_counter()
    model.forward(ids)
    return len(ids) / (time.perf_counter() - t0)


def routing(model, n):
    """How pinfer runs a prompt of n tokens, from what its load chose."""
    from pinfer.runtime import autotune
    if not model.batches(min(n, autotune.PREFILL_SIZES[-1])):
        return "dense graphs"
    size = autotune.chunk_size(model, n)
    return "kernel batch call" + (f", chunks of {size}" if size < n else "")


def _pinfer(a, threads, ctx):
    from pinfer.runtime.model import Model, RuntimeOptions
    model = Model(a.pinf_path, RuntimeOptions(threads=threads, n_ctx=ctx, device="cpu"))
    ids = protocol.text_ids(model, a.tokens)
    pinfer_prompt(model, ids)           # warm-up
    return model, ids


def measure(a, threads):
    """(pinfer's summary or failure, llama.cpp's, pinfer's route) at one thread count."""
    ctx = max(512, a.tokens)
    loaded, ours_why = protocol.guarded(_pinfer, a, threads, ctx)
    model, ids = loaded if loaded else (None, None)
    llama, theirs_why = protocol.start_llama(a, a.model, threads, ctx=ctx)
    try:
        sides = {}
        if model is not None:
            sides["pinfer"] = lambda: pinfer_prompt(model, ids)
        if llama is not None and ids is not None:
            _, theirs_why = protocol.guarded(llama.prompt, ids)      # its warm-up
            if theirs_why is None:
                sides["llama.cpp"] = lambda: llama.prompt(ids)
        elif llama is not None:
            theirs_why = "no prompt: pinfer's side could not make one (see its row)"
        runs, failed = protocol.alternate(sides, a.repeats, a.settle)
        ours_why = failed.get("pinfer", ours_why)
        theirs_why = failed.get("llama.cpp", theirs_why)
        ours = summary(runs.get("pinfer", [])) if ours_why is None else failure(ours_why)
        theirs = summary(runs.get("llama.cpp", [])) if theirs_why is None else failure(theirs_why)
        return ours, theirs, routing(model, a.tokens) if model is not None else None
    finally:
        if llama is not None:
            llama.close()
        model = None
        gc.collect()


def run(a, rec, pinf_of):
    a.pinf_path = pinf_of(a.model)
    rec["flags"].update(tokens=a.tokens, text=protocol.WIKITEXT.name)
    for t in a.threads:
        ours, theirs, route = measure(a, t)
        row = {"model": a.pinf_path.name, "threads": t, "pinfer": ours, "llama.cpp": theirs, "route": route,
               "ratio": ours["median"] / theirs["median"] if "median" in ours and "median" in theirs else None}
        rec["rows"].append(row)
        for engine in ("pinfer", "llama.cpp"):
            if "failed" in row[engine]:
                rec["failures"].append({"engine": engine, "model": a.model.name, "threads": t,
                                        "reason": row[engine]["failed"]})
        print(f"{row['model']}, {t} thread(s): pinfer {ours}, llama.cpp {theirs}", flush=True)
