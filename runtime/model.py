"""The dense runtime: one ONNX Runtime session per layer and one for the head, called through
IOBinding over NumPy buffers that are bound once (docs/design.md §4).

Per token: embedding rows (NumPy, from the file's block format) -> layer 0 .. n-1 -> head. Each
layer session takes (resid, delta), delta being the previous layer's FFN output, and returns
(resid', h) with h = act(gate)*up; pinfer's kernel turns h into the next delta from the
neuron-major down_t bundle. Residual adds ride inside SkipSimplifiedLayerNormalization. The KV cache is one buffer per layer
and per K/V, bound as both past and present (GroupQueryAttention writes in place).
"""

import os
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort

from pinfer.formats import PinfReader, blocks
from pinfer.formats import schema as S
from pinfer.formats.config import ModelConfig
from pinfer.kernels import DownProjection

from . import accounting, autotune, hybrid, placement
from .options import DEFAULT_CTX, RuntimeOptions
from .kv import AttentionState
from .ort import Bound, Buf, DeviceEmulation, MatMulDown, SplitDown, drop_output, session_options
from .sparse import Counters, LayerFfn, LayerRule, Rule


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

        self.options = options
        self.gpu, self.plan, self.ffns = None, None, []
        self.device = self._choose_device(options)
        self.dense_device = self._choose_dense_device(options)
        self.act_dtype = np.float16 if self.dense_device != "cpu" else np.float32   # resid, KV, RoPE tables
        self.act_at = {"gpu": "cuda", "emulated-gpu": "emulated"}.get(self.dense_device, "cpu")
        # the dense part's buffers in device memory: the FFN steps reach them through `copier`
        self.on_device = self.act_at != "cpu"
        self.copier = self.gpu if self.act_at == "cuda" else DeviceEmulation

        self.dense_gpu_bytes = 0     # weights ONNX Runtime's CUDA provider holds
        free_at_start = self.gpu.mem_info()[0] if self.gpu else 0
        # With the dense part on the GPU only the attention graphs go there (the full graphs would
        # copy every gate/up row into VRAM): every token, prompt ones too, takes the decode path.
        gpu_dense = self.on_device
        self.layers = [self._session(S.LAYER_GRAPH.format(i), self.threads, attention_only=gpu_dense)
                       for i in range(cfg.n_layer)]
        self.head = self._session(S.HEAD_GRAPH, self.threads)
        self.downs = [None if gpu_dense else self._down(i) for i in range(cfg.n_layer)]
        self.counters = Counters()
        self.use_kernels = {True: "on", False: "off"}.get(options.kernels, options.kernels)
        if self.use_kernels not in ("auto", "on", "off"):
            raise ValueError(f"ffn kernel {options.kernels!r} is not one of auto, on, off")
        self.path_choices = []      # what --ffn-kernel auto measured and chose, one entry per rule
        self.prefill_by_token = 0   # prompts of 2..this many tokens take the kernel's batch call
        self.prefill_times = []     # (prompt length, kernel batch time / dense graphs' time), autotune.choose_prefill
        self.attn = self.layers if gpu_dense else None   # attention-only sessions, made on first need

        self.attention = AttentionState(cfg, self.n_ctx, self.act_dtype, self.act_at,
                                        r.tensor(S.ROPE_FREQS) if S.ROPE_FREQS in r else None)
        self.attention.bind(self.layers)
        # what loading the dense part took from the device (weights, KV cache, ONNX Runtime's arena)
        self.dense_gpu_measured = free_at_start - self.gpu.mem_info()[0] if self.act_at == "cuda" else 0
        self._shape = None       # the sequence length the activation buffers are bound for
        self._head_shape = None  # the row count the head's buffers are bound for
        self.n_past = 0
        self.set_sparsity(options.sparsity)
        self.load_seconds = time.perf_counter() - t0

    def set_sparsity(self, override=""):
        """Switch every layer to the rule `override` (RuntimeOptions.sparsity), or back to the
        file's per-layer modes with ""."""
        self.rules = [LayerRule(self.reader, self.reader.header, i, self._rule(i, override), self.counters)
                      for i in range(self.cfg.n_layer)]
        self._release_gpu()
        if self.device != "cpu":
            self.plan = self._plan([rule.rule.mode for rule in self.rules])
        self.ffns = [self._sparse_ffn(i) for i in range(self.cfg.n_layer)]
        if self.device != "cpu":
            self._report_vram()
        if any(self.ffns):
            self._attention_sessions()
        self.unbind()      # the bound steps call the rules
        self.path_choices, self.prefill_by_token, self.prefill_times = [], 0, []
        if self.use_kernels == "auto" and self.device == "cpu" and not self.on_device and any(self.ffns):
            autotune.choose_paths(self)

    def _attention_sessions(self):
        if self.attn is None:
            self.attn = [self._session(S.LAYER_GRAPH.format(i), self.threads, attention_only=True)
                         for i in range(self.cfg.n_layer)]
            self.attention.bind(self.attn)

    def set_active_sets(self, draw, hotness=None):
        """Decode every layer with the fused kernel over the neurons draw(layer) returns (ascending
        int32 indices) instead of the file's rule: synthetic active sets, for benchmarks of models
        that have no trained predictors (benchmarks/synthetic_decode.py), split between GPU and CPU
        by `hotness` ((n_layer, n_ff), the draws' activation probabilities; default: the file's
        profile, see placement.hotness). set_sparsity() undoes it."""
        cfg = self.cfg
        self._release_gpu()
        if self.device != "cpu":
            self.plan = self._plan(["given"] * cfg.n_layer, hotness)
        self.ffns = [LayerFfn(self._layer_ffn(i, "given"), "given") for i in range(cfg.n_layer)]
        if self.device != "cpu":
            self._report_vram()
        self.draw = draw
        self._attention_sessions()
        self.unbind()
        self.path_choices, self.prefill_by_token, self.prefill_times = [], 0, []

    def _sparse_ffn(self, i):
        """The fused kernel (or the hybrid) for layer i's decode, or None where the ONNX graph and
        NumPy rule run: dense layers with no hot neurons (ONNX Runtime's MatMulNBits is the faster
        dense path), formats or shapes the kernel lacks, and --quant mixed splits."""
        rule, r, cfg = self.rules[i], self.reader, self.cfg
        hot = self.plan.hot[i] if self.plan else 0
        fused = self.use_kernels != "off" or hot or self.on_device   # the GPU's decode has no other FFN path
        if (not fused or (rule.rule.mode == "dense" and not hot and not self.on_device)
                or S.FFN_GATE_UP_COLD.format(i) in r.header["weights"]
                or not cfg.ffn_gated or cfg.ffn_act not in ("silu", "relu") or S.FFN_GATE_UP_BIAS.format(i) in r):
            return None
        try:
            ffn = self._layer_ffn(i, rule.rule.mode)
        except ValueError:
            return None
        thr = float(rule.threshold) if rule.threshold is not None else 0.0
        pthr = float(rule.pred[3]) if rule.pred is not None else 0.0
        return LayerFfn(ffn, rule.rule.mode, thr, pthr)

    def _layer_ffn(self, i, mode):
        """Layer i's fused FFN for `mode`: the CPU kernel, or the hybrid of the plan's hot neurons
        on the GPU (or a second CPU kernel with device cpu-split) and the rest on the CPU."""
        r, cfg = self.reader, self.cfg
        parts = (r.block(S.FFN_GATE_UP.format(i)), r.block(S.FFN_DOWN_T.format(i)), None)
        if mode in ("predicted", "relu"):
            parts = parts[:2] + ((r.block(S.FFN_PRED_W1.format(i))[1], r.block(S.FFN_PRED_W2.format(i))[1],
                                  r.tensor(S.FFN_PRED_B2.format(i))),)
        k = self.plan.hot[i] if self.plan else 0
        if self.device == "gpu":
            from pinfer.kernels.gpu import HotFFN
            spec = self.plan_specs[i][0]
            make = lambda gu, dn, pred: HotFFN(self.gpu, spec, k, gu, dn, pred, cfg.ffn_act,   # noqa: E731
                                               self.options.deterministic)
        else:
            make = hybrid.cpu_hot_factory(k, cfg.d_model, cfg.ffn_act, self.threads, self.copier)
        rows = getattr(self.downs[i], "rows", None) if self.downs else None   # W_down, shared with MatMulNBits
        return hybrid.build(parts, k, cfg.n_ff, cfg.d_model, cfg.ffn_act, self.threads, make,
                            rows if rows and rows[0] == "q4" else None)

    # -- the GPU ---------------------------------------------------------------------------------
    def _choose_device(self, options):
        if options.device not in ("auto", "cpu", "gpu", "cpu-split"):
            raise ValueError(f"device {options.device!r} is not one of auto, cpu, gpu")
        if options.device in ("cpu", "cpu-split"):
            return options.device
        from pinfer.kernels.gpu import Gpu, GpuError
        try:
            self.gpu = Gpu()
        except GpuError as e:
            if options.device == "gpu":
                raise
            if options.verbose:
                print(f"pinfer: running on the CPU ({e})", file=sys.stderr)
            return "cpu"
        return "gpu"

    def _choose_dense_device(self, options):
        want = options.dense_device
        if want not in ("auto", "cpu", "gpu", "cpu-fp16", "emulated-gpu"):
            raise ValueError(f"dense device {want!r} is not one of auto, cpu, gpu")
        if want in ("cpu", "cpu-fp16"):
            return want
        from pinfer.kernels.gpu import GpuError
        why = None
        if want != "emulated-gpu" and self.device != "gpu":
            why = "the FFN runs on the CPU"
        elif want != "emulated-gpu" and "CUDAExecutionProvider" not in ort.get_available_providers():
            why = "this onnxruntime has no CUDA provider (install onnxruntime-gpu in its place)"
        elif any(spec is None for spec, _ in placement.layer_specs(self.reader, self.cfg, ["dense"] * self.cfg.n_layer)):
            why = "some layers' FFNs are not ones the GPU kernels take"
        if why and want != "auto":
            raise GpuError(f"the dense part cannot run on the GPU: {why}")
        return "cpu" if why else "gpu" if want == "auto" else want

    def _plan(self, modes, hotness=None):
        """The hot/cold split for this machine, printed before the weights move."""
        budget = self.options.vram_budget
        if budget is None:
            if self.gpu is None:
                raise ValueError("device cpu-split needs a vram_budget to plan for")
            free, _ = self.gpu.mem_info()   # the dense part, if there, is in VRAM already
            budget_bytes = max(0, free - placement.MARGIN + self._dense_reserved().get("dense weights", 0)
                               + self._dense_reserved().get("KV cache", 0))
        else:
            if budget < 0:
                raise ValueError(f"--vram-budget {budget:g} GiB is negative; give the GiB the GPU may use")
            budget_bytes = int(budget * placement.GIB)
        self.plan_specs = placement.layer_specs(self.reader, self.cfg, modes)
        plan = placement.plan(self.reader, self.cfg, modes, budget_bytes, self._dense_reserved(), mass=hotness)
        if self.device == "gpu" or self.options.verbose:
            where = (f"GPU {self.gpu.name} (sm_{self.gpu.arch}, kernels {self.gpu.compiled.kind} "
                     f"{'from the cache' if self.gpu.compiled.cached else 'compiled now'})" if self.gpu
                     else "a second CPU kernel (cpu-split)")
            dense = ("the GPU (ONNX Runtime's CUDA provider, FP16)" if self.dense_device == "gpu"
                     else "the CPU (ONNX Runtime's CPU provider)")
            print(f"{plan.describe()}\n  hot part on {where}; dense part and KV cache on {dense}", file=sys.stderr)
        self._free_before = self.gpu.mem_info()[0] if self.gpu else 0
        return plan

    def _dense_reserved(self):
        """VRAM the dense part holds before the FFN gets any: {} when it runs on the CPU."""
        if self.dense_device != "gpu":
            return {}
        kv = self.attention.kv_bytes
        return {"dense weights": self.dense_gpu_bytes, "KV cache": kv, "scratch": placement.DENSE_SCRATCH}

    def _report_vram(self):
        if self.gpu is None:
            return
        used = self._free_before - self.gpu.mem_info()[0]
        mib = lambda b: f"{b / 2**20:,.1f} MiB"     # noqa: E731
        dense = sum(self._dense_reserved().values())
        said = (f"; dense part: planned {mib(dense)}, the device's free memory fell by "
                f"{mib(self.dense_gpu_measured)} while ONNX Runtime loaded it" if dense else "")
        print(f"VRAM: FFN hot neurons planned {mib(self.plan.total - dense)}, allocated {mib(self.gpu.allocated)} "
              f"(the device's free memory fell by {mib(used)}){said}", file=sys.stderr)

    def _release_gpu(self):
        for entry in self.ffns or []:
            hot = getattr(entry.kernel, "hot", None) if entry else None
            if hasattr(hot, "close"):
                hot.close()

    def _rule(self, layer, override):
        if override:
            return Rule.parse(override)
        layers = self.reader.header.get("layers") or []
        info = layers[layer] if layer < len(layers) else {}
        return Rule(info.get("mode", "dense"), float(info.get("value", 0.0)))

    def weight_bytes_per_token(self):
        """Weight bytes a step reads, from the rows read since the last counters.reset() (all rows
        before any call): on the NumPy-rule path every FFN row, with the fused kernel the rows it keeps."""
        return accounting.weight_bytes_per_token(self.reader, self.cfg, self.counters.read_fractions(),
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

    def _session(self, graph, threads, attention_only=False):
        proto = onnx.load_from_string(self.reader.graph_bytes(graph))
        if attention_only:
            drop_output(proto.graph, "ffn_h")
        halved = set()
        if self.dense_device != "cpu":
            from .fp16 import to_fp16
            halved = set(to_fp16(proto, keep_f32=("delta", "ffn_x", "ffn_h", "logits")))
        names, values = [], []
        for t in proto.graph.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                names.append(t.name)
                a = self.reader.tensor(t.name)
                a = a.astype(np.float16) if t.name in halved else a
                values.append(ort.OrtValue.ortvalue_from_numpy(a))
                self.dense_gpu_bytes += a.nbytes if self.dense_device == "gpu" else 0
        so = session_options(threads)
        so.add_external_initializers(names, values)
        if self.dense_device in ("cpu-fp16", "emulated-gpu"):
            so.log_severity_level = 3   # the CPU provider lacks some FP16 kernels and says so per node
        providers = ["CPUExecutionProvider"]
        if self.dense_device == "gpu":
            # one stream for ONNX Runtime's kernels and pinfer's: no event needed between them
            providers = [("CUDAExecutionProvider", {"device_id": "0",
                                                    "user_compute_stream": str(int(self.gpu.stream))}),
                         "CPUExecutionProvider"]
        sess = ort.InferenceSession(proto.SerializeToString(), so, providers=providers)
        if self.dense_device == "gpu" and sess.get_providers()[0] != "CUDAExecutionProvider":
            from pinfer.kernels.gpu import GpuError
            raise GpuError("ONNX Runtime could not start its CUDA provider (are CUDA 13 and cuDNN 9 installed? "
                           "see README.md); run with --device cpu, or fix the CUDA install")
        bound = Bound(sess, DeviceEmulation.host_read(proto.graph) if self.act_at == "emulated" else None)
        bound.keep["initializers"] = values   # ORT uses these buffers; keep them alive
        return bound

    # -- activations ---------------------------------------------------------------------------
    def bind_activations(self, n):
        """(Re)bind the activation buffers for a call over n tokens."""
        if self._shape == n:
            return
        d = self.cfg.d_model
        # resid ping-pongs (layer i reads resid[i % 2]); delta and h are reused by every layer:
        # layer i consumes delta before its down projection overwrites it. With the dense part on
        # the GPU, resid stays there, and so do x and delta in decode, where every layer's FFN
        # step reads and writes device memory; prefill's FFN runs on the host buffers.
        on_gpu = self.on_device and n == 1
        kernel = n == 1 or self._batches(n)     # prompts up to prefill_by_token: the kernel's batch call
        self._head_shape = None      # the head binds to these buffers again
        self.resid = [Buf((1, n, d), self.act_dtype, self.act_at) for _ in range(2)]
        self.delta = Buf((1, n, d), np.float32, self.act_at if on_gpu else "cpu")
        self.x = Buf((1, n, d), np.float32, self.act_at if on_gpu else "cpu")
        self.h = np.zeros((1, n, self.cfg.n_ff), np.float32)
        self.steps = [s for i in range(self.cfg.n_layer)
                      for s in self.layer_steps(i, kernel and self.ffns[i] is not None, on_gpu, n=n)]
        self._shape = n

    def unbind(self):
        """Forget the bound steps (the rules, paths or prompt routing changed): the next call binds
        its buffers and steps again."""
        self._shape = None

    def prefill_through_kernel(self, up_to):
        """Send prompts of up to `up_to` tokens (at most autotune.PREFILL_SIZES[-1]) through the kernel's
        batch call, longer ones through the dense graphs, instead of what autotune.choose_prefill chose:
        for benchmarks and tests. 0: every prompt through the dense graphs."""
        if not 0 <= up_to <= autotune.PREFILL_SIZES[-1]:
            raise ValueError(f"the kernel's batch call takes prompts of up to {autotune.PREFILL_SIZES[-1]} tokens, "
                             f"not {up_to}")
        self.prefill_by_token = up_to
        self.unbind()

    def _batches(self, n):
        """Whether a prompt of n tokens runs through the kernel's batch call (prefill_by_token,
        set by autotune.choose_prefill; the CPU's kernels only)."""
        return 1 < n <= self.prefill_by_token and not self.on_device and \
            all(f is None or hasattr(f.kernel, "bind_batch") for f in self.ffns)

    def layer_steps(self, i, kernel, on_gpu=False, rule=None, entry=None, n=1):
        """Layer i's steps over the bound buffers: the attention-only session and the fused FFN
        kernel (decode, or a prompt of n tokens in one batch call; `entry` as in self.ffns, default
        the layer's), or the whole layer graph, `rule` (default the layer's) and the down
        projection."""
        layer = self.attn[i] if kernel else self.layers[i]
        if not kernel:
            layer.bind_out("ffn_h", self.h)
        layer.bind_in("resid", self.resid[i % 2])
        layer.bind_in("delta", self.delta)
        layer.bind_out("resid_out", self.resid[(i + 1) % 2])
        layer.bind_out("ffn_x", self.x)
        if kernel:
            return [layer.run, self._kernel_step(i, on_gpu, entry) if n == 1 else self._batch_step(i, n)]
        return [layer.run, (rule or self.rules[i]).bind(self.x.np[0], self.h[0]),
                self.downs[i].bind(self.h[0], self.delta.np[0])]

    def _kernel_step(self, i, on_gpu=False, entry=None):
        entry = entry or self.ffns[i]
        ffn, mode = entry.kernel, entry.mode
        if on_gpu:
            run = hybrid.bind_device(self.copier, ffn, self.x.ptr, self.delta.ptr, mode, entry.threshold,
                                     entry.pred_threshold)
        else:
            run = entry.bind(self.x.np[0, 0], self.delta.np[0, 0])
        c, n_ff = self.counters, self.cfg.n_ff
        given = ffn.set_candidates if mode == "given" else None
        draw = self.draw if given else None
        rows_from = _rows_from(ffn, n_ff)

        def step():
            if given:
                given(draw(i))
            cand, kept = run()
            c.add(cand, kept, cand, n_ff if kept >= rows_from else kept, n_ff)   # the axpy reads what it keeps
        return step

    def _batch_step(self, i, n):
        """Layer i's FFN over the n tokens of a prompt in one call of the kernel: each token gets
        the bits of its own decode call, the weight rows read once for all of them."""
        entry = self.ffns[i]
        ffn, mode = entry.kernel, entry.mode
        run = ffn.bind_batch(self.x.np[0], self.delta.np[0], mode, entry.threshold, entry.pred_threshold)
        c, n_ff, draw = self.counters, self.cfg.n_ff, self.draw if mode == "given" else None
        rows_from = _rows_from(ffn, n_ff)

        def step():
            if draw:
                run.set_candidates([draw(i) for _ in range(n)])
            run()
            for cand, kept in run.counts:
                c.add(cand, kept, cand, n_ff if kept >= rows_from else kept, n_ff)
        return step

    # -- --ffn-kernel auto ------------------------------------------------------------------------
    def start(self, tokens, n):
        """Write a call's inputs: embeddings of `tokens`, a zero delta, the lengths."""
        rows = self.embed(tokens)
        if self.pos is not None:
            rows += self.pos[self.n_past:self.n_past + n]
        self.resid[0].write(rows[None])
        self.delta.zero()
        self.attention.set_lengths(self.n_past, n)

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
        if n > 1 and self.on_device:
            start = n - 1 if logits_from is None else logits_from
            rows = [self.forward([t]) for t in tokens]
            return np.concatenate(rows[start:])
        self.bind_activations(n)
        self.start(tokens, n)
        for step in self.steps:
            step()
        self.n_past += n
        start = n - 1 if logits_from is None else logits_from
        last = self.resid[self.cfg.n_layer % 2]
        if self.on_device:       # one token, its buffers on the device: the head reads them there
            return self._head_on_device(last)
        return self.head_logits(last.read()[:, start:], self.delta.read()[:, start:])

    def _head_on_device(self, resid):
        if self._head_shape != ("device", id(resid)):
            self._logits = np.empty((1, 1, self.cfg.vocab), np.float32)
            self.head.bind_in("resid", resid)
            self.head.bind_in("delta", self.delta)
            self.head.bind_out("logits", self._logits)
            self._head_shape = ("device", id(resid))
        self.head.run()
        return self._logits[0].copy()     # the buffer is the next call's: callers keep what they get

    def head_logits(self, resid, delta):
        m = resid.shape[1]
        if self._head_shape != m:
            self._head_in = (np.empty((1, m, self.cfg.d_model), self.act_dtype),
                             np.empty((1, m, self.cfg.d_model), np.float32))
            self._logits = np.empty((1, m, self.cfg.vocab), np.float32)
            self.head.bind_in("resid", self._head_in[0])
            self.head.bind_in("delta", self._head_in[1])
            self.head.bind_out("logits", self._logits)
            self._head_shape = m
        self._head_in[0][...] = resid
        self._head_in[1][...] = delta
        self.head.run()
        return self._logits[0].copy()     # the buffer is the next call's: callers keep what they get


def _rows_from(ffn, n_ff):
    """Survivors from which the kernel's down projection reads every row of W_down (its row
    dots), or n_ff + 1 where it has none."""
    rows = getattr(ffn, "rows", None)
    return rows.from_ if rows is not None and rows.q else n_ff + 1



class ContextFull(ValueError):
    def __init__(self, n_past, n, n_ctx):
        super().__init__(f"the context holds {n_past} tokens and {n} more do not fit in its {n_ctx}; "
                         "raise -c/--ctx-size or start a new conversation")
        self.n_past, self.n, self.n_ctx = n_past, n, n_ctx
