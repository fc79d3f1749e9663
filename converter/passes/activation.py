"""Training-free activation sparsity (as TEAL and CATS describe it): the input entries of a
projection whose magnitude is under a per-layer threshold are dropped, so the matching input
columns of its weight matrix need not be read. No predictor and no training: a threshold per layer
and projection, taken as a quantile of |input| over calibration text on the model as it runs at
that level (thresholds()), then held-out perplexity per configuration (evaluate()) and the level
per projection within a budget (choose()).

Projections, by the input they share (what one threshold and one set of survivors covers):
    qkv      the attention's normed input, read by the q, k and v projections
    o        the heads' output, read by the output projection
    gate_up  the FFN's normed input, read by the gate and up projections
    down     act(gate) * up, read by the down projection (the runtime's `down` mode)

The reference here runs in PyTorch from the source's dequantized weights (torch_llama), one layer
at a time: the calibration stream and every evaluated configuration's stream go through layer i
before layer i + 1 is loaded, so each layer's weights are dequantized once.
"""

import math
from dataclasses import dataclass

import numpy as np
import torch

from . import torch_llama as TL

PROJECTIONS = ("qkv", "o", "gate_up", "down")
SAMPLE = 1 << 20            # |input| values a threshold's quantile is taken over, per layer and projection
PROBE_SEQS = 4              # calibration sequences each level's thresholds are taken from, per layer
LEVELS = (0.1, 0.2, 0.3, 0.4, 0.5)   # what convert --activation-thresholds records
ROUNDS = 3                  # choose(): rounds of the greedy per-projection step past the model-wide level


def projection_sizes(cfg, gated=True):
    """{projection: (input width, weights its input columns hold)}; gated: the FFN has a gate."""
    hd = cfg.head_dim
    q, kv = cfg.n_head * hd, cfg.n_head_kv * hd
    gates = 2 if gated else 1
    return {"qkv": (cfg.d_model, cfg.d_model * (q + 2 * kv)), "o": (q, q * cfg.d_model),
            "gate_up": (cfg.d_model, gates * cfg.d_model * cfg.n_ff), "down": (cfg.n_ff, cfg.n_ff * cfg.d_model)}


def layer_forward(h, w, cfg, rotary, tap=TL._same):
    """One decoder layer, h (B, T, d) -> (B, T, d), with tap(name, x) on each projection's input."""
    h1 = TL.attention(h, w, cfg, rotary, tap)
    x = tap("gate_up", TL.ffn_input(h1, w, cfg))
    hact = tap("down", TL.ffn_hidden(x, w, cfg))
    return TL.ffn_residual(h1, w) + TL.ffn_output(hact @ w.down.T, w, cfg)


class Sparsifier:
    """A tap that zeroes each input entry under its projection's threshold, and counts the share
    dropped (what a column-skipping kernel would not read)."""

    def __init__(self, thresholds):
        self.t = thresholds                        # {projection: threshold}; absent: dense
        self.dropped = {p: [0, 0] for p in PROJECTIONS}

    def __call__(self, name, x):
        t = self.t.get(name, 0.0)
        if not t:
            self.dropped[name][1] += x.numel()
            return x
        keep = x.abs() >= t
        self.dropped[name][0] += int(x.numel() - keep.sum())
        self.dropped[name][1] += x.numel()
        return x * keep


class Calibrating:
    """A tap that takes, for each projection in turn, the |input| under which the share `level` of
    this batch's inputs falls, and drops them: the inputs of the later projections are then those
    of the model as it runs at that level."""

    def __init__(self, level, rng):
        self.level, self.rng, self.t = level, rng, {}

    def __call__(self, name, x):
        flat = x.detach().reshape(-1).abs()
        if flat.numel() > SAMPLE:
            flat = flat[torch.from_numpy(self.rng.integers(0, flat.numel(), SAMPLE)).to(flat.device)]
        self.t[name] = t = float(torch.quantile(flat.float(), self.level))
        return x * (x.abs() >= t)


def thresholds(src, names, cfg, train, embed, levels=LEVELS, freq_divisors=None, seed=0, on_layer=None):
    """Per layer {projection: {level: |input| threshold}} over train (n, T) token ids, one layer's
    weights at a time, each level on its own stream of the model as it runs at that level: per
    layer the first PROBE_SEQS sequences set each projection's threshold in turn (Calibrating), the
    rest follow with them. Thresholds taken from the dense model drop more than the level where the
    dropped inputs are not near zero, and compound over the projections and layers: LLaMA-7B's
    shapes with random weights (an FFN input of +-1 everywhere) kept 0.0002% of the down projection's
    inputs at 0.4 with the dense model's, 43% with the FFN input's alone taken into account."""
    rng = np.random.default_rng(seed)
    rot = TL.Rotary(cfg, train.shape[1], freq_divisors, embed.device)
    out = []
    with torch.no_grad():
        streams = {s: embed(train) for s in levels}
        for i in range(cfg.n_layer):
            w, found = TL.load_layer(src, names, i, embed.device), {}
            for s in levels:
                h, tap = streams[s], Calibrating(s, rng)
                probe = layer_forward(h[:PROBE_SEQS], w, cfg, rot, tap)
                streams[s] = torch.cat([probe, _batched(h[PROBE_SEQS:], w, cfg, rot, Sparsifier(tap.t))])
                found[s] = tap.t
            out.append({p: {s: found[s][p] for s in levels} for p in PROJECTIONS})
            del w
            if on_layer:
                on_layer(i)
    return out


