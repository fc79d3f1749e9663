"""The hybrid FFN step of one layer: its hot neurons [0, k) on the GPU, its cold ones [k, n_ff) on
the CPU kernel, at the same time; the CPU's partial sum then merges into the GPU's (docs/design.md §1).

The GPU half is kernels.gpu.HotFFN. CpuHot puts the hot half on a second CPU kernel instead, with
the same start/finish contract: it checks the split and the merge on machines without a GPU.
"""

import numpy as np

from pinfer.formats import blocks
from pinfer.formats.reader import huge_copy
from pinfer.kernels import SparseFFN


def cut(gate_up, down, predictor, start, stop):
    """Neurons [start, stop) of a layer's bundles: gate_up and down as (fmt, parts), the predictor
    as SparseFFN takes it, ((fmt, w1 parts), (fmt, w2 parts), b2): w1 whole, w2 and b2 cut."""
    gu = (gate_up[0], blocks.row_slice(gate_up[0], gate_up[1], start, stop))
    dn = (down[0], blocks.row_slice(down[0], down[1], start, stop))
    pred = None
    if predictor is not None:
        w1, w2, b2 = predictor
        pred = (w1, (w2[0], blocks.row_slice(*w2, start, stop)), b2[start:stop])
    return gu, dn, pred


class CpuHot:
    """The hot half on pinfer's CPU kernel, with HotFFN's bind contract: start() does nothing,
    finish(cold) computes the half, adds the cold partial sum and returns (candidates, survivors).
    `device` (the runtime's DeviceEmulation) gives it HotFFN's bind_device over device buffers."""

    def __init__(self, ffn, device=None):
        self.ffn, self.device = ffn, device

    def set_candidates(self, cand):
        self.ffn.set_candidates(cand)

    def survivors(self):
        return self.ffn.survivors()

    def bind(self, x, y, mode, thr, pthr):
        run = self.ffn.bind(x, y, mode, thr, pthr)

        def finish(cold):
            counts = run()
            if cold is not None:
                np.add(y, cold, out=y)
            return counts
        return (lambda: None), finish

    def bind_device(self, x_dev, y_dev, mode, thr, pthr):
        """HotFFN.bind_device's contract: start() copies x down (the cold half reads the host
        array returned), finish(cold) computes the hot half, merges and copies y up."""
        dev, d = self.device, self.ffn.d
        host_x, host_y = dev.pinned(d, np.float32), dev.pinned(d, np.float32)
        run = self.ffn.bind(host_x, host_y, mode, thr, pthr)

        def start():
            dev.to_host(host_x, x_dev)
            dev.sync()

        def finish(cold):
            counts = run()
            if cold is not None:
                np.add(host_y, cold, out=host_y)
            dev.to_device(y_dev, host_y)
            dev.sync()
            return counts
        return start, finish, host_x


class HybridFFN:
    """A layer's FFN split at neuron k: `hot` (HotFFN or CpuHot) over [0, k), a SparseFFN over
    [k, n_ff) (None when k = n_ff). The same bind contract as SparseFFN."""

    def __init__(self, hot, cold, k, d):
        self.hot, self.cold, self.k, self.d = hot, cold, k, d
        self.y_cold = np.zeros(d, np.float32)

    def set_candidates(self, cand):
        """Ascending neuron indices over the whole layer, split at k."""
        split = int(np.searchsorted(cand, self.k))
        self.hot.set_candidates(cand[:split])
        if self.cold is not None:
            self.cold.set_candidates(np.asarray(cand[split:], np.int32) - self.k)

    def bind(self, x, y, mode="dense", threshold=0.0, pred_threshold=0.0):
        start, finish = self.hot.bind(x, y, mode, threshold, pred_threshold)
        y_cold = self.y_cold
        cold = self.cold.bind(x, y_cold, mode, threshold, pred_threshold) if self.cold is not None else None

        def run():
            start()                                   # the GPU starts on the hot neurons
            c_cold, s_cold = cold() if cold is not None else (0, 0)
            c_hot, s_hot = finish(y_cold if s_cold else None)   # no cold survivor: nothing to merge
            return c_hot + c_cold, s_hot + s_cold
        run.keep = (x, y, y_cold)
        return run


def own(gate_up, down, predictor):
    """Copies (in huge pages) of a cut's parts, so that the cold half holds its own rows and not views
    of the whole layer's arrays, which would keep the hot rows in host memory beside the GPU's."""
    copy = lambda fmt_parts: (fmt_parts[0], {p: huge_copy(a) for p, a in fmt_parts[1].items()})  # noqa: E731
    pred = None if predictor is None else (predictor[0], copy(predictor[1]), np.array(predictor[2]))
    return copy(gate_up), copy(down), pred


def build(layer_parts, k, n_ff, d, act, threads, hot_factory, down_rows=None):
    """The layer's FFN with k neurons hot: a plain SparseFFN at k = 0 (given W_down as down_rows,
    see SparseFFN), else a HybridFFN whose hot half hot_factory(gate_up, down, predictor) makes
    from the cut bundles."""
    gate_up, down, predictor = layer_parts
    if k == 0:
        return SparseFFN(gate_up, down, n_ff, d, act, predictor, threads, down_rows=down_rows)
    cold = None
    if k < n_ff:    # first: a cold half the CPU kernel refuses must not leave GPU memory behind
        gu, dn, pred = own(*cut(gate_up, down, predictor, k, n_ff))
        cold = SparseFFN(gu, dn, n_ff - k, d, act, pred, threads)
    hot = hot_factory(*cut(gate_up, down, predictor, 0, k))
    return HybridFFN(hot, cold, k, d)


def cpu_hot_factory(n_ff_hot, d, act, threads, device=None):
    """hot_factory for CpuHot halves of n_ff_hot neurons (device: see CpuHot)."""
    return lambda gate_up, down, predictor: CpuHot(SparseFFN(gate_up, down, n_ff_hot, d, act, predictor, threads),
                                                   device)


def bind_device(gpu, ffn, x_dev, y_dev, mode, threshold, pred_threshold):
    """A layer's FFN step when the dense part runs on the GPU: x and y are device pointers (float32
    (d,)), `gpu` the device's copies (kernels.gpu.Gpu, or the runtime's DeviceEmulation). A hybrid
    layer with its hot half on the GPU copies x down once for its cold half and merges on the GPU;
    a CPU-only layer copies x down and y up."""
    if isinstance(ffn, HybridFFN) and hasattr(ffn.hot, "bind_device"):
        start, finish, host_x = ffn.hot.bind_device(x_dev, y_dev, mode, threshold, pred_threshold)
        y_cold = ffn.y_cold
        cold = ffn.cold.bind(host_x, y_cold, mode, threshold, pred_threshold) if ffn.cold is not None else None

        def hybrid_step():
            start()
            c_cold, s_cold = cold() if cold is not None else (0, 0)
            c_hot, s_hot = finish(y_cold if s_cold else None)
            return c_hot + c_cold, s_hot + s_cold
        return hybrid_step
    d = ffn.d
    host_x, host_y = gpu.pinned(d, np.float32), gpu.pinned(d, np.float32)
    run = ffn.bind(host_x, host_y, mode, threshold, pred_threshold)

    def cpu_step():
        gpu.to_host(host_x, x_dev)
        gpu.sync()
        counts = run()
        gpu.to_device(y_dev, host_y)
        gpu.sync()              # host_y is written again by the next token
        return counts
    cpu_step.keep = (host_x, host_y)
    return cpu_step
