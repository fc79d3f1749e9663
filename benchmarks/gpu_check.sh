#!/usr/bin/env bash
# The GPU half of the checks, for a machine with an NVIDIA GPU, run from the repository root:
#   bash benchmarks/gpu_check.sh            (LAYERS=8 THREADS=8 PYTHON=python3 to change)
# 1. builds pinfer's C kernels in place (no network: the Python packages must be there already);
# 2. the GPU tests: the CUDA kernels against the CPU kernel and NumPy-checked references, the
#    hybrid step and a whole model against the CPU (tests/test_hybrid.py; skips name their reason);
# 3. benchmarks/hybrid_decode.py: a synthetic LLaMA-13B-shaped INT4 model, CPU only vs hybrid at
#    30% and 60% of the FFN in VRAM vs all of it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
missing=$($PY - <<'PY'
import importlib.util
need = ["numpy", "onnx", "onnxruntime", "gguf", "click", "tokenizers", "jinja2", "pytest", "cuda.bindings"]
print(" ".join(m for m in need if importlib.util.find_spec(m.split(".")[0]) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages: $missing (pip install -e '.[gpu,test]' where there is a network)" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
$PY setup.py -q build_ext --inplace >/dev/null
export PYTHONPATH="$PWD/build/pyroot${PYTHONPATH:+:$PYTHONPATH}"
$PY - <<'PY'
# a `pinfer` package tree from the repository's folders (what `pip install -e .` maps)
import os, pathlib
root = pathlib.Path("build/pyroot/pinfer")
root.mkdir(parents=True, exist_ok=True)
for name, src in {"formats": "formats", "converter": "converter", "runtime": "runtime", "cli": "cli",
                  "kernels": "kernels"}.items():
    link = root / name
    if not link.exists():
        link.symlink_to(pathlib.Path(src).resolve())
for f in pathlib.Path("pinfer").glob("*.py"):
    t = root / f.name
    if not t.exists():
        t.symlink_to(f.resolve())
PY
$PY -m pytest -q -rs tests/test_hybrid.py
$PY benchmarks/hybrid_decode.py --shape 13b --layers "${LAYERS:-8}" --threads "${THREADS:-8}" --cache build/synthetic