def evaluate(src, names, cfg, evaluated, embed, head, found, configs, freq_divisors=None, on_layer=None):
    """One pass over the layers: {config name: (mean NLL of evaluated's second halves, {projection:
    share of its inputs dropped})} for configs {name: {projection: level}} (absent or 0: dense), at
    the thresholds found (per layer {projection: {level: t}}, thresholds()), on embed's device."""
    rot = TL.Rotary(cfg, evaluated.shape[1], freq_divisors, embed.device)
    with torch.no_grad():
        first_h = embed(evaluated)
        streams = {n: first_h.clone() for n in configs}
        taps = {n: Sparsifier({}) for n in configs}
        for i in range(cfg.n_layer):
            w = TL.load_layer(src, names, i, embed.device)
            for n, levels in configs.items():
                taps[n].t = {p: found[i][p][lv] for p, lv in levels.items() if lv}
                streams[n] = _batched(streams[n], w, cfg, rot, taps[n])
            del w
            if on_layer:
                on_layer(i)
        first = evaluated.shape[1] // 2
        targets = torch.from_numpy(np.ascontiguousarray(evaluated[:, first + 1:]).reshape(-1))
        out = {n: (float(head.nll(streams[n][:, first:-1].reshape(-1, cfg.d_model), targets).mean()),
                   {p: d / max(1, k) for p, (d, k) in taps[n].dropped.items()}) for n in configs}
        head.release()
    return out


@dataclass
class Choice:
    """choose()'s answer: the level per projection, the dense model's held-out NLL, and every
    configuration evaluated on the way ([{"levels", "ppl_increase", "dropped"}], in order)."""
    chosen: dict
    dense_nll: float
    curve: list

    def header(self, max_increase):
        return {"chosen": {p: self.chosen[p] for p in PROJECTIONS}, "max_ppl_increase": max_increase,
                "dense_ppl": round(math.exp(self.dense_nll), 4), "curve": self.curve}


def choose(src, names, cfg, found, evaluated, embed, head, max_increase, levels=LEVELS, freq_divisors=None,
           rounds=ROUNDS, on_pass=None):
    """The activation sparsity level of each projection within max_increase held-out perplexity:
    the highest model-wide level that keeps it, then greedy steps, each raising by one level the
    projection whose weight bytes saved per perplexity spent are the most among those that keep it
    (up to `rounds` passes of the candidates). Each pass is evaluate() over the layers; on_pass(name)
    before each."""
    sizes, curve, dense = projection_sizes(cfg, "ffn_gate" in names), [], []

    def run(configs, name):
        """{config name: its held-out perplexity increase over dense}, each also in the curve."""
        if on_pass:
            on_pass(name)
        res = evaluate(src, names, cfg, evaluated, embed, head, found, configs, freq_divisors)
        if "dense" in res:
            dense.append(res.pop("dense")[0])
        out = {}
        for n, (nll, dropped) in res.items():
            out[n] = math.exp(nll - dense[0]) - 1
            curve.append({"levels": dict(configs[n]), "ppl_increase": round(out[n], 5),
                          "dropped": {p: round(d, 4) for p, d in dropped.items()}})
        return out

    inc = run({"dense": {}, **{f"{s:g}": dict.fromkeys(PROJECTIONS, s) for s in levels}}, "model-wide levels")
    best = max([0.0] + [s for s in levels if inc[f"{s:g}"] <= max_increase])
    chosen, spent = dict.fromkeys(PROJECTIONS, best), inc.get(f"{best:g}", 0.0)
    for r in range(rounds):
        steps = {p: {**chosen, p: nxt} for p in PROJECTIONS
                 if (nxt := next((s for s in levels if s > chosen[p] + 1e-9), None)) is not None}
        if not steps:
            break
        inc = run(steps, f"greedy step {r + 1}")
        worth = {p: sizes[p][1] * (steps[p][p] - chosen[p]) / max(inc[p] - spent, 1e-6)
                 for p in steps if inc[p] <= max_increase}
        if not worth:
            break
        p = max(worth, key=worth.get)
        chosen, spent = steps[p], inc[p]
    return Choice(chosen, dense[0], curve)


def _batched(h, w, cfg, rot, tap, rows=4):
    out = torch.empty_like(h)
    for b in range(0, len(h), rows):
        out[b:b + rows] = layer_forward(h[b:b + rows], w, cfg, rot, tap)
    return out
