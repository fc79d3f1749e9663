"""One FFN layer for one token: pinfer's sparse kernel at several active fractions against its own
dense path and ONNX Runtime's MatMulNBits on the same layer, in one process.

    python benchmarks/sparse_kernel.py [--shapes 7b,13b,70b] [--threads 1,2] [--reps 20]
        [--fractions 0.05,0.1,0.25,0.5,1] [--rows-from 0.5]
    python benchmarks/sparse_kernel.py --batch 2,8,16,32,64 [--batch-active 0.1,0.25] [--shapes 7b]

Weights are random bytes in the layouts a converted file holds: INT4 (q4, group 32, f16 scale,
no min, the MatMulNBits convention) or FP16 gate/up bundles, and down_t rows of the same format.
"Active" neurons are drawn at random (no locality) and handed to the kernel as its candidate list;
every candidate survives (threshold 0), so the fraction is exact. Consecutive calls use disjoint
candidate sets (a random split of the neurons into 1/fraction sets, in turn), so a call finds
its rows in the CPU's caches no more than a token would: at the 7B shapes and up, the data between
two uses of a set exceeds a 32 MB L3. The SmolLM2 layer (1.6 MB) fits in cache whatever is done.
Bytes are the weight bytes the call reads; GB/s = bytes / median time. ONNX Runtime runs the
dense layer as MatMulNBits(gate|up) -> SiLU * up -> MatMulNBits(down), 4 bits, block 32,
accuracy level 4 (int8 activations, as pinfer's kernel), on the same number of threads; ours and
ONNX Runtime's dense layers are timed in alternating rounds. With int4 q4r down_t the kernel also
holds W_down (as the runtime does) and runs the down projection as row dots from ROWS_FROM of the
neurons surviving: "dense (ours)" and the 50% and 100% rows use them. `--rows-from 1.01` turns
them off (the axpy at every fraction, dense included) and `--fractions 0.3,0.4,0.5,0.6,0.7` with
both settings shows where the two ways cross (kernels.ROWS_FROM).
"""

import argparse
import statistics
import time

import numpy as np

from pinfer.kernels import ROWS_FROM, SparseFFN, sparse_isa

SHAPES = {"smollm2": (576, 1536), "7b": (4096, 11008), "13b": (5120, 13824), "70b": (8192, 28672)}
FRACTIONS = (0.05, 0.10, 0.25, 0.50, 1.00)


