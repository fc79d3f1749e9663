"""llama.cpp's side of the comparisons, through llama-cpp-python (run in its own environment:
`pip install llama-cpp-python` builds llama.cpp from source). Prints one JSON object.

  python benchmarks/llamacpp_side.py perplexity MODEL.gguf TEXT --ctx 512 --chunks N
  python benchmarks/llamacpp_side.py greedy MODEL.gguf --ids 504,3575 -n 64
  python benchmarks/llamacpp_side.py score MODEL.gguf --ids 504,3575,...
  python benchmarks/llamacpp_side.py decode MODEL.gguf --threads 1 -n 128
  python benchmarks/llamacpp_side.py worker MODEL.gguf --threads 1     # then "decode N" lines on stdin
  python benchmarks/llamacpp_side.py load MODEL.gguf --threads 2 -n 8   # one load's memory and a short decode
  python benchmarks/llamacpp_side.py info -                             # version and build flags
  python benchmarks/llamacpp_side.py quantize SRC.gguf DST.gguf --type Q4_0

--ubatch N sets llama.cpp's n_ubatch (its physical batch: how many tokens one evaluation takes at
most); without it llama-cpp-python's default (512, capped at n_batch). On AMX Xeons this build's
batched evaluation (n_ubatch above 1) segfaults; `--ubatch 1` evaluates a prompt token by token.
Nothing here imports pinfer: it runs in llama-cpp-python's own environment.
"""

import argparse
import json
import math
import time

import numpy as np
from llama_cpp import Llama


UBATCH = None       # --ubatch: llama.cpp's n_ubatch, None for llama-cpp-python's default


def load(path, ctx, threads, logits_all=False):
    extra = {} if UBATCH is None else {"n_ubatch": UBATCH}
    return Llama(model_path=path, n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=ctx,
                 logits_all=logits_all, verbose=False, **extra)


def last_logits(llm):
    """Logits of the last evaluated token, read from the context (llama-cpp-python keeps them in
    .scores only with logits_all)."""
    return np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))


def perplexity(a):
    llm = load(a.model, a.ctx, a.threads, logits_all=True)
    text = open(a.text, encoding="utf-8").read()
    tokens = llm.tokenize(text.encode(), add_bos=False, special=False)
    n = min(a.chunks, len(tokens) // a.ctx)
    first = a.ctx // 2
    nll = []
    for c in range(n):
        chunk = tokens[c * a.ctx:(c + 1) * a.ctx]
        llm.reset()
        llm.eval(chunk)
        logits = np.asarray(llm.scores[:a.ctx], np.float64)[first:a.ctx - 1]
        m = logits.max(axis=1, keepdims=True)
        lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
        nll.append(lse - logits[np.arange(len(logits)), chunk[first + 1:]])
    nll = np.concatenate(nll)
    ppl = math.exp(nll.mean())
    return {"ppl": ppl, "stderr": ppl * nll.std(ddof=1) / math.sqrt(len(nll)), "chunks": n, "tokens": len(nll)}


def greedy(a):
    llm = load(a.model, 512, a.threads)
    ids = [int(x) for x in a.ids.split(",")]
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(a.n):
        t = int(np.argmax(last_logits(llm)))
        out.append(t)
        llm.eval([t])
    return {"generated": out}


def score(a):
    """Perplexity of the given token ids, teacher-forced from the first: every position but the
    first scored, as pinfer's sparse_decode.py scores its modes on the same ids."""
    ids = [int(x) for x in a.ids.split(",")]
    llm = load(a.model, max(a.ctx, len(ids)), a.threads, logits_all=True)
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[:len(ids) - 1], np.float64)
    m = logits.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))
    nll = lse - logits[np.arange(len(ids) - 1), ids[1:]]
    return {"ppl": math.exp(nll.mean()), "tokens": len(nll)}


