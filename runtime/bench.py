"""llama-bench's measurements on a .pinf model: pp (prefill of N tokens from an empty cache) and
tg (N single-token decode steps from an empty cache), each repeated, as tokens per second."""

import statistics
import time
from dataclasses import dataclass

import numpy as np

from pinfer.formats import schema as S

from .model import Model, RuntimeOptions


@dataclass(frozen=True)
class BenchResult:
    test: str            # "pp512" or "tg128"
    threads: int
    tps_mean: float
    tps_sd: float
    samples: tuple
    bytes_per_token: int  # weight bytes one decode step reads (tg); all weights once per call (pp)


_GATE_UP = (S.FFN_GATE_UP, S.FFN_GATE_UP_COLD)
_DOWN = (S.FFN_DOWN_T, S.FFN_DOWN_T_COLD)
_PREDICTOR = (S.FFN_PRED_W1, S.FFN_PRED_W2, S.FFN_PRED_B2)


def weight_bytes_per_token(reader, cfg, shares=(1.0, 1.0), predictor_layers=()):
    """Bytes of weights one decode step reads: every layer's and the head's, one embedding row
    (the table when it is also the LM head); of the FFN rows, the shares (gate/up, down) read; the
    predictors of `predictor_layers` only."""
    kind = {}
    for i in range(cfg.n_layer):
        for names, k in ((_GATE_UP, 0), (_DOWN, 1), (_PREDICTOR, 2 if i in predictor_layers else 3)):
            kind.update({t.format(i): k for t in names})
    total = 0.0
    for n, e in reader.tensors.items():
        if n.startswith("blk."):
            k = kind.get(n if n in kind else n.rsplit(".", 1)[0])
            total += e["nbytes"] * (shares[k] if k in (0, 1) else 0.0 if k == 3 else 1.0)
        elif n == S.OUTPUT_NORM or n.startswith(S.OUTPUT + "."):
            total += e["nbytes"]
    embd = sum(e["nbytes"] for n, e in reader.tensors.items() if n.startswith(S.TOKEN_EMBD + "."))
    return total + (embd if cfg.tied_embeddings else embd // cfg.vocab)


def run_bench(path, tests, threads, repetitions=5, seed=0):
    """tests: [("pp", 512), ("tg", 128), ...]; returns a BenchResult per (test, thread count)."""
    out = []
    rng = np.random.default_rng(seed)
    for t in threads:
        need = max(n for _, n in tests) + 1
        model = Model(path, RuntimeOptions(n_ctx=max(need, 16), threads=t))
        nbytes = weight_bytes_per_token(model.reader, model.cfg)     # until a decode test counts rows
        vocab = model.cfg.vocab
        for kind, n in tests:
            samples = []
            model.counters.reset()
            for rep in range(repetitions + 1):      # the first run warms up and is dropped
                tokens = [int(x) for x in rng.integers(0, vocab, n)]
                model.reset()
                t0 = time.perf_counter()
                if kind == "pp":
                    model.forward(tokens)
                else:
                    for tok in tokens:
                        model.forward([tok])
                dt = time.perf_counter() - t0
                if rep:
                    samples.append(n / dt)
            sd = statistics.stdev(samples) if len(samples) > 1 else 0.0
            if kind == "tg":
                nbytes = model.weight_bytes_per_token()     # the rows this decode read under the rules
            out.append(BenchResult(f"{kind}{n}", t, statistics.mean(samples), sd, tuple(samples), nbytes))
        del model
    return out
