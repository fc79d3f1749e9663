"""The dense runtime: one ONNX Runtime session per layer and one for the head, called through
IOBinding over NumPy buffers that are bound once (docs/design.md §4).

Per token: embedding rows (NumPy, from the file's block format) -> layer 0 .. n-1 -> head. Each
layer session takes (resid, delta), delta being the previous layer's FFN output, and returns
(resid', h) with h = act(gate)*up; pinfer's kernel turns h into the next delta from the
neuron-major down_t bundle. Residual adds ride inside SkipSimplifiedLayerNormalization. The KV cache is one buffer per layer
and per K/V, bound as both past and present (GroupQueryAttention writes in place).
"""

import ctypes
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort

from pinfer.formats import PinfReader, blocks
from pinfer.formats import schema as S
from pinfer.formats.config import ModelConfig
from pinfer.kernels import DownProjection

from . import hybrid, placement
from .sparse import Counters, LayerRule, Rule


@dataclass(frozen=True)
class RuntimeOptions:
    n_ctx: int = 0          # 0: the model's training context, capped at DEFAULT_CTX
    threads: int = 0        # 0: all cores
    verbose: bool = False
    sparsity: str = ""      # "": each layer's mode from the file; else dense | down:S | predicted:R | relu:R
    # How sparse layers decode: "on" through pinfer's fused FFN kernel (rows the rule skips are not
    # read), "off" through the ONNX graph + the NumPy rule (every row read: the reference path), or
    # "auto": time both the kernel and the dense path at load and run each rule's layers through
    # the kernel only where it is faster on this machine, dense elsewhere (on SmolLM2 the kernel
    # is slower; at LLaMA-7B's shape with 10% active it is 1.9x faster). True/False mean on/off.
    kernels: str | bool = "auto"
    # Where the FFN's hot neurons run: "gpu" (hybrid: hot on the GPU, cold on the CPU), "cpu", or
    # "auto" (the GPU where cuda-python finds one). "cpu-split" plans a split like "gpu" but runs
    # the hot half on a second CPU kernel: it checks the split and the merge without a GPU.
    device: str = "auto"
    vram_budget: float | None = None   # GiB for the GPU part; None: free VRAM minus a margin
    deterministic: bool = False        # the GPU's down projection in a fixed order (tests)
    # Where the dense part (attention, norms, head) runs: "cpu" (the default until the GPU path has
    # produced right output on a GPU since its fix), "auto" (ONNX Runtime's CUDA provider in FP16
    # when the FFN runs on a GPU and onnxruntime-gpu is installed, else its CPU provider), "gpu", "cpu-fp16" (the FP16 graphs on the CPU provider: tests the conversion), or
    # "emulated-gpu": the GPU's code path (device buffers reached only through copies, host inputs
    # copied when bound, memory not zeroed at allocation) over the FP16 graphs on the CPU provider:
    # CI's check of the device plumbing (see DeviceEmulation).
    dense_device: str = "cpu"


DEFAULT_CTX = 4096

# --ffn-kernel auto: the kernel stays for a rule's layers when it takes under KEEP_BELOW of the dense
# path's time, measured over up to TIMING_TOKENS decode steps (the first TIMING_WARMUP not counted,
# stopping after TIMING_BUDGET_S once 3 are counted); prompts are then timed at PREFILL_SIZES.
KEEP_BELOW = 0.95
TIMING_TOKENS, TIMING_WARMUP, TIMING_BUDGET_S = 10, 2, 1.0
PREFILL_BUDGET_S = 0.5      # the prompt timing stops at the first size past this much time
PREFILL_SIZES = (2, 4, 8, 16, 32, 64)       # 64: kernels.MAX_BATCH, the most tokens of one batch call
TIMING_TEXT = ("The history of the city begins in the early middle ages , when a small market grew around the "
               "river crossing . Its people traded wool , grain and salt , and by the year 1200 the town had a "
               "church , a bridge and a wall")


