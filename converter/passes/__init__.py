"""The converter's middle: calibrate -> sparsify/predict -> choose modes -> order -> plan.

Produces a `LayoutPlan`: for every layer its mode, neuron order and bundle formats, with the
header entries ("sparsity", "layers", "plan") and the per-layer tensors (predictors, frequency
curves) the back end writes. Everything here is computed before any output byte is written.
"""

import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np

from pinfer.formats import schema as S

from . import plan as PL


@dataclass(frozen=True)
class PassOptions:
    sparsity: str = "auto"          # none | auto | dense | down[:S] | predicted[:R] | relu[:R]
    max_ppl_increase: float = 0.01
    calib: object = None            # Path of a .txt/.jsonl, or None for the built-in set
    calib_tokens: int | None = None  # training tokens; None: adaptive, at most CALIB_TOKENS_MAX (calibrate.py)
    heldout_tokens: int = 8192
    seq_len: int = 512
    order: str = "auto"             # auto | hot-first | source
    predictor_budget: float = 0.10  # predictor bytes as a share of the layer's FFN bytes
    seed: int = 0
    early_check: bool = True        # auto: the dense file at once where no sparse point can be faster (early.py)
    calib_device: str = "auto"      # auto | cpu | cuda: where calibration and predictor training run
    # a pass over the calibration text records every layer's activation sparsity thresholds
    # (activation.thresholds), after whatever --sparsity calibrates (with none: nothing else)
    activation: bool = False


CALIB_TOKENS_MAX = 24576

# No calibration: every layer dense, the walking skeleton's conversion (fast; used by tests that
# check the dense path).
DENSE = PassOptions(sparsity="none")


@dataclass
class LayerLayout:
    mode: str = "dense"
    value: float = 0.0
    perm: np.ndarray | None = None   # new position k holds source neuron perm[k]; None: source order
    freq: np.ndarray | None = None   # (n_ff,) in file order
    predictor: object = None         # predictor.Predictor in file order
    info: dict = field(default_factory=dict)


@dataclass
class LayoutPlan:
    layers: list
    sparsity: dict
    calibration: object = None       # calibrate.CalibrationResult
    calib_set: object = None         # calib_data.CalibrationSet


def _device_name(device):
    if device == "cpu":
        return "the CPU"
    import torch
    return f"{torch.cuda.get_device_name(0)} (CUDA)"


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


FFN_ROLES = ("ffn_gate", "ffn_up", "ffn_down")   # source tensors of the FFN bundles (no gate: OPT)


def parse_sparsity(text, cfg):
    """Validate --sparsity; returns None (auto), "none", or a calibrate.Point."""
    from .calibrate import Point
    if text in ("auto", "none"):
        return None if text == "auto" else "none"
    defaults = {"dense": 0.0, "down": 0.3, "predicted": 0.99, "relu": 0.99}
    if text.partition(":")[0] not in S.SPARSITY_MODES:
        raise ValueError(f"--sparsity {text!r} is not none, auto, or one of {', '.join(S.SPARSITY_MODES)} "
                         "with an optional :VALUE (e.g. down:0.3)")
    try:
        mode, value = S.parse_mode(text)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    if mode == "relu" and not cfg.exact_sparse:
        raise ValueError(f"--sparsity relu needs a ReLU-family model; this one uses {cfg.ffn_act}: "
                         "use down or predicted")
    if mode in ("down", "predicted") and cfg.exact_sparse:
        raise ValueError("this is a ReLU-family model: use --sparsity relu[:RECALL] (exact), or dense")
    v = defaults[mode] if value is None else value
    from .calibrate import SPARSITY_GRID
    from .predictor import RECALL_TARGETS
    allowed = SPARSITY_GRID if mode == "down" else RECALL_TARGETS
    if mode != "dense" and round(v, 4) not in allowed:
        raise ValueError(f"--sparsity {mode}:{v:g}: the calibrated values are {', '.join(map(str, allowed))}")
    return Point(mode, v)


