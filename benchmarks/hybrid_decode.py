"""Decode speed with each layer's FFN split between an NVIDIA GPU (hot neurons) and the CPU (cold
ones): CPU only vs hybrid with about 30% and 60% of the FFN in VRAM vs the whole FFN on the GPU,
in one run, on a synthetic INT4 model in LLaMA-13B's shapes whose active sets follow a power law.

    python benchmarks/hybrid_decode.py [--shape 13b] [--layers 8] [--active 0.10] [--shares 0.3,0.6]
        [--threads 4] [--tokens 32] [--repeats 3]
    python benchmarks/hybrid_decode.py --model smollm2.pinf     # a converted model, its own modes

The model and its active sets are benchmarks/synthetic_decode.py's (random Q4_0 weights, neuron j
fires with probability min(1, c (j+1)^-alpha) in the hot-first order). --vram-budget is set for
each share from the planner's own byte count (runtime/placement.py), and the plan is printed.
The planner ranks neurons by the same power law (Model.set_active_sets' hotness), so each layer's
hottest neurons go first. Attention, norms and the head run on ONNX Runtime's CPU provider, or
with --dense-device gpu on its CUDA provider in FP16 (onnxruntime-gpu). Needs a GPU and
pinfer[gpu]; prints one sentence and exits 2 without.
"""

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from synthetic_decode import CACHE, SHAPES, decode_rate, draws, power_law, synthetic_model  # see benchmarks/__init__.py


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a converted .pinf (e.g. SmolLM2) run with its own modes "
                                                "instead of the synthetic model")
    ap.add_argument("--shape", choices=list(SHAPES), default="13b")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--active", type=float, default=0.10)
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--shares", default="0.3,0.6", help="FFN shares to fit in VRAM besides 0 and 1")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=Path, default=CACHE)
    ap.add_argument("--device", choices=["gpu", "cpu-split"], default="gpu",
                    help="cpu-split: the hot half on a second CPU kernel, a check of this script without a GPU")
    ap.add_argument("--dense-device", choices=["cpu", "gpu", "emulated-gpu"], default="cpu",
                    help="where attention, norms and the head run (emulated-gpu: the GPU's code path on the CPU)")
    a = ap.parse_args(argv)

    from pinfer.kernels.gpu import GpuError
    from pinfer.runtime import placement
    from pinfer.runtime.model import Model, RuntimeOptions

    pinf = a.model or synthetic_model(a.shape, a.layers, a.cache)[1]
    try:
        m = Model(pinf, RuntimeOptions(threads=a.threads, n_ctx=256, device=a.device, vram_budget=0.0,
                                       dense_device=a.dense_device))
    except GpuError as e:
        print(f"hybrid_decode: {e}", file=sys.stderr)
        sys.exit(2)
    cfg, n_ff = m.cfg, m.cfg.n_ff
    modes = [L.rule.rule.mode for L in m.layers] if a.model else ["given"] * cfg.n_layer
    specs = [spec for spec, _ in placement.layer_specs(m.reader, cfg, modes)]
    if a.model:
        mass = placement.activation_mass(m.reader, cfg, modes)
    else:
        mass = np.tile(power_law(n_ff, a.active, a.alpha), (cfg.n_layer, 1))
    reserved = sum(m.devices.reserved().values())
    rng = np.random.default_rng(0)
    rows = []
    for share in [0.0] + [float(s) for s in a.shares.split(",")] + [1.0]:
        k = min(n_ff, int(round(share * n_ff / 64)) * 64)
        need = reserved + sum(spec.nbytes(k) for spec in specs if spec is not None)
        m.options = replace(m.options, vram_budget=(need + 4096) / placement.GIB)   # + rounding slack
        said = len(m.notes)
        if a.model:
            m.set_sparsity("")          # plans, notes the plan, moves the hot neurons
        else:
            draw, _ = draws(mass[0], cfg.n_layer, a.tokens * a.repeats, rng)
            m.set_active_sets(draw, hotness=mass)
        for note in m.notes[said:]:
            print(note.describe(), file=sys.stderr)
        rates = [decode_rate(m, a.tokens) for _ in range(a.repeats)]
        hot = sum(m.plan.hot) / (cfg.n_layer * n_ff)
        on_gpu = float(np.mean([mass[i, :h].sum() / max(mass[i].sum(), 1e-12) for i, h in enumerate(m.plan.hot)]))
        rows.append((share, hot, on_gpu, m.plan.total / 2**20, statistics.median(rates)))
    base = rows[0][-1]
    what = (f"{pinf.name}, its own modes" if a.model else
            f"{a.shape}-shaped, {a.layers} layers, Q4_0; {a.active:.0%} active, power-law alpha {a.alpha}")
    print(f"\n{what}; {a.threads} CPU threads; hot part on {m.devices.gpu.name if m.devices.gpu else a.device}; dense part on "
          f"{m.devices.dense}; {a.tokens} tokens x {a.repeats} repeats (median)\n")
    print("| FFN share asked | hot neurons | activation mass on GPU | VRAM planned | tok/s | vs CPU only |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for share, hot, on_gpu, mib, tok_s in rows:
        print(f"| {share:.0%} | {hot:.1%} | {on_gpu:.1%} | {mib:,.0f} MiB | {tok_s:.2f} | {tok_s / base:.2f}x |")


if __name__ == "__main__":
    main()
