"""The converter at LLaMA-7B's shapes: calibration and predictor training per layer, peak RSS, and
a projection for 32 layers.

    python benchmarks/convert_scale.py [--shape 7b] [--layers 2] [--calib-tokens 4096] [--heldout-tokens 2048]

The model is random Q4_0 weights in LLaMA-7B's shapes (d_model 4096, n_ff 11008, 32 heads, vocab
32000) with a ReLU FFN (about half the neurons of a layer fire for random inputs), written once
under ~/.cache/pinfer/synthetic by synthetic_decode.write_gguf. `pinfer convert --sparsity auto
--no-early-check` runs on it in its own process (the early answer skipped: the passes are what is
measured); its per-layer progress lines give each layer's calibration time, its report the split
(forward, predictor training, held-out streams, head), and wait4 the child's peak RSS.

On a CPU, --layers 2 to 4 and a projection: the per-layer time times 32 plus the head, stated as
a projection. Where PyTorch sees a GPU, --calib-device auto calibrates there and --layers defaults
to all 32 (the issue's bound: calibration plus predictor training in at most 10 minutes).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from synthetic_decode import CACHE, SHAPES, write_gguf


def run_convert(gguf_path, out, a):
    cmd = [sys.executable, "-m", "pinfer", "convert", str(gguf_path), "-o", str(out), "--force", "--sparsity", "auto",
           "--no-early-check", "--calib-device", a.calib_device, "--calib-tokens", str(a.calib_tokens), "--heldout-tokens", str(a.heldout_tokens)]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    lines = []
    for line in p.stderr:
        lines.append(line)
        if "calibrate: layer" in line or "sparsity:" in line or "verify:" in line:
            print("  " + line.strip(), file=sys.stderr, flush=True)
    _, status, usage = os.wait4(p.pid, 0)
    if status:
        sys.exit("convert_scale: the conversion failed:\n" + "".join(lines[-20:]))
    return time.perf_counter() - t0, usage.ru_maxrss * 1024, lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=None, help="default: 32 on a GPU, 2 on the CPU")
    ap.add_argument("--calib-device", default="auto", choices=("auto", "cpu", "cuda"))
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--heldout-tokens", type=int, default=2048)
    ap.add_argument("--cache", type=Path, default=CACHE)
    a = ap.parse_args(argv)
    if a.layers is None:
        import torch
        a.layers = 32 if a.calib_device != "cpu" and torch.cuda.is_available() else 2
    d, n_ff, n_head, vocab = SHAPES[a.shape]
    a.cache.mkdir(parents=True, exist_ok=True)
    gguf_path = a.cache / f"synthetic-{a.shape}-{a.layers}L-relu.Q4_0.gguf"
    if not gguf_path.exists():
        write_gguf(gguf_path, a.shape, a.layers, ffn_act="relu")
    out = gguf_path.with_suffix(".pinf")
    wall, peak, lines = run_convert(gguf_path, out, a)
    stamps = [float(m.group(2)) for line in lines if (m := re.search(r"calibrate: layer (\d+)/\d+ \(([\d.]+) s[;)]", line))]
    per_layer = [b - a_ for a_, b in zip([0.0] + stamps, stamps)]
    report = json.loads(Path(str(out) + ".report.json").read_text())
    split = report["sparsity"]["seconds"]
    layer_f32 = (4 * d * d + 3 * d * n_ff) * 4
    steady = per_layer[1:] or per_layer          # the first layer also pays start-up
    mean = sum(steady) / len(steady)
    print(f"\n{a.shape}-shaped (d_model {d}, n_ff {n_ff}, {n_head} heads, vocab {vocab}), {a.layers} layers, ReLU FFN, "
          f"Q4_0; {a.calib_tokens} calibration + {a.heldout_tokens} held-out tokens; {os.cpu_count()} CPU cores\n")
    print("| layer | calibration + predictor + held-out, s |\n| ---: | ---: |")
    for i, s in enumerate(per_layer):
        print(f"| {i} | {s:.1f} |")
    print(f"\nsplit over all layers: {', '.join(f'{k} {v:.1f} s' for k, v in split.items())}; conversion wall {wall:.0f} s")
    print(f"peak RSS {peak / 1e9:.2f} GB; one layer's FP32 weights {layer_f32 / 1e9:.2f} GB, + 2 GB = "
          f"{(layer_f32 + 2e9) / 1e9:.2f} GB")
    print(f"calibration ran on {report['sparsity'].get('device', 'the CPU')}; per layer it took "
          f"{report['sparsity'].get('cost_over_forward', float('nan')):.2f}x the layer's own forward pass over the "
          f"calibration tokens (the issue's bound: 3x)")
    if a.layers >= 32:
        print(f"measured for {a.layers} layers: {sum(per_layer):.0f} s of layers + head {split.get('head', 0):.0f} s = "
              f"{(sum(per_layer) + split.get('head', 0)) / 60:.1f} min of calibration and predictor training")
    else:
        print(f"projection for 32 layers (not measured): 32 x {mean:.0f} s + head {split.get('head', 0):.0f} s = "
              f"{(32 * mean + split.get('head', 0)) / 60:.0f} min of calibration at these token counts")


if __name__ == "__main__":
    main()
