"""Memory and load time against llama.cpp on synthetic_decode.py's random LLaMA-shaped Q4_0 models:
`python -m benchmarks run memory` once per shape, on the files it writes once under
~/.cache/pinfer/synthetic (converted with `--sparsity none`).

    python benchmarks/memory.py [--shape 7b,13b] [--layers N] [--loads 3] [--threads 2] [--ctx 512]
        [--tokens 8] [--llama-python VENV/bin/python] [--pause 0] [--mmap] [--no-mmap] [--out FOLDER]

Every option but --shape, --layers and --cache goes to the memory suite (benchmarks/harness/memory.py
says what it measures and how); one result file per shape under benchmarks/results/ (--out: another
folder).
"""

import argparse
import sys
from pathlib import Path

import synthetic_decode  # benchmarks/ is on sys.path (benchmarks/__init__.py)
from harness.cli import main as harness


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="7b", help="comma-separated: 7b, 13b, tiny")
    ap.add_argument("--layers", type=int, default=0, help="layers (default: the shape's own, 32 or 40)")
    ap.add_argument("--cache", type=Path, default=synthetic_decode.CACHE)
    a, rest = ap.parse_known_args(argv)
    for shape in a.shape.split(","):
        n_layer = a.layers or {"7b": 32, "13b": 40, "tiny": 2}[shape]
        gguf, pinf = synthetic_decode.synthetic_model(shape, n_layer, a.cache)
        rc = harness(["run", "memory", "--model", str(gguf), "--pinf", str(pinf), *rest])
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    sys.exit(main())
