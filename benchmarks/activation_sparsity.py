"""Perplexity of training-free activation sparsity (converter/passes/activation.py) on real weights.

    python benchmarks/activation_sparsity.py MODEL.gguf|HF_DIR [--chunks 16] [--levels 0.1,0.2,0.3,0.4,0.5]

Thresholds per layer and projection come from the converter's calibration text (never the
evaluation text), taken as the converter takes them (activation.thresholds: on the model as it runs
at each level); perplexity is llama.cpp's protocol (chunks of --ctx tokens of the wikitext-2 test
text, the second half of each scored) computed in PyTorch from the source's dequantized weights
(activation.evaluate). Rows: dense; every projection at one level; each projection alone at
--alone. `pinfer convert --activation-thresholds` chooses among such rows on its own held-out text,
and `benchmarks/activation_sweep.py` measures a converted file through the runtime. "skipped" is
the share of the projections' weights whose
input columns were dropped, measured on the evaluation text: the bytes a column-skipping kernel
does not read, model-wide (the head and embeddings excluded).
"""

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from harness import WIKITEXT  # benchmarks/ is on sys.path (benchmarks/__init__.py)


def open_source(path):
    from pinfer.converter.convert import ConvertOptions, _front_end
    with tempfile.TemporaryDirectory() as d:
        fe = _front_end(ConvertOptions(source=str(path), output=str(Path(d) / "unused.pinf")))
    return fe


def chunks_of(tok, text, n_ctx, n_chunks):
    add_bos = tok.add_bos and tok.bos_id is not None
    ids = tok.encode(text, add_bos=add_bos, parse_special=False)
    n = min(n_chunks, len(ids) // n_ctx)
    out = np.asarray(ids[:n * n_ctx], np.int64).reshape(n, n_ctx)
    if add_bos:
        out[:, 0] = tok.bos_id
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("-f", "--file", type=Path, default=WIKITEXT)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--levels", default="0.1,0.2,0.3,0.4,0.5")
    ap.add_argument("--alone", type=float, default=0.4, help="each projection alone at this level (0: none)")
    ap.add_argument("-t", "--threads", type=int, default=0)
    a = ap.parse_args(argv)

    import torch

    from pinfer.converter.passes import activation as A
    from pinfer.converter.passes import calib_data
    from pinfer.converter.passes import torch_llama as TL
    from pinfer.runtime.tokenizer import Tokenizer
    if a.threads:
        torch.set_num_threads(a.threads)
    fe = open_source(a.model)
    src, names, cfg = fe.src, fe.roles, fe.cfg
    tok = Tokenizer.from_spec(fe.tokenizer)
    cs = calib_data.build(tok, None, a.ctx, a.calib_tokens, a.ctx)
    ev = chunks_of(tok, a.file.read_text(encoding="utf-8"), a.ctx, a.chunks)
    levels = [float(x) for x in a.levels.split(",") if x]
    configs = {"dense": {}, **{f"all {s:g}": dict.fromkeys(A.PROJECTIONS, s) for s in levels}}
    if a.alone:
        configs.update({f"{p} {a.alone:g}": {p: a.alone} for p in A.PROJECTIONS})
    freqs = src.floats(names["rope_freqs"]) if "rope_freqs" in names else None
    embed, head = TL.Embedding(src, names, "cpu", cfg.embed_scale), TL.Head(src, names, cfg)
    t0 = time.perf_counter()

    def progress(what):
        return lambda i: print(f"\r{what}: layer {i + 1}/{cfg.n_layer}", end="", file=sys.stderr, flush=True)
    found = A.thresholds(src, names, cfg, cs.train, embed, sorted({*levels, *([a.alone] if a.alone else [])}),
                         freqs, on_layer=progress("thresholds"))
    res = A.evaluate(src, names, cfg, ev, embed, head, found, configs, freqs, on_layer=progress("evaluation"))
    print(file=sys.stderr)
    sizes = A.projection_sizes(cfg, "ffn_gate" in names)
    total = sum(w for _, w in sizes.values())
    print(f"{a.model.name}: {cfg.arch}, {cfg.n_layer} layers, d {cfg.d_model}, n_ff {cfg.n_ff}; calibration "
          f"{cs.train.size} tokens ({calib_data.DEFAULT_NAME.split(':')[0]} text), evaluation {ev.shape[0]} chunks "
          f"of {a.ctx} of {a.file.name} ({ev.shape[0] * (a.ctx - a.ctx // 2 - 1)} tokens scored); {time.perf_counter() - t0:.0f} s")
    print("| configuration | perplexity | vs dense | skipped | qkv | o | gate_up | down |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base = res["dense"][0]
    for name in configs:
        nll, dropped = res[name]
        skipped = sum(dropped[p] * sizes[p][1] for p in A.PROJECTIONS) / total
        print(f"| {name} | {math.exp(nll):.3f} | {100 * (math.exp(nll - base) - 1):+.2f}% | {100 * skipped:.1f}% | "
              + " | ".join(f"{100 * dropped[p]:.0f}%" for p in A.PROJECTIONS) + " |")


if __name__ == "__main__":
    main()
