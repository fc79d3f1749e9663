"""Per-layer activation predictors (docs/design.md §2): x (d) -> Linear(d, r) -> ReLU -> Linear(r, n_ff).

Trained with class-weighted BCE on the calibrated masks, stored in q8 or q4 blocks (FORMATS; the
calibration keeps the one that reads fewer bytes per token at its recall), and given one decision
threshold per recall target, chosen on held-out tokens, on the scores of the stored weights, for
recall of activation MASS: the share of sum |h| over truly active neurons that the selected
candidates cover.
"""

from dataclasses import dataclass

import numpy as np
import torch

from pinfer.formats import blocks

RECALL_TARGETS = (0.95, 0.99, 0.995, 0.999)
FORMATS = ("q8", "q4")     # what pinfer/kernels/csrc/ffn_sparse.c's predictor reads
MICRO_BATCH_BYTES = 24 << 20
FIT_MARGIN = 0.2   # thresholds aim for 1 - 0.8 (1 - target) on the tokens that choose them


@dataclass
class Predictor:
    w1: np.ndarray    # (r, d) float32, the values after the round trip through fmt
    w2: np.ndarray    # (n_ff, r)
    b2: np.ndarray    # (n_ff,)
    parts1: dict      # fmt parts of w1
    parts2: dict      # fmt parts of w2
    fmt: str = "q8"

    @classmethod
    def stored(cls, w1, w2, b2, fmt="q8"):
        """The predictor of float weights (fit()'s) as a file stores them in fmt (FORMATS)."""
        p1, p2 = blocks.quantize(fmt, w1), blocks.quantize(fmt, w2)
        return cls(blocks.dequantize(fmt, p1), blocks.dequantize(fmt, p2), b2, p1, p2, fmt)

    def permuted(self, perm):
        """The predictor with its neurons (W2's rows, b2) in the order perm."""
        parts2 = {k: v[perm] for k, v in self.parts2.items()}
        return Predictor(self.w1, self.w2[perm], self.b2[perm], self.parts1, parts2, self.fmt)

    @property
    def rank(self):
        return self.w1.shape[0]

    def scores(self, x):
        """x (N, d) float32 torch tensor -> (N, n_ff) logits, on x's device."""
        w1, w2, b2 = self._weights_on(x.device)
        return torch.relu(x @ w1.T) @ w2.T + b2

    def _weights_on(self, device):
        cached = self.__dict__.setdefault("_on", {})
        if device not in cached:
            cached[device] = tuple(torch.from_numpy(a).to(device) for a in (self.w1, self.w2, self.b2))
        return cached[device]

    def nbytes(self):
        return sum(a.nbytes for a in (*self.parts1.values(), *self.parts2.values())) + self.b2.nbytes


def train(x, mask, rank, seed=0, epochs=5, batch=2048, lr=3e-3):
    """fit()'s predictor stored in q8."""
    return Predictor.stored(*fit(x, mask, rank, seed, epochs, batch, lr))


