"""Perplexity and modelled bytes per token of every calibrated sparsity operating point.

    python benchmarks/sparsity_sweep.py MODEL.pinf [-f tests/data/wikitext-2-raw-test.txt] [--chunks 20]

MODEL.pinf is a file converted with calibration (the default `pinfer convert`). Each operating
point the converter measured (dense, down:S, predicted:R, relu:R) runs in pinfer's runtime over
the same chunks of the evaluation text (llama.cpp's perplexity protocol), and so does the file's
own per-layer choice ("as converted"). Bytes per token are modelled for batch-1 decode from the
file's formats and the rows read, as the converter does; the rows-read columns are measured on
the evaluation text by the runtime.
"""

import argparse
import sys
import time
from pathlib import Path

from pinfer.formats import PinfReader
from pinfer.runtime.accounting import weight_bytes_per_token
from pinfer.runtime.model import Model, RuntimeOptions
from pinfer.runtime.perplexity import perplexity
from pinfer.runtime.tokenizer import Tokenizer

from harness import WIKITEXT as DEFAULT_TEXT  # benchmarks/ is on sys.path (benchmarks/__init__.py)


def non_ffn_bytes(reader, cfg):
    return weight_bytes_per_token(reader, cfg, shares=(0.0, 0.0))     # no FFN rows, no predictors


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("-f", "--file", type=Path, default=DEFAULT_TEXT)
    ap.add_argument("--chunks", type=int, default=20)
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=0)
    a = ap.parse_args(argv)

    reader = PinfReader(a.model)
    h = reader.header
    sp = h["sparsity"]
    if "heldout" not in sp:
        sys.exit(f"{a.model} was converted without calibration (--sparsity none); convert it with the default")
    text = a.file.read_text(encoding="utf-8")
    dense_nonffn = None
    rows = []
    points = [r["point"] for r in sp["heldout"]["points"]] + [""]
    for point in points:
        t0 = time.perf_counter()
        m = Model(a.model, RuntimeOptions(n_ctx=a.ctx, threads=a.threads, sparsity=point, kernels="off"))
        tok = Tokenizer.from_spec(m.tokenizer_spec)
        res = perplexity(m, tok, text, n_ctx=a.ctx, n_chunks=a.chunks)
        gu, down = m.counters.fractions()
        if dense_nonffn is None:
            dense_nonffn = non_ffn_bytes(m.reader, m.cfg)
        if point:
            ffn = sum(lay["ffn_bytes"][point] for lay in h["layers"])
            held = next(r for r in sp["heldout"]["points"] if r["point"] == point)
            held_ppl, held_inc = held["ppl"], held["increase"]
        else:       # the file's own per-layer choice
            ffn = sum(lay["ffn_bytes"][_name(lay)] for lay in h["layers"])
            held_ppl = held_inc = None
        rows.append({"point": point or f"as converted ({', '.join(m.sparsity_names)})", "ppl": res.ppl,
                     "stderr": res.stderr, "held_ppl": held_ppl, "held_inc": held_inc, "gu": gu, "down": down,
                     "ffn_mb": ffn / 1e6, "total_mb": (ffn + dense_nonffn) / 1e6, "s": time.perf_counter() - t0})
        print(f"  {rows[-1]['point']}: PPL {res.ppl:.4f} ({rows[-1]['s']:.0f} s)", file=sys.stderr, flush=True)

    base = rows[0]["ppl"]
    print(f"\n{a.model.name}: {a.chunks} chunks of {a.ctx} tokens of {a.file.name} "
          f"({res.tokens_scored} tokens scored per point); held-out = the converter's "
          f"calibration held-out text ({sp['heldout']['tokens']} tokens)\n")
    print("| operating point | PPL (eval text) | vs dense | held-out PPL | held-out vs dense | "
          "gate/up rows read | down rows read | FFN MB/token | total MB/token |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        held = "–" if r["held_ppl"] is None else f"{r['held_ppl']:.3f}"
        held_inc = "–" if r["held_inc"] is None else f"{r['held_inc']:+.2%}"
        print(f"| {r['point']} | {r['ppl']:.4f} ± {r['stderr']:.3f} | {r['ppl'] / base - 1:+.2%} | {held} | "
              f"{held_inc} | {r['gu']:.1%} | {r['down']:.1%} | {r['ffn_mb']:.2f} | {r['total_mb']:.2f} |")
    auto = rows[-1]
    budget = sp["max_ppl_increase"]
    verdict = "within" if auto["ppl"] / base - 1 <= budget else "OUTSIDE"
    print(f"\nconverter's choice: {sp['reason']}")
    print(f"on the evaluation text it costs {auto['ppl'] / base - 1:+.2%} perplexity: {verdict} the budget "
          f"of +{budget:.1%}, reading {auto['total_mb']:.2f} of {rows[0]['total_mb']:.2f} MB per token "
          f"({1 - auto['total_mb'] / rows[0]['total_mb']:.1%} fewer)")


def _name(lay):
    return lay["mode"] if lay["mode"] == "dense" else f"{lay['mode']}:{lay['value']:g}"


if __name__ == "__main__":
    main()
