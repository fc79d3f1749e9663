"""Where each layer's FFN neurons run: the hot prefix of every layer on the GPU, the rest on the
CPU, planned at load for this machine's VRAM budget (docs/design.md §4).

The budget first holds what the GPU needs whatever the split (dense weights, KV cache and scratch,
where the dense part runs there), then blocks of neurons in one global ranking by expected
activation mass per byte: mass is the calibrated activation frequency of a sparse layer's neurons
(1 in a dense layer: every row is read each token), bytes the exact growth of the layer's device
allocation (kernels.gpu.HotSpec). A layer grows only by its next block, so its hot set stays a
prefix: one copy per tensor part. The ranking stops at the first block that does not fit, so every
layer's share grows with the budget. Equal mass per byte goes to the layer with the fewest hot
neurons, so a uniform profile (a file without calibration) gives every layer the same prefix
rather than whole layers in order; a caller that knows the profile (the synthetic benchmarks'
power law) passes it as `mass`.
"""

import heapq
from dataclasses import dataclass, field

import numpy as np

from pinfer.formats import schema as S
from pinfer.kernels.gpu import HotSpec

GIB = 1 << 30
MARGIN = 512 << 20          # left free by the default budget: the CUDA context, ONNX Runtime, the display
DENSE_SCRATCH = 256 << 20   # ONNX Runtime's CUDA workspace (cuBLAS, attention scratch) with the dense part there
BLOCK = 64                  # neurons per planning block (a multiple of 32: q4r groups, warps)


def plan_hot(mass, cost, free, block=BLOCK):
    """Per-layer hot neuron counts within `free` bytes.

    mass (n_layer, n_ff): expected activation per neuron, file order. cost(layer, k): the layer's
    device bytes with k hot neurons (0 at k = 0), or None for a layer the GPU cannot take. Blocks
    are ranked by mass per byte of their neurons' rows (a layer's fixed bytes, its predictor's
    first matrix and scratch, are paid with its first block but do not rank it: they would rank a
    layer's first block below its second); ties go to the layer with fewer hot neurons, then the
    lower layer. Stops at the first block that does not fit."""
    n_layer, n_ff = mass.shape
    hot = np.zeros(n_layer, np.int64)
    spent = np.zeros(n_layer, np.int64)
    unit = min(32, n_ff)
    per_neuron = []
    for layer in range(n_layer):
        full, first = cost(layer, n_ff), cost(layer, unit)
        per_neuron.append(None if full is None else (full - first) / (n_ff - unit) if n_ff > unit else full / n_ff)

    def entry(layer):
        k = int(hot[layer])
        if k >= n_ff or per_neuron[layer] is None:
            return None
        size = min(block, n_ff - k)
        return (-float(mass[layer, k:k + size].sum()) / (size * per_neuron[layer]), k, layer, size)

    heap = [e for e in (entry(l) for l in range(n_layer)) if e is not None]
    heapq.heapify(heap)
    while heap:
        _, _, layer, size = heapq.heappop(heap)
        grow = cost(layer, int(hot[layer]) + size) - spent[layer]
        if grow > free:
            break
        free -= grow
        hot[layer] += size
        spent[layer] += grow
        e = entry(layer)
        if e is not None:
            heapq.heappush(heap, e)
    return hot


@dataclass
class Plan:
    budget: int
    reserved: dict                  # {"dense weights": bytes, "KV cache": bytes, "scratch": bytes}
    hot: list                       # per layer: hot neurons on the GPU
    layer_bytes: list               # per layer: device bytes of its hot part
    n_ff: int
    skipped: dict = field(default_factory=dict)   # layer -> why it stays on the CPU
    hotness: str = ""               # where the activation mass that ranked the neurons came from
    mass_share: float = 0.0         # the share of the profile's activation mass the hot neurons carry

    @property
    def total(self):
        return sum(self.reserved.values()) + sum(self.layer_bytes)

    @property
    def hot_share(self):
        return sum(self.hot) / max(1, len(self.hot) * self.n_ff)

    def describe(self):
        mib = lambda b: f"{b / (1 << 20):,.1f} MiB"   # noqa: E731
        lines = [f"placement for a VRAM budget of {mib(self.budget)}:"]
        lines += [f"  {name}: {mib(b)}" for name, b in self.reserved.items() if b]
        lines.append(f"  FFN hot neurons: {sum(self.hot):,} of {len(self.hot) * self.n_ff:,} "
                     f"({self.hot_share:.1%}), {mib(sum(self.layer_bytes))}, {self.mass_share:.1%} of the "
                     f"activation mass ({self.hotness})")
        per = ", ".join(f"{h}" for h in self.hot)
        lines.append(f"  per layer: {per}")
        for layer, why in sorted(self.skipped.items()):
            lines.append(f"  layer {layer} stays on the CPU: {why}")
        lines.append(f"  planned total: {mib(self.total)}")
        return "\n".join(lines)