CALIB_DEVICES = ("auto", "cpu", "cuda")


def calib_device(name):
    """The torch device the calibration passes run on: auto is the GPU where PyTorch sees one."""
    import torch
    if name not in CALIB_DEVICES:
        raise ValueError(f"--calib-device {name!r} is not one of {', '.join(CALIB_DEVICES)}")
    cuda = torch.cuda.is_available()
    if name == "cuda" and not cuda:
        raise ValueError("--calib-device cuda: PyTorch sees no CUDA GPU here (torch.cuda.is_available() is "
                         "False: a CPU-only torch build, or no driver); use --calib-device cpu")
    return "cuda" if name == "cuda" or (name == "auto" and cuda) else "cpu"


def _bundle_formats(src, names, i, quant, permuted, predictor_bytes):
    """The FFN formats layer i will be written in (plan.bundle_formats), from the source's types."""
    types = [src.ttype(names[k].format(i)) for k in ("ffn_gate", "ffn_up") if k in names]
    return PL.bundle_formats(types, src.ttype(names["ffn_down"].format(i)), quant, permuted, predictor_bytes,
                             down_neuron_major=src.down_neuron_major)


def run(src, names, cfg, tokenizer_spec, opts, quant):
    plan = _plan(src, names, cfg, tokenizer_spec, opts, quant)
    if opts.activation:
        _activation_thresholds(src, names, cfg, tokenizer_spec, opts, plan)
    return plan


def _plan(src, names, cfg, tokenizer_spec, opts, quant):
    forced = parse_sparsity(opts.sparsity, cfg)
    if forced == "none":
        return LayoutPlan([LayerLayout() for _ in range(cfg.n_layer)], {"mode": "none"})
    if forced is None and src.powerinfer:
        return powerinfer_plan(src, names, cfg, opts, quant)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ValueError("calibration needs PyTorch, which is not installed; install it "
                         "(pip install torch, see README) or convert with --sparsity none") from None
    from pinfer.runtime.tokenizer import Tokenizer

    from . import calib_data, calibrate
    from . import torch_llama as TL

    t0 = time.perf_counter()
    tok = Tokenizer.from_spec(tokenizer_spec)
    seq_len = min(opts.seq_len, cfg.n_ctx_train)
    cs = calib_data.build(tok, opts.calib, seq_len, opts.calib_tokens or CALIB_TOKENS_MAX, opts.heldout_tokens)
    device = calib_device(opts.calib_device)
    _log(f"calibration: {cs.description}; on {_device_name(device)}")
    ffn_src_bytes = [sum(src.nbytes(names[k].format(i)) for k in FFN_ROLES if k in names)
                     for i in range(cfg.n_layer)]
    freqs = src.floats(names["rope_freqs"]) if "rope_freqs" in names else None
    embed, head = TL.Embedding(src, names, device, cfg.embed_scale), TL.Head(src, names, cfg, device=device)
    if forced is None and opts.early_check:
        answered = _early_answer(src, names, cfg, cs, (embed, head, freqs), ffn_src_bytes[0], opts, quant)
        if answered is not None:
            return answered
    bar = _progress(cfg.n_layer, "calibrate")
    result = calibrate.run(src, names, cfg, cs, embed, head, ffn_src_bytes, freqs, opts.predictor_budget,
                           seed=opts.seed, on_layer=lambda i, lc: bar.update(1), extra_point=forced,
                           adaptive=opts.calib_tokens is None)
    bar.close()
    _log_calibration(result)
    points = calibrate.points_for(cfg, forced)

    def fmts(i, p):
        permuted = _permuted(opts.order, p.mode)
        return _bundle_formats(src, names, i, quant, permuted, result.layers[i].predictor.nbytes())

    def bytes_of(i, p):
        return PL.ffn_bytes(cfg, fmts(i, p), p.mode, result.layers[i].read[p.name])

    choice = PL.choose(result, points, bytes_of, opts.max_ppl_increase, forced)
    layers = [_layer_layout(lc, p, opts.order, fmts(i, p), {q.name: bytes_of(i, q) for q in points if q.name in lc.read})
              for i, (lc, p) in enumerate(zip(result.layers, choice.modes))]
    _log(f"sparsity: {choice.reason} ({time.perf_counter() - t0:.0f} s)")
    return LayoutPlan(layers, _sparsity_record(result, choice, forced, opts, cs, device), result, cs)


