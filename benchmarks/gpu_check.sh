#!/usr/bin/env bash
# pinfer's GPU checks, run from any directory of a checkout (installed with `pip install -e .` or
# not; no network: the Python packages must be there already):
#   bash benchmarks/gpu_check.sh [--quick]
# On a machine with an NVIDIA GPU: at most 8 minutes (--quick: at most 4); without one: its CPU
# half (45 s to 2 minutes on 2 busy cores), then the line "no GPU: CPU half only", exit 0.
#
# Output: first a table of every check (passed / failed / skipped, seconds), then the tails of the
# failed checks' logs. Each check's log: build/gpu_check/<check>.log (stdout) and <check>.err
# (stderr); all of them: build/gpu_check/result.json (name, status, seconds, and the benchmarks'
# output and tables). Progress lines go to stderr, only where it is a terminal. Exit 0: every check
# that ran passed; 1: one failed, timed out or found no time left; 2: a file, a Python package or
# a tool is missing (one line says which) - before any check runs.
#
# The checks, each under `timeout` within the run's time bound:
#   build              setup.py build_ext --inplace (pinfer/kernels/_kernels*.so)
#   pyroot             build/pyroot/pinfer: a package tree of links to this checkout's folders (the
#                      package-dir mapping of pyproject.toml, made afresh each run), first on
#                      PYTHONPATH for every check after it; each pinfer package must import from it
#   help-<script>      --help of benchmarks/gpu_kernel.py, hybrid_decode.py, convert_scale.py
#   hybrid-cpu-split   benchmarks/hybrid_decode.py on a tiny model, the hot part on a second CPU kernel
#   planner            runtime/placement.py: tests/test_hybrid.py -k "plan or placement"
#   tests              tests/test_device_plumbing.py (the dense part's GPU code path on an emulated
#                      device), tests/test_hybrid.py and tests/test_calib_device.py (their GPU tests
#                      skip themselves without a GPU, saying why)
#   GPU only: gpu-kernel (benchmarks/gpu_kernel.py, the FFN kernel at 100% and 10% active against
#   the copy bandwidth); hybrid-<7b|13b>-<cpu|gpu> (benchmarks/hybrid_decode.py, LAYERS layers:
#   CPU only vs hybrid at 30% and 60% of the FFN in VRAM vs all of it, the dense part on ONNX
#   Runtime's CPU provider, and on its CUDA provider where onnxruntime-gpu is installed); with
#   CONVERT_SCALE=1 (up to 12 more minutes): convert-scale (benchmarks/convert_scale.py, the
#   converter's calibration and predictor training on the GPU at LLaMA-7B's shapes).
#   --quick: 7b only, LAYERS=4, fewer tokens and kernel calls.
# A GPU is there when cuda-python's driver API counts one (any error: no GPU).
#
# Knobs (environment): PYTHON (default python3), LAYERS (8; --quick 4), THREADS (8),
#   CONVERT_SCALE=1, GPU_CHECK_ONLY=check,check,... (only these, besides build and pyroot which
#   always run; a prefix such as "help" or "hybrid" selects its group; the others are listed as
#   skipped), GPU_CHECK_NO_GPU=1 (the CPU half even where a GPU is found).
set -uo pipefail
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
START=$(now_ms)
case ${PYTHON:-} in /*|'') ;; */*) PYTHON=$PWD/$PYTHON ;; esac   # relative to where it was started
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
QUICK=0
for arg in "$@"; do
    case $arg in
        --quick) QUICK=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check: unknown argument '$arg' (--quick, --help)" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-python3}
if ! command -v "$PY" >/dev/null; then
    echo "gpu_check: no Python at '$PY' (set PYTHON)" >&2; exit 2
fi
if ! command -v timeout >/dev/null; then
    echo "gpu_check: needs 'timeout' (GNU coreutils)" >&2; exit 2
