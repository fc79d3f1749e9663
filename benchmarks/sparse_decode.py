"""Decode speed and quality of each sparsity mode of a converted model, in one process.

    python benchmarks/sparse_decode.py MODEL.pinf [--modes dense,file,down:0.3] [--threads 1,2]
        [--tokens 64] [--repeats 3] [--ppl-tokens 512] [--llama-python VENV/bin/python --gguf SRC.gguf]

For every mode and thread count, the model decodes `--tokens` tokens one at a time after a short
prompt, `--repeats` times with the modes alternating, and the median is reported as tokens/s and
as a ratio to dense on the same thread count. Sparse modes decode through pinfer's fused FFN kernel
("kernel"), through the ONNX graph plus the NumPy rule ("numpy"), and as `--ffn-kernel auto` (the
default) chooses at load ("auto: kernel" or "auto: dense", from its own timing). Perplexity
is teacher-forced one token at a time (so it runs the decode path being timed) over the first
`--ppl-tokens` tokens of the wikitext test text. "file" is the file's own per-layer choice.
With --llama-python and --gguf (the file the model was converted from), llama.cpp decodes the
same GGUF in that environment (benchmarks/llamacpp_side.py) after each round of pinfer's modes,
and scores the same token ids teacher-forced in one batch.
"""

import argparse
import math
import statistics
from pathlib import Path

import numpy as np

import engines  # benchmarks/ is on sys.path (benchmarks/__init__.py)

from pinfer.runtime import bench
from pinfer.runtime.model import Model, RuntimeOptions
from pinfer.runtime.perplexity import log_softmax_at
from pinfer.runtime.tokenizer import Tokenizer

from harness import WIKITEXT as DEFAULT_TEXT  # benchmarks/ is on sys.path (benchmarks/__init__.py)


def decode_rate(model, prompt, tokens):
    """tok/s of `tokens` steps fed ids 1000, 1001, ... after `prompt` (runtime.bench's loop)."""
    return bench.decode_rate(model, tokens, prompt, list(range(1000, 1000 + tokens)))


def decode_ppl(model, ids):
    model.reset()
    model.counters.reset()
    nll = 0.0
    for i in range(len(ids) - 1):
        logits = model.forward([ids[i]])
        nll -= float(log_softmax_at(logits, np.asarray(ids[i + 1:i + 2]))[0])
    return math.exp(nll / (len(ids) - 1)), model.counters.fractions()


def llamacpp(what, a, threads, **args):
    """One call of benchmarks/llamacpp_side.py in the llama-cpp-python environment; its JSON."""
    return engines.llamacpp(a.llama_python, what, a.gguf, threads, **args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--modes", default="dense,file")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ppl-tokens", type=int, default=512)
    ap.add_argument("-f", "--file", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--llama-python", help="python of an environment with llama-cpp-python")
    ap.add_argument("--gguf", type=Path, help="the GGUF the model was converted from, for llama.cpp")
    a = ap.parse_args(argv)
    if bool(a.llama_python) != bool(a.gguf):
        ap.error("--llama-python and --gguf go together: llama.cpp runs the GGUF the model was converted from")

    variants = []
    for mode in a.modes.split(","):
        override = "" if mode == "file" else mode
        variants += [(mode, "onnx" if mode == "dense" else "numpy", override, "off")]
        if mode != "dense":
            variants += [(mode, "kernel", override, "on"), (mode, "auto", override, "auto")]
    n_ctx = 128 + max(a.tokens, a.ppl_tokens)     # the prompt: 6 tokens for SmolLM2, ~24 for byte-level vocabularies
    rows = []
    for threads in map(int, a.threads.split(",")):
        models = [Model(a.model, RuntimeOptions(n_ctx=n_ctx, threads=threads, sparsity=o, kernels=k, device="cpu"))
                  for _, _, o, k in variants]
        tok = Tokenizer.from_spec(models[0].tokenizer_spec)
        prompt = tok.encode("The capital of France is")
        rates = [[] for _ in variants]
        llama = []
        for _ in range(a.repeats):
            for i, m in enumerate(models):
                rates[i].append(decode_rate(m, prompt, a.tokens))
            if a.llama_python:
                llama.append(llamacpp("decode", a, threads, n=a.tokens)["tok_s"])
        text_ids = tok.encode(a.file.read_text(encoding="utf-8")[:20000])[:a.ppl_tokens] if a.ppl_tokens else []
        dense_rate = statistics.median(rates[0])
        for (mode, path, override, _), m, r in zip(variants, models, rates):
            if path == "auto":
                path = "auto: " + "+".join(sorted({c.path for c in m.path_choices}) or ["dense"])
            ppl, (gu, dn) = decode_ppl(m, text_ids) if threads == 1 and text_ids else (float("nan"), (math.nan,) * 2)
            # the file's rules as loaded: --ffn-kernel auto may have dropped them on this model
            names = models[variants.index((mode, "numpy", override, "off"))].sparsity_names if mode != "dense" else []
            rows.append((threads, f"{mode} ({', '.join(names)})" if mode == "file" else mode, path,
                         statistics.median(r), statistics.median(r) / dense_rate, ppl, gu, dn))
        if llama:
            ppl = llamacpp("score", a, 1, ids=",".join(map(str, text_ids)))["ppl"] if threads == 1 and text_ids else math.nan
            rows.append((threads, "llama.cpp (dense, same GGUF)", "llama.cpp", statistics.median(llama),
                         statistics.median(llama) / dense_rate, ppl, math.nan, math.nan))
    print(f"{a.model.name}: {a.tokens} decoded tokens, median of {a.repeats}; perplexity teacher-forced over "
          f"{a.ppl_tokens} tokens of {a.file.name} (1 thread)\n")
    print("| threads | mode | FFN path | tok/s | vs dense | PPL | gate/up rows | down rows |")
    print("| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for t, mode, path, rate, ratio, ppl, gu, dn in rows:
        cells = ["-" if math.isnan(v) else format(v, spec) for v, spec in ((ppl, ".3f"), (gu, ".1%"), (dn, ".1%"))]
        print(f"| {t} | {mode} | {path} | {rate:.1f} | {ratio:.2f}x | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
