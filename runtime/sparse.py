"""The FFN sparsity rules between a layer's ONNX session and its down projection
(formats/schema.py SPARSITY_MODES): zero the entries of h the layer's mode skips, and count the
rows a sparse kernel would read. Same rules, per token, in prefill and decode.

NumPy reference implementation: it makes every mode measurable (perplexity, rows read) with the
real runtime; the fused C kernels of pinfer.kernels replace it where they exist.
"""

from dataclasses import dataclass

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
        mode, _, value = text.partition(":")
        if mode not in S.SPARSITY_MODES:
            raise ValueError(f"sparsity {text!r} is not one of {', '.join(S.SPARSITY_MODES)} "
                             "(with :VALUE, e.g. down:0.3)")
        try:
            return cls(mode, float(value) if value else 0.0)
        except ValueError:
            raise ValueError(f"sparsity {text!r}: {value!r} is not a number") from None


class Counters:
    """Rows read, summed over tokens, for the stats line."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.tokens = 0
        self.gate_up = 0
        self.down = 0
        self.full = 0

    def fractions(self):
        """(gate/up rows read, down rows read) as shares of all rows, over the layers counted."""
        if not self.full:
            return 1.0, 1.0
        return self.gate_up / self.full, self.down / self.full


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
        if rule.mode in ("down", "predicted") and not thresholds:
            raise ValueError(f"layer {layer} has no calibrated thresholds; the file was converted with "
                             "--sparsity none: convert again with calibration to use sparsity")
        key = rule.value if rule.mode == "down" else header["sparsity"]["predictor_sparsity"]
        if rule.mode in ("down", "predicted"):
            if f"{key:g}" not in thresholds:
                raise ValueError(f"no threshold for sparsity {key:g} in layer {layer}; "
                                 f"calibrated: {', '.join(thresholds)}")
            self.threshold = np.float32(thresholds[f"{key:g}"])
        if rule.mode in ("predicted", "relu"):
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
        """A zero-argument callable applying the rule to h in place and counting rows."""
        c = self.counters
        n_ff = h.shape[-1]
        if self.rule.mode == "dense":
            def dense():
                c.gate_up += h.size
                c.down += h.size
                c.full += h.size
            return dense
        if self.rule.mode == "down":
            thr = self.threshold

            def down():
                keep = np.abs(h) >= thr
                np.multiply(h, keep, out=h)
                c.gate_up += h.size
                c.down += int(keep.sum())
                c.full += h.size
            return down
        w1, w2, b2, pthr = self.pred
        thr = self.threshold

        def predicted():
            scores = np.maximum(x @ w1, 0) @ w2 + b2          # (S, n_ff)
            keep = scores >= pthr
            c.gate_up += int(keep.sum())
            if thr is not None:
                keep &= np.abs(h) >= thr
            else:
                keep &= h != 0
            np.multiply(h, keep, out=h)
            c.down += int(keep.sum())
            c.full += h.size
        assert n_ff == w2.shape[1]
        return predicted
