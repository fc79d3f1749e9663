"""Where a decode token's time goes: every step of pinfer's per-token loop timed on its own.

    python benchmarks/decode_profile.py MODEL.pinf [--threads 1 2] [--tokens 64] [--prompt 16]
        [--sparsity RULE] [--ffn-kernel auto|on|off] [--dense-kernel on|off]

After a prompt, --tokens decode calls; each step of Model.forward (the per-layer ONNX Runtime
sessions or the C attention calls, pinfer's FFN kernel or the NumPy rule and down projection, the
head session or the C head, the embedding and the writes before the layers) is wrapped with a
timer, and what the wrappers do not see is Python between them. Per thread count: ms per token by step kind, its share, the process's
CPU time over wall time (cores busy on average), and the token rate with the profiler's own
overhead (a few microseconds per step) in it.
The rate here is not a benchmark: benchmarks/smollm2_vs_llamacpp.py is.
"""

import argparse
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def kind_of(step):
    """A readable name of one step callable: the ONNX session or the function it runs."""
    owner = getattr(step, "__self__", None)
    if owner is not None and type(owner).__name__ == "Bound":
        inputs = {i.name for i in owner.sess.get_inputs()}
        if "resid" not in inputs:
            return "onnx down projection (MatMulNBits)"
        full = any(o.name == "ffn_h" for o in owner.sess.get_outputs())
        return "onnx layer session (attention, gate/up)" if full else "onnx attention session"
    q = getattr(step, "__qualname__", type(step).__name__)
    return {"Steps._kernel.<locals>.step": "ffn kernel (fused)",
            "Steps._batch.<locals>.step": "ffn kernel (batch)",
            "AttentionStep.bind.<locals>.run": "attention (decode.c)"}.get(q, q.replace(".<locals>", ""))


def profile(path, threads, tokens, prompt, sparsity="", kernels="auto", dense_kernel="on"):
    from pinfer.runtime.model import Model, RuntimeOptions
    m = Model(path, RuntimeOptions(threads=threads, n_ctx=prompt + tokens + 8, sparsity=sparsity, kernels=kernels,
                                   dense_kernel=dense_kernel))
    ids = list(np.random.default_rng(0).integers(0, m.cfg.vocab, prompt))
    m.forward(ids)
    m.forward([ids[-1]])                 # the decode steps exist now
    spent = defaultdict(float)

    def timed(kind, fn):
        def run(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            spent[kind] += time.perf_counter() - t0
            return out
        return run
    m.bind_activations(1)
    m.steps.run = [timed(kind_of(s), s) for s in m.steps.run]
    if m.head is not None:      # made on a call's first need
        m.head.run = timed("onnx head session", m.head.run)
    if m.native_head is not None:
        m.native_head.step.bind = lambda *a, bind=m.native_head.step.bind: timed("head (decode.c)", bind(*a))
        m.native_head.bound_to = (None, None)       # bound again, timed
    m.start = timed("embedding and inputs", m.start)
    spent.clear()
    cpu0, t0 = time.process_time(), time.perf_counter()
    tok = ids[-1]
    for _ in range(tokens):
        tok = int(m.forward([tok]).argmax())
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return m, dict(spent), wall, cpu


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--sparsity", default="", help="a rule for every layer (RuntimeOptions.sparsity); default the file's")
    ap.add_argument("--ffn-kernel", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--dense-kernel", default="on", choices=("on", "off"),
                    help="off: attention and head through ONNX Runtime's sessions (RuntimeOptions.dense_kernel)")
    a = ap.parse_args(argv)
    from pinfer import kernels
    print(f"{a.model.name}: {a.tokens} decode tokens after a {a.prompt}-token prompt; {os.cpu_count()} CPU cores; "
          f"kernel ISA {kernels.sparse_isa()}")
    for t in a.threads:
        m, spent, wall, cpu = profile(a.model, t, a.tokens, a.prompt, a.sparsity, a.ffn_kernel, a.dense_kernel)
        per = {k: v / a.tokens * 1e3 for k, v in spent.items()}
        per["python between steps"] = wall / a.tokens * 1e3 - sum(per.values())
        total = wall / a.tokens * 1e3
        print(f"\n{t} thread{'s' * (t > 1)}: {1e3 / total:.1f} tok/s with the profiler, {total:.2f} ms/token, "
              f"CPU time / wall {cpu / wall:.2f} cores; {m.cfg.n_layer} layers, "
              f"{sum(L.ffn is not None for L in m.layers)} through the fused kernel")
        print("| step | ms/token | share |\n| --- | ---: | ---: |")
        for k, v in sorted(per.items(), key=lambda kv: -kv[1]):
            print(f"| {k} | {v:.3f} | {v / total:.1%} |")


if __name__ == "__main__":
    main()
