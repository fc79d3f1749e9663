"""Decode speed of pinfer against llama.cpp on the same GGUF files, in one run, as ratios.

    python benchmarks/smollm2_vs_llamacpp.py --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-python .venv-llama/bin/python [--q4-0] [--pinf converted.pinf] [--threads 1,2]
        [--tokens 128] [--repeats 5] [--isa avx2] [--activation 0,0.2]

Any llama-family GGUF goes: the 7B-shaped one of benchmarks/synthetic_decode.py too
(--model ~/.cache/pinfer/synthetic/synthetic-7b-32L.Q4_0.gguf --pinf ...32L.Q4_0.pinf --tokens 16).

The protocol, for a reader who wants to check it:
- each engine loads the model once and decodes 16 tokens before anything is timed. llama.cpp runs
  in its own process and Python (llama-cpp-python, benchmarks/llamacpp_side.py worker), started
  with PATH, HOME and the locale only: nothing of this process's environment (benchmarks/engines.py);
- per model and thread count the engines alternate `--repeats` times (at least 5), the one that
  goes first switching every round; both decode greedily, one token per call, after the same
  5-token prompt;
- before each run the machine idles SETTLE_S, so that neither engine's idle threads spin into the
  other's run;
- each figure is the median tok/s with the range (min-max) of the runs; the ratio is of medians;
- the header gives the machine, both engines' versions and build flags, and the instruction set
  pinfer's kernels take;
- `--q4-0` adds the same model in Q4_0, re-quantized from the Q4_1 file by llama.cpp's own
  quantizer (cached beside it);
- the bound column is this machine's read bandwidth (NumPy reductions over 512 MiB, on 1 and 2
  threads, measured in the same run) over the weight bytes pinfer reads per token, and pinfer's
  share of that bound.
pinfer runs a dense conversion made on the spot (`--sparsity none`, seconds), or `--pinf` for the
first model. A `--pinf` with sparse rules runs them, its predictors' reads and time included, and
the table gives the FFN rows read in the timed runs. Which rows a step reads depends on its token:
with `--feed-text` pinfer's steps take the tokens of the wikitext-2 test text (which no
calibration reads) instead of the argmax (which a random-weight model, as
benchmarks/synthetic_decode.py's, spends on a few tokens that fire fewer neurons than text does);
llama.cpp's dense decode reads the same bytes whatever the token.
"""

import argparse
import contextlib
import gc
import io
import statistics
import sys
import tempfile
import threading
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

import engines  # noqa: E402  benchmarks/ is on sys.path when a script here runs

from pinfer import kernels
from pinfer.converter.convert import ConvertOptions, convert
from pinfer.converter.passes import DENSE
from pinfer.runtime.model import Model, RuntimeOptions

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary
# Idle time before each run: the other engine's threads stop spinning first (llama.cpp's OpenMP
# workers spin after a call before they sleep; pinfer's pool lingers 100 us). On 2 cores a spinning
# thread of one engine took a core from the other's 2-thread run.
SETTLE_S = 0.3


def pinfer_decode(model, n, feed=None):
    """tok/s of n greedy decode steps after the 5-token prompt; with `feed` (token ids), the prompt
    is its first 5 and step i takes feed[5 + i] in place of the argmax it still computes."""
    model.reset()
    t = int(model.forward(feed[:5] if feed else PROMPT_IDS)[-1].argmax())
    model.counters.reset()      # the rows read are the decode steps' (every run decodes the same tokens)
    t0 = time.perf_counter()
    for i in range(n):
        t = int(model.forward([feed[5 + i] if feed else t])[-1].argmax())
    return n / (time.perf_counter() - t0)


WIKITEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "wikitext-2-raw-test.txt"


def text_ids(model, n):
    """The first n tokens of the wikitext-2 test text (never calibration text) in the model's own
    vocabulary."""
    from pinfer.runtime.tokenizer import Tokenizer
    ids = Tokenizer.from_spec(model.tokenizer_spec).encode(WIKITEXT.read_text()[:20 * n], add_bos=False)[:n]
    if len(ids) < n:
        raise SystemExit(f"{WIKITEXT.name}'s start gives {len(ids)} tokens, fewer than {n}")
    return [int(i) for i in ids]


