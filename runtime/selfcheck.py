"""The device's self-check at load: before any weight or session goes to the device,
one layer's hot FFN runs there and on pinfer's CPU kernel, and, where the dense part runs there,
one layer's attention-only graph runs there and on ONNX Runtime's CPU provider in FP32, each for
one token of the same deterministic random inputs. A difference beyond what the numerics allow
puts the whole model on the CPU (Devices.fall_back), with a Note giving the figures: a slower
answer beats wrong text. --device cpu-split and dense_device emulated-gpu run the same check on
the CPU (the emulated device), so CI runs it.

device_ffn and device_dense are the device-side runs; tests replace them to perturb the result."""

import copy
import time
from dataclasses import dataclass

import numpy as np

from pinfer.formats import schema as S
from pinfer.kernels import SparseFFN

from . import hybrid, placement
from .kv import AttentionState
from .options import Note
from .ort import Buf
from .sparse import LayerRule, Rule

SEED = 39
CHECK_NEURONS = 2048    # the checked layer's hot prefix, at most: its first block is where the plan starts
CHECK_CTX = 4           # the checked attention's KV cache positions (one token, at position 0)
# FFN: the device quantizes x as the CPU does (int8 per group of 32 against int4/5 rows), applies
# the same activation (expf, no fast math) and the same rule, so the survivors are the same neurons
# (one within float rounding of a threshold could flip; the input is fixed, so a model meets one at
# every load or never) and y differs only by the order of the float32 sums (gate/up dots over d,
# the axpy's atomic adds over the survivors). Reordering those sums moved them by at most 3e-6 of
# their largest magnitude (measured in float32 at d 576 to 8192, 1536 to 2048 neurons); the GPU
# test holds 1e-4 over 256 neurons (tests/test_hybrid.py). 1e-3 of max |y| leaves room for larger
# layers and still catches any wrong weight, scale or neuron that matters; a lost survivor shows
# in the survivor sets.
FFN_TOL = 1e-3
# Dense part: FP16 graphs (11-bit significands: 4.9e-4 relative rounding per value, inputs and
# norms included) against FP32. On the emulated device (FP16 graphs on the CPU provider) a layer's
# outputs moved by at most 9.0e-3 of their largest magnitude (60 random inputs, both layers of the
# tiny test model; 5.9e-3 at SmolLM2's shapes, 20 inputs, 4 layers); 3e-2 (about 30 FP16 steps of
# the largest value) is 3x that, and a wrong kernel, table or buffer moves them by O(1).
DENSE_TOL = 3e-2


@dataclass(frozen=True)
class Check:
    what: str
    diff: float         # max |device - CPU|
    tol: float          # the largest allowed
    differing: int = 0  # survivors in one set and not the other

    @property
    def ok(self):
        return self.diff <= self.tol and not self.differing     # a NaN diff fails

    def describe(self):
        surv = f", {self.differing} survivor{'s' * (self.differing != 1)} differing" if self.differing else ""
        return f"{self.what}: max |diff| {self.diff:.3g} against a tolerance of {self.tol:.3g}{surv}"


def self_check(devices, threads):
    """Run the checks the devices in use need (none on the CPU alone); on any difference move
    everything to the CPU with a Note. Returns the Checks."""
    dv = devices
    if dv.ffn == "cpu" and not dv.on_device:
        return []
    t0 = time.perf_counter()
    checks = [c for c in (check_ffn(dv, threads) if dv.ffn != "cpu" else None,
                          check_dense(dv, threads) if dv.on_device else None) if c is not None]
    took = time.perf_counter() - t0
    failed = [c for c in checks if not c.ok]
    if failed:
        dv.fall_back("the device's self-check at load found its results differ from the CPU's ("
                     + "; ".join(c.describe() for c in failed) + ")")
    elif checks:
        dv.notes.append(Note(f"device self-check at load passed in {took:.2f} s: "
                             + "; ".join(c.describe() for c in checks), quiet=True))
    return checks


