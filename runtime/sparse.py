"""The FFN sparsity rules between a layer's ONNX session and its down projection
(formats/schema.py SPARSITY_MODES): zero the entries of h the layer's mode skips, and count the
rows the rule keeps (what a row-skipping kernel reads) and the rows this path reads (all of them:
the ONNX graph computes every gate/up row, the down projection reads every row). Same rules, per
token, in prefill and decode.

NumPy reference implementation: it makes every mode measurable (perplexity, rows read) with the
real runtime; the fused C kernels of pinfer.kernels replace it where they exist.
"""

from dataclasses import dataclass, replace

import numpy as np

from pinfer.formats import blocks
from pinfer.formats import schema as S


@dataclass(frozen=True)
class Rule:
    mode: str
    value: float = 0.0

    @property
    def name(self):
        return self.mode if self.mode == "dense" else f"{self.mode}:{self.value:g}"

    @classmethod
    def parse(cls, text):
        mode, value = S.parse_mode(text)
        return cls(mode, value or 0.0)

    @classmethod
    def of_layer(cls, header, layer, override=""):
        """Layer `layer`'s rule: `override` (MODE[:VALUE]) where given, else the file's mode."""
        if override:
            return cls.parse(override)
        layers = header.get("layers") or []
        info = layers[layer] if layer < len(layers) else {}
        return cls(info.get("mode", "dense"), float(info.get("value", 0.0)))


def input_threshold(header, layer, projection, level):
    """The |input| under which activation sparsity `level` drops `projection`'s inputs in `layer`
    (header layers[i].input_thresholds, convert --activation-thresholds; 0 at level 0). Raises
    ValueError, one sentence, where the file has none."""
    if not level:
        return 0.0
    info = header["layers"][layer] if layer < len(header.get("layers", [])) else {}
    found = info.get("input_thresholds", {}).get(projection, {})
    key = f"{level:g}"
    if key not in found:
        raise ValueError(f"layer {layer} has no thresholds of its {projection} input for activation sparsity {key} "
                         f"(recorded: {', '.join(found) or 'none'}); convert the model with --activation-thresholds "
                         "to record them")
    return float(found[key])


ACTIVATION_PROJECTIONS = ("qkv", "o", "gate_up", "down")


def activation_levels(header, activation):
    """{projection: level} that RuntimeOptions.activation runs: S in every projection, or with
    "auto" the levels convert --activation-thresholds chose within its perplexity budget (header
    sparsity.activation.chosen). Raises ValueError, one sentence, where the file has no choice."""
    if activation != "auto":
        return dict.fromkeys(ACTIVATION_PROJECTIONS, float(activation))
    rec = (header.get("sparsity") or {}).get("activation")
    chosen = rec.get("chosen") if isinstance(rec, dict) else None
    if not isinstance(chosen, dict) or set(chosen) != set(ACTIVATION_PROJECTIONS) or not all(
            isinstance(v, (int, float)) and 0 <= v < 1 for v in chosen.values()):
        raise ValueError("the file records no activation sparsity level per projection for --activation-sparsity "
                         "auto; convert the model with --activation-thresholds, or give a level such as 0.2")
    return {p: float(chosen[p]) for p in ACTIVATION_PROJECTIONS}


def activation_label(header, activation):
    """How the path note names the activation sparsity: "0.2", or "auto (qkv 0.3, o 0.3, ...)"."""
    if activation != "auto":
        return f"{activation:g}"
    return "auto (" + ", ".join(f"{p} {v:g}" for p, v in activation_levels(header, "auto").items()) + ")"


@dataclass(frozen=True)
class LayerFfn:
    """A layer's FFN run by pinfer's fused kernel: the kernel (kernels.SparseFFN, or a
    hybrid.HybridFFN split between devices) and the rule it applies. mode: dense, down,
    predicted, relu or given (active sets handed in); threshold: |h| under it is dropped (down,
    and predicted's down rule); pred_threshold: the predictor's score cut (predicted, relu)."""
    kernel: object
    mode: str
    threshold: float = 0.0
    pred_threshold: float = 0.0

    def dense(self):
        """The same kernel over every neuron."""
        return replace(self, mode="dense", threshold=0.0, pred_threshold=0.0)

    def bind(self, x, y):
        return self.kernel.bind(x, y, self.mode, self.threshold, self.pred_threshold)