def fit(x, mask, rank, seed=0, epochs=5, batch=2048, lr=3e-3):
    """x (N, d) float32, mask (N, n_ff) bool, torch tensors on one device (the training runs there)
    -> the float32 arrays (w1, w2, b2) (Predictor.stored rounds them to a format). The initial
    weights and the batch order come from a CPU generator, the same on every device."""
    g = torch.Generator().manual_seed(seed)
    dev = x.device
    d, n_ff = x.shape[1], mask.shape[1]
    fc1 = torch.nn.Linear(d, rank, bias=False)
    fc2 = torch.nn.Linear(rank, n_ff)
    with torch.no_grad():
        for p in (fc1.weight, fc2.weight):
            p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p.shape[1]))
        counts = torch.count_nonzero(mask, dim=0).cpu().double()
        p_act = (counts / len(mask)).clamp(1e-4, 1 - 1e-4).float()
        fc2.bias.copy_(torch.log(p_act / (1 - p_act)))
    fc1, fc2 = fc1.to(dev), fc2.to(dev)
    # Missing an active neuron is the only error that changes outputs: weight positives up to
    # balance the classes (capped so a rare neuron does not dominate).
    pos_weight = ((1 - p_act) / p_act).clamp(1.0, 20.0).to(dev)
    params = [*fc1.parameters(), *fc2.parameters()]
    opt = torch.optim.Adam(params, lr=lr)
    xt, mt = x, mask
    n = len(xt)
    # the logits and the loss's intermediates are (micro, n_ff) each: a micro-batch of at most
    # MICRO_BATCH_BYTES per float32 tensor (the whole batch below LLaMA-7B's n_ff)
    parts = -(-batch // max(1, MICRO_BATCH_BYTES // (4 * n_ff)))
    micro = -(-batch // parts)
    steps = epochs * max(1, n // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    step = 0
    for _ in range(epochs):
        order = torch.randperm(n, generator=g).to(dev)
        for s in range(0, n - batch + 1 if n >= batch else 1, batch):
            idx = order[s:s + batch]
            opt.zero_grad(set_to_none=True)
            for m in range(0, len(idx), micro):   # the batch's mean loss, micro-batch by micro-batch
                sub = idx[m:m + micro]
                logits = fc2(torch.relu(fc1(xt[sub])))
                loss = torch.nn.functional.binary_cross_entropy_with_logits(
                    logits, mt[sub].float(), pos_weight=pos_weight)
                (loss * (len(sub) / len(idx)) if len(sub) < len(idx) else loss).backward()
            opt.step()
            if step < steps - 1:
                sched.step()
            step += 1
    w1 = fc1.weight.detach().cpu().numpy().astype(np.float32)
    w2 = fc2.weight.detach().cpu().numpy().astype(np.float32)
    return w1, w2, fc2.bias.detach().cpu().numpy().astype(np.float32)


@dataclass(frozen=True)
class Threshold:
    recall_target: float
    threshold: float        # a neuron is a candidate when its score >= threshold
    mass_recall: float      # measured on held-out tokens not used to choose the threshold
    count_recall: float
    candidate_fraction: float


def calibrate(fit, check, targets=RECALL_TARGETS):
    """Per recall target, the highest threshold whose mass recall on the `fit` tokens meets it,
    with its quality measured on the separate `check` tokens.

    fit, check: (scores, habs, active), (N, n_ff) arrays each: predictor logits, |h|, true mask."""
    scores, habs, active = (torch.as_tensor(a) for a in fit)
    # Sorting the scores of active neurons gives mass recall as a function of the threshold.
    s_sorted, order = torch.sort(scores[active], descending=True)
    h_sorted = habs[active][order]
    del order
    cum = torch.cumsum(h_sorted.double(), 0)
    del h_sorted
    total = float(cum[-1]) if len(cum) else 0.0
    check = tuple(torch.as_tensor(a) for a in check)
    out = []
    for t in targets:
        # aim a little past the target on the fit tokens, so that unseen tokens still meet it
        aim = 1 - (1 - t) * (1 - FIT_MARGIN)
        k = int(torch.searchsorted(cum, torch.tensor([aim * total], dtype=torch.float64, device=cum.device)))
        thr = float(s_sorted[min(k, len(s_sorted) - 1)]) if len(s_sorted) else float("inf")
        out.append(Threshold(t, thr, *quality(thr, *check)))
    return out


def quality(threshold, scores, habs, active, rows=256):
    """(mass recall, count recall, candidate fraction) of `threshold` on these tokens; `rows`
    tokens at a time bound the temporaries (float64 masses of 11008 neurons at LLaMA-7B's shapes)."""
    scores, habs, active = (torch.as_tensor(a) for a in (scores, habs, active))
    covered = total = 0.0
    hits = n_active = n_cand = 0
    for s in range(0, len(scores), rows):
        sc, ac = scores[s:s + rows], active[s:s + rows]
        cand = sc >= threshold
        mass = torch.where(ac, habs[s:s + rows].double(), 0.0)
        total += float(mass.sum())
        covered += float(mass[cand].sum())
        hits += int((cand & ac).sum())
        n_active += int(ac.sum())
        n_cand += int(cand.sum())
    return (covered / total if total > 0 else 1.0, hits / max(n_active, 1), n_cand / max(scores.numel(), 1))
