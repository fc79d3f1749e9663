"""The calibrate, sparsify and predict passes, streamed one layer at a time (docs/design.md §2).

Per layer, only that layer's dequantized weights are in memory, plus the hidden states of the
calibration tokens: one stream for the training split, and one per operating point for the
held-out split, each carrying the model as that operating point would run it. At the end the
held-out streams give the perplexity cost of every operating point, measured, not modelled.

Operating points (rules of formats/schema.py's sparsity modes, applied per token):
  dense
  down:S       |act(gate)*up| under the layer's quantile-S threshold is skipped in the down rows
  predicted:R  the predictor's candidates at mass-recall target R; inside them the down rule at
               PREDICTOR_SPARSITY
  relu:R       (ReLU-family models) the predictor's candidates at R; inside them h != 0 (act(gate) > 0)
"""

import ctypes
import gc
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pinfer.runtime.sparse import Rule as Point   # an operating point: the rule a layer runs

from . import predictor as P
from . import torch_llama as TL

SPARSITY_GRID = tuple(round(0.1 * k, 1) for k in range(1, 10))   # thresholds stored per layer
DOWN_POINTS = (0.2, 0.3, 0.4)
PREDICTED_POINTS = (0.95, 0.99, 0.999)
RELU_POINTS = (0.99, 0.995, 0.999)
PREDICTOR_SPARSITY = 0.3    # gated models: "active" for the predictor means |h| above this quantile
MAX_BATCH_SEQS = 8          # sequences per forward batch, at most
BATCH_BYTES = 96 << 20      # and at most this many float32 bytes in a batch's widest activation
PREDICTOR_HELDOUT = 4096    # held-out tokens that choose and check predictor thresholds
REFERENCE_TOKENS = 128     # dense logits kept for the verification of the written file
QUANTILE_SAMPLE = 1 << 20   # |h| values sampled per layer for the thresholds
# Adaptive calibration length (no --calib-tokens): at the first layer, predictors trained on
# ADAPTIVE_START training tokens, then twice as many, and so on up to all of them; the search stops
# at the first doubling that cuts the share of neurons needed for 0.99 held-out mass recall by less
# than ADAPTIVE_GAIN of it, and every layer is calibrated on that many tokens.
ADAPTIVE_START = 4096
ADAPTIVE_GAIN = 0.02


def points_for(cfg, extra=None):
    """The operating points measured for this model; `extra` (a Point) is added when missing."""
    if cfg.exact_sparse:
        pts = [Point("dense")] + [Point("relu", r) for r in RELU_POINTS]
    else:
        pts = ([Point("dense")] + [Point("down", s) for s in DOWN_POINTS]
               + [Point("predicted", r) for r in PREDICTED_POINTS])
    return pts + [extra] if extra is not None and extra not in pts else pts


@dataclass
class LayerCalibration:
    thresholds: dict                 # sparsity quantile S -> |h| threshold (gated models)
    freq: np.ndarray                 # (n_ff,) share of training tokens where the neuron is active
    predictor: P.Predictor
    pred_thresholds: list            # [P.Threshold] per recall target
    ranks_tried: dict                # "rank format" -> candidate fraction at 0.99 mass recall
    # per operating point name -> measured on its own held-out stream:
    #   (share of gate/up rows read, share of down rows read, share of 32-neuron groups touched)
    read: dict = field(default_factory=dict)


@dataclass
class CalibrationResult:
    layers: list                     # [LayerCalibration]
    nll: dict                        # point name -> mean held-out NLL
    tokens_scored: int
    seconds: dict                    # phase -> seconds
    reference_logits: np.ndarray     # (REFERENCE_TOKENS, vocab) dense logits, first held-out sequence
    train_tokens: int = 0            # training tokens every layer was calibrated on
    length_search: list = field(default_factory=list)   # adaptive: [(tokens, share at 0.99 recall)]

    def cost_over_forward(self):
        """The per-layer passes' time over the layers' own forward time on the calibration tokens
        (training and held-out, dense): what the statistics, predictors and held-out streams add."""
        sec = self.seconds
        layer = sum(sec[k] for k in ("load", "forward", "statistics", "predictor", "heldout"))
        return layer / max(sec["forward"], 1e-9)

    def ppl(self, name):
        return float(np.exp(self.nll[name]))


def active_mask(cfg, hact, thresholds):
    if cfg.exact_sparse:
        return hact != 0
    return hact.abs() > thresholds[PREDICTOR_SPARSITY]


