"""The quality suite: perplexity of pinfer and of llama.cpp on the same model and text.

    python -m benchmarks run quality --model MODEL.gguf --pinf MODEL.pinf \
        --llama-python .venv-llama/bin/python [--chunks 16] [--ctx 512] [--threads 2]

llama.cpp's protocol on both sides (pinfer.runtime.perplexity and benchmarks/llamacpp_side.py
perplexity): the wikitext-2 test text (harness.WIKITEXT, or --text) tokenized once, cut into
chunks of --ctx tokens, each run from an empty cache, the second half of each chunk's predictions
scored. pinfer runs the file as it loads by default (its own rules). llama.cpp evaluates each chunk
in batches of n_ubatch tokens: 1 here unless --llama-ubatch says otherwise (a perplexity is no
race, and on AMX Xeons its batched evaluation segfaults). The ratio is pinfer's perplexity over
llama.cpp's; the seconds are each engine's whole run, load included (not a speed figure).
"""

import time
from pathlib import Path

import engines

from . import WIKITEXT


def add_arguments(ap):
    ap.add_argument("--chunks", type=int, default=16, help="chunks of --ctx tokens scored (default 16)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--text", type=Path, default=WIKITEXT, help="the text (default: the wikitext-2 test text)")


def pinfer_ppl(pinf, text, ctx, chunks, threads):
    from pinfer.runtime.model import Model, RuntimeOptions
    from pinfer.runtime.perplexity import perplexity

    from .protocol import tokenizer_of
    t0 = time.perf_counter()
    m = Model(pinf, RuntimeOptions(threads=threads, n_ctx=ctx, device="cpu"))
    r = perplexity(m, tokenizer_of(m), text.read_text(encoding="utf-8"), ctx, chunks)
    return {"ppl": r.ppl, "stderr": r.stderr, "chunks": r.chunks, "tokens": r.tokens_scored,
            "seconds": time.perf_counter() - t0}


def llama_ppl(a, threads):
    t0 = time.perf_counter()
    out = engines.llamacpp(a.llama_python, "perplexity", a.model, threads, a.text, ubatch=a.llama_ubatch,
                           ctx=a.ctx, chunks=a.chunks)
    return {**out, "seconds": time.perf_counter() - t0}


def run(a, rec, pinf_of):
    from . import protocol
    from .record import NOT_AVAILABLE
    if a.llama_ubatch is None:
        a.llama_ubatch = 1
    pinf = pinf_of(a.model)
    rec["flags"].update(chunks=a.chunks, ctx=a.ctx, text=a.text.name)
    for t in a.threads:
        for engine in ("pinfer", "llama.cpp"):
            if engine == "pinfer":
                out, why = protocol.guarded(pinfer_ppl, pinf, a.text, a.ctx, a.chunks, t)
            else:
                out, why = protocol.guarded(llama_ppl, a, t) if a.llama_python else (None, NOT_AVAILABLE)
            name = pinf.name if engine == "pinfer" else a.model.name
            rec["rows"].append({"model": name, "engine": engine, "threads": t, **(out or {"failed": why})})
            if why:
                rec["failures"].append({"engine": engine, "model": name, "threads": t, "reason": why})
            print(f"{engine}, {t} thread(s): {out or why}", flush=True)
        ours, theirs = rec["rows"][-2:]
        if "ppl" in ours and "ppl" in theirs:
            ours["ratio"] = ours["ppl"] / theirs["ppl"]
