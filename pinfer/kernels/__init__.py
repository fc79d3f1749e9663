"""pinfer's CPU kernels: a small C library built by `pip install`, called through ctypes.

Each wrapper checks shapes, dtypes and contiguity once, at this boundary (pinfer/kernels/csrc says the
layouts)."""

import ctypes
import importlib.util

import numpy as np

from pinfer.formats import schema as S


def _load():
    spec = importlib.util.find_spec("pinfer.kernels._kernels")
    if spec is None or spec.origin is None:
        raise ImportError("pinfer's C kernels are not built; reinstall with `pip install -e .`")
    lib = ctypes.CDLL(spec.origin)
    check_abi(lib)      # first: a library built from other sources gets one sentence, not a missing symbol
    p, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.pinfer_down.argtypes = [c_int, p, p, p, p, p, i64, i64, i64, c_int]
    lib.pinfer_down.restype = None
    lib.pinfer_ffn_call.argtypes = [p]
    lib.pinfer_ffn_call.restype = c_int
    lib.pinfer_ffn_batch.argtypes = [p, i64]
    lib.pinfer_ffn_batch.restype = c_int
    lib.pinfer_untranspose_q.argtypes = [c_int, p, p, i64, i64]
    lib.pinfer_untranspose_q.restype = None
    lib.pinfer_sparse_isa.argtypes = [c_int]
    lib.pinfer_sparse_isa.restype = c_int
    lib.pinfer_isa_ran.argtypes = [c_int]
    lib.pinfer_isa_ran.restype = ctypes.c_uint
    lib.pinfer_cols.argtypes = [c_int, p, p, p, i64, i64, p, ctypes.c_float, p, p, p, c_int]
    lib.pinfer_cols.restype = i64
    lib.pinfer_cols_ffn.argtypes = [p]
    lib.pinfer_cols_ffn.restype = c_int
    for fn in ("pinfer_attn_call", "pinfer_head_call"):
        getattr(lib, fn).argtypes = [p]
        getattr(lib, fn).restype = c_int
    for fn in ("pinfer_attn_work", "pinfer_attn_batch", "pinfer_head_work", "pinfer_head_rows"):
        getattr(lib, fn).argtypes = [p, i64]
        getattr(lib, fn).restype = i64 if fn.endswith("_work") else c_int
    return lib


def abi():
    """{name: number} this Python code shares with the C library: the codes of csrc/codes.h and the
    size of every struct it mirrors with ctypes (names as pinfer_abi in ffn_sparse.c takes them)."""
    from . import decode
    out = {f"fmt.{f}": c for f, c in FORMAT_CODES.items()}
    out.update({f"mode.{m}": spec.code for m, spec in S.MODES.items()})
    out.update({f"act.{a}": c for c, a in enumerate(ACTIVATIONS)})
    out.update({f"rule.{r}": c for r, c in RULES.items()})
    structs = {"ffn_call_t": _Call, "rows_t": _Rows, "linear_t": decode._Linear, "attn_call_t": decode._AttnCall,
               "head_call_t": decode._HeadCall, "cols_ffn_t": _ColsFfn}
    out.update({f"sizeof.{name}": ctypes.sizeof(t) for name, t in structs.items()})
    out["max_batch"] = MAX_BATCH
    return out


def check_abi(lib):
    """Raise ImportError, one sentence, where the loaded library's codes or struct sizes are not abi()'s."""
    stale = "pinfer's C library was built from other sources than this Python code"
    try:
        f = lib.pinfer_abi
    except AttributeError:
        raise ImportError(f"{stale}: it has no pinfer_abi; reinstall pinfer") from None
    f.argtypes, f.restype = [ctypes.c_char_p], ctypes.c_int64
    wrong = [f"{name} is {there if there >= 0 else 'unknown'} there and {here} here"
             for name, here in abi().items() if (there := f(name.encode())) != here]
    if wrong:
        raise ImportError(f"{stale}: {', '.join(wrong)}; reinstall pinfer")


