"""A loaded model: one ONNX Runtime session per layer and one for the head, called through
IOBinding over buffers bound once, with pinfer's FFN kernels between them (docs/design.md §4 maps
the modules and one decode step through them).

Per token: embedding rows (NumPy, from the file's block format) -> layer 0 .. n-1 -> head. Each
layer session takes (resid, delta), delta being the previous layer's FFN output, and returns
(resid', x) and, on the ONNX path, h = act(gate)*up, which the rule and the down projection turn
into the next delta; on the fused path pinfer's kernel turns x into it. Residual adds ride inside
SkipSimplifiedLayerNormalization.
"""

import os
import time

import numpy as np

from pinfer.formats import PinfReader, blocks
from pinfer.formats import schema as S
from pinfer.formats.config import ModelConfig

from . import accounting, autotune, plan, selfcheck
from .devices import Devices
from .kv import AttentionState
from .loading import load_map, one_copy
from .options import DEFAULT_CTX, RuntimeOptions
from .sparse import Counters, Rule
from .steps import Steps


class Model:
    """A loaded `.pinf` model with its KV cache. Not thread-safe: one sequence at a time."""

    def __init__(self, path, options=RuntimeOptions()):
        t0 = time.perf_counter()
        self.reader = r = PinfReader(path, mapped=options.mmap is True)
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
        self.use_kernels = options.kernels
        self.devices = dv = Devices(r, cfg, options)
        selfcheck.self_check(dv, self.threads)      # before anything goes to the device: CPU on a difference
        self.notes = dv.notes       # what loading chose (Note, autotune's records): the CLI prints them
        self.plan, self.steps, self.draw = None, None, None     # plan: the placement of hot neurons on a device
        # dense part on a device: only attention graphs go there (not every gate/up row); all tokens decode
        self.load_map = load_map(self.threads if dv.ffn == "cpu" and dv.dense == "cpu" else 1, r)
        self.head = None        # ONNX Runtime's head graph, made on first need (one copy: native_head takes all)
        # one copy of the weights where the C kernels take every step (loading.one_copy): no layer graphs
        self.one_copy = one_copy(self, [Rule.of_layer(r.header, i, options.sparsity).mode
                                        for i in range(cfg.n_layer)]) is None
        self.counters = Counters(cfg.n_layer)
        self.attention = AttentionState(cfg, self.n_ctx, dv.act_dtype, dv.act_at,
                                        r.tensor(S.ROPE_FREQS) if S.ROPE_FREQS in r else None, dv.kv_dtype)
        plan.build(self)        # self.layers: one plan.Layer per layer, what runs it and why
        self.native_head = plan.head(self)      # the head through pinfer's C kernels where they cover it
        dv.loaded(self.attention.kv_bytes)
        self._head_shape = None  # the row count the head's buffers are bound for
        self.n_past = 0
        self.set_sparsity(options.sparsity)
        if self.one_copy:       # after set_sparsity, which gives a layer the kernel refuses back to the graphs
            self.notes.append(accounting.memory_note(r.tensors, cfg, self.n_ctx, self.attention.kv_bytes))
        self.load_seconds = time.perf_counter() - t0

    def set_sparsity(self, override=""):
        """Switch every layer to the rule `override` (RuntimeOptions.sparsity), or back to the
        file's per-layer modes with "". With --ffn-kernel auto, times the paths (autotune)."""
        plan.set_rules(self, override)

    def set_active_sets(self, draw, hotness=None):
        """Decode every layer with the fused kernel over the neurons draw(layer) returns (ascending
        int32 indices) instead of the file's rule: synthetic active sets, for benchmarks of models
        that have no trained predictors (benchmarks/synthetic_decode.py), split between GPU and CPU
        by `hotness` ((n_layer, n_ff), the draws' activation probabilities; default: the file's
        profile, see placement.hotness). set_sparsity() undoes it."""
        plan.place(self, None, hotness)
        self.draw = draw
        self.path_choices = []

    def weight_bytes_per_token(self):
        """Weight bytes a step reads, from the rows read since the last counters.reset() (all rows
        before any call): on the NumPy-rule path every FFN row, with the fused kernel the rows it keeps."""
        return accounting.weight_bytes_per_token(
            self.reader, self.cfg, self.counters.read_fractions(),
            {i for i, L in enumerate(self.layers) if S.MODES[L.rule.rule.mode].uses_predictor},
            accounting.attention_shares(self))

    @property
    def sparsity_names(self):
        """The distinct rules the layers run, e.g. ["down:0.3"] (or the activation sparsity)."""
        return [f"activation:{self.options.activation}"] if self.options.activation else sorted({L.rule.rule.name for L in self.layers})

    # -- binding and routing ---------------------------------------------------------------------
    def bind_activations(self, n):
        """(Re)build the activation buffers and steps for a call over n tokens."""
        if self.steps is None or self.steps.n != n:
            self._head_shape = None      # the head binds to the new buffers
            self.steps = Steps(self, n)

    def unbind(self):
        """Forget the bound steps (the rules, paths or prompt routing changed): the next call binds
        its buffers and steps again."""
        self.steps = None

    def prefill_through_kernel(self, up_to):
        """Send prompts of up to `up_to` tokens (at most autotune.PREFILL_SIZES[-1]) through the
        kernel's batch call, longer ones through the dense graphs, instead of what
        autotune.choose_prefill chose: for benchmarks and tests. 0: every prompt through the graphs."""
        if not 0 <= up_to <= autotune.PREFILL_SIZES[-1]:
            raise ValueError(f"the kernel's batch call takes prompts of up to {autotune.PREFILL_SIZES[-1]} tokens, "
                             f"not {up_to}")
        self.prefill_by_token = up_to
        self.unbind()

    def batches(self, n):
        """Whether a prompt of n tokens runs through the kernel's batch call (prefill_by_token,
        set by autotune.choose_prefill; the CPU's kernels only)."""
        return 1 < n <= self.prefill_by_token and not self.devices.on_device and \
            all(L.ffn is None or hasattr(L.ffn.kernel, "bind_batch") for L in self.layers)

    # -- a call ------------------------------------------------------------------------------------
    def start(self, tokens, n):
        """Write a call's inputs: embeddings of `tokens`, a zero delta, the lengths."""
        rows = self.embed(tokens)
        if self.pos is not None:
            rows += self.pos[self.n_past:self.n_past + n]
        self.steps.resid[0].write(rows[None])
        self.steps.delta.zero()
        self.attention.set_lengths(self.n_past, n)

    def embed(self, tokens):
        rows = blocks.dequantize(self.embd_format, self.embd_parts, rows=np.asarray(tokens))
        if self.cfg.embed_scale != 1.0:         # Gemma: sqrt(d_model), in float32 as transformers does
            rows *= np.float32(self.cfg.embed_scale)
        return rows

    def reset(self):
        self.n_past = 0

    def forward(self, tokens, logits_from=None):
        """Run `tokens` after the cached ones; returns logits (n, vocab) for positions
        logits_from.. of this call (default: the last one only). A prompt longer than one batch
        call of the kernel takes may run as several (autotune.chunk_size)."""
        n = len(tokens)
        if n == 0:
            raise ValueError("forward() needs at least one token")
        if self.n_past + n > self.n_ctx:
            raise ContextFull(self.n_past, n, self.n_ctx)
        start = n - 1 if logits_from is None else logits_from
        if not 0 <= start < n:
            raise ValueError(f"logits_from {logits_from} is outside this call's {n} tokens")
        if n > 1 and self.devices.on_device:
            return np.concatenate([self.forward([t]) for t in tokens][start:])
        size, out = autotune.chunk_size(self, n), []
        for c in range(0, n, size):
            part = tokens[c:c + size]
            self.bind_activations(len(part))
            self.start(part, len(part))
            for step in self.steps.run:
                step()
            self.n_past += len(part)
            if start < c + len(part):
                out.append(self._head(self.steps.resid[self.cfg.n_layer % 2], self.steps.delta, max(start - c, 0)))
        return out[0] if len(out) == 1 else np.concatenate(out)

    def _head(self, resid, delta, start):
        """Logits of rows start.. of the last layer's output. On a device (one token) the head
        reads the device buffers where they are; on the host the rows are copied to the head's
        own buffers, bound for that row count."""
        rows = resid.shape[1] - start
        if self.native_head is not None and (rows == 1 or self.one_copy):
            return self.native_head(resid, delta) if rows == 1 else self.native_head.rows(resid, delta, start)
        on_device = self.devices.on_device
        if self.head is None:
            self.head = self.devices.session(S.HEAD_GRAPH, self.threads)
        shape = ("device", id(resid)) if on_device else resid.shape[1] - start
        if self._head_shape != shape:
            if on_device:
                self._head_in = (resid, delta)
            else:
                self._head_in = (np.empty((1, shape, self.cfg.d_model), self.devices.act_dtype),
                                 np.empty((1, shape, self.cfg.d_model), np.float32))
            self._logits = np.empty((1, 1 if on_device else shape, self.cfg.vocab), np.float32)
            self.head.bind_in("resid", self._head_in[0])
            self.head.bind_in("delta", self._head_in[1])
            self.head.bind_out("logits", self._logits)
            self._head_shape = shape
        if not on_device:
            self._head_in[0][...] = resid.read()[:, start:]
            self._head_in[1][...] = delta.read()[:, start:]
        self.head.run()
        return self._logits[0].copy()     # the buffer is the next call's: callers keep what they get


class ContextFull(ValueError):
    def __init__(self, n_past, n, n_ctx):
        super().__init__(f"the context holds {n_past} tokens and {n} more do not fit in its {n_ctx}; "
                         "raise -c/--ctx-size or start a new conversation")
        self.n_past, self.n, self.n_ctx = n_past, n, n_ctx
