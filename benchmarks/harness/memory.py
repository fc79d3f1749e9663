"""The memory suite: load time and memory against llama.cpp, each load in a fresh process, the
engines alternating.

    python -m benchmarks run memory --model MODEL.gguf --pinf MODEL.pinf [--loads 3] [--threads 2]
        [--ctx 512] [--tokens 8] [--llama-python VENV/bin/python] [--pause 0] [--mmap] [--no-mmap]

(benchmarks/memory.py --shape 7b,13b does the same on synthetic_decode.py's random LLaMA-shaped
Q4_0 files, written and converted once under ~/.cache/pinfer/synthetic.) Both files are read once
before the first load, so every load finds them in the page cache (a warm load). Per load, from
the process's /proc/self/status: load seconds (the engine's constructor), RSS after load (VmRSS),
its anonymous part (RssAnon: memory the process owns, not the file's pages), the peak (VmHWM),
then decode tok/s over --tokens greedy tokens after a short prompt fed token by token (llama.cpp's
batched evaluation segfaults on AMX Xeons; its n_ubatch here is 1 unless --llama-ubatch says
otherwise, as it sizes llama.cpp's buffers). pinfer's own figure of what a one-copy load should
take (accounting.expected_bytes) is recorded beside its measured RSS. Both engines' processes get
the minimal environment of benchmarks/engines.py. An engine that crashes is a row saying so.

Load time depends on the state of free memory. On a virtual machine that hands freed memory back to
its host (a Firecracker guest here, Linux 6.18), memory idle for about 2 s is faulted in again from
the host on first touch, and 2 MB pages more slowly than 4 KB ones (benchmarks/page_touch.py: 3 GB
touched after 8 s idle at 0.39-0.52 GB/s in 2 MB pages, 2.24-2.39 GB/s in 4 KB pages). Who loads
first alternates each round; --pause idles the same time before every load of either engine.
"""

import json
import subprocess
import sys
import time

import engines

from . import ROOT
from .record import MEMORY_PROMPT, process_memory, summary

KEYS = ("load_s", "VmRSS", "RssAnon", "VmHWM", "peak_after_decode", "tok_s", "expected_bytes")
ENGINES = {"pinfer": "auto", "pinfer --mmap": "on", "pinfer --no-mmap": "off"}


def add_arguments(ap):
    ap.add_argument("--tokens", type=int, default=8, help="decode steps after each load (default 8)")
    ap.add_argument("--loads", type=int, default=3, help="loads of each engine (default 3)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--pause", type=float, default=0.0, help="seconds of idling before each load (see above)")
    ap.add_argument("--mmap", action="store_true", help="also pinfer --mmap (every weight read from the file's map)")
    ap.add_argument("--no-mmap", dest="copies", action="store_true",
                    help="also pinfer --no-mmap (the weights copied into 2 MB pages, the default before the map)")


def pinfer_side(pinf, threads, ctx, tokens, mapped, isa=None):
    """One load of a .pinf file and a short decode, in this (fresh) process: its figures."""
    from pinfer import kernels
    from pinfer.runtime import accounting
    from pinfer.runtime.bench import decode_rate
    from pinfer.runtime.model import Model, RuntimeOptions
    if isa:
        kernels.sparse_isa(isa)
    t0 = time.perf_counter()
    m = Model(pinf, RuntimeOptions(threads=threads, n_ctx=ctx, mmap={"auto": None, "on": True, "off": False}[mapped]))
    load = time.perf_counter() - t0
    mem = process_memory()
    rate = decode_rate(m, tokens, MEMORY_PROMPT)
    expected = accounting.expected_bytes(m.reader.tensors, m.cfg.tied_embeddings, m.attention.kv_bytes) \
        if m.one_copy else None         # the accounting covers a one-copy load only
    return {"load_s": load, **mem, "peak_after_decode": process_memory()["VmHWM"], "tok_s": rate,
            "kv_bytes": m.attention.kv_bytes, "expected_bytes": expected}


def one_load(engine, a, threads, pinf):
    """A fresh process's figures, or {"error": ...} where it failed or crashed."""
    if engine == "llama.cpp":
        try:
            return engines.llamacpp(a.llama_python, "load", a.model, threads, ubatch=a.llama_ubatch,
                                    ctx=a.ctx, n=a.tokens)
        except engines.EngineFailed as e:
            return {"error": str(e)}
        except (ValueError, KeyError, IndexError, subprocess.SubprocessError) as e:     # an answer it cannot read
            return {"error": f"llama.cpp's load gave no readable result ({type(e).__name__}: {e})"[:300]}
    cmd = [sys.executable, "-m", "benchmarks", "side-memory", str(pinf), "--threads", str(threads), "--ctx",
           str(a.ctx), "--tokens", str(a.tokens), "--map", ENGINES[engine]] + (["--isa", a.isa] if a.isa else [])
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=engines.clean_env(), cwd=ROOT, timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 30 minutes"}
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"pinfer's load exited with {engines.exit_status(out.returncode)}: {last[:200]}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"pinfer's load printed no result: {out.stdout.strip()[-200:]!r}"}


def warm(path):
    """Read a file once so that the loads after find it in the page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def run(a, rec, pinf_of):
    from pinfer.formats import PinfReader
    from pinfer.formats.config import ModelConfig
    from pinfer.runtime.accounting import kv_cache_bytes
    if a.llama_ubatch is None:
        a.llama_ubatch = 1
    pinf = pinf_of(a.model)
    cfg = ModelConfig.from_dict(PinfReader(pinf).header["config"])
    rec["flags"].update(tokens=a.tokens, loads=a.loads, ctx=a.ctx, pause_s=a.pause, prompt_ids=MEMORY_PROMPT)
    rec["kv_f16_bytes"] = {"4096": kv_cache_bytes(cfg, 4096), str(a.ctx): kv_cache_bytes(cfg, a.ctx)}
    for path in (a.model, pinf):
        warm(path)
    sides = ["pinfer"] + ["pinfer --mmap"] * a.mmap + ["pinfer --no-mmap"] * a.copies + \
        ["llama.cpp"] * bool(a.llama_python)
    for t in a.threads:
        runs = {e: [] for e in sides}
        for i in range(a.loads):
            for engine in sides[::-1 if i % 2 else 1]:    # who goes first alternates too
                time.sleep(a.pause)
                runs[engine].append(one_load(engine, a, t, pinf))
            print(f"  load {i + 1}, {t} thread(s): " + "; ".join(f"{k} {json.dumps(v[-1])}" for k, v in runs.items()),
                  flush=True)
        _rows(rec, a, t, runs)


def _rows(rec, a, threads, runs):
    from .record import NOT_AVAILABLE
    name = a.model.name
    for engine, loads in runs.items():
        errors = [r["error"] for r in loads if "error" in r]
        row = {"model": name, "threads": threads, "engine": engine, "loads": loads,
               **{k: summary(r.get(k) for r in loads if "error" not in r) for k in KEYS}}
        if errors:
            row["failed"] = errors[0]
            rec["failures"].append({"engine": engine, "model": name, "threads": threads, "reason": errors[0],
                                    "loads_failed": len(errors)})
        rec["rows"].append(row)
    if "llama.cpp" not in runs:
        rec["rows"].append({"model": name, "threads": threads, "engine": "llama.cpp", "loads": [],
                            "failed": NOT_AVAILABLE, **{k: None for k in KEYS}})
        rec["failures"].append({"engine": "llama.cpp", "model": name, "threads": threads, "reason": NOT_AVAILABLE})
