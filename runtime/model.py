"""The dense runtime: one ONNX Runtime session per layer and one for the head, called through
IOBinding over NumPy buffers that are bound once (DESIGN.md §4).

Per token: embedding rows (NumPy, from the file's block format) -> layer 0 .. n-1 -> head. Each
layer session takes (resid, delta), delta being the previous layer's FFN output, and returns
(resid', h) with h = act(gate)*up; pinfer's kernel turns h into the next delta from the
neuron-major down_t bundle. Residual adds ride inside SkipSimplifiedLayerNormalization. The KV cache is one buffer per layer
and per K/V, bound as both past and present (GroupQueryAttention writes in place).
"""

import os
import time
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from pinfer.formats import PinfReader, blocks
from pinfer.formats import schema as S
from pinfer.formats.config import ModelConfig
from pinfer.kernels import DownProjection, SparseFFN

from .sparse import Counters, LayerRule, Rule


@dataclass(frozen=True)
class RuntimeOptions:
    n_ctx: int = 0          # 0: the model's training context, capped at DEFAULT_CTX
    threads: int = 0        # 0: all cores
    verbose: bool = False
    sparsity: str = ""      # "": each layer's mode from the file; else dense | down:S | predicted:R | relu:R
    # Decode sparse layers with pinfer's fused FFN kernel instead of the ONNX graph + NumPy rule.
    # Off by default: on SmolLM2 it decodes slower than the dense path (benchmarks/sparse_decode.py);
    # at LLaMA-7B's shape with 10% active it is 1.9x faster (benchmarks/synthetic_decode.py).
    kernels: bool = False


DEFAULT_CTX = 4096


def rope_tables(cfg, n_ctx, freq_divisors=None):
    """cos/sin caches (n_ctx, rotary_dim/2) for positions 0..n_ctx-1."""
    half = cfg.rotary_dim // 2
    inv = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2 / cfg.rotary_dim)
    if freq_divisors is not None:
        inv = inv / np.asarray(freq_divisors, np.float64)
    pos = np.arange(n_ctx, dtype=np.float64) / cfg.rope_linear_scale
    ang = np.outer(pos, inv)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


_shared_arena = False


def _register_shared_arena():
    """One CPU arena for every session of the process. Each session otherwise keeps its own arena,
    grown to its largest call and never returned: a 512-token prefill left SmolLM2's 31 sessions
    holding 1.2 GB, against 0.48 GB shared, at the same speed."""
    global _shared_arena
    if not _shared_arena:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))
        _shared_arena = True


def _session_options(threads):
    _register_shared_arena()
    so = ort.SessionOptions()
    so.add_session_config_entry("session.use_env_allocators", "1")
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # Sessions run one after another on the same cores: spinning pools would fight each other.
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


class MatMulDown:
    """The down projection as ONNX Runtime's MatMulNBits over W_down (d, n_ff), rebuilt in memory
    at load from the file's q4r/q8r down_t: an exact transpose, since those formats keep GGUF's
    groups, which run along n_ff, MatMulNBits' K. Every row is read, like DownProjection, only
    faster; h is quantized to int8 per block of 32, as for every other MatMulNBits (and as
    llama.cpp does). Same bind(h, y) contract as DownProjection."""

    FORMATS = ("q4r", "q8r")

    def __init__(self, fmt, parts, threads, n_ff, d):
        from pinfer.converter.graphs import F32, GraphBuilder
        plain, w = blocks.from_transposed_r(fmt, parts)     # W_down (d, n_ff)
        self.arrays = {S.part_name("w", p): a for p, a in w.items()}
        directory = {name: {"dtype": S.DTYPE_CODES[a.dtype], "shape": list(a.shape), "nbytes": a.nbytes}
                     for name, a in self.arrays.items()}
        b = GraphBuilder("down", directory)
        h = b.input("h", F32, [1, "S", n_ff])
        b.output(b.linear(h, "w", plain, d, n_ff), "y", F32, [1, "S", d])
        so = _session_options(threads)
        values = [ort.OrtValue.ortvalue_from_numpy(a) for a in self.arrays.values()]
        so.add_external_initializers(list(self.arrays), values)
        self.bound = _Bound(ort.InferenceSession(b.build().SerializeToString(), so,
                                                 providers=["CPUExecutionProvider"]))
        self.bound.keep["initializers"] = values

    def bind(self, h, y):
        self.bound.bind_in("h", h.reshape(1, *h.shape))
        self.bound.bind_out("y", y.reshape(1, *y.shape))
        return self.bound.run


