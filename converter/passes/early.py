"""The early answer of `--sparsity auto`: before the full calibration (minutes per layer on a large
model), whether any sparse operating point could be within the perplexity budget and decode faster
than dense on this machine. Every estimate here is the best case a predictor could reach, so "no"
is an answer the full calibration could not overturn (on these sample tokens); "maybe" goes on to it.

1. A small sample (EARLY_TOKENS calibration tokens) through every layer of the source in PyTorch,
   one layer at a time. Per point, the share of neurons whose rows it reads: down:S reads every
   gate/up row and 1 - S of the down rows; predicted:R and relu:R read the candidates of a
   predictor trained on the sample alone at EARLY_LAYERS layers, as calibration trains one (on
   SmolLM2 with 4096 tokens it selects 1 to 6 points more than the full calibration's). Per layer
   and point, the |h| threshold its perplexity is measured with: down:S its S quantile;
   predicted:R and relu:R the oracle, the fewest (token, neuron) entries, largest |h| first, whose
   active mass reaches R (predictor.quality's mass recall): no predictor drops only smaller ones,
   so that is the best case of perplexity. Also the neurons' activation frequencies (the GPU
   plan's hotness).
2. pinfer's fused CPU kernel timed at the model's shapes and formats (random weights: the time
   depends on shapes, formats and the share of rows read, not on the values), in its dense mode and
   under each point at its share, the predictor's own cost included. At load `--ffn-kernel auto`
   keeps a rule only where the layer, attention included, takes under KEEP_BELOW of the faster
   dense way; the kernel's dense mode is one of those ways and attention adds the same time to both
   sides, so a point whose kernel time is not under KEEP_BELOW of the kernel's dense time is never
   kept there.
3. For the points that pass 2, the sample again through every layer under each point's rule: the
   held-out perplexity increase over the dense pass, against --max-ppl-increase.

When no point passes both, the conversion writes the dense file at once, with the sample's
frequencies and a teacher-forced check of the written file against the sample's dense logits.
"""

import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from pinfer.formats import blocks

from . import calibrate
from . import torch_llama as TL

EARLY_TOKENS = 4096
EARLY_LAYERS = 4                # layers a predictor is trained at, evenly spaced
PREDICTOR_STEPS = 60            # optimizer steps, as calibration's 5 epochs of 24,576 tokens take
SORT_SAMPLE = 1 << 18           # |h| entries per layer the thresholds and shares are taken from
TIMING_ROUNDS, TIMING_BUDGET_S = 30, 3.0


@dataclass(frozen=True)
class EarlyAnswer:
    tokens: int                 # sample tokens
    threads: int
    points: tuple               # ({"point", "share", "kernel_over_dense", "ppl_increase"}, ...): the share of
                                # neurons whose rows it reads; kernel_over_dense None where the kernel does not
                                # take its formats; ppl_increase None where the speed already rules it out
    keep_below: float
    max_ppl_increase: float
    seconds: float

    @property
    def faster(self):
        """The points that might be kept (the full calibration decides)."""
        return [p["point"] for p in self.points if p["kernel_over_dense"] is not None
                and p["kernel_over_dense"] < self.keep_below and p["ppl_increase"] is not None
                and p["ppl_increase"] <= self.max_ppl_increase]

    def reason(self):
        def one(p):
            if p["kernel_over_dense"] is None:
                return f"{p['point']}: the fused kernel does not take this model's formats or activation"
            said = f"{p['point']}: {p['share']:.0%} of rows, kernel {p['kernel_over_dense']:.2f}x"
            return said + (f", perplexity {p['ppl_increase']:+.1%}" if p["ppl_increase"] is not None else "")
        return (f"no sparse point can be within +{self.max_ppl_increase:.1%} perplexity and decode faster than dense "
                f"here (best cases on {self.tokens} sample tokens, the fused kernel's time against its dense mode on "
                f"{self.threads} thread{'s' * (self.threads > 1)}; kept only under {self.keep_below:.2f}x): "
                f"{'; '.join(one(p) for p in self.points)} ({self.seconds:.0f} s; --no-early-check calibrates anyway)")

    def record(self):
        return {"tokens": self.tokens, "threads": self.threads, "keep_below": self.keep_below,
                "points": list(self.points), "seconds": round(self.seconds, 1)}


