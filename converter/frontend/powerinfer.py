"""PowerInfer's own model files: a GGUF v3 container whose magic is PWRI (gguf_check reads it),
with per layer a predictor, blk.N.fc1.weight (rank, d_model) and blk.N.fc2.weight (n_ff, rank)
(Linear, ReLU, Linear, no biases; a neuron is computed when its logit is at least
powerinfer.sparse_threshold, default 0), W_down transposed as blk.N.ffn_down_t, neurons in their
original order, and beside the file activation/activation_N.pt per layer: a 1-D tensor of how
often each neuron fired. pinfer takes the predictors as its `relu` rule and the counts as the
hotness profile, with no calibration (converter/passes: powerinfer_plan)."""

import warnings
from pathlib import Path

import numpy as np

THRESHOLD_KEY = "powerinfer.sparse_threshold"
FC1, FC2 = "blk.{}.fc1.weight", "blk.{}.fc2.weight"


class PowerInferError(ValueError):
    pass


def threshold(meta):
    t = meta.get(THRESHOLD_KEY, 0.0)
    if not isinstance(t, (int, float)) or isinstance(t, bool) or not np.isfinite(t):
        raise PowerInferError(f"{THRESHOLD_KEY} is {t!r}, not a number")
    return float(t)


def activation_counts(path, n_layer, n_ff):
    """(n_layer, n_ff) float64 counts from activation/activation_N.pt beside `path`, read with
    torch.load(weights_only=True): tensors only, never arbitrary pickled objects."""
    folder = Path(path).parent / "activation"
    try:
        import torch
    except ImportError:
        raise PowerInferError("reading a PowerInfer file's activation counts needs PyTorch (pip install torch)") from None
    out = np.zeros((n_layer, n_ff))
    for i in range(n_layer):
        f = folder / f"activation_{i}.pt"
        if not f.is_file():
            raise PowerInferError(f"{f} is missing: a PowerInfer model comes with activation/activation_N.pt per layer "
                                  "beside its file (the neurons' activation counts); put the folder there")
        try:
            with warnings.catch_warnings():     # torch warns about foreign pickles before refusing them
                warnings.simplefilter("ignore")
                t = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:      # torch raises many kinds for a damaged or foreign pickle
            raise PowerInferError(f"{f} could not be read as a tensor of counts ({type(e).__name__}); "
                                  "it must be a plain tensor saved with torch.save") from None
        if not isinstance(t, torch.Tensor) or t.dim() != 1 or t.numel() != n_ff:
            raise PowerInferError(f"{f} holds {type(t).__name__} {tuple(getattr(t, 'shape', ()))}, not the "
                                  f"{n_ff} counts of layer {i}'s neurons")
        c = t.double().numpy()
        if not np.isfinite(c).all() or (c < 0).any():
            raise PowerInferError(f"{f} holds negative or non-finite counts")
        out[i] = c
    return out
