"""The protocol every suite shares: both engines warm, alternating runs with the first engine
switching every round, an idle pause before each run, and an engine that fails dropped with its
reason (a row saying so), never the run.

- each engine loads the model once and runs once before anything is timed. llama.cpp runs in its
  own process and Python (llama-cpp-python, benchmarks/llamacpp_side.py worker), started with
  PATH, HOME and the locale only: nothing of this process's environment (benchmarks/engines.py);
- per model and thread count the engines alternate `--repeats` times (at least 5), the one that
  goes first switching every round;
- before each run the machine idles SETTLE_S, so that neither engine's idle threads spin into the
  other's run;
- each figure is the median with the range (min-max) of the runs; the ratio is of medians,
  pinfer's over llama.cpp's."""

import threading
import time

import numpy as np

import engines

from . import WIKITEXT
from .record import NOT_AVAILABLE

# Idle time before each run: the other engine's threads stop spinning first (llama.cpp's OpenMP
# workers spin after a call before they sleep; pinfer's pool lingers 100 us). On 2 cores a spinning
# thread of one engine took a core from the other's 2-thread run.
SETTLE_S = 0.3
PROMPT_TEXT = "The capital of France is"     # both engines' decode prompt, each in its own tokenizer
MIN_REPEATS = 5


def describe(e):
    """An exception as a row's reason: EngineFailed's own words, anything else with its type."""
    return str(e) if isinstance(e, engines.EngineFailed) else f"{type(e).__name__}: {e}"


def alternate(sides, repeats, settle=SETTLE_S):
    """Run each of `sides` ({name: callable returning a rate}) `repeats` times, in turn, the order
    reversed every other round, `settle` seconds idle before each run. A side that raises is
    dropped from then on. Returns ({name: [rates]}, {name: reason it failed})."""
    runs, failed = {k: [] for k in sides}, {}
    for r in range(repeats):
        for k in (list(sides)[::-1] if r % 2 else list(sides)):
            if k in failed:
                continue
            time.sleep(settle)
            try:
                runs[k].append(sides[k]())
            except Exception as e:      # noqa: BLE001  an engine's failure is a result
                failed[k] = describe(e)
    return runs, failed


def guarded(fn, *args, **kw):
    """(fn(...), None), or (None, the reason) where it raised."""
    try:
        return fn(*args, **kw), None
    except Exception as e:              # noqa: BLE001
        return None, describe(e)


def start_llama(a, gguf, threads, ctx=512):
    """(a warm LlamaWorker, None), or (None, why there is none): no --llama-python, or a worker
    that died or could not start."""
    if not a.llama_python:
        return None, NOT_AVAILABLE
    return guarded(engines.LlamaWorker, a.llama_python, gguf, threads, ctx=ctx, ubatch=a.llama_ubatch)


def llama_info(a):
    """llama-cpp-python's version and build flags, or {"failed": why}."""
    if not a.llama_python:
        return {"failed": NOT_AVAILABLE}
    info, why = guarded(engines.llamacpp_info, a.llama_python)
    return info if why is None else {"failed": why}


def tokenizer_of(model):
    from pinfer.runtime.tokenizer import Tokenizer
    return Tokenizer.from_spec(model.tokenizer_spec)


def prompt_ids(model):
    """PROMPT_TEXT in the model's own vocabulary (llama.cpp's side tokenizes the same text)."""
    return [int(i) for i in tokenizer_of(model).encode(PROMPT_TEXT, add_bos=False)]


def text_ids(model, n):
    """The first n tokens of the wikitext-2 test text (never calibration text) in the model's own
    vocabulary."""
    ids = tokenizer_of(model).encode(WIKITEXT.read_text(encoding="utf-8")[:20 * n], add_bos=False)[:n]
    if len(ids) < n:
        raise ValueError(f"{WIKITEXT.name}'s start gives {len(ids)} tokens, fewer than {n}")
    return [int(i) for i in ids]


def read_bandwidth(threads, nbytes=512 << 20, repeats=5):
    """Bytes per second that `threads` threads read, each summing its share of a large array
    (NumPy's reductions run without the GIL); best of `repeats`."""
    a = np.ones(nbytes // 8, np.int64)
    parts = np.array_split(a, threads)
    best = np.inf
    for _ in range(repeats):
        workers = [threading.Thread(target=p.sum) for p in parts]
        t = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = min(best, time.perf_counter() - t)
    return nbytes / best