@dataclass
class Sample:
    """What the dense sample pass measured."""
    seqs: np.ndarray            # (n, T) token ids
    shares: dict                # {point name: share of neurons whose rows it reads, mean over layers}
    thresholds: list            # per layer {point name: the |h| its rule keeps from}
    freq: list                  # per layer (n_ff,) share of sample tokens where the neuron is active
    reference_logits: np.ndarray
    nll: float                  # mean held-out NLL of the dense pass
    seconds: float

    @property
    def tokens(self):
        return int(self.seqs.size)


def layer_rules(cfg, hact, points, seed=0):
    """({point name: the |h| its rule keeps from}, per-neuron active frequency) of one layer's hidden
    values hact (N, n_ff), from SORT_SAMPLE of its entries: down:S its S quantile; predicted:R and
    relu:R the oracle's, the smallest |h| among the fewest entries whose active mass reaches R."""
    habs = hact.abs().float()
    flat = habs.reshape(-1)
    g = torch.Generator().manual_seed(seed)
    vals = (flat[torch.randint(0, flat.numel(), (SORT_SAMPLE,), generator=g).to(flat.device)]
            if flat.numel() > SORT_SAMPLE else flat)
    if cfg.exact_sparse:
        floor = 0.0                # active: h != 0
        freq = (hact != 0).float().mean(0).cpu().numpy()
    else:
        floor = float(torch.quantile(vals, calibrate.PREDICTOR_SPARSITY))
        freq = (habs > floor).float().mean(0).cpu().numpy()
    mass = torch.sort(vals[vals > floor].double(), descending=True).values
    cum = torch.cumsum(mass, 0)
    thresholds = {}
    for p in points:
        if p.mode == "down":
            thresholds[p.name] = float(torch.quantile(vals, p.value))
        elif len(mass):
            k = int(torch.searchsorted(cum, torch.tensor([p.value * float(cum[-1])], dtype=torch.float64,
                                                         device=cum.device)))
            thresholds[p.name] = float(mass[min(k, len(mass) - 1)])
        else:
            thresholds[p.name] = float("inf")
    return thresholds, freq


def _layers(src, names, cfg, streams, freq_divisors, step, on_layer=None):
    """Each stream (n, T, d) through every layer, in place, one layer's weights at a time;
    step(i, name, x, hact) returns the hidden values the down projection takes."""
    T = next(iter(streams.values())).shape[1]
    dev = next(iter(streams.values())).device
    rot, bs = TL.Rotary(cfg, T, freq_divisors, dev), calibrate.batch_seqs(cfg, T)
    for i in range(cfg.n_layer):
        w = TL.load_layer(src, names, i, dev)
        with torch.no_grad():
            for name, h in streams.items():
                for b in range(0, len(h), bs):
                    h1, x, hact = calibrate.forward_ffn(h[b:b + bs], w, cfg, rot)
                    h[b:b + bs] = h1 + TL.ffn_output(step(i, name, x, hact) @ w.down.T, w, cfg)
        del w
        src.release()
        if on_layer:
            on_layer(i)


def _nll(head, cfg, h, seqs):
    targets = torch.from_numpy(seqs[:, 1:].reshape(-1))
    with torch.no_grad():
        return float(head.nll(h[:, :-1].reshape(-1, cfg.d_model), targets).mean())