class SplitDown:
    """The down projection of a layer written with --quant mixed: rows [0, hot) in one format,
    the rest in another; the same bind(h, y) contract as DownProjection."""

    def __init__(self, hot, cold):
        self.hot, self.cold = hot, cold

    def bind(self, h, y):
        n_hot = self.hot.n_ff
        if h.shape[0] == 1:       # decode: both halves of the one row are contiguous already
            h_hot, h_cold = h[:, :n_hot], h[:, n_hot:]
            copy = None
        else:
            h_hot = np.empty((h.shape[0], n_hot), np.float32)
            h_cold = np.empty((h.shape[0], h.shape[1] - n_hot), np.float32)
            copy = (h, h_hot, h_cold, n_hot)
        y_cold = np.empty_like(y)
        run_hot, run_cold = self.hot.bind(h_hot, y), self.cold.bind(h_cold, y_cold)

        def run():
            if copy:
                src, a, b, k = copy
                np.copyto(a, src[:, :k])
                np.copyto(b, src[:, k:])
            run_hot()
            run_cold()
            np.add(y, y_cold, out=y)
        return run


class _Bound:
    """A session with one IOBinding whose inputs and outputs are NumPy arrays bound by name."""

    def __init__(self, session):
        self.sess = session
        self.io = session.io_binding()
        self._run = session._sess.run_with_iobinding   # the raw call: ~2 µs against ~50 µs
        self._ro = ort.RunOptions()
        self.keep = {}

    def bind_in(self, name, array):
        self.keep[name] = array
        self.io.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))

    def bind_out(self, name, array):
        self.keep["out:" + name] = array
        self.io.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(array))

    def run(self):
        self._run(self.io._iobinding, self._ro)


