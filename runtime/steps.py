"""The activation buffers of a call over n tokens and the steps that run every layer over them,
built once per length and bound to the sessions and kernels: forward() only calls them.

resid ping-pongs (layer i reads resid[i % 2]); delta and h are reused by every layer: layer i
consumes delta before its down projection overwrites it. With the dense part on a device, resid
stays there, and so do x and delta in decode, where every layer's FFN step reads and writes device
memory; prefill's FFN runs on the host buffers."""

import numpy as np

from . import hybrid, native
from .plan import ensure_graphs
from .ort import Buf


class Steps:
    def __init__(self, model, n):
        self.model, self.n = model, n
        dv, d = model.devices, model.cfg.d_model
        self.on_device = dv.on_device and n == 1
        kernel = n == 1 or model.batches(n)     # prompts up to prefill_by_token: the kernel's batch call
        self.resid = [Buf((1, n, d), dv.act_dtype, dv.act_at) for _ in range(2)]
        self.delta = Buf((1, n, d), np.float32, dv.act_at if self.on_device else "cpu")
        self.x = Buf((1, n, d), np.float32, dv.act_at if self.on_device else "cpu")
        self.h = np.zeros((1, n, model.cfg.n_ff), np.float32)
        if model.attention.writes_back:     # the sessions' new K and V, every layer's in turn
            kv = model.attention.kv[0][0]
            self.new_kv = [np.empty((1, kv.shape[1], n, kv.shape[3]), kv.dtype) for _ in range(2)]
        if not (kernel and all(L.ffn is not None for L in model.layers)):
            ensure_graphs(model)
        self.by_layer = [self.layer(i, kernel and model.layers[i].ffn is not None) for i in range(model.cfg.n_layer)]
        self.run = [s for steps in self.by_layer for s in steps]

    def layer(self, i, kernel, rule=None, entry=None):
        """Layer i's steps: the attention (the C kernels' call per token, or the attention-only
        session) and the fused FFN kernel (decode, or a prompt in one batch call; `entry` a
        LayerFfn, default the layer's), or the whole layer graph, `rule` (default the layer's) and
        the down projection."""
        m, L = self.model, self.model.layers[i]
        if kernel and L.native is not None:     # the attention through the C kernels, a prompt in one call
            attn = [native.bind_layer(L.native, m.attention, i, self.resid[i % 2], self.delta,
                                      self.resid[(i + 1) % 2], self.x)]
        else:
            layer = L.attn if kernel else L.graph
            if not kernel:
                layer.bind_out("ffn_h", self.h)
            layer.bind_in("resid", self.resid[i % 2])
            layer.bind_in("delta", self.delta)
            layer.bind_out("resid_out", self.resid[(i + 1) % 2])
            layer.bind_out("ffn_x", self.x)
            attn = [layer.run]
            if m.attention.writes_back:
                state, (new_k, new_v) = m.attention, self.new_kv
                layer.bind_out("new_key", new_k)
                layer.bind_out("new_value", new_v)
                attn.append(lambda: state.write_back(i, new_k, new_v))
        if kernel:
            return attn + [self._kernel(i, entry or L.ffn) if self.n == 1 else self._batch(i)]
        return attn + [(rule or L.rule).bind(self.x.np[0], self.h[0]), L.down.bind(self.h[0], self.delta.np[0])]

    def _kernel(self, i, entry):
        m = self.model
        ffn, mode = entry.kernel, entry.mode
        if self.on_device:
            run = hybrid.bind_device(m.devices.copier, ffn, self.x.ptr, self.delta.ptr, mode, entry.threshold,
                                     entry.pred_threshold)
        else:
            run = entry.bind(self.x.np[0, 0], self.delta.np[0, 0])
        c, n_ff = m.counters, m.cfg.n_ff
        given = ffn.set_candidates if mode == "given" else None
        draw = m.draw if given else None
        rows_from = _rows_from(ffn, n_ff)

        def step():
            if given:
                given(draw(i))
            cand, kept = run()
            c.add(cand, kept, cand, n_ff if kept >= rows_from else kept, n_ff)   # the axpy reads what it keeps
        return step

    def _batch(self, i):
        """Layer i's FFN over the n tokens of a prompt in one call of the kernel: each token gets
        the bits of its own decode call, the weight rows read once for all of them."""
        m, n = self.model, self.n
        entry = m.layers[i].ffn
        ffn, mode = entry.kernel, entry.mode
        run = ffn.bind_batch(self.x.np[0], self.delta.np[0], mode, entry.threshold, entry.pred_threshold)
        c, n_ff, draw = m.counters, m.cfg.n_ff, m.draw if mode == "given" else None
        rows_from = _rows_from(ffn, n_ff)

        def step():
            if draw:
                run.set_candidates([draw(i) for _ in range(n)])
            run()
            for cand, kept in run.counts:
                c.add(cand, kept, cand, n_ff if kept >= rows_from else kept, n_ff)
        return step


def _rows_from(ffn, n_ff):
    """Survivors from which the kernel's down projection reads every row of W_down (its row
    dots), or n_ff + 1 where it has none."""
    rows = getattr(ffn, "rows", None)
    return rows.from_ if rows is not None and rows.q else n_ff + 1