def _log_calibration(result):
    from .calibrate import ADAPTIVE_GAIN
    if result.length_search:
        steps = ", ".join(f"{n} tokens {share:.1%}" for n, share in result.length_search)
        _log(f"calibration length: {result.train_tokens} training tokens (the share of neurons the first layer's "
             f"predictor needs for 0.99 held-out mass recall: {steps}; doubling stops below "
             f"{ADAPTIVE_GAIN:.0%} better; --calib-tokens N fixes it)")
    _log(f"calibration cost: {result.cost_over_forward():.1f}x the layers' own forward pass over the calibration "
         f"tokens ({', '.join(f'{k} {v:.1f} s' for k, v in result.seconds.items() if v)})")


def _sparsity_record(result, choice, forced, opts, cs, device):
    """The header's "sparsity" entry of a calibrated conversion."""
    from .calibrate import PREDICTOR_SPARSITY
    return {
        "mode": "auto" if forced is None else forced.name,
        "chosen": sorted({m.name for m in choice.modes}),
        "reason": choice.reason,
        "max_ppl_increase": opts.max_ppl_increase,
        "predictor_sparsity": PREDICTOR_SPARSITY,
        "heldout": {"tokens": result.tokens_scored, "dense_ppl": result.ppl("dense"), "points": choice.table},
        "calibration": cs.description,
        "train_tokens": result.train_tokens,
        "length_search": [list(x) for x in result.length_search],
        "cost_over_forward": round(result.cost_over_forward(), 2),
        "device": _device_name(device),
        "seconds": {k: round(v, 1) for k, v in result.seconds.items()},
    }


def _activation_thresholds(src, names, cfg, tokenizer_spec, opts, plan):
    """Each layer's activation sparsity thresholds (header input_thresholds: activation.thresholds,
    from the calibration text) into its LayerLayout's header entry, and the level per projection
    that keeps held-out perplexity within --max-ppl-increase (activation.choose) into the header's
    sparsity["activation"], for --activation-sparsity auto."""
    from pinfer.runtime.tokenizer import Tokenizer

    from . import activation, calib_data
    from . import torch_llama as TL
    t0 = time.perf_counter()
    cs = calib_data.build(Tokenizer.from_spec(tokenizer_spec), opts.calib, min(opts.seq_len, cfg.n_ctx_train),
                          opts.calib_tokens or ACTIVATION_TOKENS, opts.heldout_tokens)
    freqs = src.floats(names["rope_freqs"]) if "rope_freqs" in names else None
    device = calib_device(opts.calib_device)
    embed = TL.Embedding(src, names, device, cfg.embed_scale)
    bar = _progress(cfg.n_layer, f"activation thresholds on {_device_name(device)}")
    found = activation.thresholds(src, names, cfg, cs.train, embed, activation.LEVELS, freqs, opts.seed,
                                  lambda i: bar.update(1))
    bar.close()
    for lay, th in zip(plan.layers, found):
        lay.info = {**(lay.info or {"mode": lay.mode, "value": lay.value, "order": "source"}),
                    "input_thresholds": {p: {f"{s:g}": t for s, t in ts.items()} for p, ts in th.items()}}
    t1 = time.perf_counter()
    choice = activation.choose(src, names, cfg, found, cs.heldout, embed, TL.Head(src, names, cfg, device=device),
                               opts.max_ppl_increase, freq_divisors=freqs,
                               on_pass=lambda name: _log(f"activation sparsity: held-out perplexity, {name}"))
    plan.sparsity = {**plan.sparsity, "activation": choice.header(opts.max_ppl_increase)}
    _log(f"activation thresholds: {cs.train.size} tokens of {cs.description.split(';')[0]} ({t1 - t0:.0f} s); "
         f"levels within +{opts.max_ppl_increase:.1%} perplexity on {cs.heldout.size} held-out tokens: "
         + ", ".join(f"{p} {v:g}" for p, v in choice.chosen.items()) + f" ({time.perf_counter() - t1:.0f} s)")