def choose_path(rule_r, dense_r, keep_below=None):
    """"kernel", "kernel-dense" or "dense" from the times of the kernel under the rule and in its
    dense mode, as ratios to ONNX Runtime's dense path: the exact ways unless the rule is clearly
    (keep_below, default KEEP_BELOW) faster than the faster of them; the kernel's dense mode only
    where it is clearly faster than ONNX Runtime's."""
    keep_below = KEEP_BELOW if keep_below is None else keep_below
    if rule_r < keep_below * min(1.0, dense_r):
        return "kernel"
    return "kernel-dense" if dense_r < keep_below else "dense"


def timing_tokens(spec, vocab, n):
    """n token ids of ordinary English for timing the FFN paths: TIMING_TEXT's words looked up in
    the vocabulary as whole tokens (GPT-2 or SentencePiece spelling), without the cost of building
    the tokenizer; ids spread over the vocabulary where the vocabulary has no such words."""
    index = {t: i for i, t in enumerate(spec.get("tokens") or [])}
    ids = []
    for k, word in enumerate(TIMING_TEXT.split()):
        for spelling in ((word,) if k == 0 else ()) + ("\u0120" + word, "\u2581" + word, word):
            if spelling in index:
                ids.append(index[spelling])
                break
    if len(ids) < n:
        ids += [int(i) for i in np.linspace(vocab // 4, vocab - 1, n - len(ids))]
    return ids[:n]


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
        self.rows = (plain, w)     # the fused kernel's row dots read the same arrays
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


class Buf:
    """An activation or cache buffer as an OrtValue: in host memory (with a NumPy view), on the GPU
    the dense part runs on (ONNX Runtime allocates it; `ptr` is its device address), or "emulated":
    host memory reached like a device's, through write/read and copies by address, never a view.
    Device buffers are zeroed once here: the device's allocator returns whatever was there."""

    def __init__(self, shape, dtype, device="cpu"):
        self.shape, self.dtype, self.device = tuple(shape), np.dtype(dtype), device
        if device == "cpu":
            self.np = np.zeros(shape, dtype)
            self.ov = ort.OrtValue.ortvalue_from_numpy(self.np)
        else:
            self.np = None
            if device == "emulated":
                self._memory = DeviceEmulation.allocate(shape, self.dtype)
                self.ov = ort.OrtValue.ortvalue_from_numpy(self._memory)
            else:
                self.ov = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), self.dtype.type, "cuda", 0)
            self.zero()
        self.ptr = self.ov.data_ptr()

    def write(self, array):
        if self.np is not None:
            self.np[...] = array
        else:
            self.ov.update_inplace(np.ascontiguousarray(array, self.dtype).reshape(self.shape))

    def zero(self):
        self.write(np.zeros(self.shape, self.dtype)) if self.np is None else self.np.fill(0)

    def read(self):
        return self.np if self.np is not None else self.ov.numpy()


class DeviceEmulation:
    """The dense part's device plumbing on the CPU (dense_device "emulated-gpu"), faithful where
    the GPU path can go wrong without a GPU showing it:
    - ONNX Runtime copies a host input that a CUDA kernel consumes to the device when it is bound,
      not when the session runs: a host array updated after binding keeps its first value there.
      Here every host input is copied at bind time too, except those the CUDA kernels read on
      the host (HOST_INPUTS: GroupQueryAttention's total_sequence_length, input 6);
    - device memory comes uninitialised: emulated buffers start as NaN (all ones for integers);
    - device buffers are reached through copies by address (to_host, to_device), as the FFN
      steps reach the GPU's, and `pinned` arrays stand in for page-locked host memory."""

    HOST_INPUTS = {("GroupQueryAttention", 6)}    # (op, input index) a CUDA kernel reads on the host

    @staticmethod
    def allocate(shape, dtype):
        fill = np.nan if np.issubdtype(dtype, np.floating) else -1
        return np.full(shape, fill, dtype)

    @classmethod
    def host_read(cls, graph):
        """Names of the graph's inputs that the CUDA kernels read on the host."""
        return {node.input[k] for node in graph.node for op, k in cls.HOST_INPUTS
                if node.op_type == op and len(node.input) > k and node.input[k]}

    @staticmethod
    def pinned(n, dtype):
        return np.zeros(max(1, n), dtype)[:n]

    @staticmethod
    def to_host(host, src):
        ctypes.memmove(host.ctypes.data, src, host.nbytes)

    @staticmethod
    def to_device(dst, host):
        ctypes.memmove(dst, np.ascontiguousarray(host).ctypes.data, host.nbytes)

    @staticmethod
    def sync():
        pass


