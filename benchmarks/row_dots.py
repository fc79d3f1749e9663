"""How fast pinfer's row dots read q4 weights from memory: one linear (decode.c's head call) over a
matrix larger than the caches, the weights in transparent huge pages (formats.reader.huge_copy, as
the runtime holds them) or in 4 KB pages (MADV_NOHUGEPAGE), at row widths from SmolLM2's to 7B's.
Rows of up to SHORT_ROW (csrc/quants.h) weights are read four at a time, longer ones one at a time.

    python benchmarks/row_dots.py [--widths 576,1536,4096,11008] [--mb 96] [--threads 1] [--isa avx2]

Each figure is the weight bytes over the median of --reps calls.
"""

import argparse
import mmap
import statistics
import time

import numpy as np

from pinfer.formats.reader import huge_copy
from pinfer.kernels import ISAS, sparse_isa
from pinfer.kernels.decode import HeadStep


def small_pages(a):
    """A copy of `a` in anonymous memory the kernel is told not to back with huge pages."""
    mm = mmap.mmap(-1, a.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_NOHUGEPAGE)
    out = np.frombuffer(mm, a.dtype, a.size).reshape(a.shape)
    out[...] = a
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", default="576,1536,4096,11008")
    ap.add_argument("--mb", type=int, default=96, help="weight MB per matrix (above the L3 cache)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--isa", choices=ISAS, default=None)
    a = ap.parse_args(argv)
    if a.isa:
        sparse_isa(a.isa)
    rng = np.random.default_rng(0)
    print(f"kernel ISA {sparse_isa()}, {a.threads} thread(s), {a.mb} MB of q4 weights per matrix\n")
    print("| row width | huge pages GB/s | 4 KB pages GB/s | ratio |\n| ---: | ---: | ---: | ---: |")
    for k in (int(w) for w in a.widths.split(",")):
        rows = (a.mb << 20) // (k // 2 + k // 16) // 4 * 4
        parts = {"q": rng.integers(0, 256, (rows, k // 2), np.uint8),
                 "scale": np.full((rows, k // 32), 0.01, np.float16)}
        x = rng.standard_normal(k).astype(np.float32)
        nbytes = sum(p.nbytes for p in parts.values())
        rates = []
        for place in (huge_copy, small_pages):
            step = HeadStep(("q4", {n: place(p) for n, p in parts.items()}), np.ones(k, np.float32), rows,
                            eps=1e-5, threads=a.threads)
            run = step.bind(x, np.zeros(k, np.float32), np.empty(rows, np.float32))
            run()
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                run()
                times.append(time.perf_counter() - t0)
            rates.append(nbytes / statistics.median(times) / 1e9)
        print(f"| {k} | {rates[0]:.1f} | {rates[1]:.1f} | {rates[0] / rates[1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
