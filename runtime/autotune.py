"""--ffn-kernel auto: at load, time each sparse rule's layers three ways (the fused kernel under the
rule, the kernel over every neuron, ONNX Runtime's dense graph) and keep the rule only where it is
clearly faster; then time prompts through the kernel's batch call against the dense graphs. It
prints nothing: what it measured and chose comes back as records (PathChoice, PrefillChoice) that
the model keeps in its notes and the CLI prints."""

import time
from dataclasses import dataclass

import numpy as np

from .sparse import Counters, LayerRule, Rule

# --ffn-kernel auto: the kernel stays for a rule's layers when it takes under KEEP_BELOW of the dense
# path's time, measured over up to TIMING_TOKENS decode steps (the first TIMING_WARMUP not counted,
# stopping after TIMING_BUDGET_S once 3 are counted); prompts are then timed at PREFILL_SIZES.
KEEP_BELOW = 0.95
clock = time.perf_counter     # every timing here reads this (tests inject a noisy one)
TIMING_TOKENS, TIMING_WARMUP, TIMING_BUDGET_S = 10, 2, 1.0
PREFILL_BUDGET_S = 0.5      # the prompt timing stops at the first size past this much time
PREFILL_SIZES = (2, 4, 8, 16, 32, 64)       # 64: kernels.MAX_BATCH, the most tokens of one batch call
PREFILL_LAYERS = 1 / 8      # the share of the layers (the first ones, one at least) a prompt is timed over
TIMING_TEXT = ("The history of the city begins in the early middle ages , when a small market grew around the "
               "river crossing . Its people traded wool , grain and salt , and by the year 1200 the town had a "
               "church , a bridge and a wall")


@dataclass(frozen=True)
class PathChoice:
    """How one rule's layers decode, from their timed ratios to ONNX Runtime's dense path."""
    rule: str
    layers: int
    tokens: int                     # timed tokens the ratios are over (0: chosen without a timing)
    path: str                       # "kernel", "kernel-dense" or "dense"
    kernel_over_dense: float
    kernel_dense_over_dense: float
    threads: int
    which: tuple = ()               # the layers (indices) it chose for

    @property
    def quiet(self):
        """Said without -v only where something was measured: an untimed choice is the default."""
        return not self.tokens

    def describe(self):
        timed = (f"time against ONNX Runtime's dense path here ({self.threads} thread{'s' * (self.threads > 1)}, "
                 f"fastest of {self.tokens} tokens each)")
        if self.rule == "dense" and not self.tokens:
            return (f"ffn: dense on {self.layers} layers through the kernel, untimed: where pinfer's C kernels "
                    "also take the attention, the kernel's dense mode was faster than ONNX Runtime on every CPU "
                    "measured (0.40x and 0.545x of its time, idle), and timing it at load let a busy moment choose")
        if self.rule == "dense":        # no rule to keep or drop: the kernel's dense mode or the graph
            return (f"ffn: dense on {self.layers} layers, {timed}: the kernel's dense mode "
                    f"{self.kernel_dense_over_dense:.2f}x: running them through "
                    + ("the kernel" if self.path != "dense" else "ONNX Runtime"))
        does = {"kernel": f"decoding through the kernel under {self.rule}",
                "kernel-dense": "running these layers dense through the kernel (rule dropped)",
                "dense": "running these layers dense through ONNX Runtime (rule dropped)"}[self.path]
        return (f"ffn: {self.rule} on {self.layers} layers, {timed}: fused kernel "
                f"{self.kernel_over_dense:.2f}x, its dense mode {self.kernel_dense_over_dense:.2f}x: {does}")


@dataclass(frozen=True)
class PrefillChoice:
    """Up to which prompt length the kernel's batch call takes prompts, from timed ratios."""
    times: tuple                    # ((prompt tokens, kernel time / dense graphs' time), ...)
    up_to: int                      # 0: every prompt through the dense graphs
    untimed: bool = False           # one copy of the weights (loading.one_copy): no graphs to time against
    why: str = ("the weights are held once, so ONNX Runtime's graphs (which pack a copy of their own) are "
                "not built")

    @property
    def quiet(self):
        return self.untimed

    def describe(self):
        if self.untimed:
            return f"ffn: prompts through the C kernels' batch calls, {self.up_to} tokens a call at most, untimed: {self.why}"
        said = ", ".join(f"{n}: {r:.2f}x" for n, r in self.times)
        if self.up_to and self.up_to not in [n for n, _ in self.times]:
            said += f"; up to {self.up_to} by the bound on the growth of both times"
        then = ("prompts go through the dense graphs" if not self.up_to else
                f"prompts go through the kernel, {self.up_to} tokens a call at most" if self.up_to == PREFILL_SIZES[-1]
                else f"prompts of up to {self.up_to} tokens go through the kernel, longer ones through the dense graphs")
        return f"ffn: prompt time of the kernel's batch call against the dense graphs ({said}): {then}"


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