def random_layer(fmt, n, d, rng, down="q4"):
    """(gate_up (fmt, parts), down_t (fmt, parts)) with values of a plausible scale; down "q4r"
    keeps GGUF's groups of 32 neurons (a converted Q4_0 model's down_t), "q4" groups along d."""
    if fmt == "f16":
        gu = {"w": (rng.standard_normal((n, 2, d), np.float32) * 0.02).astype(np.float16)}
        dn = {"w": (rng.standard_normal((n, d), np.float32) * 0.02).astype(np.float16)}
        return ("f16", gu), ("f16", dn)
    gu = {"q": rng.integers(0, 256, (n, 2, d // 2), np.uint8),
          "scale": np.full((n, 2, d // 32), 0.003, np.float16)}
    if down == "q4r":
        dn = {"q": rng.integers(0, 256, (n, d // 2), np.uint8), "scale": np.full((n // 32, d), 0.003, np.float16)}
        return ("q4", gu), ("q4r", dn)
    dn = {"q": rng.integers(0, 256, (n, d // 2), np.uint8), "scale": np.full((n, d // 32), 0.003, np.float16)}
    return ("q4", gu), ("q4", dn)


def ort_layer(gu, dn_fmt, dn, n, d, threads):
    """ONNX Runtime session of the same dense layer; the down weight is re-laid out (d, n) for
    MatMulNBits' [N, K] convention."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper
    from pinfer.formats import blocks

    # down_t rows j = column j of W_down; MatMulNBits wants rows i of W_down (d, n), groups along n
    w_down = blocks.dequantize(dn_fmt, dn).T.copy()
    g = w_down.reshape(d, n // 32, 32)
    scale = (np.abs(g).max(-1) / 7).astype(np.float16)
    inv = np.divide(1, scale.astype(np.float32), out=np.zeros(scale.shape, np.float32), where=scale != 0)
    q = np.clip(np.rint(g * inv[..., None]) + 8, 0, 15).astype(np.uint8)
    q_down = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    inits = [
        numpy_helper.from_array(gu["q"].reshape(2 * n, d // 32, 16), "gu_q"),
        numpy_helper.from_array(gu["scale"].astype(np.float32).reshape(-1), "gu_s"),
        numpy_helper.from_array(q_down, "dn_q"),
        numpy_helper.from_array(scale.astype(np.float32).reshape(-1), "dn_s"),
        numpy_helper.from_array(np.array([-1, n, 2], np.int64), "shape3"),
        numpy_helper.from_array(np.array([-1, n], np.int64), "shape2"),
    ]
    mm = dict(domain="com.microsoft", bits=4, block_size=32, accuracy_level=4)
    nodes = [
        helper.make_node("MatMulNBits", ["x", "gu_q", "gu_s"], ["gu"], K=d, N=2 * n, **mm),
        helper.make_node("Reshape", ["gu", "shape3"], ["gu3"]),
        helper.make_node("Split", ["gu3"], ["g", "u"], axis=2, num_outputs=2),
        helper.make_node("Sigmoid", ["g"], ["sg"]),
        helper.make_node("Mul", ["g", "sg"], ["a"]),
        helper.make_node("Mul", ["a", "u"], ["h3"]),
        helper.make_node("Reshape", ["h3", "shape2"], ["h"]),
        helper.make_node("MatMulNBits", ["h", "dn_q", "dn_s"], ["y"], K=n, N=d, **mm),
    ]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", d])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["tokens", d])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda x: sess.run(None, {"x": x.reshape(-1, d)})


def median_time(fn, reps):
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def rotating_sets(ffn, x, y, n, frac, rng):
    """A call of the layer whose candidates are the next of int(1/frac) disjoint random sets."""
    k = max(1, int(round(1 / frac)))
    size = int(round(frac * n))
    order = rng.permutation(n)
    sets = [np.sort(order[i * size:(i + 1) * size]).astype(np.int32) for i in range(k)]
    run, state = ffn.bind(x, y, "given"), {"i": 0}

    def call():
        s = sets[state["i"] % k]
        state["i"] += 1
        ffn.set_candidates(s)
        return run()
    return call


def power_law_sets(n, frac, count, rng, alpha=1.0):
    """`count` active sets drawn as benchmarks/synthetic_decode.py draws them: neuron j (hot first)
    fires with probability min(1, c (j+1)^-alpha), mean frac."""
    base = np.arange(1, n + 1, dtype=np.float64) ** -alpha
    lo, hi = 0.0, float(n)
    for _ in range(100):
        c = (lo + hi) / 2
        lo, hi = (c, hi) if np.minimum(1.0, c * base).mean() < frac else (lo, c)
    p = np.minimum(1.0, c * base)
    return [np.flatnonzero(rng.random(n) < p).astype(np.int32) for _ in range(count)]


def batch_table(a, rng):
    """Prompt processing: per token, the kernel's batch call over the union of power-law active
    sets against the same tokens' single calls and ONNX Runtime's dense layer on the whole batch."""
    print("\nPrompts (INT4, q4r down with W_down rows): ms per token of one layer; each token's active set "
          "drawn from the power law (alpha 1) at the given mean fraction\n")
    print("| shape | threads | active | tokens | union of sets | single calls | batch call | ORT dense batch "
          "| batch vs single | batch vs ORT |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in a.shapes.split(","):
        d, n = SHAPES[shape]
        gu, dn = random_layer("q4", n, d, rng, "q4r")
        for threads in map(int, a.threads.split(",")):
            ffn = SparseFFN(gu, dn, n, d, threads=threads, down_rows="transpose", rows_from=a.rows_from)
            run_ort = ort_layer(gu[1], dn[0], dn[1], n, d, threads)
            for frac in map(float, a.batch_active.split(",")):
                for nt in map(int, a.batch.split(",")):
                    x = rng.standard_normal((nt, d)).astype(np.float32)
                    y = np.empty_like(x)
                    reps = max(3, a.reps // 4)
                    sets = [power_law_sets(n, frac, nt, rng) for _ in range(reps + 1)]
                    single = ffn.bind(x[0], y[0], "given")
                    batch = ffn.bind_batch(x, y, "given")
                    it = {"s": 0, "b": 0}

                    def singles():
                        for s in sets[it["s"] % len(sets)]:
                            ffn.set_candidates(s)
                            single()
                        it["s"] += 1

                    def batched():
                        batch.set_candidates(sets[it["b"] % len(sets)])
                        batch()
                        it["b"] += 1
                    t_s, t_b, t_o = (median_time(f, reps) / nt for f in (singles, batched, lambda: run_ort(x)))
                    union = np.mean([len(np.unique(np.concatenate(s))) for s in sets]) / n
                    print(f"| {shape} | {threads} | {frac:.0%} | {nt} | {union:.0%} | {t_s * 1e3:.3f} | "
                          f"{t_b * 1e3:.3f} | {t_o * 1e3:.3f} | {t_s / t_b:.2f}x | {t_o / t_b:.2f}x |", flush=True)
            ffn = run_ort = None    # freed before the next thread count; the closures above still name them
        del gu, dn
    print("\nbatch vs single / vs ORT: how many times faster the batch call is (>1: faster).")


def row_bytes(fmt, d):
    return 2 * d if fmt == "f16" else d // 2 + 2 * (d // 32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="7b,13b,70b")
    ap.add_argument("--formats", default="int4,fp16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--down", choices=("q4", "q4r"), default="q4r",
                    help="int4 down_t layout: q4r (GGUF's groups of 32 neurons) or q4 (groups along d_model)")
    ap.add_argument("--fractions", default=",".join(str(f) for f in FRACTIONS))
    ap.add_argument("--rows-from", type=float, default=None,
                    help="share of surviving neurons from which int4 q4r runs the down projection as row "
                         "dots over W_down (default kernels.ROWS_FROM; above 1: never)")
    ap.add_argument("--batch", default=None,
                    help="prompt sizes, e.g. 8,16,32,64: time the batch call instead of the single-token table")
    ap.add_argument("--batch-active", default="0.1,0.25", help="mean active fractions of the --batch table")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    if a.batch:
        print(f"sparse kernels: {sparse_isa()} path")
        batch_table(a, rng)
        return
    rows = "never" if (a.rows_from or 0) > 1 else f"from {ROWS_FROM if a.rows_from is None else a.rows_from:.0%} surviving"
    print(f"sparse kernels: {sparse_isa()} path; int4 down_t as {a.down}; row dots over W_down (q4r): {rows}\n")
    print("| shape (d x n_ff) | format | threads | active | ms | GB/s | vs our dense | vs ORT MatMulNBits |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in a.shapes.split(","):
        d, n = SHAPES[shape]
        for fmt_name in a.formats.split(","):
            fmt = "f16" if fmt_name == "fp16" else "q4"
            gu, dn = random_layer(fmt, n, d, rng, a.down)
            x = rng.standard_normal(d).astype(np.float32)
            y = np.empty(d, np.float32)
            per_neuron = 3 * row_bytes(fmt, d)
            for threads in map(int, a.threads.split(",")):
                # int4 q4r: the kernel also holds W_down, for its row dots once half the neurons survive
                rows = "transpose" if dn[0] == "q4r" and (a.rows_from or 0) <= 1 else None
                ffn = SparseFFN(gu, dn, n, d, threads=threads, down_rows=rows, rows_from=a.rows_from)
                ort_t = None
                dense = ffn.bind(x, y, "dense")
                if fmt == "q4":    # ours and ONNX Runtime's dense layer in alternating rounds
                    run_ort = ort_layer(gu[1], dn[0], dn[1], n, d, threads)
                    rounds = [(median_time(dense, max(1, a.reps // 5)), median_time(lambda: run_ort(x), max(1, a.reps // 5)))
                              for _ in range(5)]
                    dense_t, ort_t = (statistics.median(r[k] for r in rounds) for k in (0, 1))
                else:
                    dense_t = median_time(dense, a.reps)
                print(f"| {shape} ({d} x {n}) | {fmt_name} | {threads} | dense (ours) | {dense_t * 1e3:.2f} "
                      f"| {n * per_neuron / dense_t / 1e9:.1f} | 1.00x | {f'{ort_t / dense_t:.2f}x' if ort_t else '-'} |")
                for frac in map(float, a.fractions.split(",")):
                    t = median_time(rotating_sets(ffn, x, y, n, frac, rng), a.reps)
                    gbs = round(frac * n) * per_neuron / t / 1e9
                    vs_ort = f"{ort_t / t:.2f}x" if ort_t else "-"
                    print(f"| {shape} ({d} x {n}) | {fmt_name} | {threads} | {frac:.0%} | {t * 1e3:.2f} | {gbs:.1f} "
                          f"| {dense_t / t:.2f}x | {vs_ort} |", flush=True)
                if ort_t:
                    gbs = n * per_neuron / ort_t / 1e9
                    print(f"| {shape} ({d} x {n}) | {fmt_name} | {threads} | ORT dense | {ort_t * 1e3:.2f} | {gbs:.1f} "
                          f"| {dense_t / ort_t:.2f}x | 1.00x |", flush=True)
            del gu, dn
    print("\nvs our dense / vs ORT: how many times faster this row is than that dense layer (>1: faster).")


if __name__ == "__main__":
    main()