class Counters:
    """FFN rows summed over layers and tokens: those the rules keep (gate/up: the candidates; down:
    the survivors) and those actually read from memory, which differ on the NumPy-rule path. With
    activation sparsity, attn_kept[i] = the inputs layer i's q/k/v and output calls by columns kept
    (the C attention adds to its row in place)."""

    def __init__(self, n_layer=0):
        self.attn_kept = np.zeros((n_layer, 2), np.int64)
        self.reset()

    def reset(self):
        self.gate_up = self.down = 0            # kept by the rules
        self.read_gate_up = self.read_down = 0  # read
        self.full = 0
        self.attn_kept[...] = 0                 # in place: the bound calls point into it

    def add(self, gate_up, down, read_gate_up, read_down, full):
        self.gate_up += gate_up
        self.down += down
        self.read_gate_up += read_gate_up
        self.read_down += read_down
        self.full += full

    def fractions(self):
        """(gate/up rows, down rows) the rules keep, as shares of all rows counted."""
        if not self.full:
            return 1.0, 1.0
        return self.gate_up / self.full, self.down / self.full

    def read_fractions(self):
        """(gate/up rows, down rows) read from memory, as shares of all rows counted."""
        if not self.full:
            return 1.0, 1.0
        return self.read_gate_up / self.full, self.read_down / self.full


class LayerRule:
    """One layer's rule, bound to its buffers x (S, d) (FFN input) and h (S, n_ff)."""

    def __init__(self, reader, header, layer, rule, counters):
        self.rule, self.counters = rule, counters
        info = header["layers"][layer] if layer < len(header.get("layers", [])) else {}
        self.threshold = None
        self.pred = None
        if rule.mode == "dense":
            return
        thresholds = info.get("thresholds")
        thresholded = S.MODES[rule.mode].rule == "threshold"
        if thresholded and not thresholds:
            raise ValueError(f"layer {layer} has no calibrated thresholds; the file was converted with "
                             "--sparsity none: convert again with calibration to use sparsity")
        if thresholded:
            key = rule.value if rule.mode == "down" else header["sparsity"]["predictor_sparsity"]
            if f"{key:g}" not in thresholds:
                raise ValueError(f"no threshold for sparsity {key:g} in layer {layer}; "
                                 f"calibrated: {', '.join(thresholds)}")
            self.threshold = np.float32(thresholds[f"{key:g}"])
        if S.MODES[rule.mode].uses_predictor:
            pinfo = info.get("predictor")
            if not pinfo or S.FFN_PRED_B2.format(layer) not in reader:
                raise ValueError(f"layer {layer} has no predictor; convert with calibration to use {rule.mode}")
            t = next((t for t in pinfo["thresholds"] if abs(t["recall_target"] - rule.value) < 1e-9), None)
            if t is None:
                raise ValueError(f"no predictor threshold for recall {rule.value:g}; calibrated: "
                                 f"{', '.join(str(t['recall_target']) for t in pinfo['thresholds'])}")
            self.pred = (blocks.dequantize(*reader.block(S.FFN_PRED_W1.format(layer))).T.copy(),   # (d, r)
                         blocks.dequantize(*reader.block(S.FFN_PRED_W2.format(layer))).T.copy(),   # (r, n_ff)
                         reader.tensor(S.FFN_PRED_B2.format(layer)),
                         np.float32(t["threshold"]))

    def bind(self, x, h):
        """A zero-argument callable applying the rule to h in place and counting rows (this path
        reads every row, whatever the rule keeps)."""
        c = self.counters
        n_ff = h.shape[-1]
        if self.rule.mode == "dense":
            def dense():
                c.add(h.size, h.size, h.size, h.size, h.size)
            return dense
        if self.rule.mode == "down":
            thr = self.threshold

            def down():
                keep = np.abs(h) >= thr
                np.multiply(h, keep, out=h)
                c.add(h.size, int(keep.sum()), h.size, h.size, h.size)
            return down
        w1, w2, b2, pthr = self.pred
        thr = self.threshold

        def predicted():
            scores = np.maximum(x @ w1, 0) @ w2 + b2          # (S, n_ff)
            keep = scores >= pthr
            candidates = int(keep.sum())
            if thr is not None:
                keep &= np.abs(h) >= thr
            else:
                keep &= h != 0
            np.multiply(h, keep, out=h)
            c.add(candidates, int(keep.sum()), h.size, h.size, h.size)
        assert n_ff == w2.shape[1]
        return predicted