def read_bandwidth(threads, nbytes=512 << 20, repeats=5):
    """Bytes per second that `threads` threads read, each summing its share of a large array
    (NumPy's reductions run without the GIL); best of `repeats`."""
    a = np.ones(nbytes // 8, np.int64)
    parts = np.array_split(a, threads)
    best = np.inf
    for _ in range(repeats):
        workers = [threading.Thread(target=p.sum) for p in parts]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


def q4_0_of(gguf, py):
    out = gguf.with_name(gguf.name.replace("Q4_1", "Q4_0") if "Q4_1" in gguf.name else gguf.stem + ".Q4_0.gguf")
    if not out.exists():
        engines.quantize(py, gguf, out, "Q4_0")
    return out


def measure(pinf, gguf, threads, a):
    """({activation level: (pinfer tok/s runs, MB read per token, FFN rows read (gate/up, down))},
    llama.cpp tok/s runs) of one model at one thread count, pinfer once per --activation level
    (0: the file's own rules), all in turn with llama.cpp. A file with sparse rules runs them, its
    predictors' reads and time included; the rows read are the last run's decode steps'."""
    models = {lv: Model(pinf, RuntimeOptions(threads=threads, n_ctx=512, device="cpu", activation=lv,
                                             **({"kernels": "on", "sparsity": "dense"} if lv else {})))
              for lv in a.activation}
    runs, theirs, llama = {lv: [] for lv in models}, [], None
    try:
        llama = engines.LlamaWorker(a.llama_python, gguf, threads)
    except engines.EngineFailed as e:
        theirs = str(e)             # the row says so; pinfer's runs go on alone
    try:
        feed = text_ids(models[a.activation[0]], 5 + a.tokens) if a.feed_text else None
        for model in models.values():
            pinfer_decode(model, 16)     # warm-up; llama.cpp's worker warmed itself up
        for r in range(a.repeats):
            sides = [lambda lv=lv: runs[lv].append(pinfer_decode(models[lv], a.tokens, feed)) for lv in models]
            if isinstance(theirs, list):
                sides.append(lambda: theirs.append(llama.decode(a.tokens)))
            for side in sides[::-1] if r % 2 else sides:
                time.sleep(SETTLE_S)
                try:
                    side()
                except engines.EngineFailed as e:
                    theirs = str(e)
        return {lv: (runs[lv], m.weight_bytes_per_token() / 1e6, m.counters.read_fractions())
                for lv, m in models.items()}, theirs
    finally:
        if llama is not None:
            llama.close()
        models = None
        gc.collect()    # the model's bound steps hold it in cycles: a 7B one must go before the next loads


def rows_read(gate_up, down):
    return "all" if gate_up == down == 1.0 else f"{gate_up:.1%} gate/up, {down:.1%} down"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--llama-python", required=True, help="python of an environment with llama-cpp-python")
    ap.add_argument("--q4-0", action="store_true", help="also the model re-quantized to Q4_0 by llama.cpp")
    ap.add_argument("--pinf", type=Path, default=None, help="a converted file of --model to run instead")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--isa", choices=kernels.ISAS, default=None,
                    help="force pinfer's kernels onto this instruction set (the AVX2 path on an AVX-512 CPU)")
    ap.add_argument("--feed-text", action="store_true",
                    help="pinfer's steps take wikitext-2 test tokens, not its argmax (a sparse file's rows read "
                         "depend on the tokens)")
    ap.add_argument("--activation", default="0", metavar="S[,S...]",
                    help="pinfer runs the file once per level, in turn with the others and llama.cpp: 0 its own "
                         "rules, S > 0 activation sparsity S through the column kernels (the file needs its "
                         "calibrated thresholds), auto the levels per projection its converter chose")
    a = ap.parse_args(argv)
    a.activation = [x if x == "auto" else float(x) for x in a.activation.split(",")]
    if a.isa:
        kernels.sparse_isa(a.isa)
    if a.repeats < 5:
        ap.error("--repeats is at least 5: fewer alternations do not give a median worth a ratio")
    threads = [int(x) for x in a.threads.split(",")]
    ggufs = [a.model] + ([q4_0_of(a.model, a.llama_python)] if a.q4_0 else [])
    info = engines.llamacpp_info(a.llama_python)
    bandwidth = {t: read_bandwidth(t) for t in threads}
    print(f"machine: {engines.machine()}; read bandwidth "
          + ", ".join(f"{bw / 1e9:.1f} GB/s on {t} thread{'s' * (t > 1)}" for t, bw in bandwidth.items()))
    print(f"pinfer {version('pinfer')} (onnxruntime {version('onnxruntime')}, its kernels' ISA "
          f"{kernels.sparse_isa()}); llama.cpp via llama-cpp-python {info['version']}: {info['system_info']}")
    print(f"greedy decode of {a.tokens} tokens after a 5-token prompt; median (min-max) of {a.repeats} alternating "
          "runs per row, after a warm-up of each engine\n")
    print("| model | threads | pinfer tok/s | llama.cpp tok/s | ratio | FFN rows read | MB read/token | bound tok/s | "
          "pinfer / bound |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        for gguf in ggufs:
            pinf = a.pinf if a.pinf and gguf == a.model else Path(tmp) / f"{gguf.stem}.pinf"
            if not pinf.exists():
                with contextlib.redirect_stderr(io.StringIO()):
                    convert(ConvertOptions(gguf, pinf, passes=DENSE))
            for t in threads:
                sides, theirs = measure(pinf, gguf, t, a)
                for lv, (ours, mb, (gu, down)) in sides.items():
                    o = statistics.median(ours)
                    bound = bandwidth[t] / (mb * 1e6)
                    if isinstance(theirs, str):     # llama.cpp failed: its cell says how
                        llama_cell, ratio = f"failed: {theirs}", "—"
                    else:
                        l = statistics.median(theirs)
                        llama_cell, ratio = f"{l:.1f} ({min(theirs):.1f}-{max(theirs):.1f})", f"{o / l:.2f}x"
                    name = gguf.name + (f", activation sparsity {lv}" if lv else "")
                    print(f"| {name} | {t} | {o:.1f} ({min(ours):.1f}-{max(ours):.1f}) | {llama_cell} | {ratio} "
                          f"| {rows_read(gu, down)} | {mb:.1f} | {bound:.0f} | {o / bound:.0%} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