class Model:
    """A loaded `.pinf` model with its KV cache. Not thread-safe: one sequence at a time."""

    def __init__(self, path, options=RuntimeOptions()):
        t0 = time.perf_counter()
        self.reader = r = PinfReader(path)
        self.cfg = cfg = ModelConfig.from_dict(r.header["config"])
        self.n_ctx = options.n_ctx or min(cfg.n_ctx_train, DEFAULT_CTX)
        self.threads = options.threads or os.cpu_count() or 1
        self.tokenizer_spec = r.header["tokenizer"]
        self.embd_format, self.embd_parts = r.block(S.TOKEN_EMBD)
        self.pos = r.tensor(S.POS_EMBD) if cfg.positions == "learned" else None   # (n_pos, d)
        if self.pos is not None and self.n_ctx > len(self.pos):
            raise ValueError(f"the context of {self.n_ctx} tokens is longer than the {len(self.pos)} positions "
                             "this model learned; pass a smaller -c/--ctx-size")

        self.layers = [self._session(S.LAYER_GRAPH.format(i), self.threads) for i in range(cfg.n_layer)]
        self.head = self._session(S.HEAD_GRAPH, self.threads)
        self.downs = [self._down(i) for i in range(cfg.n_layer)]
        self.counters = Counters()
        self.use_kernels = options.kernels
        self.attn = None        # attention-only sessions for kernel decode, made on first need

        kv_shape = (1, cfg.n_head_kv, self.n_ctx, cfg.head_dim)
        self.kv = [(np.zeros(kv_shape, np.float32), np.zeros(kv_shape, np.float32)) for _ in range(cfg.n_layer)]
        freqs = r.tensor(S.ROPE_FREQS) if S.ROPE_FREQS in r else None
        self.cos, self.sin = rope_tables(cfg, self.n_ctx, freqs)
        self.seqlens = np.zeros(1, np.int32)     # GroupQueryAttention: total length - 1
        self.total = np.zeros((), np.int32)      # total length after this call
        self._bind_state(self.layers)
        self.set_sparsity(options.sparsity)
        self._shape = None       # the sequence length the activation buffers are bound for
        self._head_shape = None  # the row count the head's buffers are bound for
        self.n_past = 0
        self.load_seconds = time.perf_counter() - t0

    def set_sparsity(self, override=""):
        """Switch every layer to the rule `override` (RuntimeOptions.sparsity), or back to the
        file's per-layer modes with ""."""
        self.rules = [LayerRule(self.reader, self.reader.header, i, self._rule(i, override), self.counters)
                      for i in range(self.cfg.n_layer)]
        self.ffns = [self._sparse_ffn(i) for i in range(self.cfg.n_layer)]
        if any(self.ffns):
            self._attention_sessions()
        self._shape = None      # the bound steps call the rules: bind again

    def _attention_sessions(self):
        if self.attn is None:
            self.attn = [self._session(S.LAYER_GRAPH.format(i), self.threads, attention_only=True)
                         for i in range(self.cfg.n_layer)]
            self._bind_state(self.attn)

    def set_active_sets(self, draw):
        """Decode every layer with the fused kernel over the neurons draw(layer) returns (ascending
        int32 indices) instead of the file's rule: synthetic active sets, for benchmarks of models
        that have no trained predictors (benchmarks/synthetic_decode.py). set_sparsity() undoes it."""
        r, cfg = self.reader, self.cfg
        self.ffns = [(SparseFFN(r.block(S.FFN_GATE_UP.format(i)), r.block(S.FFN_DOWN_T.format(i)), cfg.n_ff,
                                cfg.d_model, cfg.ffn_act, None, self.threads), "given", 0.0, 0.0)
                     for i in range(cfg.n_layer)]
        self.draw = draw
        self._attention_sessions()
        self._shape = None

    def _sparse_ffn(self, i):
        """The fused kernel for layer i's decode, or None where the ONNX graph and NumPy rule run:
        dense layers (ONNX Runtime's MatMulNBits is the faster dense path), formats or shapes the
        kernel lacks, and --quant mixed splits."""
        rule, r, cfg = self.rules[i], self.reader, self.cfg
        if (not self.use_kernels or rule.rule.mode == "dense" or S.FFN_GATE_UP_COLD.format(i) in r.header["weights"]
                or not cfg.ffn_gated or cfg.ffn_act not in ("silu", "relu") or S.FFN_GATE_UP_BIAS.format(i) in r):
            return None
        gate_up, down = r.block(S.FFN_GATE_UP.format(i)), r.block(S.FFN_DOWN_T.format(i))
        predictor = None
        if rule.rule.mode in ("predicted", "relu"):
            predictor = (r.block(S.FFN_PRED_W1.format(i))[1], r.block(S.FFN_PRED_W2.format(i))[1],
                         r.tensor(S.FFN_PRED_B2.format(i)))
        try:
            ffn = SparseFFN(gate_up, down, cfg.n_ff, cfg.d_model, cfg.ffn_act, predictor, self.threads)
        except ValueError:
            return None
        thr = float(rule.threshold) if rule.threshold is not None else 0.0
        pthr = float(rule.pred[3]) if rule.pred is not None else 0.0
        return ffn, rule.rule.mode, thr, pthr

    def _rule(self, layer, override):
        if override:
            return Rule.parse(override)
        layers = self.reader.header.get("layers") or []
        info = layers[layer] if layer < len(layers) else {}
        return Rule(info.get("mode", "dense"), float(info.get("value", 0.0)))

    def weight_bytes_per_token(self):
        """Weight bytes a step reads, from the rows read since the last counters.reset() (all rows
        before any call): on the NumPy-rule path every FFN row, with the fused kernel the rows it keeps."""
        from .bench import weight_bytes_per_token
        return weight_bytes_per_token(self.reader, self.cfg, self.counters.read_fractions(),
                                      {i for i, r in enumerate(self.rules) if r.rule.mode in ("predicted", "relu")})

    @property
    def sparsity_names(self):
        """The distinct rules the layers run, e.g. ["down:0.3"]."""
        return sorted({rule.rule.name for rule in self.rules})

    def _down(self, i):
        r, cfg = self.reader, self.cfg
        hot_fmt, hot_parts = r.block(S.FFN_DOWN_T.format(i))
        cold = S.FFN_DOWN_T_COLD.format(i)
        if cold not in r.header["weights"]:
            down = MatMulDown if hot_fmt in MatMulDown.FORMATS else DownProjection
            return down(hot_fmt, hot_parts, self.threads, cfg.n_ff, cfg.d_model)
        hot = (r.header.get("ffn", {}).get("hot_rows") or [None] * cfg.n_layer)[i:i + 1]
        if not hot or not isinstance(hot[0], int) or not 0 < hot[0] < cfg.n_ff:
            raise ValueError(f"layer {i}'s FFN is split in hot and cold rows but the header's ffn.hot_rows does "
                             f"not say where (found {hot[0] if hot else None!r}, expected 1..{cfg.n_ff - 1}); "
                             "convert the model again")
        hot = hot[0]
        return SplitDown(DownProjection(hot_fmt, hot_parts, self.threads, hot, cfg.d_model),
                         DownProjection(*r.block(cold), self.threads, cfg.n_ff - hot, cfg.d_model))

    def _bind_state(self, sessions):
        """Bind the KV cache, positions and RoPE tables, shared by every layer session."""
        for i, layer in enumerate(sessions):
            k, v = self.kv[i]
            for name, a in (("past_key", k), ("past_value", v), ("seqlens_k", self.seqlens),
                            ("total_len", self.total), ("cos_cache", self.cos), ("sin_cache", self.sin)):
                layer.bind_in(name, a)
            layer.bind_out("present_key", k)
            layer.bind_out("present_value", v)

    def _session(self, graph, threads, attention_only=False):
        proto = onnx.load_from_string(self.reader.graph_bytes(graph))
        if attention_only:
            _drop_output(proto.graph, "ffn_h")
        names, values = [], []
        for t in proto.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                names.append(t.name)
                values.append(ort.OrtValue.ortvalue_from_numpy(self.reader.tensor(t.name)))
        so = _session_options(threads)
        so.add_external_initializers(names, values)
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
        bound = _Bound(sess)
        bound.keep["initializers"] = values   # ORT uses these buffers; keep them alive
        return bound

    # -- activations ---------------------------------------------------------------------------
    def _bind_activations(self, n):
        """(Re)bind the activation buffers for a call over n tokens."""
        if self._shape == n:
            return
        d = self.cfg.d_model
        # resid ping-pongs (layer i reads resid[i % 2]); delta and h are reused by every layer:
        # layer i consumes delta before its down projection overwrites it.
        self.resid = [np.zeros((1, n, d), np.float32) for _ in range(2)]
        self.delta = np.zeros((1, n, d), np.float32)
        self.h = np.zeros((1, n, self.cfg.n_ff), np.float32)
        self.x = np.zeros((1, n, d), np.float32)
        self.steps = []
        for i, layer in enumerate(self.layers):
            kernel = n == 1 and self.ffns[i] is not None     # decode: the fused FFN kernel
            if kernel:
                layer = self.attn[i]
            else:
                layer.bind_out("ffn_h", self.h)
            layer.bind_in("resid", self.resid[i % 2])
            layer.bind_in("delta", self.delta)
            layer.bind_out("resid_out", self.resid[(i + 1) % 2])
            layer.bind_out("ffn_x", self.x)
            if kernel:
                self.steps += [layer.run, self._kernel_step(i)]
            else:
                self.steps += [layer.run, self.rules[i].bind(self.x[0], self.h[0]),
                               self.downs[i].bind(self.h[0], self.delta[0])]
        self._shape = n

    def _kernel_step(self, i):
        ffn, mode, thr, pthr = self.ffns[i]
        run, c, n_ff = ffn.bind(self.x[0, 0], self.delta[0, 0], mode, thr, pthr), self.counters, self.cfg.n_ff
        given = ffn.set_candidates if mode == "given" else None
        draw = self.draw if given else None

        def step():
            if given:
                given(draw(i))
            cand, kept = run()
            c.add(cand, kept, cand, kept, n_ff)     # the kernel reads what it keeps
        return step

    def embed(self, tokens):
        return blocks.dequantize(self.embd_format, self.embd_parts, rows=np.asarray(tokens))

    def reset(self):
        self.n_past = 0

    def forward(self, tokens, logits_from=None):
        """Run `tokens` after the cached ones; returns logits (n, vocab) for positions
        logits_from.. of this call (default: the last one only)."""
        n = len(tokens)
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if self.n_past + n > self.n_ctx:
            raise ContextFull(self.n_past, n, self.n_ctx)
        self._bind_activations(n)
        self.resid[0][0] = self.embed(tokens)
        if self.pos is not None:
            self.resid[0][0] += self.pos[self.n_past:self.n_past + n]
        self.delta.fill(0)
        self.seqlens[0] = self.n_past + n - 1
        self.total[()] = self.n_past + n
        for step in self.steps:
            step()
        self.n_past += n
        start = n - 1 if logits_from is None else logits_from
        return self.head_logits(self.resid[self.cfg.n_layer % 2][:, start:], self.delta[:, start:])

    def head_logits(self, resid, delta):
        m = resid.shape[1]
        if self._head_shape != m:
            self._head_in = (np.empty((1, m, self.cfg.d_model), np.float32),
                             np.empty((1, m, self.cfg.d_model), np.float32))
            self._logits = np.empty((1, m, self.cfg.vocab), np.float32)
            self.head.bind_in("resid", self._head_in[0])
            self.head.bind_in("delta", self._head_in[1])
            self.head.bind_out("logits", self._logits)
            self._head_shape = m
        self._head_in[0][...] = resid
        self._head_in[1][...] = delta
        self.head.run()
        return self._logits[0]


def _drop_output(graph, name):
    """Remove the output `name` and every node and initializer only it needed. ONNX Runtime does
    not prune them itself: attention-only sessions kept computing gate/up (a 7B layer's 50 MB),
    which made the fused kernel's decode slower than dense."""
    keep = [o for o in graph.output if o.name != name]
    del graph.output[:]
    graph.output.extend(keep)
    needed = {o.name for o in keep}
    nodes = []
    for node in reversed(graph.node):
        if any(out in needed for out in node.output):
            nodes.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(nodes))
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)


class ContextFull(ValueError):
    def __init__(self, n_past, n, n_ctx):
        super().__init__(f"the context holds {n_past} tokens and {n} more do not fit in its {n_ctx}; "
                         "raise -c/--ctx-size or start a new conversation")
        self.n_past, self.n, self.n_ctx = n_past, n, n_ctx