ACTIVATION_TOKENS = 4096     # calibration tokens of --activation-thresholds without --calib-tokens


def _layer_layout(lc, p, order, f, ffn_bytes):
    """A layer's LayerLayout for operating point p, from its calibration lc: neurons hottest first
    where the mode selects them (the predictor permuted alike), and the header's account of it."""
    perm = np.argsort(-lc.freq, kind="stable") if _permuted(order, p.mode) else None
    pred = lc.predictor if perm is None else lc.predictor.permuted(perm)
    return LayerLayout(
        mode=p.mode, value=p.value, perm=perm, freq=lc.freq if perm is None else lc.freq[perm], predictor=pred,
        info={"mode": p.mode, "value": p.value, "order": "source" if perm is None else "hot-first",
              "bundle_formats": {"gate_up": f.gate_up[0], "down_t": f.down[0]},
              "thresholds": {f"{s:g}": t for s, t in lc.thresholds.items()},
              "active_fraction": float(lc.freq.mean()),
              "predictor": {"rank": pred.rank, "format": pred.fmt, "ranks_tried": dict(lc.ranks_tried),
                            "bytes": pred.nbytes(),
                            "thresholds": [t.__dict__ for t in lc.pred_thresholds]},
              "read": {k: list(v) for k, v in lc.read.items()},
              "ffn_bytes": ffn_bytes})


