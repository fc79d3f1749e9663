"""The decode suite: greedy decode speed of pinfer against llama.cpp on the same GGUF, as ratios.

    python -m benchmarks run decode --model SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-python .venv-llama/bin/python [--q4-0] [--pinf converted.pinf] [--threads 1,2]
        [--tokens 128] [--repeats 5] [--isa avx2] [--activation 0,0.2] [--feed-text]

Any llama-family GGUF goes: the 7B-shaped one of benchmarks/synthetic_decode.py too
(--model ~/.cache/pinfer/synthetic/synthetic-7b-32L.Q4_0.gguf --pinf ...32L.Q4_0.pinf --tokens 16).

The protocol is harness/protocol.py's; here both engines decode greedily, one token per call,
after the same prompt ("The capital of France is" in each engine's tokenizer), fed one token a
call too (on AMX Xeons llama.cpp's batched evaluation segfaults). pinfer's loop is
pinfer.runtime.bench.decode_rate, the one `pinfer bench` times. The record also gives:
- `--q4-0`: the same model in Q4_0, re-quantized from the Q4_1 file by llama.cpp's own quantizer
  (cached beside it);
- the bound: this machine's read bandwidth (NumPy reductions over 512 MiB, on each thread count,
  measured in the same run) over the weight bytes pinfer reads per token, and pinfer's share of it.
pinfer runs a dense conversion made on the spot (`--sparsity none`, seconds), or `--pinf` for the
first model. A `--pinf` with sparse rules runs them, its predictors' reads and time included, and
the rows give the FFN rows read in the timed runs. Which rows a step reads depends on its token:
with `--feed-text` pinfer's steps take the tokens of the wikitext-2 test text (which no
calibration reads) instead of the argmax (which a random-weight model, as
benchmarks/synthetic_decode.py's, spends on a few tokens that fire fewer neurons than text does);
llama.cpp's dense decode reads the same bytes whatever the token. `--activation 0,S` runs pinfer
once per level (0: the file's own rules; S > 0 activation sparsity S through the column kernels;
auto: the levels its converter chose), all in turn with llama.cpp.
"""

import gc

import engines

from . import protocol
from .record import failure, summary


def add_arguments(ap):
    ap.add_argument("--tokens", type=int, default=128, help="decode steps per run (default 128)")
    ap.add_argument("--q4-0", action="store_true", help="also the model re-quantized to Q4_0 by llama.cpp")
    ap.add_argument("--feed-text", action="store_true",
                    help="pinfer's steps take wikitext-2 test tokens, not its argmax (a sparse file's rows read "
                         "depend on the tokens)")
    ap.add_argument("--activation", default="0", metavar="S[,S...]",
                    help="pinfer runs the file once per level, in turn with the others and llama.cpp: 0 its own "
                         "rules, S > 0 activation sparsity S through the column kernels (the file needs its "
                         "calibrated thresholds), auto the levels per projection its converter chose")


def q4_0_of(gguf, py):
    out = gguf.with_name(gguf.name.replace("Q4_1", "Q4_0") if "Q4_1" in gguf.name else gguf.stem + ".Q4_0.gguf")
    if not out.exists():
        engines.quantize(py, gguf, out, "Q4_0")
    return out


def _load(pinf, threads, level):
    from pinfer.runtime.model import Model, RuntimeOptions
    extra = {"kernels": "on", "sparsity": "dense"} if level else {}
    return Model(pinf, RuntimeOptions(threads=threads, n_ctx=512, device="cpu", activation=level, **extra))


def _sides(models, llama, a):
    """{side: callable} of one model and thread count, every side warmed up once; {side: reason}
    of those that failed already."""
    from pinfer.runtime.bench import decode_rate
    sides, failed = {}, {}
    if models:
        first = next(iter(models.values()))
        prompt = protocol.prompt_ids(first)
        feed = protocol.text_ids(first, 5 + a.tokens) if a.feed_text else None
        sides = {lv: (lambda m=m: decode_rate(m, a.tokens, feed[:5], feed[5:])) if feed else
                 (lambda m=m: decode_rate(m, a.tokens, prompt)) for lv, m in models.items()}
    for lv, m in models.items():        # warm-up; llama.cpp's worker warmed itself up
        _, why = protocol.guarded(decode_rate, m, 16, prompt)
        if why:
            failed[lv] = why
            del sides[lv]
    if llama is not None:
        sides["llama.cpp"] = lambda: llama.decode(a.tokens)
    return sides, failed


