"""Decode speed of pinfer against llama.cpp on the same GGUF, in one run, as ratios.

    python benchmarks/smollm2_vs_llamacpp.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-python .venv-llama/bin/python [--pinf converted.pinf] [--tokens 128] [--repeats 3]

pinfer runs `--pinf` (e.g. the default `pinfer convert` output, with its per-layer sparsity) or,
without it, a dense conversion made on the spot (`--sparsity none`, seconds).

llama.cpp runs through llama-cpp-python in its own environment (benchmarks/llamacpp_side.py);
the two sides alternate, `--repeats` times per thread count, and the median of each is reported.
Both decode greedily after the same short prompt, one token per call. The table also gives the
weight bytes each pinfer token reads, the effective bandwidth, and the time per token that
pinfer spends in Python outside ONNX Runtime and its kernels.
"""

import argparse
import contextlib
import io
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import engines  # noqa: E402  benchmarks/ is on sys.path when a script here runs

from pinfer.converter.convert import ConvertOptions, convert
from pinfer.converter.passes import DENSE
from pinfer.runtime import bench
from pinfer.runtime.model import Model, RuntimeOptions

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary


def weight_bytes_per_token(model):
    return bench.weight_bytes_per_token(model.reader, model.cfg)


def pinfer_decode(model, n):
    model.reset()
    t = int(model.forward(PROMPT_IDS)[-1].argmax())
    t0 = time.perf_counter()
    for _ in range(n):
        t = int(model.forward([t])[-1].argmax())
    return n / (time.perf_counter() - t0)


def python_overhead_us(model, n):
    """Per-token time outside ONNX Runtime runs and kernel calls, from a timed copy of the loop."""
    model.reset()
    t = int(model.forward(PROMPT_IDS)[-1].argmax())
    t = int(model.forward([t])[-1].argmax())  # binds the one-token buffers and steps
    inner = 0.0
    steps = model.steps
    timed = []
    for s in steps:
        def wrap(s=s):
            nonlocal inner
            a = time.perf_counter()
            s()
            inner += time.perf_counter() - a
        timed.append(wrap)
    head_run = model.head.run

    def head_timed():
        nonlocal inner
        a = time.perf_counter()
        head_run()
        inner += time.perf_counter() - a

    model.steps, model.head.run = timed, head_timed
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            t = int(model.forward([t])[-1].argmax())
        total = time.perf_counter() - t0
    finally:
        model.steps, model.head.run = steps, head_run
    return (total - inner) / n * 1e6, total / n * 1e6


def llamacpp_decode(py, gguf, threads, n):
    return engines.llamacpp(py, "decode", gguf, threads, n=n)["tok_s"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--llama-python", default=None, help="python of an environment with llama-cpp-python")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--pinf", type=Path, default=None, help="a converted file of the same model to run")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        pinf = a.pinf
        if pinf is None:
            pinf = Path(tmp) / "m.pinf"
            with contextlib.redirect_stderr(io.StringIO()):
                convert(ConvertOptions(a.model, pinf, passes=DENSE))
        rows = []
        for threads in [int(x) for x in a.threads.split(",")]:
            model = Model(pinf, RuntimeOptions(threads=threads, n_ctx=512, device="cpu"))
            modes = ", ".join(model.sparsity_names)
            if model.path_choices:      # what --ffn-kernel auto made of the file's rules at load
                modes += "; FFN " + ", ".join(f"{c['rule']}: {c['path']}" for c in model.path_choices)
            pinfer_decode(model, 8)  # warm up
            ours, theirs = [], []
            for _ in range(a.repeats):
                ours.append(pinfer_decode(model, a.tokens))
                if a.llama_python:
                    theirs.append(llamacpp_decode(a.llama_python, a.model, threads, a.tokens))
            py_us, step_us = python_overhead_us(model, a.tokens)
            nbytes = weight_bytes_per_token(model)
            o = statistics.median(ours)
            t = statistics.median(theirs) if theirs else float("nan")
            rows.append((threads, o, t, o / t if theirs else float("nan"), nbytes / 1e6, nbytes * o / 1e9, py_us, step_us))
            del model
    print(f"\nSmolLM2 decode, {a.tokens} tokens after a 5-token prompt, median of {a.repeats} alternating runs; "
          f"pinfer runs {pinf.name if a.pinf else 'a dense conversion'} ({modes})\n")
    print("| threads | pinfer tok/s | llama.cpp tok/s | ratio | MB read/token | pinfer GB/s | Python µs/token (of µs) |")
    print("|---|---|---|---|---|---|---|")
    for th, o, t, r, mb, gbs, py_us, step_us in rows:
        print(f"| {th} | {o:.1f} | {t:.1f} | {r:.2f} | {mb:.1f} | {gbs:.1f} | {py_us:.0f} ({step_us:.0f}) |")


if __name__ == "__main__":
    sys.exit(main())