def predictor_shares(cfg, x, hact, rank, targets, seed=0):
    """{recall target: candidate share} of a predictor of `rank` trained on the first 3/4 of one
    layer's sample tokens (x (N, d), hact (N, n_ff)), thresholds chosen and checked on halves of
    the rest, as calibrate._fit_predictor does with its larger sets."""
    from . import predictor as P
    habs = hact.abs()
    floor = 0.0 if cfg.exact_sparse else float(torch.quantile(
        habs.reshape(-1)[torch.randperm(habs.numel(), generator=torch.Generator().manual_seed(seed))[:SORT_SAMPLE]
                         .to(habs.device)].float(),
        calibrate.PREDICTOR_SPARSITY))
    active = habs > floor
    cut = len(x) * 3 // 4
    half = cut + (len(x) - cut) // 2
    epochs = max(5, -(-PREDICTOR_STEPS // max(1, cut // 2048)))
    pred = P.train(x[:cut], active[:cut], rank, seed=seed, epochs=epochs)
    s = pred.scores(x[cut:])
    fit = (s[:half - cut], habs[cut:half], active[cut:half])
    check = (s[half - cut:], habs[half:], active[half:])
    return {t.recall_target: t.candidate_fraction for t in P.calibrate(fit, check, targets=targets)}


def sample(src, names, cfg, seqs, model, points, rank, on_layer=None):
    """The dense sample pass: seqs (n, T) token ids; model = (embed, head, freq_divisors); rank:
    the predictors'."""
    t0 = time.perf_counter()
    embed, head, freq_divisors = model
    trained_at = set(np.linspace(0, cfg.n_layer - 1, min(EARLY_LAYERS, cfg.n_layer)).round().astype(int).tolist())
    targets = tuple(sorted({p.value for p in points if p.mode != "down"}))
    seen, rules, learned = [], [], []

    def step(i, name, x, hact):
        seen.append((x.reshape(-1, cfg.d_model) if i in trained_at else None, hact.reshape(-1, cfg.n_ff)))
        return hact

    def done(i):
        hact = torch.cat([b for _, b in seen])
        rules.append(layer_rules(cfg, hact, points, seed=i))
        if i in trained_at and targets:
            learned.append(predictor_shares(cfg, torch.cat([a for a, _ in seen]), hact, rank, targets, seed=i))
        seen.clear()
        if on_layer:
            on_layer(i)
    streams = {"dense": embed(seqs)}
    _layers(src, names, cfg, streams, freq_divisors, step, done)
    h = streams["dense"]
    with torch.no_grad():
        ref = head.logits(h[0, :calibrate.REFERENCE_TOKENS]).cpu().numpy()
    shares = {p.name: float(np.mean([s[p.value] for s in learned])) if p.mode != "down" else 1.0 - p.value
              for p in points}
    return Sample(seqs, shares, [r[0] for r in rules], [r[1] for r in rules], ref, _nll(head, cfg, h, seqs),
                  time.perf_counter() - t0)


def ppl_increases(src, names, cfg, smp, model, points, on_layer=None):
    """{point name: held-out perplexity increase over the dense pass} with each point's rule (keep
    |h| over its threshold) in every layer, all points in one pass over the layers."""
    embed, head, freq_divisors = model
    streams = {p.name: embed(smp.seqs) for p in points}

    def step(i, name, x, hact):
        return hact * (hact.abs() >= smp.thresholds[i][name])
    _layers(src, names, cfg, streams, freq_divisors, step, on_layer)
    return {name: float(np.exp(_nll(head, cfg, h, smp.seqs) - smp.nll) - 1) for name, h in streams.items()}


def _weights(fmt, rows, d, rng):
    w = (rng.standard_normal((rows, d)) * 0.02).astype(np.float32)
    return w, blocks.quantize(fmt, w)


def _down_t(fmt, has_min, w):
    """down_t (n_ff, d) in fmt; the row-grouped formats as GGUF's blocks of W_down carry over."""
    if fmt not in ("q4r", "q8r"):
        return blocks.quantize(fmt, w)
    import gguf
    qt = gguf.GGMLQuantizationType
    ttype = qt.Q8_0 if fmt == "q8r" else qt.Q4_1 if has_min else qt.Q4_0
    raw = gguf.quants.quantize(np.ascontiguousarray(w.T), ttype)
    return blocks.from_gguf_transposed(ttype, raw, w.shape[1], w.shape[0])[1]


def _kernel(cfg, formats, rank, threads, rng):
    """A SparseFFN at the model's shapes in `formats` (plan.BundleFormats), random weights, with
    a predictor of `rank` whose scores are its bias (b2) alone; and the float gate/up rows."""
    from pinfer.kernels import SparseFFN
    d, n = cfg.d_model, cfg.n_ff
    fg, fd = formats.gate_up[0], formats.down[0]
    gate, gp = _weights(fg, n, d, rng)
    up, upp = _weights(fg, n, d, rng)
    gate_up = (fg, {p: np.ascontiguousarray(np.stack([gp[p], upp[p]], axis=1)) for p in gp})
    down = (fd, _down_t(fd, formats.down[1], (rng.standard_normal((n, d)) * 0.02).astype(np.float32)))
    _, p1 = _weights("q8", rank, d, rng)
    p2 = blocks.quantize("q8", np.zeros((n, rank), np.float32))
    b2 = ((rng.permutation(n) + 0.5) / n).astype(np.float32)    # scores: candidates are b2 >= a quantile
    k = SparseFFN(gate_up, down, n, d, cfg.ffn_act, (("q8", p1), ("q8", p2), b2),
                  threads, down_rows="transpose" if fd == "q4r" else None)
    return k, gate, up


def _median_times(calls):
    """{name: median seconds} of the bound calls, run in rotating order for TIMING_ROUNDS rounds
    (or TIMING_BUDGET_S), after one warm-up round."""
    names = list(calls)
    spent = {n: [] for n in names}
    t_end = time.perf_counter() + TIMING_BUDGET_S
    for r in range(TIMING_ROUNDS + 1):
        for n in np.roll(names, r):
            t0 = time.perf_counter()
            calls[n]()
            if r:
                spent[n].append(time.perf_counter() - t0)
        if r >= 5 and time.perf_counter() > t_end:
            break
    return {n: float(np.median(v)) for n, v in spent.items()}


def time_points(cfg, points, rows, formats_of, rank, threads, seed=0):
    """{point name: kernel time / the kernel's dense time} for points (calibrate.Point) at rows[name]
    (the share of neurons whose rows they read), each in the formats formats_of(point) gives;
    infinite where the kernel does not take those formats (the runtime would run the layer dense)."""
    from pinfer.runtime.placement import activation_refusal
    if activation_refusal(cfg):         # the runtime runs every layer dense: no point can be faster
        return {p.name: float("inf") for p in points}
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(cfg.d_model).astype(np.float32)
    y = np.zeros(cfg.d_model, np.float32)
    out = {}
    by_formats = {}
    for p in points:
        by_formats.setdefault(formats_of(p), []).append(p)
    for fm, group in by_formats.items():
        try:
            k, gate, up = _kernel(cfg, fm, rank, threads, rng)
        except ValueError:                # formats the kernel does not take: these layers would run dense
            out.update({p.name: float("inf") for p in group})
            continue
        g, u = gate @ x, up @ x
        h = np.abs((g / (1 + np.exp(-g)) if cfg.ffn_act != "relu" else np.maximum(g, 0)) * u)
        calls = {"dense": k.bind(x, y, "dense", 0.0, 0.0)}
        for p in group:
            share = rows[p.name]
            if p.mode == "down":          # every gate/up row; the down rows of |h| over the S quantile
                calls[p.name] = k.bind(x, y, "down", float(np.quantile(h, 1 - share)), 0.0)
            elif p.mode == "predicted":   # the candidates (the share whose score, b2, passes), then the
                thr = float(np.quantile(h, calibrate.PREDICTOR_SPARSITY))   # down rule among them
                calls[p.name] = k.bind(x, y, "predicted", thr, float(1.0 - share))
            else:                         # relu: the candidates, then h != 0 among them
                calls[p.name] = k.bind(x, y, p.mode, 0.0, float(1.0 - share))
        times = _median_times(calls)
        out.update({p.name: times[p.name] / times["dense"] for p in group})
    return out


def answer(cfg, smp, points, formats_of, rank, ppl_of, max_ppl_increase, threads=None, keep_below=None):
    """The EarlyAnswer for points (the sparse ones of calibrate.points_for): the kernel timed at
    each point's mean share over the layers, then ppl_of(points) for those fast enough."""
    from pinfer.runtime.autotune import KEEP_BELOW
    t0 = time.perf_counter()
    threads = threads or os.cpu_count() or 1
    keep_below = KEEP_BELOW if keep_below is None else keep_below
    rows = smp.shares
    ratios = time_points(cfg, points, rows, formats_of, rank, threads)
    fast = [p for p in points if ratios[p.name] < keep_below]
    increases = ppl_of(fast) if fast else {}
    table = tuple({"point": p.name, "share": round(rows[p.name], 4),
                   "kernel_over_dense": round(ratios[p.name], 3) if np.isfinite(ratios[p.name]) else None,
                   "ppl_increase": round(increases[p.name], 5) if p.name in increases else None}
                  for p in points)
    return EarlyAnswer(smp.tokens, threads, table, keep_below, max_ppl_increase,
                       smp.seconds + time.perf_counter() - t0)
