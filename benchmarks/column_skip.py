"""One FFN layer for one token at LLaMA shapes: pinfer's dense kernel (int4 row dots, as decode runs
today) against activation sparsity's column skipping (kernels.Columns over the input-major layouts:
gate|up transposed to (d_model, 2 n_ff) and down_t (n_ff, d_model), both q4r, groups of 32 inputs)
at several shares of inputs dropped, in one process, alternating.

    python benchmarks/column_skip.py [--shape 7b|13b|smollm2] [--threads 1,2] [--levels 0,0.3,0.4,0.5] [--isa avx2]

Weights are random bytes (the byte counts, not the values, set a kernel's time; the inputs dropped
are chosen by a magnitude threshold over a random x, so the share is what the threshold says).
Several copies of the layer rotate (--layers) so that a call finds its weights in no cache, as a
token's next layer does. "column, 0" reads every row through the column kernel: what the layout
costs before any input is dropped. Times are medians over rounds of --reps calls; the range is
the rounds' min-max. The activation between the two column calls (SiLU(g) * u in NumPy) is
timed with them.
"""

import argparse
import statistics
import time

import numpy as np

from pinfer.kernels import Columns, SparseFFN, sparse_isa

SHAPES = {"smollm2": (576, 1536), "7b": (4096, 11008), "13b": (5120, 13824)}


def q4r(n, d, rng):
    """(n, d) input-major weight in q4r: q u8 (n, d/2), scale f16 (n/32, d)."""
    return {"q": rng.integers(0, 256, (n, d // 2), np.uint8), "scale": np.full((n // 32, d), 0.003, np.float16)}


def layers(d, n, count, threads, rng):
    out = []
    for _ in range(count):
        gu = {"q": rng.integers(0, 256, (n, 2, d // 2), np.uint8), "scale": np.full((n, 2, d // 32), 0.003, np.float16)}
        dn = q4r(n, d, rng)
        dense = SparseFFN(("q4", gu), ("q4r", dn), n, d, threads=threads, down_rows="transpose")
        cols_gu = Columns("q4r", q4r(d, 2 * n, rng), d, 2 * n, threads)
        cols_dn = Columns("q4r", dn, n, d, threads)
        out.append((dense, cols_gu, cols_dn))
    return out


def timed(fn, reps):
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b", choices=SHAPES)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--levels", default="0,0.3,0.4,0.5")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--isa", choices=("avx512", "avx2", "portable"), default=None,
                    help="force the kernels' instruction set (both paths), as the tests do")
    a = ap.parse_args(argv)
    if a.isa and sparse_isa(a.isa) != a.isa:
        raise SystemExit(f"this CPU has no {a.isa} path")
    rng = np.random.default_rng(0)
    d, n = SHAPES[a.shape]
    levels = [float(v) for v in a.levels.split(",")]
    x = rng.standard_normal(d).astype(np.float32)
    y, g = np.empty(d, np.float32), np.empty(2 * n, np.float32)
    nbytes = 3 * n * (d // 2 + 2 * (d // 32))
    print(f"sparse kernels: {sparse_isa()} path; {a.shape} FFN layer (d {d}, n_ff {n}), q4 weights "
          f"{nbytes / 1e6:.1f} MB; {a.layers} copies rotating; {a.rounds} rounds of {a.reps} calls\n")
    print("| threads | path | dropped | ms (median, range) | GB/s of the bytes read | vs dense |")
    print("|---:|---|---:|---:|---:|---:|")
    for threads in map(int, a.threads.split(",")):
        ls = layers(d, n, a.layers, threads, rng)
        it = {"i": 0}

        def nxt():
            it["i"] += 1
            return ls[it["i"] % len(ls)]
        dense_calls = [dn.bind(x, y, "dense") for dn, _, _ in ls]

        def dense():
            dense_calls[it["i"] % len(ls)]()
            it["i"] += 1

        def columns(level):
            """The two column calls with thresholds fixed beforehand, as calibration fixes them."""
            t = {"x": float(np.quantile(np.abs(x), level)) if level else 0.0, "h": 0.0}
            h = np.empty(n, np.float32)

            def run():
                _, cg, cd = nxt()
                cg(x, g, t["x"])
                gg, uu = g[:n], g[n:]
                np.multiply(gg / (1.0 + np.exp(-gg)), uu, out=h)
                cd(h, y, t["h"])
            run()
            t["h"] = float(np.quantile(np.abs(h), level)) if level else 0.0
            return run
        paths = [("dense (row dots)", 0.0, dense)] + [("column", lv, columns(lv)) for lv in levels]
        rounds = {p[:2]: [] for p in paths}
        for _ in range(a.rounds):
            for name, lv, fn in paths:
                fn()
                rounds[(name, lv)].append(timed(fn, a.reps))
        base = statistics.median(rounds[("dense (row dots)", 0.0)])
        for name, lv, _ in paths:
            ts = rounds[(name, lv)]
            m = statistics.median(ts)
            read = nbytes * (1 - lv)
            print(f"| {threads} | {name} | {lv:.0%} | {m * 1e3:.2f} ({min(ts) * 1e3:.2f}-{max(ts) * 1e3:.2f}) | "
                  f"{read / m / 1e9:.1f} | {base / m:.2f}x |", flush=True)
        del ls, dense_calls


if __name__ == "__main__":
    main()
