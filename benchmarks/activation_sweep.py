"""Activation sparsity level by level, through pinfer's runtime: perplexity on the wikitext-2 test
text and decode speed, in one run.

    python benchmarks/activation_sweep.py MODEL.pinf [--levels 0,0.1,0.2,0.3,auto] [--chunks 16]
        [--threads 1,2] [--tokens 128] [--repeats 5]

MODEL.pinf is converted with `--activation-thresholds` (auto: the levels per projection the
converter chose). Each level runs every projection by columns (`--activation-sparsity S`); 0 is
the dense file as it decodes by default. Perplexity follows llama.cpp's protocol over --chunks
chunks of 512 tokens (each prompt token through the same column kernels as decode), on the first
thread count. Decode: --tokens steps fed with wikitext-2 tokens (the kept inputs depend on the
tokens), every level loaded at once and run in turn, --repeats times, the order reversed every
other round; medians and ranges, and the ratio to level 0 in the same run. The cost of the
thresholds and of skipping is inside those times. "MB/token" counts every weight a step reads,
the FFN's and the attention's rows at the shares they kept. Memory: every level holds its own transposed copies, so a 7B-shaped file takes about 4 GB a
level.
"""

import argparse
import gc
import statistics
from pathlib import Path

from harness import WIKITEXT  # benchmarks/ is on sys.path (benchmarks/__init__.py)
from harness.protocol import alternate, text_ids

from pinfer.runtime.bench import decode_rate
from pinfer.runtime.model import Model, RuntimeOptions
from pinfer.runtime.perplexity import perplexity
from pinfer.runtime.tokenizer import Tokenizer


def options(level, threads):
    if level in (0, 0.0):
        return RuntimeOptions(threads=threads, n_ctx=512, device="cpu")
    return RuntimeOptions(threads=threads, n_ctx=512, device="cpu", activation=level, kernels="on", sparsity="dense")


def quality(path, levels, chunks, threads, text):
    """{level: (perplexity, (gate/up kept, down kept), MB read per token)}, one model at a time."""
    out = {}
    for lv in levels:
        m = Model(path, options(lv, threads))
        m.counters.reset()
        r = perplexity(m, Tokenizer.from_spec(m.tokenizer_spec), text, 512, chunks)
        out[lv] = (r.ppl, m.counters.read_fractions(), m.weight_bytes_per_token() / 1e6)
        del m
        gc.collect()
    return out


def speed(path, levels, threads, tokens, repeats):
    """{level: [tok/s per round]} at one thread count, every level loaded, in turn (the harness's
    alternation, 0.2 s idle before each run)."""
    models = {lv: Model(path, options(lv, threads)) for lv in levels}
    feed = text_ids(models[levels[0]], 5 + tokens)
    for m in models.values():
        decode_rate(m, 16, feed[:5], feed[5:])          # warm-up
    runs, failed = alternate({lv: (lambda m=m: decode_rate(m, tokens, feed[:5], feed[5:])) for lv, m in models.items()},
                             repeats, settle=0.2)
    if failed:
        raise SystemExit(f"a level failed: {failed}")
    models = None
    gc.collect()
    return runs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--levels", default="0,0.1,0.2,0.3,auto")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("-f", "--file", type=Path, default=WIKITEXT)
    a = ap.parse_args(argv)
    if a.repeats < 5:
        ap.error("--repeats is at least 5: fewer alternations do not give a median worth a ratio")
    levels = [x if x == "auto" else float(x) for x in a.levels.split(",")]
    levels = [0.0] + [lv for lv in dict.fromkeys(levels) if lv != 0]      # dense first, each level once
    threads = [int(t) for t in a.threads.split(",")]
    text = a.file.read_text(encoding="utf-8")
    q = quality(a.model, levels, a.chunks, threads[0], text)
    s = {t: speed(a.model, levels, t, a.tokens, a.repeats) for t in threads}
    print(f"{a.model.name}: perplexity over {a.chunks} chunks of 512 of {a.file.name} ({threads[0]} thread(s)); "
          f"decode of {a.tokens} fed tokens, median (min-max) of {a.repeats} rounds in turn\n")
    head = "| level | perplexity | vs dense | gate/up kept | down kept | MB/token |"
    head += "".join(f" {t} thread{'s' if t > 1 else ''} tok/s | vs dense |" for t in threads)
    print(head)
    print("|" + " --- |" * (6 + 2 * len(threads)))
    base = q[levels[0]][0]
    for lv in levels:
        ppl, (gu, dn), mb = q[lv]
        row = f"| {lv if lv == 'auto' else f'{lv:g}'} | {ppl:.4f} | {ppl / base - 1:+.2%} | {gu:.1%} | {dn:.1%} | {mb:.1f} |"
        for t in threads:
            v, d = s[t][lv], statistics.median(s[t][levels[0]])
            row += f" {statistics.median(v):.1f} ({min(v):.1f}-{max(v):.1f}) | {statistics.median(v) / d:.2f}x |"
        print(row, flush=True)


if __name__ == "__main__":
    main()
