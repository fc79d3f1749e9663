"""Running the other engine (llama.cpp through benchmarks/llamacpp_side.py) from a benchmark:
in its own Python, with a minimal environment of its own, never the benchmark's. Thread
settings (OMP_*, GOMP_*, KMP_*, ORT_*) or anything else this process carries would change how
llama.cpp runs: OMP_WAIT_POLICY=PASSIVE once made its 2-thread decode slower than its 1-thread."""

import json
import os
import signal
import subprocess
from pathlib import Path

SIDE = Path(__file__).with_name("llamacpp_side.py")
PASSED = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR")     # what a process needs to start, nothing tuned


def clean_env():
    return {k: os.environ[k] for k in PASSED if k in os.environ}


class EngineFailed(RuntimeError):
    """The other engine's process died or answered nothing: a benchmark reports it as a result."""


def exit_status(rc):
    """How a process ended, in words: "status 3", "status -11 (a segmentation fault)"."""
    if rc is not None and rc < 0:
        try:
            name = {signal.SIGSEGV: "a segmentation fault", signal.SIGABRT: "an abort", signal.SIGKILL:
                    "killed"}.get(-rc) or signal.Signals(-rc).name
        except ValueError:
            name = "a signal"
        return f"status {rc} ({name})"
    return f"status {rc}"


def _start(cmd, **kw):
    """Popen/run of llama.cpp's side in its own environment; a Python that cannot start is an
    EngineFailed too (a missing or broken --llama-python)."""
    runner = kw.pop("runner")
    try:
        return runner(cmd, text=True, env=clean_env(), **kw)
    except OSError as e:
        raise EngineFailed(f"llama.cpp's Python {cmd[0]} did not start: {e.strerror or e}") from None


def _ubatch(ubatch):
    return [] if ubatch is None else ["--ubatch", str(ubatch)]


def llamacpp(py, what, gguf, threads, *positional, ubatch=None, **args):
    """One call of llamacpp_side.py (`what`: decode, perplexity, greedy, score, load, info) in the
    interpreter `py`; its JSON result. positional: after the model (perplexity's text file); ubatch:
    llama.cpp's n_ubatch (None: llama-cpp-python's default); args: further options, -x for one
    letter, --name otherwise. A process that dies or prints no JSON raises EngineFailed."""
    cmd = [str(py), str(SIDE), what, str(gguf), *map(str, positional), "--threads", str(threads), *_ubatch(ubatch)]
    cmd += [x for k, v in args.items() for x in (f"--{k}" if len(k) > 1 else f"-{k}", str(v))]
    out = _start(cmd, runner=subprocess.run, capture_output=True)
    lines = out.stdout.strip().splitlines()
    if out.returncode or not lines:
        last = (out.stderr.strip().splitlines() or [""])[-1][:200]
        raise EngineFailed(f"llama.cpp's {what} exited with {exit_status(out.returncode)}" + (f": {last}" if last else ""))
    return json.loads(lines[-1])


class LlamaWorker:
    """A warm llama.cpp process (llamacpp_side.py worker) on one model and thread count. A worker
    that dies (llama.cpp segfaults on some CPUs) raises EngineFailed with its exit status.
    n_ubatch: what llama.cpp took (ubatch None: llama-cpp-python's default)."""

    def __init__(self, py, gguf, threads, ctx=512, ubatch=None):
        self.proc = _start([str(py), str(SIDE), "worker", str(gguf), "--threads", str(threads), "--ctx", str(ctx),
                            *_ubatch(ubatch)], runner=subprocess.Popen,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        ready = self._answer()
        if not ready.get("ready"):
            raise EngineFailed("llama.cpp's worker did not start")
        self.n_ubatch = ready.get("n_ubatch")

    def _answer(self):
        line = self.proc.stdout.readline()
        if not line:
            rc = self.proc.wait(30)
            raise EngineFailed(f"llama.cpp's worker exited with {exit_status(rc)}")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise EngineFailed(f"llama.cpp's worker answered {line.strip()[:100]!r}, not JSON") from None

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
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def quantize(py, src, dst, qtype):
    """dst: src re-quantized to qtype (e.g. Q4_0, Q4_K_M) by llama.cpp's own quantizer."""
    partial = Path(str(dst) + ".partial")
    if llamacpp(py, "quantize", src, 2, partial, type=qtype)["rc"] != 0:
        raise RuntimeError(f"llama.cpp could not quantize {src} to {qtype}")
    partial.rename(dst)
    return dst


def llamacpp_info(py):
    """llama-cpp-python's version and llama.cpp's build flags (llama_print_system_info)."""
    return llamacpp(py, "info", "-", 1)

