"""llama-bench's measurements on a .pinf model: pp (prefill of N tokens from an empty cache) and
tg (N single-token decode steps from an empty cache), each repeated, as tokens per second.
decode_rate is the one decode loop: `pinfer bench`'s tg and the benchmarks (benchmarks/harness)
time their decode through it."""

import statistics
import time
from dataclasses import dataclass, replace

import numpy as np


from .accounting import weight_bytes_per_token
from .model import Model, RuntimeOptions


@dataclass(frozen=True)
class BenchResult:
    test: str            # "pp512" or "tg128"
    threads: int
    tps_mean: float
    tps_sd: float
    samples: tuple
    bytes_per_token: int  # weight bytes one decode step reads (tg); all weights once per call (pp)


def decode_rate(model, n, prompt=(), feed=None):
    """Tokens per second of n single-token decode steps from an empty cache, after `prompt` (fed
    one token a call, untimed; may be empty when `feed` is given). Step i takes feed[i] where `feed`
    is given, else the argmax of the step before (greedy); the argmax is computed either way, so a
    fed run and a greedy one time the same work. The model's counters count the timed steps only."""
    if len(prompt) == 0 and feed is None:
        raise ValueError("a greedy decode needs a prompt, or give the tokens to feed")
    if feed is not None and len(feed) < n:
        raise ValueError(f"{len(feed)} tokens to feed, fewer than the {n} steps")
    model.reset()
    t = None
    for tok in prompt:
        t = int(model.forward([int(tok)])[-1].argmax())
    model.counters.reset()
    t0 = time.perf_counter()
    for i in range(n):
        t = int(model.forward([int(feed[i]) if feed is not None else t])[-1].argmax())
    return n / (time.perf_counter() - t0)


def run_bench(path, tests, threads, repetitions=5, seed=0, options=RuntimeOptions(), on_load=None):
    """tests: [("pp", 512), ("tg", 128), ...]; returns a BenchResult per (test, thread count).
    options: how the model runs (its n_ctx and threads are set here); on_load(model) is called as
    each thread count's model has loaded (pinfer bench prints its notes)."""
    out = []
    rng = np.random.default_rng(seed)
    for t in threads:
        need = max(n for _, n in tests) + 1
        model = Model(path, replace(options, n_ctx=max(need, 16), threads=t))
        if on_load is not None:
            on_load(model)
        nbytes = weight_bytes_per_token(model.reader, model.cfg)     # until a decode test counts rows
        vocab = model.cfg.vocab
        for kind, n in tests:
            samples = []
            model.counters.reset()
            for rep in range(repetitions + 1):      # the first run warms up and is dropped
                tokens = [int(x) for x in rng.integers(0, vocab, n)]
                if kind == "pp":
                    model.reset()
                    t0 = time.perf_counter()
                    model.forward(tokens)
                    rate = n / (time.perf_counter() - t0)
                else:
                    rate = decode_rate(model, n, feed=tokens)
                if rep:
                    samples.append(rate)
            sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
            if kind == "tg":
                nbytes = model.weight_bytes_per_token()     # the rows this decode read under the rules
            out.append(BenchResult(f"{kind}{n}", t, statistics.mean(samples), sd, tuple(samples), nbytes))
        del model
    return out