def activation_refusal(cfg):
    """Why pinfer's fused FFN kernels cannot take this model's FFN at all, or None."""
    from pinfer.kernels import ACTIVATIONS
    if not cfg.ffn_gated or cfg.ffn_act not in ACTIVATIONS:
        return (f"the kernels take gated {'/'.join(ACTIVATIONS)} FFNs, not "
                f"{'gated ' * cfg.ffn_gated}{cfg.ffn_act}")
    return None


def kernel_refusal(reader, cfg, i):
    """Why pinfer's fused FFN kernels (the CPU's and the GPU's) cannot take layer i, from the file
    alone, or None; each kernel may still refuse a format it lacks (SparseFFN, HotSpec.supported)."""
    if S.FFN_GATE_UP_COLD.format(i) in reader.header["weights"]:
        return "its bundles are split in hot and cold formats (--quant mixed)"
    why = activation_refusal(cfg)
    if why:
        return why
    if S.FFN_GATE_UP_BIAS.format(i) in reader:
        return "its FFN has biases"
    return None


def layer_specs(reader, cfg, rules):
    """Per layer: (HotSpec, or None with the reason the GPU cannot take the layer)."""
    out = []
    for i in range(cfg.n_layer):
        why = kernel_refusal(reader, cfg, i)
        if why:
            out.append((None, why))
            continue
        gf, gp = reader.block(S.FFN_GATE_UP.format(i))
        df, dp = reader.block(S.FFN_DOWN_T.format(i))
        rank = 0
        if S.MODES[rules[i]].uses_predictor:
            rank = reader.block(S.FFN_PRED_W1.format(i))[1]["q"].shape[0]     # q8 on the GPU (gpu.q8_predictor)
        spec = HotSpec(cfg.d_model, cfg.n_ff, (gf, "min" in gp), (df, "min" in dp), rank)
        why = spec.supported()
        out.append((None, f"the GPU kernels do not take {why}") if why else (spec, None))
    return out


def activation_mass(reader, cfg, rules):
    """(n_layer, n_ff): calibrated activation frequency in sparse layers, 1 in dense ones."""
    return hotness(reader, cfg, rules)[0]


def hotness(reader, cfg, rules, given=None):
    """(mass (n_layer, n_ff), where it came from): `given` (a caller's profile, e.g. a benchmark's
    power law), else the calibrated activation frequency in sparse layers and 1 in dense ones
    (every row is read each token), uniform where the file has no calibration."""
    if given is not None:
        mass = np.asarray(given, np.float64)
        if mass.shape != (cfg.n_layer, cfg.n_ff) or not np.isfinite(mass).all() or (mass < 0).any():
            raise ValueError(f"a hotness profile is ({cfg.n_layer}, {cfg.n_ff}) non-negative numbers, "
                             f"not {mass.shape}")
        return mass, "the profile given"
    freq = reader.tensor(S.FFN_FREQ) if S.FFN_FREQ in reader else None
    mass = np.ones((cfg.n_layer, cfg.n_ff), np.float64)
    sparse = [i for i, mode in enumerate(rules) if mode != "dense"]
    if freq is None:
        return mass, "uniform: the file has no calibration, so every layer gets the same share"
    for i in sparse:
        mass[i] = freq[i]
    return mass, ("calibrated activation frequencies" if len(sparse) == len(rules) else
                  f"calibrated activation frequencies in {len(sparse)} sparse layers, 1 in the "
                  f"{len(rules) - len(sparse)} dense ones")


def plan(reader, cfg, rules, budget, reserved=None, block=BLOCK, mass=None):
    """The split for `budget` bytes; rules: each layer's mode name; reserved: bytes held before the
    FFN ({} where the dense part runs on the CPU); mass: a hotness profile (see hotness)."""
    reserved = dict(reserved or {})
    specs = layer_specs(reader, cfg, rules)
    mass, source = hotness(reader, cfg, rules, mass)
    skipped = {i: why for i, (spec, why) in enumerate(specs) if spec is None}

    def cost(layer, k):
        spec = specs[layer][0]
        return spec.nbytes(k) if spec is not None else None

    free = budget - sum(reserved.values())
    hot = plan_hot(mass, cost, free, block) if free > 0 else np.zeros(cfg.n_layer, np.int64)
    layer_bytes = [specs[i][0].nbytes(int(h)) if specs[i][0] else 0 for i, h in enumerate(hot)]
    share = sum(mass[i, :h].sum() for i, h in enumerate(hot)) / max(mass.sum(), 1e-300)
    return Plan(int(budget), reserved, [int(h) for h in hot], layer_bytes, cfg.n_ff, skipped, source, float(share))