fi
NEED_FILES="setup.py pyproject.toml pinfer/__init__.py pinfer/kernels/__init__.py runtime/placement.py
    tests/conftest.py tests/fixtures.py tests/test_device_plumbing.py tests/test_hybrid.py tests/test_calib_device.py
    benchmarks/gpu_kernel.py benchmarks/hybrid_decode.py benchmarks/convert_scale.py benchmarks/synthetic_decode.py"
missing=""
for f in $NEED_FILES; do [ -e "$f" ] || missing="$missing $f"; done
if [ -n "$missing" ]; then
    echo "gpu_check: missing from this checkout ($ROOT):$missing" >&2; exit 2
fi
missing=$("$PY" - <<'PY'
import importlib.util
need = ["numpy", "onnx", "onnxruntime", "gguf", "click", "tokenizers", "jinja2", "pytest", "torch", "setuptools"]
def absent(m):
    try:
        return importlib.util.find_spec(m) is None
    except Exception:
        return True
print(" ".join(m for m in need if absent(m)))
PY
) || { echo "gpu_check: $PY could not run" >&2; exit 2; }
if [ -n "$missing" ]; then
    echo "gpu_check: missing Python packages for $PY: $missing (pip install -e '.[test,convert]' where there is a network)" >&2
    exit 2
fi

# -- a GPU? ---------------------------------------------------------------------------------------
probe=$(timeout 60 "$PY" - <<'PY' 2>/dev/null
try:
    from cuda.bindings import driver as cu
    (status,) = cu.cuInit(0)
    if status != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuInit: {status.name}")
    status, n = cu.cuDeviceGetCount()
    if status != cu.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuDeviceGetCount: {status.name}")
    print(n, "devices" if n else "cuda-python counts no device")
except BaseException as e:
    print(0, f"cuda-python: {type(e).__name__}: {e}".splitlines()[0].split(". ")[0][:120])
PY
) || probe="0 the cuda-python probe did not finish"
ngpu=${probe%% *}
case $ngpu in ''|*[!0-9]*) ngpu=0 ;; esac
why=${probe#* }
if [ "${GPU_CHECK_NO_GPU:-0}" = 1 ]; then ngpu=0; why="GPU_CHECK_NO_GPU=1"; fi
GPU=0; gpu_name=""
if [ "$ngpu" -gt 0 ]; then
    GPU=1
    gpu_name=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)
    nvrtc=$("$PY" -c "from cuda.bindings import nvrtc; print(nvrtc.nvrtcVersion()[1:])" 2>&1) || {
        echo "gpu_check: a GPU is here but NVRTC is not usable: ${nvrtc##*$'\n'} (pip install -e '.[gpu]')" >&2; exit 2; }
fi

