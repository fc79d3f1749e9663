"""Next-token sampling with llama.cpp's defaults and order.

llama.cpp's chain (common/sampling): repeat penalty -> top-k -> top-p -> min-p -> temperature ->
draw. Top-p and min-p therefore see probabilities at temperature 1; temperature only reshapes the
final draw. temp <= 0 is greedy: argmax after the repeat penalty.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SamplerConfig:
    temp: float = 0.8            # <= 0: greedy
    top_k: int = 40              # <= 0: off
    top_p: float = 0.95          # >= 1: off
    min_p: float = 0.05          # <= 0: off; keep p >= min_p * p_max
    repeat_penalty: float = 1.0  # 1: off
    repeat_last_n: int = 64      # window of history penalised; 0: off, -1: all of it
    seed: int = -1               # -1: random (the seed used is on Sampler.seed)

    def __post_init__(self):
        checks = [
            (0.0 <= self.top_p, f"top_p must be at least 0, got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be between 0 and 1, got {self.min_p}"),
            (self.repeat_penalty > 0.0,
             f"repeat_penalty must be positive, got {self.repeat_penalty}"),
            (self.repeat_last_n >= -1,
             f"repeat_last_n must be -1 (all), 0 (off) or a window size, got {self.repeat_last_n}"),
            (-1 <= self.seed < 2**64, f"seed must be -1 (random) or a non-negative integer, "
                                       f"got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"Sampler setting invalid: {message}.")


class Sampler:
    """Draws token ids from logits; holds the random state of one generation."""

    def __init__(self, config: SamplerConfig = SamplerConfig()):
        self.config = config
        self.seed = config.seed if config.seed >= 0 else secrets.randbits(32)
        self._rng = np.random.default_rng(self.seed)

    def sample(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """One token id. logits: (vocab,) float32 for the next position; history: ids so far
        (prompt included, as llama.cpp counts them), newest last."""
        logits = np.asarray(logits, dtype=np.float32)
        if logits.ndim != 1 or logits.shape[0] == 0:
            raise ValueError(f"Sampler expects one position's logits, shape (vocab,); got shape "
                             f"{logits.shape}. Slice out the last position first.")
        logits = self._penalize(logits, history)
        if self.config.temp <= 0.0:
            return int(np.argmax(logits))
        ids, z = self._truncate(logits)
        weights = np.exp((z - z.max()) / np.float32(self.config.temp))
        cdf = np.cumsum(weights, dtype=np.float64)  # unnormalised; the draw scales into it
        pick = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        return int(ids[min(pick, len(ids) - 1)])

    def _penalize(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """llama.cpp's rule on each distinct id in the window: positive logits divided by the
        penalty, others multiplied (dividing a negative one would make it more likely)."""
        c = self.config
        if c.repeat_penalty == 1.0 or c.repeat_last_n == 0 or len(history) == 0:
            return logits
        window = history if c.repeat_last_n < 0 else history[-c.repeat_last_n:]
        ids = np.unique(np.asarray(window, dtype=np.int64))
        seen = logits[ids]
        out = logits.copy()  # the caller's logits stay as they were
        out[ids] = np.where(seen <= 0, seen * c.repeat_penalty, seen / c.repeat_penalty)
        return out

    def _truncate(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(ids, float32 logits) that survive top-k, top-p and min-p; never empty. Full-vocab
        work stays in float32 (numpy's float32 exp is ~10x its float64 one)."""
        c = self.config
        ids = _top_k(logits, c.top_k)
        z = logits[ids]
        z_max = z.max()
        if not math.isfinite(z_max):
            raise ValueError(f"Sampler got logits whose maximum is {z_max}; the model output "
                             "is broken (NaN or all -inf).")
        # Top-p normalises over everything top-k kept, so take the sum before min-p shrinks it.
        total = np.exp(z - z_max).sum(dtype=np.float64) if c.top_p < 1.0 else 0.0
        if c.min_p > 0.0:
            # Min-p keeps every logit >= max + log(min_p): a prefix of the sorted order, so doing
            # it before top-p (also a prefix) leaves their intersection unchanged and the sort
            # below short. Only top_k = 0 with min_p = 0 sorts the whole vocabulary.
            keep = np.flatnonzero(z >= z_max + np.float32(math.log(c.min_p)))
            ids, z = ids[keep], z[keep]
        if c.top_p < 1.0:
            order = np.argsort(-z)
            ids, z = ids[order], z[order]
            cum = np.cumsum(np.exp(z - z_max), dtype=np.float64) / total
            n = int(np.searchsorted(cum, c.top_p, side="left")) + 1  # first cum >= top_p
            ids, z = ids[:n], z[:n]
        return ids, z


# Logit distances below the max tried before selecting top-k from the whole vocabulary.
_TOP_K_MARGINS = (8.0, 16.0, 32.0)


def _top_k(logits: np.ndarray, k: int) -> np.ndarray:
    """Ids of the k largest logits, unordered; all ids when k <= 0 or k >= vocab."""
    vocab = logits.shape[0]
    if not 0 < k < vocab:
        return np.arange(vocab)
    # argpartition over 49k logits costs ~0.5 ms. If at least k logits lie within a margin of
    # the max, the k largest are among them, and selecting from that short list costs ~30 us.
    near = np.arange(vocab)
    top = logits.max()
    for margin in _TOP_K_MARGINS:
        found = np.flatnonzero(logits >= top - margin)
        if len(found) >= k:
            near = found
            break
    cut = len(near) - k
    return near[np.argpartition(logits[near], cut)[cut:]]
