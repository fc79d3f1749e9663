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


def llamacpp(py, what, gguf, threads, **args):
    """One call of llamacpp_side.py (`what`: decode, perplexity, greedy, score) in the interpreter
    `py`; its JSON result. args: further options, -x for one letter, --name otherwise."""
    cmd = [str(py), str(SIDE), what, str(gguf), "--threads", str(threads)]
    cmd += [x for k, v in args.items() for x in (f"--{k}" if len(k) > 1 else f"-{k}", str(v))]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=clean_env())
    return json.loads(out.stdout.strip().splitlines()[-1])
