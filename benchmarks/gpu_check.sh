#!/usr/bin/env bash
# The GPU half of the checks, for a machine with an NVIDIA GPU and no network, run from the
# repository root (about 6 minutes on an H200 with 16 cores):
#   bash benchmarks/gpu_check.sh            (LAYERS=8 THREADS=8 PYTHON=python3 to change)
# 1. builds pinfer's C kernels in place (no network: the Python packages must be there already);
# 2. the GPU tests: the CUDA kernels against the CPU kernel (same survivors), the hybrid step and
#    a whole model against the CPU, the dense part on the CUDA provider where onnxruntime-gpu is
#    installed (tests/test_hybrid.py), and the device plumbing (tests/test_device_plumbing.py:
#    the CPU half, which CI runs too);
# 3. benchmarks/gpu_kernel.py: the FFN kernel at 100% and 10% active against the copy bandwidth;
# 4. benchmarks/hybrid_decode.py at LLaMA-7B's and 13B's shapes (LAYERS layers): CPU only vs
#    hybrid at 30% and 60% of the FFN in VRAM vs all of it, the dense part on the CPU provider,
#    then on the CUDA provider where onnxruntime-gpu is installed.
# 5. with CONVERT_SCALE=1 (about 10 more minutes): benchmarks/convert_scale.py, the converter's
#    calibration and predictor training on the GPU over all 32 layers of a LLaMA-7B-shaped model.
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
status=0
$PY -m pytest -q -rs tests/test_hybrid.py tests/test_device_plumbing.py tests/test_calib_device.py || status=1
$PY benchmarks/gpu_kernel.py --shapes 7b,13b || status=1
dense="cpu"
if $PY -c "import onnxruntime, sys; sys.exit('CUDAExecutionProvider' not in onnxruntime.get_available_providers())"; then
    dense="cpu gpu"
else
    echo "gpu_check: this onnxruntime has no CUDA provider: the dense part runs on the CPU provider only" >&2
fi
for shape in 7b 13b; do
    for dd in $dense; do
        $PY benchmarks/hybrid_decode.py --shape $shape --layers "${LAYERS:-8}" --threads "${THREADS:-8}" \
            --dense-device "$dd" --tokens 16 --repeats 3 --cache build/synthetic || status=1
    done
done
if [ "${CONVERT_SCALE:-0}" = 1 ]; then
    $PY benchmarks/convert_scale.py --calib-device cuda --cache build/synthetic || status=1
fi
exit $status