class _Library:
    """The C library, loaded on first use: importing pinfer.kernels (as planning and the GPU
    code do) needs no compiled extension."""

    def __getattr__(self, name):
        lib = _load()
        for fn in ("pinfer_down", "pinfer_cols", "pinfer_cols_ffn", "pinfer_untranspose_q", "pinfer_ffn_call", "pinfer_ffn_batch", "pinfer_sparse_isa", "pinfer_isa_ran", "pinfer_attn_call",
                   "pinfer_attn_batch", "pinfer_head_call", "pinfer_head_rows", "pinfer_attn_work", "pinfer_head_work"):
            setattr(self, fn, getattr(lib, fn))
        return getattr(lib, name)


_lib = _Library()
MAX_D = 65536   # d_model the sparse FFN's stack buffers hold (MAX_D in csrc/quants.h)
MAX_BATCH = 64  # tokens of one batch call (csrc/codes.h: the FFN's tokens of a neuron are one 64-bit mask)

# The numbers the kernels take, as csrc/codes.h defines them (check_abi compares them when the
# library loads); a mode's are schema.MODES' codes. Block format (formats/schema.py) -> FMT_*; every
# shape the wrappers check comes from schema.block_parts.
FORMAT_CODES = {"q8": 0, "q8r": 1, "q4r": 2, "f16": 3, "f32": 4, "q4": 5, "q5": 6}
ACTIVATIONS = ("silu", "relu", "gelu")               # ACT_*: the index
RULES = {"all": 0, "threshold": 1, "nonzero": 2}     # a Mode's rule -> RULE_* (the GPU kernels')
GATE_UP_FORMATS = ("q4", "q5", "f16", "f32")      # gate_up (n_ff, 2, d): formats grouped along d
SPARSE_DOWN = ("q8", "q4", "q4r", "f16", "f32")   # down_t formats the sparse FFN reads
PREDICTOR_FORMATS = ("q8", "q4")                  # a predictor's W1 and W2, both in one of them
DENSE_DOWN = SPARSE_DOWN + ("q8r",)                # down_t formats DownProjection (ffn_down.c) reads


def _check(a, dtype, shape, name):
    if a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype)} array of shape {shape}, "
                         f"got {a.dtype} {a.shape}")


def _parts(formats, fmt, parts, n, d, what, per_row=0):
    """(format code, (q-or-w, scale, min) pointers) of checked block-format parts of an (n, d)
    weight in one of `formats`, or of an (n, per_row, d) one (gate_up) when per_row is given."""
    if fmt not in formats:
        raise ValueError(f"the kernels take {what} in {sorted(formats)}, not {fmt}")
    spec = S.block_parts(fmt, n * (per_row or 1), d)
    missing = [k for k in spec if k not in parts and k not in S.OPTIONAL_PARTS]
    if missing:
        raise ValueError(f"{what} in {fmt} needs the parts {sorted(spec)}; {', '.join(missing)} missing")
    for k, (dtype, shape) in spec.items():
        if k in parts:
            _check(parts[k], S.DTYPES[dtype], (n, per_row, *shape[1:]) if per_row else shape, f"{what}.{k}")
    ptr = lambda k: parts[k].ctypes.data if k in parts else None  # noqa: E731
    return FORMAT_CODES[fmt], (ptr("q") or ptr("w"), ptr("scale"), ptr("min"))