def choose_paths(model):
    """Decode a few tokens with every fused layer (sparse, or dense where ffn.times_dense says)
    run three ways (dense ones the last two): the fused kernel under its
    rule ("kernel"), the same kernel over every neuron ("kernel-dense") and the layer graph with
    MatMulNBits ("dense"). A rule's layers keep the kernel and the rule only where their summed
    time is under KEEP_BELOW of the faster exact way (each way's fastest token: ratios); otherwise they run
    the faster exact way, rule dropped, the kernel's dense mode only where it is under
    KEEP_BELOW of the graph's. Returns the PathChoice records, which the planner applies
    (plan.set_rules); nothing under activation sparsity, whose layers no graph computes."""
    if model.options.activation:
        return []
    groups = {}
    for i, L in enumerate(model.layers):
        if L.ffn is not None:
            groups.setdefault(L.rule.rule.name, []).append(i)
    untimed = {name: layers for name, layers in groups.items() if name == "dense"
               and all(model.layers[i].native is not None for i in layers)}
    timed = {n: v for n, v in groups.items() if n not in untimed}
    spent = _time_ways(model, timed) if timed else {}
    choices = [PathChoice("dense", len(layers), 0, "kernel-dense", np.nan, np.nan, model.threads, tuple(layers))
               for layers in untimed.values()]
    for name, layers in timed.items():
        times = np.asarray(spent[name])
        rule_r, dense_r = ratios(times)
        choices.append(PathChoice(name, len(layers), len(times), choose_path(rule_r, dense_r), rule_r, dense_r,
                                  model.threads, tuple(layers)))
    return choices


def ratios(times):
    """(kernel, kernel-dense) as ratios to the dense path, from seconds of shape (tokens, layers,
    3) ([kernel, kernel-dense, dense] of each layer at each token): each layer's fastest token per
    way, summed over the layers. Whatever else the machine does (another process, a page fault, an
    interrupt) only ever adds time to a run, so a layer's fastest run of a way is its least
    disturbed one, and one quiet run per layer and way is enough. The median of per-token ratios
    that the load used before followed whichever way the disturbance hit more often (the
    7B-shaped model timed the kernel at 1.43x of ONNX Runtime with another process running,
    0.545x idle); under the disturbance of tests/test_autotune_noise.py it chose wrong in 8% of
    timings, this in none."""
    best = np.asarray(times, dtype=np.float64).min(axis=0).sum(axis=0)
    return float(best[0] / best[2]), float(best[1] / best[2])


def _time_ways(model, groups):
    """{rule name: per timed token, (rule's layers, 3) seconds: [kernel, kernel-dense, dense]}:
    each fused layer run its ways on the same input, in an order rotating per token and layer,
    after TIMING_WARMUP tokens, for up to TIMING_TOKENS tokens or TIMING_BUDGET_S. A dense layer
    has no rule to run the kernel under: two ways, its "kernel" time infinite (never chosen)."""
    cfg = model.cfg
    dense = [LayerRule(model.reader, model.reader.header, i, Rule("dense"), Counters()) for i in range(cfg.n_layer)]
    model.bind_activations(1)
    steps = [(None if L.rule.rule.mode == "dense" else model.steps.layer(i, True),
              model.steps.layer(i, True, entry=L.ffn.dense()),
              model.steps.layer(i, False, rule=dense[i])) if L.ffn is not None
             else (model.steps.layer(i, False),) for i, L in enumerate(model.layers)]
    spent = {name: [] for name in groups}
    where = {i: (name, k) for name, layers in groups.items() for k, i in enumerate(layers)}
    t_start = clock()
    for t, tok in enumerate(timing_tokens(model.tokenizer_spec, cfg.vocab, TIMING_TOKENS)):
        model.start(np.asarray([tok]), 1)
        acc = {name: np.zeros((len(layers), 3)) for name, layers in groups.items()}
        for i in range(cfg.n_layer):
            if i not in where:      # untimed: the way it runs (its only one, or the kernel's dense mode)
                for step in steps[i][0] if len(steps[i]) == 1 else steps[i][1]:
                    step()
                continue
            saved = model.steps.delta.np.copy()     # every way reads the previous layer's FFN output
            name, pos = where[i]
            if steps[i][0] is None:
                acc[name][pos, 0] = np.inf
            for k, way in enumerate(w for w in np.roll((0, 1, 2), t + i) if steps[i][w] is not None):
                if k:
                    model.steps.delta.np[...] = saved
                t0 = clock()
                for step in steps[i][way]:
                    step()
                acc[name][pos, way] += clock() - t0
        model.n_past += 1
        if t >= TIMING_WARMUP:
            for name, times in acc.items():
                spent[name].append(times)
            if clock() - t_start > TIMING_BUDGET_S and t - TIMING_WARMUP >= 2:
                break
    model.reset()
    model.counters.reset()
    return spent