def apply_point(cfg, point, hact, x, lc):
    """Zero the entries of hact (N, n_ff) the operating point skips; returns (hact, gu_read,
    down_read) with the per-entry read masks (None: all read)."""
    if point.mode == "dense":
        return hact, None, None
    if point.mode == "down":
        keep = hact.abs() >= lc.thresholds[point.value]
        return hact * keep, None, keep
    thr = next(t.threshold for t in lc.pred_thresholds if t.recall_target == point.value)
    cand = lc.predictor.scores(x) >= thr
    keep = cand & active_mask(cfg, hact, lc.thresholds) if point.mode == "predicted" else cand & (hact != 0)
    return hact * keep, cand, keep


def batch_seqs(cfg, seq_len):
    """Sequences per forward batch: a batch's widest activation (the FFN's hidden values, or the
    attention scores of all heads) within BATCH_BYTES, which bounds the scratch memory of each
    intermediate (SmolLM2: 8 sequences of 512; LLaMA-7B's shapes: 2)."""
    per_seq = 4 * seq_len * max(cfg.n_ff, cfg.n_head * seq_len)
    return int(max(1, min(MAX_BATCH_SEQS, BATCH_BYTES // per_seq)))


def forward_ffn(h, w, cfg, rotary):
    """Attention, then the FFN's input and hidden values, for one batch h (B, T, d)."""
    h1 = TL.attention(h, w, cfg, rotary)
    x = TL.ffn_input(h1, w, cfg)
    return TL.ffn_residual(h1, w), x, TL.ffn_hidden(x, w, cfg)


def _quantiles(values, qs, rng):
    flat = values.reshape(-1)
    if flat.numel() > QUANTILE_SAMPLE:
        flat = flat[torch.from_numpy(rng.integers(0, flat.numel(), QUANTILE_SAMPLE)).to(flat.device)]
    q = torch.quantile(flat.float(), torch.tensor(qs, dtype=torch.float32, device=flat.device))
    return {s: float(v) for s, v in zip(qs, q)}


def run(src, names, cfg, calib, embed, head, ffn_bytes, freq_divisors=None, predictor_budget=0.10,
        on_layer=None, seed=0, extra_point=None, adaptive=False):
    """The layer-streamed passes over `calib` (calib_data.CalibrationSet), on the device `embed`
    and `head` were made for (torch_llama): one layer's weights, the streams and the layer's
    activations there; the results come back as NumPy arrays and floats. adaptive: the training
    tokens are cut at the first layer to the length where the predictors converge (ADAPTIVE_GAIN)."""
    torch.manual_seed(seed)
    _fixed_mmap_threshold()
    rng = np.random.default_rng(seed)
    seconds = dict.fromkeys(("load", "forward", "statistics", "predictor", "heldout", "head", "length_search"), 0.0)
    T = calib.train.shape[1]
    dev = embed.device
    rot = TL.Rotary(cfg, T, freq_divisors, dev)
    points = points_for(cfg, extra_point)
    bs = batch_seqs(cfg, T)
    train_h = embed(calib.train)                                  # (Nt, T, d)
    streams = {p.name: embed(calib.heldout) for p in points}      # each (Nh, T, d)
    layers, search = [], []
    clock = _Clock(seconds, dev)
    for i in range(cfg.n_layer):
        with clock("load"):
            w = TL.load_layer(src, names, i, dev)
        with torch.no_grad():
            with clock("forward"):
                x_train, h_train = _train_forward(train_h, w, cfg, rot, bs)
                # the dense held-out stream gives the predictor its held-out tokens: (the residual the
                # down projection adds to, the FFN's input, its hidden values), all held-out sequences
                dense = _dense_heldout(streams["dense"], w, cfg, rot, bs)
                x_held, hact_held = dense[1].view(-1, cfg.d_model), dense[2].view(-1, cfg.n_ff)
            with clock("statistics"):
                thresholds, mask_train, freq = _statistics(h_train, cfg, rng)
                del h_train
        # the layer's float32 weights (0.81 GB at LLaMA-7B's shapes) are not held through the
        # predictor's training: dequantized again for the held-out streams
        del w
        release_memory(src)
        lc, ranks = LayerCalibration(thresholds, freq, None, [], {}), predictor_ranks(cfg, ffn_bytes[i], predictor_budget)
        heldout = _heldout_split(cfg, x_held, hact_held, thresholds)
        if i == 0 and adaptive and len(train_h) * T > ADAPTIVE_START:
            with clock("length_search"):
                train_h, x_train, mask_train, search = _converged_length(train_h, x_train, mask_train, heldout,
                                                                         ranks[-1], seed)
        with clock("predictor"):
            _fit_predictor(lc, x_train, mask_train, heldout, ffn_bytes[i], seed + i, ranks)
            del x_train, mask_train, heldout
        with clock("load"):
            w = TL.load_layer(src, names, i, dev)
        with clock("heldout"):
            _advance_heldout(points, streams, dense, w, cfg, rot, lc, bs)
        layers.append(lc)
        del w, dense, x_held, hact_held
        release_memory(src)
        if on_layer:
            on_layer(i, lc)

    with clock("head"):
        nll, ref = _head_nll(head, cfg, streams, calib.heldout)
    return CalibrationResult(layers, nll, calib.heldout[:, 1:].size, seconds, ref, int(train_h.shape[0] * T), search)


def _head_nll(head, cfg, streams, heldout):
    """({point name: mean held-out NLL of its stream}, the dense stream's first REFERENCE_TOKENS logits)."""
    targets = torch.from_numpy(heldout[:, 1:].reshape(-1))
    with torch.no_grad():
        nll = {name: float(head.nll(h[:, :-1].reshape(-1, cfg.d_model), targets).mean()) for name, h in streams.items()}
        return nll, head.logits(streams["dense"][0, :REFERENCE_TOKENS]).cpu().numpy()


def _train_forward(train_h, w, cfg, rot, bs):
    """The training stream through the layer, in place; returns the FFN's inputs (N, d) and |h|
    (N, n_ff, float16) of every training token."""
    n, T, _ = train_h.shape
    x_train = torch.empty(n * T, cfg.d_model, device=train_h.device)
    h_train = torch.empty(n * T, cfg.n_ff, dtype=torch.float16, device=train_h.device)
    for b in range(0, n, bs):
        h1, x, hact = forward_ffn(train_h[b:b + bs], w, cfg, rot)
        train_h[b:b + bs] = h1 + TL.ffn_output(hact @ w.down.T, w, cfg)
        x_train[b * T:(b + len(x)) * T] = x.reshape(-1, cfg.d_model)
        h_train[b * T:(b + len(x)) * T] = hact.reshape(-1, cfg.n_ff).abs()
        del h1, x, hact
    return x_train, h_train


def _statistics(h_train, cfg, rng):
    """(the |h| threshold of each SPARSITY_GRID quantile, the predictor's target mask, each neuron's
    active share) of the training tokens' |h|."""
    thresholds = _quantiles(h_train, list(SPARSITY_GRID), rng)
    mask = (h_train > 0) if cfg.exact_sparse else h_train > thresholds[PREDICTOR_SPARSITY]
    return thresholds, mask, (torch.count_nonzero(mask, dim=0).float() / len(mask)).cpu().numpy()


class _Clock:
    """seconds[phase] += the wall time of each `with clock(phase)` (a CUDA device synchronized
    first, so that queued work is counted where it was issued)."""

    def __init__(self, seconds, device):
        self.seconds, self.cuda = seconds, torch.device(device).type == "cuda"

    def __call__(self, phase):
        self.phase = phase
        return self

    def __enter__(self):
        self._sync()
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        self._sync()
        self.seconds[self.phase] += time.perf_counter() - self.t0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize()


def _converged_length(train_h, x_train, mask_train, heldout, rank, seed):
    """The adaptive calibration length (ADAPTIVE_GAIN's rule) at the first layer: predictors of `rank`
    on a fixed random order of the training sequences, ADAPTIVE_START tokens of them, then twice as
    many...; returns the training stream, inputs and masks cut to the sequences kept (in their
    order), and [(tokens, share at 0.99 recall)] of the search."""
    keep, history = _converged_sequences(x_train, mask_train, heldout, rank, train_h.shape[1], seed)
    rows = (keep[:, None] * train_h.shape[1] + torch.arange(train_h.shape[1])).reshape(-1).to(x_train.device)
    return train_h[keep.to(train_h.device)], x_train[rows], mask_train[rows], history


def _converged_sequences(x_train, mask_train, heldout, rank, T, seed):
    """(the sequence indices kept, sorted; [(tokens, share at 0.99 recall)]) of _converged_length."""
    n_seq = len(x_train) // T
    order = torch.randperm(n_seq, generator=torch.Generator().manual_seed(seed))
    n, prev, history = max(1, ADAPTIVE_START // T), None, []
    while True:
        n = min(n, n_seq)
        rows = (order[:n, None] * T + torch.arange(T)).reshape(-1).to(x_train.device)
        pred = P.train(x_train[rows], mask_train[rows], rank, seed=seed)
        share = _share_at_99(pred, heldout)[0]
        history.append((n * T, share))
        if n == n_seq or (prev is not None and prev - share < ADAPTIVE_GAIN * prev):
            return order[:n].sort().values, history
        prev, n = share, 2 * n


def _dense_heldout(h, w, cfg, rot, bs):
    """forward_ffn over every sequence of h, batch by batch, into three whole tensors."""
    n, T, _ = h.shape
    out = tuple(torch.empty(n, T, k, device=h.device) for k in (cfg.d_model, cfg.d_model, cfg.n_ff))
    for b in range(0, n, bs):
        for dst, src in zip(out, forward_ffn(h[b:b + bs], w, cfg, rot)):
            dst[b:b + bs] = src
    return out


def _advance_heldout(points, streams, dense, w, cfg, rot, lc, bs):
    """Each operating point's held-out stream through this layer under its own rule, in place,
    with the shares of FFN rows it read into lc.read (dense: the forward pass already made)."""
    with torch.no_grad():
        for p in points:
            h = streams[p.name]
            reads = np.zeros(3)
            for b in range(0, len(h), bs):
                a, x, hh = ((t[b:b + bs] for t in dense) if p.mode == "dense"
                            else forward_ffn(h[b:b + bs], w, cfg, rot))
                x = x.reshape(-1, cfg.d_model)
                flat, gu, dn = apply_point(cfg, p, hh.reshape(-1, cfg.n_ff), x, lc)
                h[b:b + bs] = a + TL.ffn_output((flat @ w.down.T).view(a.shape), w, cfg)
                reads += _read_shares(gu, dn, cfg.n_ff, flat.shape[0])
            lc.read[p.name] = tuple(reads / max(1, -(-len(h) // bs)))


def _fixed_mmap_threshold():
    """Large buffers straight from mmap and back to the system when freed: with glibc's default
    dynamic threshold, the per-layer buffers end up in a heap that fragments as layers go by."""
    try:
        ctypes.CDLL(None).mallopt(-3, 32 << 20)    # M_MMAP_THRESHOLD: 32 MiB, its largest value
    except (OSError, AttributeError):
        pass


def release_memory(src):
    """Give this layer's memory back: the source file's pages, and the heap that glibc keeps after
    large frees (its dynamic mmap threshold otherwise lets peak RSS creep up layer by layer)."""
    gc.collect()
    src.release()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _read_shares(gu, dn, n_ff, n_tok):
    """(gate/up rows, down rows, 32-neuron groups with any down row) read, as shares of all."""
    share = lambda m: int(torch.count_nonzero(m)) / max(m.numel(), 1)    # noqa: E731 (no copy of the mask)
    g = 1.0 if gu is None else share(gu)
    if dn is None:
        return np.array([g, 1.0, 1.0])
    groups = dn.view(n_tok, n_ff // 32, 32).any(-1) if n_ff % 32 == 0 else dn
    return np.array([g, share(dn), share(groups)])


def predictor_ranks(cfg, ffn_bytes, budget):
    """The predictor ranks tried for a layer: the largest whose q8 weights (and f32 bias) fit in
    `budget` of the layer's FFN bytes, and half of it."""
    per_rank = 1.0625 * (cfg.d_model + cfg.n_ff)           # q8 bytes per unit of rank
    r_max = max(32, int((budget * ffn_bytes - 4 * cfg.n_ff) / per_rank) // 32 * 32)
    return sorted({max(32, r_max // 2 // 32 * 32), r_max})


def _heldout_split(cfg, x_held, hact_held, thresholds):
    """The predictor's held-out tokens: (x, (|h|, active) of the half that chooses thresholds, the
    same of the half that checks them), from the first PREDICTOR_HELDOUT held-out tokens."""
    habs = hact_held[:PREDICTOR_HELDOUT].abs()
    active = (habs != 0) if cfg.exact_sparse else habs > thresholds[PREDICTOR_SPARSITY]
    half = len(habs) // 2
    return x_held[:PREDICTOR_HELDOUT], (habs[:half], active[:half]), (habs[half:], active[half:])


def _share_at_99(pred, heldout):
    """(share of neurons the predictor selects for 0.99 held-out mass recall, its scores)."""
    x, fit, check = heldout
    s = pred.scores(x)
    half = len(fit[0])
    return P.calibrate((s[:half], *fit), (s[half:], *check), targets=(0.99,))[0].candidate_fraction, s


def _fit_predictor(lc, x_train, mask_train, heldout, ffn_bytes, seed, ranks):
    """Train at `ranks` (predictor_ranks: what the byte budget, a share of the layer's FFN bytes,
    allows), each stored in every format the kernels read (P.FORMATS); keep the one that reads the
    fewest bytes per token at 0.99 mass recall, predictor included: a coarser format costs
    candidates (its scores are noisier), which the held-out tokens count."""
    _, fit, check = heldout
    half = len(fit[0])
    best = None
    for r in ranks:
        weights = P.fit(x_train, mask_train, r, seed=seed)
        for fmt in P.FORMATS:
            pred = P.Predictor.stored(*weights, fmt)
            at99, s = _share_at_99(pred, heldout)
            lc.ranks_tried[f"{r} {fmt}"] = at99
            cost = pred.nbytes() + at99 * ffn_bytes
            if best is None or cost < best[0]:
                best = (cost, pred, s)
    _, lc.predictor, s = best
    lc.pred_thresholds = P.calibrate((s[:half], *fit), (s[half:], *check))