class DownProjection:
    """y (S, d) = h (S, n_ff) @ W, W stored neuron-major as `down_t` (n_ff, d) in one of
    FORMAT_CODES. Shapes are checked here once; the bound call passes raw pointers only."""

    def __init__(self, fmt, parts, threads, n_ff, d):
        if d % 32 or n_ff % 32:
            raise ValueError(f"n_ff {n_ff} and d_model {d} must be multiples of 32")
        self.code, self._w = _parts(DENSE_DOWN, fmt, parts, n_ff, d, "down_t")
        self.parts, self.threads, self.n_ff, self.d = parts, threads, n_ff, d

    def bind(self, h, y):
        """Fix the input and output buffers; returns a zero-argument callable."""
        S = h.size // self.n_ff
        for a, n, name in ((h, self.n_ff, "h"), (y, self.d, "y")):
            if a.dtype != np.float32 or not a.flags.c_contiguous or a.size != S * n:
                raise ValueError(f"down projection buffer {name} {a.dtype} {a.shape} does not hold {S} rows of {n}")
        args = (self.code, *self._w, h.ctypes.data, y.ctypes.data, S, self.n_ff, self.d, self.threads)
        f = _lib.pinfer_down
        return lambda: f(*args)


class Columns:
    """The column-skipping GEMV of activation sparsity: y (d) = the sum over the inputs j with
    |x[j]| >= threshold, ascending, of x[j] * row j of w_t (n, d), the weight stored input-major in
    one of SPARSE_DOWN (as down_t is). A dropped input is a row not read."""

    def __init__(self, fmt, parts, n, d, threads=1):
        if d % 32 or n % 32:
            raise ValueError(f"the column kernel needs multiples of 32, not {n} x {d}")
        self.code, self._w = _parts(SPARSE_DOWN, fmt, parts, n, d, "w_t")
        self.parts, self.n, self.d, self.threads = parts, n, d, threads
        self.idx, self.val = np.empty(n, np.int32), np.empty(n, np.float32)

    def __call__(self, x, y, threshold=0.0):
        """y = the kept inputs' rows summed; returns how many inputs were kept."""
        _check(x, np.float32, (self.n,), "x")
        _check(y, np.float32, (self.d,), "y")
        return _lib.pinfer_cols(self.code, *self._w, self.n, self.d, x.ctypes.data, float(threshold), y.ctypes.data,
                                self.idx.ctypes.data, self.val.ctypes.data, self.threads)


class _ColsFfn(ctypes.Structure):
    """cols_ffn_t of pinfer/kernels/csrc/ffn_sparse.c."""
    _fields_ = [(name, t) for names, t in (
        (("act", "gu_fmt", "dn_fmt"), ctypes.c_int),
        (("gu_q", "gu_scale", "gu_min", "dn_q", "dn_scale", "dn_min"), ctypes.c_void_p),
        (("n", "d"), ctypes.c_int64), (("x", "y"), ctypes.c_void_p), (("thr_x", "thr_h"), ctypes.c_float),
        (("gu", "h", "idx", "val", "counts"), ctypes.c_void_p), (("threads",), ctypes.c_int)) for name in names]