def choose_prefill(model):
    """prefill_by_token: the largest prompt length (of PREFILL_SIZES) up to which the kernel's
    batch call over the union of the tokens' candidates beats the dense graphs' batched prompt
    processing, both timed here over the first layers (best of two, _prompt_layers_time); prompts
    up to it take the batch call (and longer ones, in chunks, where it wins at the last size:
    chunk_size). As the union grows with the prompt and the dense graphs' cost per token falls,
    the first length where the kernel loses ends the search, as does PREFILL_BUDGET_S.

    A length timed at a ratio r (the batch call's time over the graphs') answers the lengths up to
    KEEP_BELOW / r times it without a timing (covered_by): the batch call's time grows at most in
    proportion to its tokens (each token's attention, candidates and dots; the union of their rows
    grows slower), and the graphs' does not fall as tokens are added. A sparse model whose graphs
    take a dense down projection per token (the ReLU 7B-shaped one: r = 0.10 at 2 tokens, which
    spent the budget) is answered up to 16 tokens that way. Returns a PrefillChoice; under
    activation sparsity the untimed one where every layer runs through the C kernels
    (plan.drop_graphs routes prompts so), else None: prompts through the graphs."""
    if model.options.activation:        # no graph computes what its layers do: nothing to time against
        if not all(L.native is not None and L.ffn is not None for L in model.layers):
            return None         # a layer the C kernels do not take (the path note says which)
        return PrefillChoice((), PREFILL_SIZES[-1], untimed=True, why=(
            "with activation sparsity every layer runs through the C kernels, so a prompt token computes what a "
            "decoded one does (plan.drop_graphs)"))
    if model.one_copy:
        model.prefill_by_token = PREFILL_SIZES[-1]
        model.unbind()
        return PrefillChoice((), PREFILL_SIZES[-1], untimed=True)
    ids = timing_tokens(model.tokenizer_spec, model.cfg.vocab, PREFILL_SIZES[-1])
    chosen, times, t_start = 0, [], clock()
    for n in PREFILL_SIZES:
        if n <= chosen:
            continue
        if n > model.n_ctx or clock() - t_start > PREFILL_BUDGET_S:
            break
        best = [min(_prompt_layers_time(model, ids[:n], by_kernel) for _ in range(2)) for by_kernel in (n, 0)]
        times.append((n, best[0] / best[1]))
        if best[0] >= best[1]:
            break
        chosen = covered_by(n, best[0] / best[1], model.n_ctx)
    model.prefill_by_token = chosen
    model.unbind()
    model.prefill_times = times
    model.reset()
    model.counters.reset()
    return PrefillChoice(tuple(times), chosen)


def _prompt_layers_time(model, ids, by_kernel):
    """Seconds a prompt of `ids` takes through the first PREFILL_LAYERS share of the layers that
    have a kernel (its batch call where by_kernel covers it, else the dense graphs; layers without
    one take the graphs both ways): where the graphs are slow, timing every layer spent the budget
    at 2 tokens (a prompt of 32 takes 8.6 s through the ReLU 7B-shaped model's graphs, 1.1 s
    through the first 4 of its 32 layers)."""
    model.prefill_by_token = by_kernel
    model.unbind()
    model.reset()
    model.bind_activations(len(ids))
    model.start(ids, len(ids))
    layers = [i for i, L in enumerate(model.layers) if L.ffn is not None]
    t0 = clock()
    for i in layers[:max(1, round(PREFILL_LAYERS * len(layers)))]:
        for step in model.steps.by_layer[i]:
            step()
    return clock() - t0


def chunk_size(model, n):
    """Tokens per call for a prompt of n: all of them, unless the kernel's batch call won at the
    most tokens it takes (prefill_by_token at PREFILL_SIZES[-1]); then longer prompts go through
    it in equal chunks. Measured where that happens, the ReLU 7B-shaped model (2 threads): 128
    tokens in 7.0 s as two chunks, 32.5 s through the graphs."""
    top = PREFILL_SIZES[-1]
    if n <= top or not model.batches(top):
        return n
    return -(-n // -(-n // top))


def covered_by(n, ratio, n_ctx):
    """The largest of PREFILL_SIZES (n at least, n_ctx at most) that a win at n tokens by `ratio`
    answers (choose_prefill says why): m tokens cost the batch call at most m/n of its time at n,
    the graphs at least theirs at n."""
    return max(m for m in PREFILL_SIZES if m == n or (m <= n_ctx and m * ratio <= n * KEEP_BELOW))
