"""pinfer's GPU FFN kernel (pinfer/kernels/cuda/ffn_hot.cu) on one layer, against the device's own copy
bandwidth measured in the same run.

    python benchmarks/gpu_kernel.py [--shapes 7b,13b] [--active 1.0,0.1] [--calls 200]

Per shape: random INT4 weights (q4 gate/up rows, q4r down rows, as Q4_0 files convert), every
neuron on the GPU (one HotFFN), x and y in device memory. Each figure is the device time of one
call, from `calls` calls queued back to back on the stream and one synchronisation (the host's
own cost per call is printed beside it): at 100% active the kernel reads every row; at 10% the
candidates are a random tenth, handed in as an active set ("given"), so the figure is the gather
GEMV's and the axpy's alone. Effective bandwidth is the weight bytes the call reads over its time.
Targets (the GPU issue): 100% at >= 50% of the copy bandwidth; 10% at <= 0.2x the 100% time.
Needs an NVIDIA GPU and pinfer[gpu]; prints one sentence and exits 2 without.
"""

import argparse
import sys
import time

import numpy as np

SHAPES = {"7b": (4096, 11008), "13b": (5120, 13824), "tiny": (256, 704)}


def q4_rows(rng, rows, d, with_min):
    parts = {"q": rng.integers(0, 256, (rows, d // 2), dtype=np.uint8),
             "scale": (rng.random((rows, d // 32), np.float32) * 0.01).astype(np.float16)}
    if with_min:
        parts["min"] = (-8 * parts["scale"].astype(np.float32)).astype(np.float16)
    return parts


def layer(rng, d, n_ff):
    """(gate_up, down) bundles of a random INT4 layer: q4 gate/up rows (n_ff, 2, d), q4r down (n_ff, d)."""
    gu = q4_rows(rng, n_ff * 2, d, False)
    gate_up = ("q4", {k: v.reshape(n_ff, 2, -1) for k, v in gu.items()})
    down = ("q4r", {"q": rng.integers(0, 256, (n_ff, d // 2), dtype=np.uint8),
                    "scale": (rng.random((n_ff // 32, d), np.float32) * 0.01).astype(np.float16)})
    return gate_up, down


def copy_bandwidth(gpu, nbytes=1 << 30, repeats=10):
    """Bytes moved (read + written) per second by the device's own copy engine, best of `repeats`."""
    cu = gpu.cu
    src, dst = gpu.alloc(nbytes), gpu.alloc(nbytes)
    best = np.inf
    try:
        for _ in range(repeats):
            gpu.sync()
            t = time.perf_counter()
            cu.cuMemcpyDtoDAsync(dst, src, nbytes, gpu.stream)
            gpu.sync()
            best = min(best, time.perf_counter() - t)
    finally:
        gpu.free(src, nbytes)
        gpu.free(dst, nbytes)
    return 2 * nbytes / best


def time_calls(gpu, launch, calls):
    """(device seconds per call, host seconds per call to queue it)."""
    for _ in range(5):
        launch()
    gpu.sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        launch()
    t1 = time.perf_counter()
    gpu.sync()
    t2 = time.perf_counter()
    return (t2 - t0) / calls, (t1 - t0) / calls


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b,13b")
    ap.add_argument("--active", default="1.0,0.1")
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args(argv)
    from pinfer.kernels.gpu import Gpu, GpuError, HotFFN, HotSpec
    try:
        gpu = Gpu()
    except GpuError as e:
        print(f"gpu_kernel: {e}", file=sys.stderr)
        sys.exit(2)
    bw = copy_bandwidth(gpu)
    print(f"{gpu.name} (sm_{gpu.arch}): device copy bandwidth {bw / 1e9:,.0f} GB/s (read + write, 1 GiB)\n")
    print("| layer | active | device us/call | host us/call | weight MB read | GB/s | share of copy bw | vs 100% |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        d, n_ff = SHAPES[shape]
        gate_up, down = layer(rng, d, n_ff)
        spec = HotSpec(d, n_ff, ("q4", False), ("q4r", False))
        ffn = HotFFN(gpu, spec, n_ff, gate_up, down)
        x = gpu.alloc(d * 4)
        gpu.upload(x, rng.standard_normal(d).astype(np.float32))
        y = gpu.alloc(d * 4)
        row_bytes = 2 * (d // 2 + d // 32 * 2) + d // 2 + d * 2 / 32       # gate + up + down row, q4r scales
        full = None
        for share in (float(s) for s in a.active.split(",")):
            if share >= 1.0:
                launch, rows = ffn._launcher(x, y, "dense", 0.0, 0.0), n_ff
            else:
                cand = np.sort(rng.choice(n_ff, int(share * n_ff), replace=False)).astype(np.int32)
                ffn.set_candidates(cand)
                launch, rows = ffn._launcher(x, y, "given", 0.0, 0.0), len(cand)
            dev, host = time_calls(gpu, launch, a.calls)
            full = dev if share >= 1.0 else full
            read = rows * row_bytes
            print(f"| {shape} ({d} x {n_ff}) | {share:.0%} | {dev * 1e6:,.1f} | {host * 1e6:,.1f} | {read / 1e6:,.1f} | "
                  f"{read / dev / 1e9:,.0f} | {read / dev / bw:.0%} | {dev / full:.2f}x |" if full else "")
        ffn.close()
        gpu.free(x, d * 4)
        gpu.free(y, d * 4)


if __name__ == "__main__":
    main()