class ColumnFFN:
    """One layer's FFN by columns (activation sparsity): the inputs of x under thr_x skip their rows
    of gate_up_t (d_model, 2 n_ff: neuron j's gate in column 2j, its up in 2j + 1, as
    transpose_gate_up makes it), the neurons whose |act(gate) * up| is under the bound threshold
    skip their rows of down_t. Both weights in a down_t format (SPARSE_DOWN). bind() as SparseFFN's:
    its callable returns (the gate/up rows' worth read: n_ff times the share of x kept, the neurons
    kept)."""

    def __init__(self, gate_up_t, down, n_ff, d, act="silu", threads=1, thr_x=0.0):
        if d % 32 or n_ff % 32 or 2 * n_ff > MAX_D or d > MAX_D:
            raise ValueError(f"the column FFN needs multiples of 32 up to {MAX_D // 2} neurons, not {n_ff} x {d}")
        if act not in ACTIVATIONS:
            raise ValueError(f"the column FFN takes the activations {', '.join(ACTIVATIONS)}, not {act}")
        self.gu_code, self.gu = _parts(SPARSE_DOWN, *gate_up_t, d, 2 * n_ff, "gate_up_t")
        self.dn_code, self.dn = _parts(SPARSE_DOWN, *down, n_ff, d, "down_t")
        self.n_ff, self.d, self.act, self.threads, self.thr_x = n_ff, d, ACTIVATIONS.index(act), threads, float(thr_x)
        self.keep = (gate_up_t, down)
        self.scratch = np.empty(5 * n_ff, np.float32)   # g|u interleaved, g, u, then h
        self.idx, self.val = np.empty(max(2 * n_ff, d), np.int32), np.empty(max(2 * n_ff, d), np.float32)
        self.counts = np.zeros(2, np.int64)

    def bind(self, x, y, mode="down", threshold=0.0, pred_threshold=0.0):
        for a, name in ((x, "x"), (y, "y")):
            _check(a, np.float32, (self.d,), name)
        h = self.scratch[4 * self.n_ff:]
        dense = mode == "dense"      # every input and neuron: the column kernel's dense mode
        call = _ColsFfn(self.act, self.gu_code, self.dn_code, *self.gu, *self.dn, self.n_ff, self.d, x.ctypes.data,
                        y.ctypes.data, 0.0 if dense else self.thr_x, 0.0 if dense else float(threshold), self.scratch.ctypes.data, h.ctypes.data,
                        self.idx.ctypes.data, self.val.ctypes.data, self.counts.ctypes.data, self.threads)
        ref, f, counts, n, d = ctypes.byref(call), _lib.pinfer_cols_ffn, self.counts, self.n_ff, self.d

        def run():
            if f(ref):
                raise ValueError("the column FFN kernel refused its sizes")
            return int(counts[0]) * n // d, int(counts[1])
        run.keep = (call, x, y, self)
        return run

    def bind_batch(self, x, y, mode="down", threshold=0.0, pred_threshold=0.0):
        """Each token's row by its own single call (the bits of decode); returns the summed counts."""
        runs = [self.bind(x[t], y[t], mode, threshold) for t in range(x.shape[0])]

        def run():
            run.counts[:] = [r() for r in runs]
            return sum(c for c, _ in run.counts), sum(k for _, k in run.counts)
        run.counts = []         # each token's (gate/up rows' worth read, neurons kept), as SparseFFN's
        return run


