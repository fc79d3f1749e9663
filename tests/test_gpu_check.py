"""benchmarks/gpu_check.sh on a machine without a GPU, from a copy of the checkout in tmp_path (the
files git knows, tracked or new, none it ignores: no build/, no built extension, no venv).

The copy is what makes the path resolution real: the venv's `pip install -e .` maps pinfer to this
checkout, so a pinfer that imported "from wherever it is installed" would pass here whatever the
copy holds. The script must build the copy's extension and resolve every pinfer package into the
copy (build/pyroot). GPU_CHECK_ONLY=help keeps each run to build, pyroot and the --help checks;
CI runs the whole CPU half (.ci/run)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = "benchmarks/gpu_check.sh"


def _has_gpu():
    try:
        from cuda.bindings import driver as cu
        return cu.cuInit(0)[0] == cu.CUresult.CUDA_SUCCESS and cu.cuDeviceGetCount()[1] > 0
    except Exception:
        return False


@pytest.fixture
def copy(tmp_path):
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to copy")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           check=True, capture_output=True).stdout.decode().split("\0")
    dst = tmp_path / "repo"
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():           # a tracked file someone has just deleted is not copied
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    assert not (dst / "build").exists() and not list((dst / "pinfer" / "kernels").glob("_kernels*"))
    return dst


def run(repo, only="help", **env):
    e = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPU_CHECK_ONLY", "GPU_CHECK_NO_GPU")}
    e.update(PYTHON=sys.executable, GPU_CHECK_ONLY=only, **env)
    if _has_gpu():
        e["GPU_CHECK_NO_GPU"] = "1"
    # from another directory: the script finds its checkout by its own path
    return subprocess.run(["bash", str(repo / SCRIPT)], cwd=repo.parent, env=e, capture_output=True, text=True,
                          timeout=600)


def statuses(repo):
    result = json.loads((repo / "build" / "gpu_check" / "result.json").read_text())
    return {c["name"]: c["status"] for c in result["checks"]}


@pytest.mark.slow
def test_the_cpu_half_runs_from_a_clean_copy_and_again_over_its_leftovers(copy):
    # what the old script left behind: build/pyroot/pinfer/kernels linked to a kernels/ that moved
    stale = copy / "build" / "pyroot" / "pinfer"
    stale.mkdir(parents=True)
    (stale / "kernels").symlink_to(copy / "kernels")
    for attempt in (1, 2):
        p = run(copy)
        assert p.returncode == 0, f"run {attempt}:\n{p.stdout}\n{p.stderr}"
        lines = p.stdout.splitlines()
        assert lines[0].startswith("gpu_check: ") and " 0 failed" in lines[0], p.stdout
        assert lines[1] == "| check | status | seconds | what |"
        assert any(line.startswith("no GPU: CPU half only") for line in lines), p.stdout
        got = statuses(copy)
        assert {k: got[k] for k in ("build", "pyroot", "help-gpu_kernel", "help-hybrid_decode",
                                    "help-convert_scale")} == dict.fromkeys(
            ("build", "pyroot", "help-gpu_kernel", "help-hybrid_decode", "help-convert_scale"), "passed")
        assert got["tests"] == got["gpu-kernel"] == "skipped"
        assert (copy / "build" / "pyroot" / "pinfer" / "kernels").resolve() == copy / "pinfer" / "kernels"
        log = (copy / "build" / "gpu_check" / "pyroot.log").read_text()
        assert f"{'pinfer.kernels':32} {copy / 'pinfer' / 'kernels'}" in log
        assert f"{'pinfer.runtime':32} {copy / 'runtime'}" in log


@pytest.mark.slow
def test_a_package_missing_from_the_copy_fails_pyroot_and_nothing_else_runs(copy):
    """The venv's editable install would supply pinfer.cli from the real checkout: pyroot says so."""
    (copy / "cli" / "__init__.py").unlink()
    p = run(copy)
    assert p.returncode == 1, p.stdout + p.stderr
    assert p.stdout.splitlines()[0].startswith("gpu_check: ") and " 1 failed" in p.stdout.splitlines()[0]
    got = statuses(copy)
    assert got["build"] == "passed" and got["pyroot"] == "failed"
    assert got["help-gpu_kernel"] == "skipped" and "| help-gpu_kernel | skipped | 0.0 | not run: pyroot failed |" in p.stdout
    assert "pyroot: not in this checkout: pinfer.cli (cli/__init__.py)" in p.stdout


@pytest.mark.parametrize("gone", ["tests/test_device_plumbing.py", "benchmarks/hybrid_decode.py",
                                  "pinfer/kernels/__init__.py"])
def test_a_missing_file_is_named_before_anything_runs(copy, gone):
    (copy / gone).unlink()
    p = run(copy, only="")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [f"gpu_check: missing from this checkout ({copy}): {gone}"]
    assert not (copy / "build").exists()


def test_a_missing_python_package_is_one_line(copy, tmp_path):
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(
        "import sys\n"
        "class Hide:\n"
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        if name.partition('.')[0] == 'gguf':\n"
        "            raise ModuleNotFoundError(name)\n"
        "sys.meta_path.insert(0, Hide)\n")
    p = run(copy, only="", PYTHONPATH=str(hide))
    assert p.returncode == 2
    (line,) = p.stderr.strip().splitlines()
    assert line.startswith(f"gpu_check: missing Python packages for {sys.executable}: gguf ("), line