# -- the run's bound and the checks' bookkeeping --------------------------------------------------
if [ $QUICK = 1 ]; then BUDGET=240; LAYERS=${LAYERS:-4}; else BUDGET=480; LAYERS=${LAYERS:-8}; fi
THREADS=${THREADS:-8}
[ "${CONVERT_SCALE:-0}" = 1 ] && [ $GPU = 1 ] && BUDGET=$((BUDGET + 720))
DEADLINE=$((START + (BUDGET - 10) * 1000))          # 10 s for the summary
OUT=$ROOT/build/gpu_check
rm -rf "$OUT" && mkdir -p "$OUT" || { echo "gpu_check: cannot make $OUT" >&2; exit 2; }
TSV=$OUT/checks.tsv
: >"$TSV"
FAILED=0
BROKEN=""                                           # build or pyroot, where one failed: nothing else runs
record() {  # name status seconds note kind
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" >>"$TSV"
    if [ -t 2 ]; then echo "gpu_check: $1: $2 ($3 s) $4" >&2; fi
}
selected() {   # build and pyroot always run: every other check needs them
    [ -z "${GPU_CHECK_ONLY:-}" ] || [ "$1" = build ] || [ "$1" = pyroot ] && return 0
    local item
    for item in ${GPU_CHECK_ONLY//,/ }; do
        case $1 in "$item"|"$item"-*) return 0 ;; esac
    done
    return 1
}
# check NAME CAP_SECONDS KIND NOTE -- COMMAND...: runs COMMAND in build/gpu_check under timeout.
check() {
    local name=$1 cap=$2 kind=$3 note=$4; shift 5
    if ! selected "$name"; then record "$name" skipped 0 "not in GPU_CHECK_ONLY" "$kind"; return; fi
    if [ -n "$BROKEN" ]; then record "$name" skipped 0 "not run: $BROKEN failed" "$kind"; FAILED=1; return; fi
    local t0 left rc secs
    t0=$(now_ms)
    left=$(( (DEADLINE - t0) / 1000 ))
    if [ "$left" -lt 15 ]; then
        record "$name" skipped 0 "no time left in the ${BUDGET} s bound" "$kind"; FAILED=1; return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    if [ -t 2 ]; then echo "gpu_check: $name ..." >&2; fi
    (cd "$OUT" && timeout -k 5 "$cap" "$@") >"$OUT/$name.log" 2>"$OUT/$name.err"
    rc=$?
    secs=$(awk -v ms=$(( $(now_ms) - t0 )) 'BEGIN { printf "%.1f", ms / 1000 }')
    if [ $rc = 0 ]; then
        record "$name" passed "$secs" "$note" "$kind"
    elif [ $rc = 124 ] || [ $rc = 137 ]; then
        record "$name" failed "$secs" "timed out after $cap s; $note" "$kind"; FAILED=1
    else
        record "$name" failed "$secs" "exit $rc; $note" "$kind"; FAILED=1
    fi
    if [ $rc != 0 ] && [ "$kind" = step ] && { [ "$name" = build ] || [ "$name" = pyroot ]; }; then BROKEN=$name; fi
}
skip() { record "$1" skipped 0 "$2" bench; }
if [ $GPU = 0 ] && [ "${GPU_CHECK_NO_GPU:-0}" != 1 ] && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
    record gpu-probe failed 0 "nvidia-smi lists a GPU that cuda-python cannot use ($why)" step; FAILED=1
fi

# -- the checks -----------------------------------------------------------------------------------
check build 180 step "setup.py build_ext --inplace" -- bash -c 'cd "$1" && exec "$2" setup.py build_ext --inplace' _ "$ROOT" "$PY"

rm -rf "$ROOT/build/pyroot"                         # links of an earlier run, dangling or not
export PYTHONPATH="$ROOT/build/pyroot${PYTHONPATH:+:$PYTHONPATH}"
check pyroot 60 step "pinfer's packages from build/pyroot" -- "$PY" - "$ROOT" <<'PY'
# A `pinfer` package tree of links to this checkout's folders, as pyproject.toml maps them for
# `pip install -e .`; then every package must import from this checkout, not from an installed pinfer.
import pathlib, subprocess, sys
root = pathlib.Path(sys.argv[1]).resolve()
try:
    import tomllib
    setup_cfg = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs, packages = setup_cfg["package-dir"], setup_cfg["packages"]
except ModuleNotFoundError:         # Python 3.10: pyproject.toml's mapping, by hand
    dirs = {"pinfer": "pinfer", "pinfer.formats": "formats", "pinfer.converter": "converter",
            "pinfer.runtime": "runtime", "pinfer.cli": "cli"}
    packages = ["pinfer", "pinfer.formats", "pinfer.converter", "pinfer.runtime", "pinfer.cli", "pinfer.kernels"]

def src(pkg):
    """The folder of a package in this checkout: its own mapping, else its parent's plus its name."""
    if pkg in dirs:
        return root / dirs[pkg]
    parent, _, name = pkg.rpartition(".")
    return src(parent) / name

tree = root / "build" / "pyroot"
top = tree / "pinfer"
top.mkdir(parents=True)
for entry in sorted(src("pinfer").iterdir()):
    if entry.name != "__pycache__":
        (top / entry.name).symlink_to(entry)
for pkg in packages:
    parts = pkg.split(".")
    if len(parts) == 2 and src(pkg) != src("pinfer") / parts[1]:
        link = top / parts[1]
        if link.is_symlink():
            link.unlink()
        link.symlink_to(src(pkg))