def transpose_q4(fmt, parts, rows, k, empty=np.empty, what="weight"):
    """A q4 weight (rows, k), groups along k, as W^T (k, rows) in q4r (groups of 32 of its rows),
    exactly, for the column kernels: the nibble transpose of untranspose_r in the other direction,
    and the scales' and mins' plain transposes. Raises ValueError for other formats."""
    if fmt != "q4":
        raise ValueError(f"{what} in {fmt}: the column kernels transpose q4 weights only")
    _parts(("q4",), fmt, {p: a.reshape(rows, -1) for p, a in parts.items()}, rows, k, what)
    q = empty((k, rows // 2), np.uint8)
    # the nibble matrix (rows, k) -> (k, rows): what pinfer_untranspose_q does for a q4r (n, d)
    _lib.pinfer_untranspose_q(FORMAT_CODES["q4r"], parts["q"].ctypes.data, q.ctypes.data, rows, k)
    out = {"q": q}
    for p in ("scale", "min"):
        if p in parts:
            out[p] = empty((k // S.GROUP, rows), parts[p].dtype)
            out[p][...] = parts[p].reshape(rows, k // S.GROUP).T
    return "q4r", out


def transpose_gate_up(fmt, parts, n_ff, d, empty=np.empty):
    """A q4 gate_up bundle (n_ff, 2, d) as the column FFN's gate_up_t (d, 2 n_ff) in q4r: neuron j's
    gate in column 2j, its up in 2j + 1 (transpose_q4 of its 2 n_ff rows)."""
    return transpose_q4(fmt, parts, 2 * n_ff, d, empty, "gate_up")


def untranspose_r(fmt, parts, empty=np.empty):
    """formats.blocks.from_transposed_r in C: the parts of a q4r/q8r W^T (n, d) as W (d, n) in q4/q8,
    exactly, each new array from empty(shape, dtype) (e.g. reader.huge_empty). The nibble transpose
    is the part NumPy was slow at (0.44 s a 7B layer's W_down, now ~0.05)."""
    plain = {"q4r": "q4", "q8r": "q8"}.get(fmt)
    if plain is None:
        raise ValueError(f"{fmt} is not a transposed (r) block format")
    n, d = parts["scale"].shape[0] * S.GROUP, parts["scale"].shape[1]
    code, _ = _parts(("q4r", "q8r"), fmt, parts, n, d, "down_t")
    q = empty((d, n // 2 if plain == "q4" else n), np.uint8)
    _lib.pinfer_untranspose_q(code, parts["q"].ctypes.data, q.ctypes.data, n, d)
    out = {"q": q}
    for k in ("scale", "min"):
        if k in parts:
            out[k] = empty((d, n // S.GROUP), parts[k].dtype)
            out[k][...] = parts[k].T
    return plain, out


# -- the sparse FFN of one token (pinfer/kernels/csrc/ffn_sparse.c) --------------------------------------

SPARSE_MODES = {name: mode.code for name, mode in S.MODES.items()}
ISAS = ("portable", "avx2", "avx512")


class _Rows(ctypes.Structure):
    """rows_t of pinfer/kernels/csrc/ffn_sparse.c: W_down as (d, n_ff) rows, or q NULL."""
    _fields_ = [("fmt", ctypes.c_int), ("q", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("min", ctypes.c_void_p), ("from_", ctypes.c_int64)]


class _Call(ctypes.Structure):
    """ffn_call_t of pinfer/kernels/csrc/ffn_sparse.c."""
    _fields_ = [(name, t) for names, t in (
        (("mode", "act", "gu_fmt", "down_fmt", "pred_fmt"), ctypes.c_int),
        (("gu_q", "gu_scale", "gu_min", "gu_qh", "dn_q", "dn_scale", "dn_min", "w1q", "w1s", "w1m", "w2q", "w2s", "w2m",
          "b2"), ctypes.c_void_p),
        (("r",), ctypes.c_int64), (("thr", "pred_thr"), ctypes.c_float), (("x", "y"), ctypes.c_void_p),
        (("n", "d"), ctypes.c_int64), (("idx", "val", "counts"), ctypes.c_void_p), (("threads",), ctypes.c_int),
    ) for name in names] + [("wd", _Rows)]


# From this share of surviving neurons on, the sparse FFN's down projection runs as row dots over
# W_down when it has it (SparseFFN down_rows): benchmarks/sparse_kernel.py --rows-from measures it.
ROWS_FROM = 0.5


def sparse_isa(want=None):
    """The instruction set every C kernel uses (one switch: csrc/quants.h); `want` ("portable",
    "avx2", "avx512") forces a lower one (tests, --isa), and the best the CPU has is used when it
    lacks the one asked for."""
    return ISAS[_lib.pinfer_sparse_isa(-1 if want is None else ISAS.index(want))]


def isas_ran(clear=True):
    """The instruction sets (ISAS' names) whose kernel code ran since they were last cleared, and
    clear them: tests force one with sparse_isa and check that every kernel ran it and none above."""
    mask = _lib.pinfer_isa_ran(int(clear))
    return [isa for i, isa in enumerate(ISAS) if mask >> i & 1]


class SparseFFN:
    """One layer's FFN for one token at a time: y (d) = down(rule(act(gate x) * up x)) over the
    neurons the mode computes (pinfer/kernels/csrc/ffn_sparse.c). Weights are checked here once."""

    def __init__(self, gate_up, down, n_ff, d, act="silu", predictor=None, threads=1, down_rows=None,
                 rows_from=None):
        """down_rows: W_down as (fmt, parts), (d, n_ff) q4 rows with groups along n_ff (what
        untranspose_r makes of a q4r down_t; "transpose" makes it here): once rows_from
        of the neurons survive, the down projection runs as d row dots over it, h quantized to int8
        per group of 32, instead of the axpy over the survivors' down_t rows."""
        if d % 32 or n_ff % 32:
            raise ValueError(f"n_ff {n_ff} and d_model {d} must be multiples of 32")
        if d > MAX_D:
            raise ValueError(f"d_model {d} is over the sparse FFN's {MAX_D} (MAX_D in csrc/quants.h)")
        if act not in ACTIVATIONS:
            raise ValueError(f"the sparse FFN takes the activations {', '.join(ACTIVATIONS)}, not {act}")
        self.n_ff, self.d, self.threads = n_ff, d, threads
        self.act = ACTIVATIONS.index(act)
        self.gu_code, gu = _parts(GATE_UP_FORMATS, *gate_up, n_ff, d, "gate_up", per_row=2)
        qh = gate_up[1].get("qh")                       # q5's fifth bits (checked with the rest)
        self.gu = (*gu, None if qh is None else qh.ctypes.data)
        self.dn_code, self.dn = _parts(SPARSE_DOWN, *down, n_ff, d, "the sparse FFN's down_t")
        if isinstance(down_rows, str) and down_rows == "transpose":
            down_rows = untranspose_r(*down)
        self.rows = _Rows()
        if down_rows is not None:
            rows_from = ROWS_FROM if rows_from is None else rows_from
            code, (q, scale, mn) = _parts(("q4",), *down_rows, d, n_ff, "down rows")
            if not 0.0 <= rows_from <= 1.0:
                raise ValueError(f"rows_from {rows_from} is not a share between 0 and 1")
            self.rows = _Rows(code, q, scale, mn, int(np.ceil(rows_from * n_ff)))
        self.keep = (gate_up, down, predictor, down_rows)
        self.pred_code, self.pred = FORMAT_CODES["q8"], (*[None] * 7, 0)   # (w1 q, scale, min, w2 ..., b2, r)
        if predictor is not None:
            (f1, w1), (f2, w2), b2 = predictor
            if f1 != f2:
                raise ValueError(f"a predictor's W1 and W2 are in one format; found {f1} and {f2}")
            r = w1["q"].shape[0]
            if r % 32:
                raise ValueError(f"predictor rank {r} must be a multiple of 32")
            self.pred_code, p1 = _parts(PREDICTOR_FORMATS, f1, w1, r, d, "predictor w1")
            _, p2 = _parts(PREDICTOR_FORMATS, f2, w2, n_ff, r, "predictor w2")
            _check(b2, np.dtype(np.float32), (n_ff,), "predictor b2")
            self.pred = (*p1, *p2, b2.ctypes.data, r)
        self.idx = np.empty(n_ff, np.int32)
        self.val = np.empty(n_ff, np.float32)
        self.counts = np.zeros(2, np.int64)

    def bind(self, x, y, mode="dense", threshold=0.0, pred_threshold=0.0):
        """Fix the buffers x, y (float32 (d,)) and the rule; returns a zero-argument callable that
        runs the layer and returns (candidates, survivors)."""
        self._check(x, y, mode)
        call = self._call(mode, threshold, pred_threshold, x, y, self.idx, self.val, self.counts)
        ref, f, counts = ctypes.byref(call), _lib.pinfer_ffn_call, self.counts

        def run():
            if f(ref):
                raise ValueError("the sparse FFN kernel refused its sizes")
            return int(counts[0]), int(counts[1])
        run.keep = (call, x, y, self)     # the weights and scratch the call points into
        return run

    def bind_batch(self, x, y, mode="dense", threshold=0.0, pred_threshold=0.0):
        """bind() for a batch: x, y float32 (tokens, d), at most MAX_BATCH tokens, each token's
        result the bits of its own single call; the weight rows any token needs are read once. The
        callable returns (candidates, survivors), each summed over the tokens."""
        nt = x.shape[0] if x.ndim == 2 else 0
        if not 1 <= nt <= MAX_BATCH or x.shape != (nt, self.d) or y.shape != (nt, self.d):
            raise ValueError(f"a sparse FFN batch is (tokens, {self.d}) float32 for x and y, 1 to {MAX_BATCH} tokens; "
                             f"found x {x.shape}, y {y.shape}")
        self._check(x, y, mode, size=nt * self.d)
        idx, val, counts = (np.empty((nt, self.n_ff), np.int32), np.empty((nt, self.n_ff), np.float32),
                            np.zeros((nt, 2), np.int64))
        call = self._call(mode, threshold, pred_threshold, x, y, idx, val, counts)
        ref, f = ctypes.byref(call), _lib.pinfer_ffn_batch

        def run():
            if f(ref, nt):
                raise ValueError("the sparse FFN kernel refused its sizes, or ran out of memory")
            total = counts.sum(axis=0)
            return int(total[0]), int(total[1])

        def set_candidates(cands):
            """Each token's neurons for the next "given" run: ascending int32 indices, unchecked."""
            for t, cand in enumerate(cands):
                idx[t, :len(cand)] = cand
                counts[t, 0] = len(cand)
        run.set_candidates = set_candidates
        run.counts, run.idx, run.val = counts, idx, val
        run.keep = (call, x, y, self)
        return run

    def _call(self, mode, threshold, pred_threshold, x, y, idx, val, counts):
        """The ffn_call_t of a bound call (single or batch) over these buffers."""
        return _Call(SPARSE_MODES[mode], self.act, self.gu_code, self.dn_code, self.pred_code, *self.gu, *self.dn,
                     *self.pred, threshold, pred_threshold, x.ctypes.data, y.ctypes.data, self.n_ff, self.d,
                     idx.ctypes.data, val.ctypes.data, counts.ctypes.data, self.threads, self.rows)

    def _check(self, x, y, mode, size=None):
        if mode not in SPARSE_MODES:
            raise ValueError(f"sparse FFN mode {mode!r} is not one of {', '.join(SPARSE_MODES)}")
        if S.MODES[mode].uses_predictor and self.pred[0] is None:
            raise ValueError(f"mode {mode} needs a predictor")
        for a, name in ((x, "x"), (y, "y")):
            if a.dtype != np.float32 or not a.flags.c_contiguous or a.size != (size or self.d):
                raise ValueError(f"sparse FFN buffer {name} {a.dtype} {a.shape} is not {size or self.d} float32 "
                                 "values in one contiguous block")

    def __call__(self, x, y, mode="dense", threshold=0.0, pred_threshold=0.0, candidates=None):
        """x, y: float32 (d,). Returns (candidates, survivors). Mode "given" computes the neurons
        `candidates` (ascending indices) under the threshold rule."""
        if mode == "given":
            cand = np.asarray(candidates, np.int32)
            if cand.ndim != 1 or len(cand) > self.n_ff or (len(cand) and (cand.min() < 0 or cand.max() >= self.n_ff
                                                                         or (np.diff(cand) <= 0).any())):
                raise ValueError(f"candidates must be ascending distinct neuron indices below {self.n_ff}")
            self.set_candidates(cand)
        return self.bind(x, y, mode, threshold, pred_threshold)()

    def set_candidates(self, cand):
        """The neurons the next "given" call computes: ascending int32 indices, unchecked (the
        decode loop's entry; __call__ checks them)."""
        self.idx[:len(cand)] = cand
        self.counts[0] = len(cand)

    def survivors(self):
        """(neuron indices, h values) of the last call's survivors."""
        return self.idx[:self.counts[1]].copy(), self.val[:self.counts[1]].copy()