def check_ffn(dv, threads):
    """The hot half of the first layer the GPU kernels take (a prefix of up to CHECK_NEURONS
    neurons, the layer's own mode and thresholds) against the CPU kernel over the same rows;
    None where no layer's FFN can go to the device."""
    r, cfg, opts = dv.reader, dv.cfg, dv.options
    rules = [Rule.of_layer(r.header, i, opts.sparsity) for i in range(cfg.n_layer)]
    specs = placement.layer_specs(r, cfg, [rule.mode for rule in rules])
    layer = next((i for i, (spec, _) in enumerate(specs) if spec is not None), None)
    if layer is None:
        return None
    rule = LayerRule(r, r.header, layer, rules[layer], None)
    mode = rule.rule.mode
    thr = float(rule.threshold) if rule.threshold is not None else 0.0
    pthr = float(rule.pred[3]) if rule.pred is not None else 0.0
    pred = None
    if S.MODES[mode].uses_predictor:
        pred = (r.block(S.FFN_PRED_W1.format(layer)), r.block(S.FFN_PRED_W2.format(layer)),
                r.tensor(S.FFN_PRED_B2.format(layer)))
    k, d = min(cfg.n_ff, CHECK_NEURONS), cfg.d_model
    gu, dn, pred = hybrid.cut(r.block(S.FFN_GATE_UP.format(layer)), r.block(S.FFN_DOWN_T.format(layer)), pred, 0, k)
    if dv.ffn == "gpu":
        from pinfer.kernels.gpu import HotFFN, q8_predictor
        hot = HotFFN(dv.gpu, specs[layer][0], k, gu, dn, pred, cfg.ffn_act, opts.deterministic)
        pred = q8_predictor(pred)       # the predictor the GPU reads
    else:
        hot = hybrid.cpu_hot_factory(k, d, cfg.ffn_act, threads, dv.copier)(gu, dn, pred)
    try:
        ref = SparseFFN(gu, dn, k, d, cfg.ffn_act, pred, threads)
        x = np.random.default_rng(SEED).standard_normal(d).astype(np.float32)
        want = np.zeros(d, np.float32)
        ref.bind(x, want, mode, thr, pthr)()
        got, surv = device_ffn(hot, x, mode, thr, pthr)
    finally:
        if hasattr(hot, "close"):
            hot.close()         # the device memory goes back whatever the outcome
    return Check(f"layer {layer}'s FFN ({k} hot neurons, {mode})", float(np.abs(got - want).max()),
                 FFN_TOL * float(np.abs(want).max()), len(np.setxor1d(surv, ref.survivors()[0])))


def device_ffn(hot, x, mode, thr, pthr):
    """(y, ascending survivor indices) of the hot half (HotFFN or CpuHot) for x."""
    y = np.full(len(x), np.nan, np.float32)
    start, finish = hot.bind(x, y, mode, thr, pthr)
    start()
    finish(None)
    return y, hot.survivors()[0]


def check_dense(dv, threads):
    """Layer 0's attention-only graph on the dense part's device against an FP32 session of the
    same graph on ONNX Runtime's CPU provider; each output held to DENSE_TOL of its magnitude."""
    rng = np.random.default_rng(SEED + 1)
    resid, delta = (rng.standard_normal((1, 1, dv.cfg.d_model)).astype(np.float32) for _ in range(2))
    cpu = copy.copy(dv)
    cpu.dense = "cpu"
    cpu._place_buffers()
    cpu.kv_dtype = np.float32           # the reference in f32 throughout
    want = layer_outputs(cpu, threads, 0, resid, delta)
    held = dv.dense_weight_bytes
    try:
        got = device_dense(dv, threads, 0, resid, delta)
    finally:
        dv.dense_weight_bytes = held    # the check's session is gone: the plan must not count it
    checks = [Check(f"layer 0's attention ({name}, the worst of {', '.join(want)})", float(np.abs(got[name] - w).max()),
                    DENSE_TOL * float(np.abs(w).max())) for name, w in want.items()]
    return max(checks, key=lambda c: c.diff / c.tol if c.diff < c.tol else np.inf)     # NaN: the worst


def layer_outputs(dv, threads, layer, resid, delta):
    """{output: float32 array} of the layer's attention-only graph over one token at position 0,
    through a session and buffers where `dv` puts the dense part."""
    cfg, at, d = dv.cfg, dv.act_at, dv.cfg.d_model
    sess = dv.session(S.LAYER_GRAPH.format(layer), threads, attention_only=True)
    r = dv.reader
    state = AttentionState(cfg, CHECK_CTX, dv.act_dtype, at, r.tensor(S.ROPE_FREQS) if S.ROPE_FREQS in r else None,
                           dv.kv_dtype)
    state.bind([None] * layer + [sess])
    state.set_lengths(0, 1)
    bufs = {name: Buf((1, 1, d), dtype, at) for name, dtype in (
        ("resid", dv.act_dtype), ("delta", np.float32), ("resid_out", dv.act_dtype), ("ffn_x", np.float32))}
    bufs["resid"].write(resid)
    bufs["delta"].write(delta)
    for name, buf in bufs.items():
        (sess.bind_in if name in ("resid", "delta") else sess.bind_out)(name, buf)
    sess.run()
    key, value = state.kv[layer]

    def read(buf):
        host = np.empty(buf.shape, buf.dtype)
        dv.copier.to_host(host, buf.ptr)
        dv.copier.sync()
        return host.astype(np.float32)
    return {"resid_out": read(bufs["resid_out"]), "ffn_x": read(bufs["ffn_x"]),
            "key": read(key)[:, :, 0], "value": read(value)[:, :, 0]}


device_dense = layer_outputs