bad = [f"{pkg} ({src(pkg).relative_to(root)}/__init__.py)" for pkg in packages
       if not (src(pkg) / "__init__.py").is_file()
       or (tree.joinpath(*pkg.split(".")) / "__init__.py").resolve() != (src(pkg) / "__init__.py").resolve()]
if bad:
    sys.exit("pyroot: not in this checkout: " + ", ".join(bad))
print(f"made {tree}")

probe = r'''
import importlib, importlib.util, pathlib, sys, ctypes
root = pathlib.Path(sys.argv[1])
sys.path[:] = [p for p in sys.path if pathlib.Path(p or ".").resolve() != root]
bad = []
for pkg, want in zip(sys.argv[2::2], sys.argv[3::2]):
    mod = importlib.import_module(pkg)
    got = pathlib.Path(mod.__file__).resolve().parent
    print(f"{pkg:32} {got}")
    if got != pathlib.Path(want):
        bad.append(f"{pkg} from {got}, not {want}")
spec = importlib.util.find_spec("pinfer.kernels._kernels")
if spec is None or spec.origin is None:
    bad.append("pinfer.kernels._kernels is not built")
else:
    ctypes.CDLL(spec.origin)
    print(f"{'pinfer.kernels._kernels':32} {spec.origin}")
    if pathlib.Path(spec.origin).resolve().parent != root / "pinfer" / "kernels":
        bad.append(f"pinfer.kernels._kernels from {spec.origin}")
importlib.import_module("pinfer.runtime.placement")
if bad:
    sys.exit("pyroot: " + "; ".join(bad))
'''
args = [a for pkg in packages for a in (pkg, str(src(pkg).resolve()))]
sys.exit(subprocess.run([sys.executable, "-c", probe, str(root), *args]).returncode)
PY

for s in gpu_kernel hybrid_decode convert_scale; do
    check "help-$s" 30 step "benchmarks/$s.py --help" -- "$PY" "$ROOT/benchmarks/$s.py" --help
done
check hybrid-cpu-split 60 step "hybrid_decode.py on a tiny model, hot part on a second CPU kernel" -- \
    "$PY" "$ROOT/benchmarks/hybrid_decode.py" --device cpu-split --shape tiny --layers 2 --tokens 4 --repeats 1 \
    --threads 2 --cache "$ROOT/build/synthetic"
T=$ROOT/tests
check planner 120 step "runtime/placement.py: test_hybrid.py -k 'plan or placement'" -- \
    "$PY" -m pytest -q -rs -p no:cacheprovider "$T/test_hybrid.py" -k "plan or placement"
check tests 300 step "test_device_plumbing, test_hybrid, test_calib_device$([ $GPU = 1 ] || echo ' (GPU tests skip)')" -- \
    "$PY" -m pytest -q -rs -p no:cacheprovider "$T/test_device_plumbing.py" "$T/test_hybrid.py" \
    "$T/test_calib_device.py" -k "not plan and not placement"

if [ $QUICK = 1 ]; then SHAPES="7b"; TOKENS=8; REPEATS=2; CALLS=50; else SHAPES="7b 13b"; TOKENS=16; REPEATS=3; CALLS=200; fi
if [ $GPU = 1 ]; then
    check gpu-kernel 90 bench "gpu_kernel.py --shapes ${SHAPES// /,} --calls $CALLS" -- \
        "$PY" "$ROOT/benchmarks/gpu_kernel.py" --shapes "${SHAPES// /,}" --calls "$CALLS"
    cuda_ep=0
    "$PY" -c "import onnxruntime, sys; sys.exit('CUDAExecutionProvider' not in onnxruntime.get_available_providers())" \
        2>/dev/null && cuda_ep=1
    for shape in 7b 13b; do
        for dd in cpu gpu; do
            name=hybrid-$shape-$dd
            if [ "${SHAPES/$shape/}" = "$SHAPES" ]; then skip "$name" "--quick: 7b only"; continue; fi
            if [ $dd = gpu ] && [ $cuda_ep = 0 ]; then
                skip "$name" "this onnxruntime has no CUDA provider (onnxruntime-gpu in its place)"; continue
            fi
            check "$name" 150 bench "hybrid_decode.py --shape $shape --layers $LAYERS --dense-device $dd" -- \
                "$PY" "$ROOT/benchmarks/hybrid_decode.py" --shape "$shape" --layers "$LAYERS" --threads "$THREADS" \
                --dense-device "$dd" --tokens "$TOKENS" --repeats "$REPEATS" --cache "$ROOT/build/synthetic"
        done
    done
    if [ "${CONVERT_SCALE:-0}" = 1 ]; then
        layers_arg=(); [ $QUICK = 1 ] && layers_arg=(--layers "$LAYERS")
        check convert-scale 720 bench "convert_scale.py --calib-device cuda" -- \
            "$PY" "$ROOT/benchmarks/convert_scale.py" --calib-device cuda "${layers_arg[@]}" --cache "$ROOT/build/synthetic"
    else
        skip convert-scale "CONVERT_SCALE=1 runs it"
    fi
