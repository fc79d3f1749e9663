"""What a result file says besides the figures: the machine, the versions, the commit, the files
measured; and the figures' summaries (median, range). Standard library only (numpy and pinfer
are imported where their versions are read)."""

import hashlib
import json
import os
import platform
import statistics
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from . import ROOT

SCHEMA = 1
NOT_AVAILABLE = "not available (no --llama-python)"
# The CPU flags that decide which kernels either engine takes.
FLAGS = ("avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
         "amx_tile", "amx_int8", "amx_bf16")


def machine():
    """{cpu, cores, ram_bytes, kernel, flags, summary} of this machine (Linux's /proc; elsewhere
    what platform says)."""
    name, flags, ram = platform.processor() or "unknown CPU", set(), None
    try:
        for line in open("/proc/cpuinfo"):
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("unknown CPU", platform.processor()):
                name = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal:"):
                ram = int(line.split()[1]) * 1024
    except OSError:
        pass
    have = [f for f in FLAGS if f in flags]
    out = {"cpu": name, "cores": os.cpu_count(), "ram_bytes": ram, "kernel": f"{platform.system()} {platform.release()}",
           "flags": have}
    out["summary"] = (f"{name}, {out['cores']} cores" + (f", {ram / 2**30:.0f} GiB" if ram else "")
                      + f", {' '.join(have) or 'no AVX2'}")
    return out


# The memory suite's prompt, fed one token a call by both engines before its decode: ids under every
# vocabulary's size (its random models' too).
MEMORY_PROMPT = [1, 45, 74, 31, 34]


def process_memory():
    """{VmRSS, VmHWM, RssAnon, RssFile: bytes} of this process, from /proc/self/status."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def git_state():
    """{commit, short, dirty, diff_sha256} of the checkout: diff_sha256 names the uncommitted
    changes (`git diff HEAD`, and the untracked files' names and bytes) a run measured, where there
    are any. What the harness itself writes (results, the page, its plots) does not count: a run
    of `make bench` after the first is not "uncommitted changes" for the first one's file."""
    def git(*args):
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout

    own = [":(exclude)benchmarks/results", ":(exclude)docs/benchmarks.md", ":(exclude)docs/img/benchmarks"]
    try:
        commit = git("rev-parse", "HEAD").strip()
        diff = git("diff", "HEAD", "--", ".", *own)
        untracked = git("ls-files", "--others", "--exclude-standard", "--", ".", *own).split()
    except OSError:
        return {"commit": "unknown", "short": "unknown", "dirty": None, "diff_sha256": None}
    dirty = bool(diff or untracked)
    h = hashlib.sha256(diff.encode())
    for name in untracked:
        path = ROOT / name
        h.update(name.encode() + (path.read_bytes() if path.is_file() else b""))
    digest = h.hexdigest()[:12] if dirty else None
    return {"commit": commit or "unknown", "short": commit[:7] or "unknown", "dirty": dirty, "diff_sha256": digest}


def _version(pkg):
    try:
        return version(pkg)
    except PackageNotFoundError:
        return None


def versions(llama=None):
    """pinfer's side (this Python) and llama.cpp's (`llama`: llamacpp_info's answer, or
    {"failed": why})."""
    out = {"pinfer": _version("pinfer"), "python": platform.python_version(), "numpy": _version("numpy"),
           "onnxruntime": _version("onnxruntime")}
    if llama is not None and "failed" not in llama:
        out["llama_cpp_python"] = llama.get("version")
        out["llama_cpp_system_info"] = llama.get("system_info")
    else:
        out["llama_cpp_python"] = None
        out["llama_cpp_failed"] = (llama or {}).get("failed", NOT_AVAILABLE)
    return out


def file_info(path):
    """{name, bytes, sha256} of a model file (the digest's first 16 hex digits; the whole file is
    read: a 7B file takes a few seconds)."""
    path = Path(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": h.hexdigest()[:16]}


def summary(values):
    """{runs, median, min, max, n} of a list of rates (or seconds, or bytes); None when empty."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return None
    return {"runs": values, "median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def failure(reason):
    """An engine's cell that says why it has no figures."""
    return {"failed": str(reason)}


def new(suite, argv):
    """The record a run fills in: everything but the rows, flags and versions."""
    return {"schema": SCHEMA, "suite": suite, "origin": "measured",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "command": "python -m benchmarks " + " ".join(argv), "commit": git_state(), "machine": machine(),
            "versions": {}, "flags": {}, "models": [], "rows": [], "failures": []}


def write(record, folder):
    """The record as JSON in `folder` (made if missing): SUITE-MODEL-DATE.json; the path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stem = Path(record["models"][0]["gguf"]["name"] if record["models"] else "model")
    stamp = record["date"].replace("-", "").replace(":", "")
    out = folder / f"{record['suite']}-{stem.stem}-{stamp}.json"
    out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    return out

