"""Memory and load time against llama.cpp: each load in a fresh process, the engines alternating.

    python benchmarks/memory.py [--shape 7b,13b] [--loads 3] [--threads 2] [--ctx 512] [--tokens 8]
        [--llama-python VENV/bin/python] [--pause 0] [--mmap] [--no-mmap] [--out benchmarks/results/memory.json]

The models are synthetic_decode.py's random LLaMA-shaped Q4_0 GGUFs (write_gguf), written once under
~/.cache/pinfer/synthetic and converted with `--sparsity none`. Both files are read once before the
first load, so every load finds them in the page cache (a warm load). Per load, from the process's
/proc/self/status: load seconds (the engine's constructor), RSS after load (VmRSS), its anonymous
part (RssAnon: memory the process owns, not the file's pages), the peak (VmHWM), then decode tok/s
over --tokens greedy tokens after a short prompt fed token by token (llama.cpp's batched evaluation
segfaults on AMX Xeons). pinfer's own figure of what a one-copy load should take (accounting.expected_bytes)
is printed beside its measured RSS. An engine that crashes is a row saying so.

Load time depends on the state of free memory. On a virtual machine that hands freed memory back to
its host (a Firecracker guest here, Linux 6.18), memory idle for about 2 s is faulted in again from
the host on first touch, and 2 MB pages more slowly than 4 KB ones (benchmarks/page_touch.py: 3 GB
touched after 8 s idle at 0.39-0.52 GB/s in 2 MB pages, 2.24-2.39 GB/s in 4 KB pages). pinfer copies weights into 2 MB pages
(faster decode), llama.cpp's repacked copy takes 4 KB pages. Who loads first alternates each round;
--pause idles the same time before every load of either engine.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import engines  # noqa: E402  benchmarks/ is on sys.path when a script here runs
import synthetic_decode

PROMPT_IDS = [1, 45, 74, 31, 34]    # fed one at a time before the timed decode (random models: ids under every vocab)
STATUS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


def status():
    """{VmRSS, VmHWM, RssAnon, RssFile: bytes} of this process."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in STATUS:
            out[key] = int(value.split()[0]) * 1024
    return out


def pinfer_side(a):
    """One load of a .pinf file and a short decode, in this process; prints one JSON line."""
    import numpy as np

    from pinfer.runtime import accounting
    from pinfer.runtime.model import Model, RuntimeOptions
    t0 = time.perf_counter()
    mmap = {"auto": None, "on": True, "off": False}[a.map]
    m = Model(a.model, RuntimeOptions(threads=a.threads, n_ctx=a.ctx, mmap=mmap))
    load = time.perf_counter() - t0
    mem = status()
    for t in PROMPT_IDS:
        logits = m.forward([t])
    t = int(np.argmax(logits[-1]))
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        t = int(np.argmax(m.forward([t])[-1]))
    dt = time.perf_counter() - t0
    expected = accounting.expected_bytes(m.reader.tensors, m.cfg.tied_embeddings, m.attention.kv_bytes) \
        if m.one_copy else None         # the accounting covers a one-copy load only
    print(json.dumps({"load_s": load, **mem, "peak_after_decode": status()["VmHWM"], "tok_s": a.tokens / dt,
                      "kv_bytes": m.attention.kv_bytes, "expected_bytes": expected}))


def llama_side(a):
    """llama.cpp's load and decode (llama-cpp-python, mmap as its default), in this process."""
    from llama_cpp import Llama
    t0 = time.perf_counter()
    llm = Llama(model_path=a.model, n_ctx=a.ctx, n_threads=a.threads, n_threads_batch=a.threads, n_batch=a.ctx,
                n_ubatch=1, verbose=False)
    load = time.perf_counter() - t0
    mem = status()
    import numpy as np
    for t in PROMPT_IDS:
        llm.eval([t])
    logits = lambda: np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))  # noqa: E731
    t = int(np.argmax(logits()))
    t0 = time.perf_counter()
    for _ in range(a.tokens):
        llm.eval([t])
        t = int(np.argmax(logits()))
    dt = time.perf_counter() - t0
    print(json.dumps({"load_s": load, **mem, "peak_after_decode": status()["VmHWM"], "tok_s": a.tokens / dt}))


def one_load(python, engine, model, a):
    """A fresh process's figures, or {"error": ...} where it failed or crashed."""
    side, _, mapped = engine.partition("-")
    cmd = [str(python), __file__, f"side-{side}", str(model), "--threads", str(a.threads), "--ctx", str(a.ctx),
           "--tokens", str(a.tokens)] + ["--map", mapped] * bool(mapped)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=engines.clean_env(), timeout=1800)
    except subprocess.TimeoutExpired:
        return {"error": "did not finish in 30 minutes"}
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"exit status {out.returncode}: {last[:200]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def warm(path):
    """Read a file once so that the loads after find it in the page cache."""
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def summary(runs, key, scale=1.0):
    vals = [r[key] * scale for r in runs if "error" not in r and r.get(key) is not None]
    if not vals:
        return None
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)}


def commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def fmt(s, unit="", scale=1.0):
    if s is None:
        return "—"
    return f"{s['median'] * scale:.2f}{unit} ({s['min'] * scale:.2f}-{s['max'] * scale:.2f})"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", default="run", choices=["run", "side-pinfer", "side-llama"])
    ap.add_argument("--mmap", action="store_true", help="also pinfer --mmap (every weight read from the file's map)")
    ap.add_argument("--no-mmap", dest="copies", action="store_true",
                    help="also pinfer --no-mmap (the weights copied into 2 MB pages, the default before the map)")
    ap.add_argument("--map", choices=["auto", "on", "off"], default="auto", help=argparse.SUPPRESS)  # a side's
    ap.add_argument("model", nargs="?")
    ap.add_argument("--shape", default="7b", help="comma-separated: 7b, 13b, tiny")
    ap.add_argument("--layers", type=int, default=0, help="layers (default: the shape's own, 32 or 40)")
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--llama-python", help="python of an environment with llama-cpp-python")
    ap.add_argument("--pause", type=float, default=0.0,
                    help="seconds of idling before each load (default 0): a virtual machine that gives freed "
                         "memory back to its host makes the next process fault it in again (see the docstring)")
    ap.add_argument("--cache", type=Path, default=synthetic_decode.CACHE)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "memory.json")
    a = ap.parse_args(argv)
    if a.what != "run":
        return (pinfer_side if a.what == "side-pinfer" else llama_side)(a)

    result = {"benchmark": "memory", "commit": commit(), "machine": engines.machine(), "python": platform.python_version(),
              "threads": a.threads, "ctx": a.ctx, "tokens": a.tokens, "pause_s": a.pause, "llama_cpp": None, "models": []}
    if a.llama_python:
        result["llama_cpp"] = engines.llamacpp_info(a.llama_python)
    print(f"# {result['machine']}; pinfer at {result['commit']}; "
          f"llama.cpp {result['llama_cpp']['version'] if result['llama_cpp'] else 'not run'}", flush=True)
    from pinfer.formats import PinfReader       # here, not at the top: the llama.cpp side runs under
    from pinfer.formats.config import ModelConfig   # another Python, which has no pinfer
    from pinfer.runtime.accounting import kv_cache_bytes
    for shape in a.shape.split(","):
        n_layer = a.layers or {"7b": 32, "13b": 40, "tiny": 2}[shape]
        gguf, pinf = synthetic_decode.synthetic_model(shape, n_layer, a.cache)
        cfg = ModelConfig.from_dict(PinfReader(pinf).header["config"])
        for path in (gguf, pinf):
            warm(path)
        runs = {"pinfer": [], "pinfer --mmap": [], "pinfer --no-mmap": [], "llama.cpp": []}
        sides = [("pinfer", sys.executable, "pinfer", pinf)] + \
            ([("pinfer --mmap", sys.executable, "pinfer-on", pinf)] if a.mmap else []) + \
            ([("pinfer --no-mmap", sys.executable, "pinfer-off", pinf)] if a.copies else []) + \
            ([("llama.cpp", a.llama_python, "llama", gguf)] if a.llama_python else [])
        for i in range(a.loads):
            for engine, python, side, path in sides[::-1 if i % 2 else 1]:    # who goes first alternates too
                time.sleep(a.pause)
                runs[engine].append(one_load(python, side, path, a))
            print(f"  {shape} load {i + 1}: " + "; ".join(f"{k} {json.dumps(v[-1])}" for k, v in runs.items() if v),
                  flush=True)
        row = {"shape": shape, "layers": n_layer, "gguf_bytes": gguf.stat().st_size, "pinf_bytes": pinf.stat().st_size,
               "kv_f16_bytes_at_4096": kv_cache_bytes(cfg, 4096), "kv_f16_bytes_at_ctx": kv_cache_bytes(cfg, a.ctx),
               "runs": runs}
        for engine, rs in runs.items():
            row[engine] = {k: summary(rs, k) for k in ("load_s", "VmRSS", "RssAnon", "VmHWM", "peak_after_decode",
                                                      "tok_s", "expected_bytes")}
            row[engine]["errors"] = [r["error"] for r in rs if "error" in r]
        result["models"].append(row)

    print("\n| model | engine | load s | RSS after load GB | anonymous GB | peak during load GB | peak after decode GB "
          "| decode tok/s | expected GB |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in result["models"]:
        name = f"{row['shape']} Q4_0 ({row['gguf_bytes'] / 1e9:.2f} GB)"
        for engine in [e for e, rs in row["runs"].items() if rs]:
            s = row[engine]
            if s["errors"]:
                print(f"| {name} | {engine} | failed: {s['errors'][0]} |||||||")
            if s["load_s"] is None:
                continue
            print(f"| {name} | {engine} | {fmt(s['load_s'])} | {fmt(s['VmRSS'], scale=1e-9)} | {fmt(s['RssAnon'], scale=1e-9)} "
                  f"| {fmt(s['VmHWM'], scale=1e-9)} | {fmt(s['peak_after_decode'], scale=1e-9)} | {fmt(s['tok_s'])} "
                  f"| {fmt(s['expected_bytes'], scale=1e-9)} |")
        ratio = [row[e]["load_s"] for e in ("pinfer", "llama.cpp")]
        if all(ratio):
            print(f"\nload time pinfer / llama.cpp: {ratio[0]['median'] / ratio[1]['median']:.2f}x (medians)")
        print(f"KV cache in f16 at 4096 tokens: {row['kv_f16_bytes_at_4096'] / 1e9:.2f} GB; at --ctx {a.ctx}: "
              f"{row['kv_f16_bytes_at_ctx'] / 1e9:.3f} GB")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {a.out}")


if __name__ == "__main__":
    sys.exit(main())