else
    for name in gpu-kernel hybrid-7b-cpu hybrid-7b-gpu hybrid-13b-cpu hybrid-13b-gpu convert-scale; do
        skip "$name" "no GPU"
    done
fi

# -- the summary first, then the failures' logs ---------------------------------------------------
TOTAL=$(awk -v ms=$(( $(now_ms) - START )) 'BEGIN { printf "%.0f", ms / 1000 }')
"$PY" - "$TSV" "$OUT/result.json" "$GPU" "$gpu_name" "$why" "$QUICK" "$LAYERS" "$THREADS" "$TOTAL" "$BUDGET" <<'PY'
import json, pathlib, sys
tsv, result, gpu, gpu_name, why, quick, layers, threads, total, budget = sys.argv[1:]
rows = [line.split("\t") for line in pathlib.Path(tsv).read_text().splitlines() if line]
out = pathlib.Path(result).parent

def tables(text):
    """The markdown tables a benchmark prints, as lists of {column: cell}."""
    found, block = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif block:
            if len(block) > 2:
                found.append([dict(zip(block[0], r)) for r in block[2:]])
            block = []
    return found

checks = []
for name, status, secs, note, kind in rows:
    c = {"name": name, "status": status, "seconds": float(secs), "note": note}
    if status != "skipped":
        c["log"], c["stderr"] = str(out / f"{name}.log"), str(out / f"{name}.err")
    if kind == "bench" and status != "skipped":
        text = (out / f"{name}.log").read_text(errors="replace")
        c["stdout"], c["tables"] = text, tables(text)
    checks.append(c)
count = {s: sum(c["status"] == s for c in checks) for s in ("passed", "failed", "skipped")}
where = f"GPU: {gpu_name or 'found by cuda-python'}" if gpu == "1" else "no GPU"
print(f"gpu_check: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped in {total} s "
      f"({where}; {'--quick, ' if quick == '1' else ''}bound {budget} s; LAYERS={layers} THREADS={threads})")
print("| check | status | seconds | what |")
print("| --- | --- | ---: | --- |")
for c in checks:
    print(f"| {c['name']} | {c['status']} | {c['seconds']:.1f} | {c['note']} |")
pathlib.Path(result).write_text(json.dumps({
    "gpu": (gpu_name or "found by cuda-python") if gpu == "1" else None, "no_gpu_reason": None if gpu == "1" else why,
    "quick": quick == "1", "layers": int(layers), "threads": int(threads), "seconds": float(total),
    "bound_seconds": int(budget), "checks": checks}, indent=1) + "\n")
PY
[ $GPU = 1 ] || echo "no GPU: CPU half only ($why)"
while IFS=$'\t' read -r name status _; do
    [ "$status" = failed ] || continue
    for f in "$OUT/$name.log" "$OUT/$name.err"; do
        [ -s "$f" ] || continue
        echo
        echo "--- $name: the end of ${f#"$ROOT"/} ---"
        tail -n 20 "$f"
    done
done <"$TSV"
echo "logs and result.json: ${OUT#"$ROOT"/}/"
exit $FAILED
