"""Prompt (prefill) speed of pinfer against llama.cpp on the same GGUF, in one run, as ratios.

    python benchmarks/prompt_vs_llamacpp.py --model MODEL.gguf --pinf MODEL.pinf \
        --llama-python .venv-llama/bin/python [--tokens 100] [--threads 1,2] [--repeats 5]

Both engines take the same prompt: the first --tokens tokens of the wikitext-2 test text in the
model's vocabulary, from an empty cache. pinfer routes it as its load chose (`--ffn-kernel auto`:
the dense graphs, or the kernel's batch call, in chunks of up to 64 tokens; the table says which);
llama.cpp evaluates it in one batch. The protocol is benchmarks/smollm2_vs_llamacpp.py's: each
engine loaded once and warmed up with the same prompt, llama.cpp in its own process and
environment, `--repeats` (at least 5) alternating runs with the first engine switching each round,
SETTLE_S of idle before each, medians and ranges, both engines' versions and build flags in the
header.
"""

import argparse
import gc
import statistics
import sys
import time
from importlib.metadata import version
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import engines  # noqa: E402
from smollm2_vs_llamacpp import SETTLE_S, text_ids  # noqa: E402

from pinfer import kernels  # noqa: E402
from pinfer.runtime import autotune  # noqa: E402
from pinfer.runtime.model import Model, RuntimeOptions  # noqa: E402


def pinfer_prompt(model, ids):
    model.reset()
    t0 = time.perf_counter()
    model.forward(ids)
    return len(ids) / (time.perf_counter() - t0)


def routing(model, n):
    """How pinfer runs a prompt of n tokens, from what its load chose."""
    if not model.batches(min(n, autotune.PREFILL_SIZES[-1])):
        return "dense graphs"
    size = autotune.chunk_size(model, n)
    return "kernel batch call" + (f", chunks of {size}" if size < n else "")


def measure(a, threads):
    model = Model(a.pinf, RuntimeOptions(threads=threads, n_ctx=max(512, a.tokens), device="cpu"))
    llama = engines.LlamaWorker(a.llama_python, a.model, threads, ctx=max(512, a.tokens))
    try:
        ids = text_ids(model, a.tokens)
        pinfer_prompt(model, ids)       # warm-up of each engine on the same prompt
        llama.prompt(ids)
        ours, theirs = [], []
        for r in range(a.repeats):
            sides = [lambda: ours.append(pinfer_prompt(model, ids)), lambda: theirs.append(llama.prompt(ids))]
            for side in sides[::-1] if r % 2 else sides:
                time.sleep(SETTLE_S)
                side()
        return ours, theirs, routing(model, a.tokens)
    finally:
        llama.close()
        model = None
        gc.collect()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="the GGUF llama.cpp runs")
    ap.add_argument("--pinf", required=True, type=Path, help="its conversion, which pinfer runs")
    ap.add_argument("--llama-python", required=True, help="python of an environment with llama-cpp-python")
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    a = ap.parse_args(argv)
    if a.repeats < 5:
        ap.error("--repeats is at least 5: fewer alternations do not give a median worth a ratio")
    info = engines.llamacpp_info(a.llama_python)
    print(f"machine: {engines.machine()}")
    print(f"pinfer {version('pinfer')} (onnxruntime {version('onnxruntime')}, its kernels' ISA "
          f"{kernels.sparse_isa()}); llama.cpp via llama-cpp-python {info['version']}: {info['system_info']}")
    print(f"a {a.tokens}-token prompt from an empty cache; median (min-max) of {a.repeats} alternating runs per row, "
          "after a warm-up of each engine\n")
    print("| model | threads | pinfer tok/s | llama.cpp tok/s | ratio | pinfer's route |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for t in [int(x) for x in a.threads.split(",")]:
        ours, theirs, route = measure(a, t)
        o, l = statistics.median(ours), statistics.median(theirs)
        print(f"| {a.pinf.name} | {t} | {o:.1f} ({min(ours):.1f}-{max(ours):.1f}) | {l:.1f} "
              f"({min(theirs):.1f}-{max(theirs):.1f}) | {o / l:.2f}x | {route} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
