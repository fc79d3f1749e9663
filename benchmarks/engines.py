"""Running the other engine (llama.cpp through benchmarks/llamacpp_side.py) from a benchmark:
in its own Python, with a minimal environment of its own, never the benchmark's. Thread
settings (OMP_*, GOMP_*, KMP_*, ORT_*) or anything else this process carries would change how
llama.cpp runs: OMP_WAIT_POLICY=PASSIVE once made its 2-thread decode slower than its 1-thread."""

import json
import os
import subprocess
from pathlib import Path

SIDE = Path(__file__).with_name("llamacpp_side.py")
PASSED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")     # what a process needs to start, nothing tuned


def clean_env():
    return {k: os.environ[k] for k in PASSED if k in os.environ}


def llamacpp(py, what, gguf, threads, *positional, **args):
    """One call of llamacpp_side.py (`what`: decode, perplexity, greedy, score) in the interpreter
    `py`; its JSON result. positional: after the model (perplexity's text file); args: further
    options, -x for one letter, --name otherwise."""
    cmd = [str(py), str(SIDE), what, str(gguf), *map(str, positional), "--threads", str(threads)]
    cmd += [x for k, v in args.items() for x in (f"--{k}" if len(k) > 1 else f"-{k}", str(v))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=clean_env())
    return json.loads(out.stdout.strip().splitlines()[-1])


class EngineFailed(RuntimeError):
    """The other engine's process died or answered nothing: a benchmark reports it as a result."""


class LlamaWorker:
    """A warm llama.cpp process (llamacpp_side.py worker) on one model and thread count. A worker
    that dies (llama.cpp segfaults on some CPUs) raises EngineFailed with its exit status."""

    def __init__(self, py, gguf, threads, ctx=512):
        self.proc = subprocess.Popen([str(py), str(SIDE), "worker", str(gguf), "--threads", str(threads),
                                      "--ctx", str(ctx)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=clean_env())
        if not self._answer().get("ready"):
            raise EngineFailed("llama.cpp's worker did not start")

    def _answer(self):
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(30)
            raise EngineFailed(f"llama.cpp's worker exited with status {rc}"
                               + (" (a segmentation fault)" if rc == -11 else ""))
        return json.loads(line)

    def _ask(self, line):
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass        # _answer says how it ended
        return self._answer()

    def decode(self, n):
        """tok/s of n greedy decode steps."""
        return self._ask(f"decode {n}")["tok_s"]

    def prompt(self, ids):
        """tok/s of `ids` as one prompt from an empty cache."""
        return self._ask("prompt " + " ".join(map(str, ids)))["tok_s"]

    def close(self):
        try:
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        self.proc.wait(30)


def quantize(py, src, dst, qtype):
    """dst: src re-quantized to qtype (e.g. Q4_0, Q4_K_M) by llama.cpp's own quantizer."""
    partial = Path(str(dst) + ".partial")
    cmd = [str(py), str(SIDE), "quantize", str(src), str(partial), "--type", qtype, "--threads", "2"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=clean_env())
    if json.loads(out.stdout.strip().splitlines()[-1])["rc"] != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {qtype}")
    partial.rename(dst)
    return dst


def llamacpp_info(py):
    """llama-cpp-python's version and llama.cpp's build flags (llama_print_system_info)."""
    return llamacpp(py, "info", "-", 1)


def machine():
    """The CPU's model name, core count and the vector extensions that matter here."""
    flags, name = set(), "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name") and name == "unknown CPU":
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni") if f in flags]
    return f"{name}, {os.cpu_count()} cores, {' '.join(isa) or 'no AVX2'}"
