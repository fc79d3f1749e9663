"""How long the sampler takes for one token at the defaults: SmolLM2's vocabulary (49,152 logits),
a seed and a repeat penalty over a 64-token history, as `pinfer generate` samples each token.

    python benchmarks/sample_speed.py [--vocab 49152] [--calls 200] [--reps 5] [--budget-ms 2]

Prints the median over --reps rounds of the time per call of --calls calls; exits 1 when it is
over --budget-ms (the figure the unit tests once asserted; a timing is a benchmark's business, not
a unit test's, whose machine may be shared and busy).
"""

import argparse
import statistics
import sys
import time

import numpy as np

from pinfer.runtime.sample import Sampler, SamplerConfig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=49152, help="logits per call (SmolLM2's vocabulary)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--history", type=int, default=64, help="tokens the repeat penalty looks back on")
    ap.add_argument("--budget-ms", type=float, default=2.0, help="exit 1 when the median is above this")
    a = ap.parse_args(argv)
    logits = np.random.default_rng(0).normal(0.0, 3.0, a.vocab).astype(np.float32)
    sampler = Sampler(SamplerConfig(seed=0, repeat_penalty=1.1))
    history = list(range(a.history))
    sampler.sample(logits, history)         # warm-up
    per_call = []
    for _ in range(a.reps):
        start = time.perf_counter()
        for _ in range(a.calls):
            sampler.sample(logits, history)
        per_call.append((time.perf_counter() - start) / a.calls)
    median = statistics.median(per_call) * 1e3
    print(f"default sampling, vocab {a.vocab}: {median:.3f} ms per token (median of {a.reps} x {a.calls} calls; "
          f"min {min(per_call) * 1e3:.3f}, max {max(per_call) * 1e3:.3f}); budget {a.budget_ms} ms")
    return 0 if median <= a.budget_ms else 1


if __name__ == "__main__":
    sys.exit(main())