def measure(pinf, gguf, threads, a):
    """({level: summary or failure}, {level: (MB read per token, (gate/up, down) rows read)},
    llama.cpp's summary or failure) of one model at one thread count."""
    models, failed = {}, {}
    for lv in a.activation:
        models[lv], why = protocol.guarded(_load, pinf, threads, lv)
        if why:
            failed[lv] = why
            del models[lv]
    llama, llama_why = protocol.start_llama(a, gguf, threads)
    try:
        sides, warm_failed = _sides(models, llama, a)
        failed.update(warm_failed)
        runs, run_failed = protocol.alternate(sides, a.repeats, a.settle)
        failed.update(run_failed)
        llama_why = failed.pop("llama.cpp", llama_why)
        ours = {lv: summary(runs[lv]) if lv not in failed else failure(failed[lv]) for lv in a.activation}
        reads = {lv: (m.weight_bytes_per_token() / 1e6, m.counters.read_fractions()) for lv, m in models.items()
                 if lv not in failed}
        theirs = summary(runs.get("llama.cpp", [])) if llama_why is None else failure(llama_why)
        return ours, reads, theirs
    finally:
        if llama is not None:
            llama.close()
        models = None
        gc.collect()    # the model's bound steps hold it in cycles: a 7B one must go before the next loads


def _row(gguf, threads, lv, ours, reads, theirs, bandwidth):
    row = {"model": gguf.name + (f", activation sparsity {lv}" if lv else ""), "threads": threads,
           "activation": lv, "pinfer": ours, "llama.cpp": theirs, "ratio": None}
    if "median" in ours and "median" in theirs:
        row["ratio"] = ours["median"] / theirs["median"]
    if lv in reads:
        mb, (gate_up, down) = reads[lv]
        bound = bandwidth / (mb * 1e6)
        row.update(mb_per_token=mb, rows_read=[gate_up, down], bound_tok_s=bound,
                   share_of_bound=ours["median"] / bound if "median" in ours else None)
    return row


def run(a, rec, pinf_of):
    """Fill rec's rows; pinf_of(gguf) gives the .pinf pinfer runs for a GGUF (and records it)."""
    a.activation = [x if x == "auto" else float(x) for x in a.activation.split(",")]
    if a.q4_0 and not a.llama_python:
        raise SystemExit("--q4-0 needs --llama-python: llama.cpp's quantizer makes the Q4_0 file")
    ggufs = [a.model]
    if a.q4_0:
        q4_0, why = protocol.guarded(q4_0_of, a.model, a.llama_python)
        ggufs += [q4_0] if why is None else []
        rec["failures"] += [{"engine": "llama.cpp", "model": "Q4_0 of " + a.model.name, "reason": why}] if why else []
    bandwidth = {t: protocol.read_bandwidth(t) for t in a.threads}
    rec["bandwidth_bytes_per_s"] = {str(t): bw for t, bw in bandwidth.items()}
    rec["flags"].update(tokens=a.tokens, feed_text=a.feed_text, activation=a.activation,
                        prompt=protocol.PROMPT_TEXT, llama_fed="one token per call")
    for gguf in ggufs:
        pinf = pinf_of(gguf)
        for t in a.threads:
            ours, reads, theirs = measure(pinf, gguf, t, a)
            for lv in a.activation:
                rec["rows"].append(_row(gguf, t, lv, ours[lv], reads, theirs, bandwidth[t]))
                print(_line(rec["rows"][-1]), flush=True)
            rec["failures"] += [{"engine": "pinfer", "model": gguf.name, "threads": t, "activation": lv,
                                 "reason": c["failed"]} for lv, c in ours.items() if "failed" in c]
            if "failed" in theirs:
                rec["failures"].append({"engine": "llama.cpp", "model": gguf.name, "threads": t,
                                        "reason": theirs["failed"]})


def _line(row):
    """A progress line of one row (the tables are render.py's)."""
    def cell(c):
        return f"{c['median']:.1f} ({c['min']:.1f}-{c['max']:.1f})" if "median" in c else f"failed: {c['failed']}"
    ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "—"
    return f"{row['model']}, {row['threads']} thread(s): pinfer {cell(row['pinfer'])}, " \
           f"llama.cpp {cell(row['llama.cpp'])}, ratio {ratio}"