class _Bound:
    """A session with one IOBinding whose inputs and outputs are NumPy arrays or Bufs, by name.
    snapshot: under DeviceEmulation, the input names the device reads on the host; every other
    host input is copied when bound, as ONNX Runtime's CUDA provider does."""

    def __init__(self, session, snapshot=None):
        self.sess = session
        self.io = session.io_binding()
        self._run = session._sess.run_with_iobinding   # the raw call: ~2 µs against ~50 µs
        self._ro = ort.RunOptions()
        self.keep = {}
        self.snapshot = snapshot

    def bind_in(self, name, array):
        if self.snapshot is not None and name not in self.snapshot:
            host = array.np if isinstance(array, Buf) else array
            array = host.copy() if host is not None else array     # a device Buf has no host view
        self.keep[name] = array
        self.io.bind_ortvalue_input(name, array.ov if isinstance(array, Buf) else ort.OrtValue.ortvalue_from_numpy(array))

    def bind_out(self, name, array):
        self.keep["out:" + name] = array
        self.io.bind_ortvalue_output(name, array.ov if isinstance(array, Buf) else ort.OrtValue.ortvalue_from_numpy(array))

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
        self.prefill_times = []     # (prompt length, kernel batch time / dense graphs' time), _choose_prefill
        self.attn = self.layers if gpu_dense else None   # attention-only sessions, made on first need

        kv_shape = (1, cfg.n_head_kv, self.n_ctx, cfg.head_dim)
        self.kv = [(Buf(kv_shape, self.act_dtype, self.act_at), Buf(kv_shape, self.act_dtype, self.act_at))
                   for _ in range(cfg.n_layer)]
        freqs = r.tensor(S.ROPE_FREQS) if S.ROPE_FREQS in r else None
        tables = rope_tables(cfg, self.n_ctx, freqs)
        self.cos, self.sin = (Buf(t.shape, self.act_dtype, self.act_at) for t in tables)
        for buf, table in zip((self.cos, self.sin), tables):
            buf.write(table)
        # what loading the dense part took from the device (weights, KV cache, ONNX Runtime's arena)
        self.dense_gpu_measured = free_at_start - self.gpu.mem_info()[0] if self.act_at == "cuda" else 0
        # GroupQueryAttention's lengths: seqlens_k (total length - 1) is read on the device, so it
        # lives there, written once per call for every layer (a host array would be copied to the
        # GPU once, when bound, and keep its first value); total_sequence_length is read on the host.
        self.seqlens = Buf((1,), np.int32, self.act_at)
        self.total = np.zeros((), np.int32)      # total length after this call
        self._bind_state(self.layers)
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
        self._shape = None      # the bound steps call the rules: bind again
        self.path_choices, self.prefill_by_token, self.prefill_times = [], 0, []
        if self.use_kernels == "auto" and self.device == "cpu" and not self.on_device and any(self.ffns):
            self._choose_paths()

    def _attention_sessions(self):
        if self.attn is None:
            self.attn = [self._session(S.LAYER_GRAPH.format(i), self.threads, attention_only=True)
                         for i in range(self.cfg.n_layer)]
            self._bind_state(self.attn)

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
        self.ffns = [(self._layer_ffn(i, "given"), "given", 0.0, 0.0) for i in range(cfg.n_layer)]
        if self.device != "cpu":
            self._report_vram()
        self.draw = draw
        self._attention_sessions()
        self._shape = None
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
        return ffn, rule.rule.mode, thr, pthr

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
        kv = sum(2 * int(np.prod(k.shape)) * k.dtype.itemsize for k, _ in self.kv)    # K and V
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
            hot = getattr(entry[0], "hot", None) if entry else None
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
        so = _session_options(threads)
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
        bound = _Bound(sess, DeviceEmulation.host_read(proto.graph) if self.act_at == "emulated" else None)
        bound.keep["initializers"] = values   # ORT uses these buffers; keep them alive
        return bound

    # -- activations ---------------------------------------------------------------------------
    def _bind_activations(self, n):
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
                      for s in self._layer_steps(i, kernel and self.ffns[i] is not None, on_gpu, n=n)]
        self._shape = n

    def prefill_through_kernel(self, up_to):
        """Send prompts of up to `up_to` tokens (at most PREFILL_SIZES[-1]) through the kernel's
        batch call, longer ones through the dense graphs, instead of what _choose_prefill chose:
        for benchmarks and tests. 0: every prompt through the dense graphs."""
        if not 0 <= up_to <= PREFILL_SIZES[-1]:
            raise ValueError(f"the kernel's batch call takes prompts of up to {PREFILL_SIZES[-1]} tokens, "
                             f"not {up_to}")
        self.prefill_by_token, self._shape = up_to, None

    def _batches(self, n):
        """Whether a prompt of n tokens runs through the kernel's batch call (prefill_by_token,
        set by _choose_prefill; the CPU's kernels only)."""
        return 1 < n <= self.prefill_by_token and not self.on_device and \
            all(f is None or hasattr(f[0], "bind_batch") for f in self.ffns)

    def _layer_steps(self, i, kernel, on_gpu=False, rule=None, entry=None, n=1):
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
        ffn, mode, thr, pthr = entry or self.ffns[i]
        if on_gpu:
            run = hybrid.bind_device(self.copier, ffn, self.x.ptr, self.delta.ptr, mode, thr, pthr)
        else:
            run = ffn.bind(self.x.np[0, 0], self.delta.np[0, 0], mode, thr, pthr)
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
        ffn, mode, thr, pthr = self.ffns[i]
        run = ffn.bind_batch(self.x.np[0], self.delta.np[0], mode, thr, pthr)
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
    def _choose_paths(self):
        """Decode a few tokens with every sparse layer run three ways: the fused kernel under its
        rule ("kernel"), the same kernel over every neuron ("kernel-dense") and the layer graph with
        MatMulNBits ("dense"). A rule's layers keep the kernel and the rule only where their summed
        time is under KEEP_BELOW of the faster exact way (median over tokens); otherwise they run
        the faster exact way, rule dropped, the kernel's dense mode only where it is under
        KEEP_BELOW of the graph's. Each choice is printed and kept in path_choices; where a kernel
        stays, prompts of up to prefill_by_token tokens take its batch call (_choose_prefill)."""
        cfg = self.cfg
        groups = {}
        for i, f in enumerate(self.ffns):
            if f is not None:
                groups.setdefault(self.rules[i].rule.name, []).append(i)
        dense = [LayerRule(self.reader, self.reader.header, i, Rule("dense"), Counters()) for i in range(cfg.n_layer)]
        self._bind_activations(1)
        steps = [(self._layer_steps(i, True), self._layer_steps(i, True, entry=(self.ffns[i][0], "dense", 0.0, 0.0)),
                  self._layer_steps(i, False, rule=dense[i])) if self.ffns[i]
                 else (self._layer_steps(i, False),) for i in range(cfg.n_layer)]
        ids = timing_tokens(self.tokenizer_spec, self.cfg.vocab, TIMING_TOKENS)
        spent = {name: [] for name in groups}      # per token: seconds of each way over the rule's layers
        t_start = time.perf_counter()
        for t, tok in enumerate(ids):
            self._start(np.asarray([tok]), 1)
            acc = {name: [0.0, 0.0, 0.0] for name in groups}
            for i in range(cfg.n_layer):
                if len(steps[i]) == 1:
                    for step in steps[i][0]:
                        step()
                    continue
                saved = self.delta.np.copy()     # every way reads the previous layer's FFN output
                for k, way in enumerate(np.roll((0, 1, 2), t + i)):
                    if k:
                        self.delta.np[...] = saved
                    t0 = time.perf_counter()
                    for step in steps[i][way]:
                        step()
                    acc[self.rules[i].rule.name][way] += time.perf_counter() - t0
            self.n_past += 1
            if t >= TIMING_WARMUP:
                for name, times in acc.items():
                    spent[name].append(times)
                if time.perf_counter() - t_start > TIMING_BUDGET_S and t - TIMING_WARMUP >= 2:
                    break
        self.reset()
        self.counters.reset()
        for name, layers in groups.items():
            times = np.asarray(spent[name])
            rule_r, dense_r = (float(np.median(times[:, k] / times[:, 2])) for k in (0, 1))
            path = choose_path(rule_r, dense_r)
            self.path_choices.append({"rule": name, "layers": len(layers), "tokens": len(times), "path": path,
                                      "kernel_over_dense": rule_r, "kernel_dense_over_dense": dense_r})
            if path != "kernel":
                for i in layers:
                    self.rules[i] = LayerRule(self.reader, self.reader.header, i, Rule("dense"), self.counters)
                    self.ffns[i] = (self.ffns[i][0], "dense", 0.0, 0.0) if path == "kernel-dense" else None
            does = {"kernel": f"decoding through the kernel under {name}",
                    "kernel-dense": "running these layers dense through the kernel (rule dropped)",
                    "dense": "running these layers dense through ONNX Runtime (rule dropped)"}[path]
            print(f"ffn: {name} on {len(layers)} layers, time against ONNX Runtime's dense path here ({self.threads} "
                  f"thread{'s' * (self.threads > 1)}, median of {len(times)} tokens): fused kernel {rule_r:.2f}x, "
                  f"its dense mode {dense_r:.2f}x: {does}", file=sys.stderr)
        self._shape = None
        if any(self.ffns):
            self._choose_prefill()
        elif not self.on_device:
            self.attn = None        # the attention-only sessions go unused

    def _choose_prefill(self):
        """prefill_by_token: the largest prompt length (of PREFILL_SIZES) up to which the kernel's
        batch call over the union of the tokens' candidates beats the dense graphs' batched prompt
        processing, both timed here (best of two); prompts up to it take the batch call. As the
        union grows with the prompt and the dense graphs' cost per token falls, the first length
        where the kernel loses ends the search, as does PREFILL_BUDGET_S."""
        ids = timing_tokens(self.tokenizer_spec, self.cfg.vocab, PREFILL_SIZES[-1])
        chosen, times, t_start = 0, [], time.perf_counter()
        for n in PREFILL_SIZES:
            if n > self.n_ctx or time.perf_counter() - t_start > PREFILL_BUDGET_S:
                break
            best = []
            for by_kernel in (n, 0):
                self.prefill_by_token, self._shape = by_kernel, None
                t = np.inf
                for _ in range(2):
                    self.reset()
                    t0 = time.perf_counter()
                    self.forward(list(ids[:n]))
                    t = min(t, time.perf_counter() - t0)
                best.append(t)
            times.append((n, best[0] / best[1]))
            if best[0] >= best[1]:
                break
            chosen = n
        self.prefill_by_token, self._shape = chosen, None
        self.prefill_times = times
        self.reset()
        self.counters.reset()
        said = ", ".join(f"{n}: {r:.2f}x" for n, r in times)
        print(f"ffn: prompt time of the kernel's batch call against the dense graphs ({said}): "
              + (f"prompts of up to {chosen} tokens go through the kernel, longer ones through the dense graphs"
                 if chosen else "prompts go through the dense graphs"), file=sys.stderr)

    def _start(self, tokens, n):
        """Write a call's inputs: embeddings of `tokens`, a zero delta, the lengths."""
        rows = self.embed(tokens)
        if self.pos is not None:
            rows += self.pos[self.n_past:self.n_past + n]
        self.resid[0].write(rows[None])
        self.delta.zero()
        self.seqlens.write(np.int32(self.n_past + n - 1))
        self.total[()] = self.n_past + n

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
        self._bind_activations(n)
        self._start(tokens, n)
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