def decode(a):
    """Decode speed: prompt, then n greedy tokens, each one llama_decode of a single token."""
    llm = load(a.model, 512, a.threads)
    dt = decode_loop(llm, llm.tokenize(b"The capital of France is", add_bos=False), a.n)
    return {"tokens": a.n, "seconds": dt, "tok_s": a.n / dt}


def decode_loop(llm, prompt, n):
    """Seconds for n greedy tokens after `prompt`, each one llama_decode of a single token; the prompt
    too goes in one token a call: on AMX Xeons a batched evaluation (n_ubatch above 1) of this build
    segfaults (the Qwen3-shaped synthetic file's 5-token prompt did)."""
    llm.reset()
    for tok in prompt:
        llm.eval([tok])
    t = int(np.argmax(last_logits(llm)))
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([t])
        t = int(np.argmax(last_logits(llm)))
    return time.perf_counter() - t0


def worker(a):
    """Load once, warm up, then answer each "decode N" line of stdin (N greedy tokens after a short
    prompt) or "prompt ID ID ..." line (those ids as one prompt, from an empty cache, in batches
    of --ctx) with one JSON line, so that a benchmark can alternate warm runs of both engines."""
    import sys
    llm = load(a.model, a.ctx, a.threads)
    prompt = llm.tokenize(b"The capital of France is", add_bos=False)
    decode_loop(llm, prompt, 16)
    print(json.dumps({"ready": True, "n_ubatch": llm.context_params.n_ubatch}), flush=True)
    for line in sys.stdin:
        what, *args = line.split()
        if what == "prompt":
            ids = [int(i) for i in args]
            llm.reset()                 # eval drops the cache past n_tokens, here all of it
            t0 = time.perf_counter()
            llm.eval(ids)
            n, dt = len(ids), time.perf_counter() - t0
        else:
            n = int(args[0])
            dt = decode_loop(llm, prompt, n)
        print(json.dumps({"tokens": n, "seconds": dt, "tok_s": n / dt}), flush=True)
    return None


def load_once(a):
    """One load in this (fresh) process, its memory, then a greedy decode of -n tokens after a
    5-token prompt, one token a call: load seconds, VmRSS/VmHWM/RssAnon/RssFile after load, the peak
    after decode, tok/s (benchmarks' memory suite; mmap as llama.cpp's default)."""
    from harness.record import MEMORY_PROMPT, process_memory     # benchmarks/ is this script's folder
    t0 = time.perf_counter()
    llm = load(a.model, a.ctx, a.threads)
    seconds = time.perf_counter() - t0
    mem = process_memory()
    dt = decode_loop(llm, MEMORY_PROMPT, a.n)
    return {"load_s": seconds, **mem, "peak_after_decode": process_memory()["VmHWM"], "tok_s": a.n / dt,
            "n_ubatch": llm.context_params.n_ubatch}


def info(a):
    import llama_cpp
    return {"version": llama_cpp.__version__, "system_info": llama_cpp.llama_print_system_info().decode().strip()}


def quantize(a):
    """DST (the `text` argument) from MODEL re-quantized by llama.cpp's own quantizer to --type."""
    import ctypes

    import llama_cpp
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{a.type.upper()}")
    params.allow_requantize = True
    params.nthread = a.threads
    rc = llama_cpp.llama_model_quantize(a.model.encode(), a.text.encode(), ctypes.byref(params))
    return {"rc": rc, "out": a.text}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["perplexity", "greedy", "score", "decode", "worker", "load", "info", "quantize"])
    p.add_argument("model")
    p.add_argument("text", nargs="?")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--chunks", type=int, default=100)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ids", default="")
    p.add_argument("-n", type=int, default=64)
    p.add_argument("--type", default="Q4_0")
    p.add_argument("--ubatch", type=int, default=None, help="llama.cpp's n_ubatch (default: llama-cpp-python's)")
    a = p.parse_args()
    global UBATCH
    UBATCH = a.ubatch
    out = {"perplexity": perplexity, "greedy": greedy, "score": score, "decode": decode, "worker": worker,
           "load": load_once, "info": info, "quantize": quantize}[a.what](a)
    if out is not None:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