def _early_answer(src, names, cfg, cs, model, ffn_bytes, opts, quant):
    """--sparsity auto's early answer (early.py): a dense LayoutPlan at once when no sparse point can
    be within the budget and decode faster than dense on this machine, else None (calibrate)."""
    from . import calibrate, early
    points = [p for p in calibrate.points_for(cfg) if p.mode != "dense"]
    seqs = cs.train[:max(1, early.EARLY_TOKENS // cs.train.shape[1])]
    rank = calibrate.predictor_ranks(cfg, ffn_bytes, opts.predictor_budget)[0]
    bar = _progress(cfg.n_layer, "sample")
    smp = early.sample(src, names, cfg, seqs, model, points, rank, on_layer=lambda i: bar.update(1))
    bar.close()

    def ppl_of(fast):
        bar = _progress(cfg.n_layer, f"sample under {', '.join(p.name for p in fast)}")
        out = early.ppl_increases(src, names, cfg, smp, model, fast, on_layer=lambda i: bar.update(1))
        bar.close()
        return out
    formats_of = lambda p: _bundle_formats(src, names, 0, quant, _permuted(opts.order, p.mode), 0)  # noqa: E731
    ans = early.answer(cfg, smp, points, formats_of, rank, ppl_of, opts.max_ppl_increase)
    if ans.faster:
        _log(f"early check: {', '.join(ans.faster)} might be within the budget and faster than dense here; "
             f"calibrating ({ans.seconds:.0f} s)")
        model[1].release()          # the head's weights: not needed again until after the layers
        return None
    _log(f"sparsity: dense: {ans.reason()}")
    sparsity = {"mode": "auto", "chosen": ["dense"], "reason": ans.reason(), "max_ppl_increase": opts.max_ppl_increase,
                "early": ans.record(), "calibration": cs.description, "seconds": {"early": round(ans.seconds, 1)}}
    result = calibrate.CalibrationResult([], {}, 0, {"early": ans.seconds}, smp.reference_logits)
    return LayoutPlan([LayerLayout(freq=f) for f in smp.freq], sparsity, result, replace(cs, heldout=seqs[:1]))


# The rule name under which a PowerInfer file's own predictor threshold is stored (the header keys
# predictor thresholds by recall target; PowerInfer's has none measured: the report says so)
POWERINFER_VALUE = 0.99


def powerinfer_plan(src, names, cfg, opts, quant):
    """A PowerInfer file's own predictors and activation counts as the layout, no calibration:
    every layer runs relu (the predictor's candidates, h != 0 among them), hottest first by the
    counts unless --order source."""
    from pinfer.formats import blocks

    from ..frontend import powerinfer as PI
    from .predictor import Predictor
    thr = PI.threshold(src.meta)
    counts = PI.activation_counts(src.path, cfg.n_layer, cfg.n_ff)
    layers = []
    for i in range(cfg.n_layer):
        w1, w2 = src.floats(PI.FC1.format(i)), src.floats(PI.FC2.format(i))      # (r, d), (n_ff, r)
        if w1.shape[1] != cfg.d_model or w2.shape != (cfg.n_ff, w1.shape[0]) or w1.shape[0] % 32:
            raise ValueError(f"layer {i}'s predictor is {w1.shape} and {w2.shape}, not (rank, {cfg.d_model}) and "
                             f"({cfg.n_ff}, rank) with a rank that is a multiple of 32")
        p1, p2 = (src.block(PI.FC1.format(i)), src.block(PI.FC2.format(i)))
        p1 = p1[1] if p1 and p1[0] == "q8" else blocks.quantize("q8", w1)
        p2 = p2[1] if p2 and p2[0] == "q8" else blocks.quantize("q8", w2)
        pred = Predictor(blocks.dequantize("q8", p1), blocks.dequantize("q8", p2), np.zeros(cfg.n_ff, np.float32), p1, p2)
        freq = counts[i] / max(counts[i].max(), 1.0)
        perm = None if opts.order == "source" else np.argsort(-counts[i], kind="stable")
        pred = pred if perm is None else pred.permuted(perm)
        f = _bundle_formats(src, names, i, quant, perm is not None, pred.nbytes())
        layers.append(LayerLayout(
            mode="relu", value=POWERINFER_VALUE, perm=perm, freq=freq if perm is None else freq[perm], predictor=pred,
            info={"mode": "relu", "value": POWERINFER_VALUE, "order": "source" if perm is None else "hot-first",
                  "bundle_formats": {"gate_up": f.gate_up[0], "down_t": f.down[0]},
                  "active_fraction": float(freq.mean()),
                  "predictor": {"rank": pred.rank, "bytes": pred.nbytes(), "source": "powerinfer",
                                "thresholds": [{"recall_target": POWERINFER_VALUE, "threshold": thr,
                                                "source": "the file's powerinfer.sparse_threshold"}]}}))
    reason = (f"the PowerInfer file's own predictors (a neuron is computed when its logit is at least {thr:g}) and "
              f"its activation/ counts (neurons ordered hottest first, the GPU plan's hotness); no calibration. "
              f"The rule is named relu:{POWERINFER_VALUE:g}: its recall was not measured")
    _log(f"sparsity: {reason}")
    return LayoutPlan(layers, {"mode": "powerinfer", "chosen": [f"relu:{POWERINFER_VALUE:g}"], "reason": reason,
                               "predictor_threshold": thr})


def _permuted(order, mode):
    if order == "hot-first":
        return True
    if order == "source":
        return False
    # auto: reorder where the mode selects neurons; elsewhere keep the source's exact blocks
    return S.MODES[mode].uses_predictor


class _LineProgress:
    """One log line per step where no terminal shows a bar (logs, CI)."""

    def __init__(self, total, desc):
        self.total, self.desc, self.n, self.t0 = total, desc, 0, time.perf_counter()

    def update(self, n):
        self.n += n
        spent = time.perf_counter() - self.t0
        left = spent / self.n * (self.total - self.n)
        _log(f"  {self.desc}: layer {self.n}/{self.total} ({spent:.1f} s" + (f"; about {left:.0f} s left)" if left else ")"))

    def close(self):
        pass


def _progress(total, desc):
    if not sys.stderr.isatty():
        return _LineProgress(total, desc)
    try:
        from tqdm import tqdm
    except ImportError:
        return _LineProgress(total, desc)
    return tqdm(total=total, desc=desc, unit="layer", file=sys.stderr)


def placement_plan(cfg, layout, directory, target_vram_gib, n_ctx, hot_rows=None):
    """Header "plan": per-layer hot neuron counts for target_vram_gib, and what was reserved.
    With --quant mixed the plan is the split the file was written with (hot_rows, fp16 rows)."""
    ffn_names = {S.FFN_GATE_UP, S.FFN_DOWN_T, S.FFN_GATE_UP_COLD, S.FFN_DOWN_T_COLD}
    ffn_names = {t.format(i) for t in ffn_names for i in range(cfg.n_layer)}
    ffn = np.zeros(cfg.n_layer)
    dense = 0
    for name, e in directory.items():
        base = name.rsplit(".", 1)[0]
        if base in ffn_names:
            ffn[int(base.split(".")[1])] += e["nbytes"]
        elif _on_gpu(cfg, name, base):
            dense += e["nbytes"]
    if hot_rows is not None:
        hot, neuron = np.asarray(hot_rows), np.full(cfg.n_layer, PL.row_bytes("f16", cfg.d_model, False)[0] * 3.0)
        kv, scratch = _reserved(cfg, n_ctx)
    else:
        neuron = ffn / cfg.n_ff
        hot, kv, scratch = _hot(cfg, layout, dense, neuron, target_vram_gib, n_ctx)
    return {"target_vram_gib": target_vram_gib, "reserved": {"dense_bytes": int(dense), "kv_bytes": int(kv),
                                                               "n_ctx": n_ctx, "scratch_bytes": scratch},
            "hot_neurons": [int(h) for h in hot], "neuron_bytes": [float(b) for b in neuron],
            "hot_share": float(hot.sum() / (cfg.n_layer * cfg.n_ff))}


def _on_gpu(cfg, name, base):
    """Dense tensors the GPU holds: all but graphs and the embedding table (looked up on the CPU)
    unless the table is also the LM head."""
    return not name.startswith("graph.") and (base != S.TOKEN_EMBD or cfg.tied_embeddings)


def _reserved(cfg, n_ctx):
    from pinfer.runtime.placement import DENSE_SCRATCH
    kv = 2 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim * n_ctx * 2    # f16 K and V
    return kv, DENSE_SCRATCH


def _hot(cfg, layout, dense, neuron_bytes, target_vram_gib, n_ctx):
    kv, scratch = _reserved(cfg, n_ctx)
    freq = np.stack([lay.freq if lay.freq is not None else np.ones(cfg.n_ff) for lay in layout.layers])
    return PL.placement(cfg, freq, neuron_bytes, dense + kv + scratch, target_vram_gib * PL.GIB), kv, scratch


def mixed_split(src, names, cfg, layout, target_vram_gib, n_ctx):
    """--quant mixed: the per-layer fp16 prefixes the placement plan fits in target_vram_gib, with
    fp16 bundle rows and the dense tensors at their source sizes (they are carried over)."""
    keys = [k for k in names if k not in FFN_ROLES]
    dense = 0
    src_names = set(src.tensor_names())
    for key in keys:
        for i in range(cfg.n_layer) if "{}" in names[key] else [None]:
            name = names[key].format(i) if i is not None else names[key]
            if name in src_names and (key != "token_embd" or cfg.tied_embeddings):
                dense += src.nbytes(name)
    rows = 3.0 if cfg.ffn_gated else 2.0       # gate, up, down rows per neuron
    neuron = np.full(cfg.n_layer, PL.row_bytes("f16", cfg.d_model, False)[0] * rows)
    hot, _, _ = _hot(cfg, layout, dense, neuron, target_vram_gib, n_ctx)
    return [int(h) for h in hot]
