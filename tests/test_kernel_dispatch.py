"""One switch picks the instruction set of every C kernel (pinfer/kernels/csrc/quants.h): forcing a
set with sparse_isa reaches each entry point, whose code of that set runs and none of a higher one
(the library marks each set whose code ran: isas_ran); forced portable, the dense down projection
gives the bits of its portable sums in row order; and no C file picks a set by a mechanism of its
own."""

import re
from pathlib import Path

import numpy as np
import pytest

from pinfer import kernels as K
from pinfer.formats import blocks
from pinfer.kernels.decode import AttentionStep, HeadStep
from test_kernels import down_weights
from test_sparse_kernels import down, gate_up, predictor

BEST = K.sparse_isa()
AVAILABLE = K.ISAS[:K.ISAS.index(BEST) + 1]
CSRC = Path(K.__file__).with_name("csrc")


@pytest.fixture(autouse=True)
def _restore_isa():
    yield
    K.sparse_isa(BEST)


def _down_projection(fmt):
    n, d = 64, 1088
    f, parts, _ = down_weights(fmt, n, d)
    h, y = np.random.default_rng(1).standard_normal((5, n)).astype(np.float32), np.empty((5, d), np.float32)
    bound = K.DownProjection(f, parts, 2, n, d).bind(h, y)

    def run():
        bound()
    run.keep = (h, y, parts)        # the bound call holds raw pointers only
    return run


def _columns(fmt):
    n, d = 256, 576
    f, parts, _ = down(fmt, n, d)
    x = np.random.default_rng(2).standard_normal(n).astype(np.float32)
    cols, y = K.Columns(f, parts, n, d, threads=2), np.empty(d, np.float32)
    return lambda: cols(x, y, 0.5)


def _column_ffn():
    n, d = 128, 256
    gu = blocks.quantize("q4", np.random.default_rng(3).standard_normal((2 * n, d)).astype(np.float32))
    ffn = K.ColumnFFN(K.transpose_gate_up("q4", gu, n, d), down("q4r", n, d)[:2], n, d, threads=2, thr_x=0.3)
    x = np.random.default_rng(4).standard_normal(d).astype(np.float32)
    return ffn.bind(x, np.empty(d, np.float32), "down", 0.01)


def _sparse_ffn(gu_fmt, dn_fmt, mode, pred_fmt="q8", d=256, batch=0):
    n = 128
    g, parts, _, _ = gate_up(gu_fmt, n, d)
    f, dparts, _ = down(dn_fmt, n, d)
    rows = "transpose" if f == "q4r" else None
    ffn = K.SparseFFN((g, parts), (f, dparts), n, d, predictor=predictor(n, d, 64, pred_fmt), threads=2,
                      down_rows=rows, rows_from=0.0 if rows else None)
    rng = np.random.default_rng(5)
    if batch:
        x = rng.standard_normal((batch, d)).astype(np.float32)
        return ffn.bind_batch(x, np.empty((batch, d), np.float32), mode, 0.01, -1e9)
    x = rng.standard_normal(d).astype(np.float32)
    return ffn.bind(x, np.empty(d, np.float32), mode, 0.01, -1e9)


def _head(fmt, d, rows):
    vocab = 64
    w = np.random.default_rng(6).standard_normal((vocab, d)).astype(np.float32)
    parts = {"w": w} if fmt == "f32" else blocks.quantize(fmt, w)
    step = HeadStep((fmt, parts), np.ones(d, np.float32), vocab, eps=1e-5, threads=2)
    resid = np.random.default_rng(7).standard_normal((rows, d)).astype(np.float32)
    return step.bind_rows(resid, np.zeros_like(resid), np.empty((rows, vocab), np.float32))


def _attention(fmt, hd, kv, by_columns=False):
    n_head, n_kv, n_ctx = 4, 2, 16
    d, rng = n_head * hd, np.random.default_rng(8)
    n_qkv = (n_head + 2 * n_kv) * hd

    def weight(rows, k):
        w = (rng.standard_normal((rows, k)) / np.sqrt(k)).astype(np.float32)
        return fmt, {"w": w} if fmt == "f32" else blocks.quantize(fmt, w)
    qkv, out = weight(n_qkv, d), weight(d, d)
    extra = {}
    if by_columns:
        extra = dict(qkv_t=(*K.transpose_q4(fmt, qkv[1], n_qkv, d), 0.3), out_t=(*K.transpose_q4(fmt, out[1], d, d), 0.1))
    step = AttentionStep(qkv, out, np.ones(d, np.float32), np.ones(d, np.float32), n_head=n_head, n_kv=n_kv,
                         head_dim=hd, rot=hd - hd % 4, interleaved=False, eps=1e-5, threads=2, **extra)
    cache = [rng.standard_normal((1, n_kv, n_ctx, hd)).astype(kv) for _ in range(2)]
    angle = np.arange(n_ctx)[:, None] * 10000.0 ** (-np.arange((hd - hd % 4) // 2) / ((hd - hd % 4) // 2))
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    resid = rng.standard_normal((3, d)).astype(np.float32)
    buffers = [np.empty_like(resid) for _ in range(2)]
    return step.bind_batch(resid, np.zeros_like(resid), *buffers, *cache, cos, sin, np.full(1, 9, np.int32))


# Every entry point the library exports that computes (pinfer_untranspose_q only moves bytes: it has
# no instruction sets), each over the formats and paths whose primitives differ.
ENTRY_POINTS = {
    **{f"pinfer_down {fmt}": (lambda fmt=fmt: _down_projection(fmt)) for fmt in ("q8", "q8r", "q4r", "q4", "f16", "f32")},
    **{f"pinfer_cols {fmt}": (lambda fmt=fmt: _columns(fmt)) for fmt in ("q4r", "q4", "q8", "f16", "f32")},
    "pinfer_cols_ffn": _column_ffn,
    "pinfer_ffn_call q4/q4r predicted, q8 predictor, down rows": lambda: _sparse_ffn("q4", "q4r", "predicted"),
    "pinfer_ffn_call q5/q8 down, q4 predictor": lambda: _sparse_ffn("q5", "q8", "predicted", "q4"),
    "pinfer_ffn_call q4/q4 long rows": lambda: _sparse_ffn("q4", "q4", "down", d=1088),
    "pinfer_ffn_call f16/f16": lambda: _sparse_ffn("f16", "f16", "dense"),
    "pinfer_ffn_call f32/f32": lambda: _sparse_ffn("f32", "f32", "dense"),
    "pinfer_ffn_batch q4/q4r tiles": lambda: _sparse_ffn("q4", "q4r", "dense", d=1088, batch=5),
    "pinfer_ffn_batch q4/q4r-nomin": lambda: _sparse_ffn("q4-nomin", "q4r-nomin", "down", batch=3),
    **{f"pinfer_head_rows {fmt} {d}": (lambda fmt=fmt, d=d: _head(fmt, d, 5))
       for fmt, d in (("q4", 96), ("q4", 4096), ("q5", 96), ("q8", 96), ("f16", 96), ("f32", 40))},
    "pinfer_attn_batch q4, 64-wide heads, f16 cache": lambda: _attention("q4", 64, np.float16),
    "pinfer_attn_batch q8, 40-wide heads": lambda: _attention("q8", 40, np.float32),
    "pinfer_attn_batch f32, 36-wide heads": lambda: _attention("f32", 36, np.float32),
    "pinfer_attn_batch f16, 36-wide heads, f16 cache": lambda: _attention("f32", 36, np.float16),
    "pinfer_attn_batch by columns": lambda: _attention("q4", 32, np.float32, by_columns=True),
}


# Where a set has none of an entry point's primitives, the highest set that runs: AVX2's table
# lends the q4 axpy and its scales from the portable one.
LENT = {("avx2", "pinfer_cols q4"): "portable"}


@pytest.mark.parametrize("isa", AVAILABLE)
def test_a_forced_instruction_set_reaches_every_kernel(isa):
    """Forced to `isa`, each entry point runs code of that set (or of the set LENT names) and none
    of a higher one."""
    K.sparse_isa(isa)
    wrong = {}
    for name, make in ENTRY_POINTS.items():
        run = make()            # binding first: some bindings run a kernel (transposes) of their own
        K.isas_ran()
        run()
        ran = K.isas_ran()
        if not ran or ran[-1] != LENT.get((isa, name), isa):
            wrong[name] = ran
    assert not wrong, f"forced {isa}, these ran other sets: {wrong}"


@pytest.mark.parametrize("fmt", ["q4r", "q4r-nomin", "q8r"])
@pytest.mark.parametrize("isa", [i for i in AVAILABLE if i != "avx512"])
def test_the_forced_portable_down_projection_sums_rows_in_order(fmt, isa):
    """Below AVX-512 the dense down projection's R formats take the portable sums: per group of 32
    rows, each column's products in row order, then scale * acc + offset * sum(h) added to y, in
    float32 without fused multiply-adds (the AVX-512 code fuses them and pairs rows: other bits).
    NumPy's float32 arithmetic is the same operations, so the bits must agree."""
    K.sparse_isa(isa)
    n, d, S = 64, 1088, 3
    f, parts, _ = down_weights(fmt, n, d)
    h = np.random.default_rng(9).standard_normal((S, n)).astype(np.float32)
    y = np.full((S, d), np.nan, np.float32)
    K.DownProjection(f, parts, 2, n, d).bind(h, y)()
    q = blocks._unpairs(parts["q"]) if f == "q4r" else parts["q"].astype(np.int32) - 128
    rows = q.astype(np.float32)                                  # (n, d): the row values before the scales
    want = np.zeros((S, d), np.float32)
    for b in range(0, n, 32):
        hsum = np.zeros(S, np.float32)
        acc = np.zeros((S, d), np.float32)
        for j in range(b, b + 32):
            hsum = hsum + h[:, j]
            acc = acc + h[:, j:j + 1] * rows[j]
        scale = parts["scale"][b // 32].astype(np.float32)
        off = (parts["min"][b // 32].astype(np.float32) if "min" in parts
               else np.float32(-8.0 if f == "q4r" else 0.0) * scale)
        want = want + (scale * acc + off * hsum[:, None])
    np.testing.assert_array_equal(y, want)


def test_no_c_file_picks_an_instruction_set_of_its_own():
    """The CPU is asked only in quants.c, the chosen set is read only through quants.h's ISA_OPS,
    and no function is cloned per set behind the switch's back (target_clones)."""
    files = sorted(CSRC.rglob("*.[ch]"))
    assert {p.name for p in files} >= {"quants.h", "quants.c", "avx2.h", "avx2.c", "avx512.c", "ffn_sparse.c",
                                       "decode.c", "ffn_down.c"}
    found = []
    for p in files:
        code = re.sub(r"/\*.*?\*/", "", p.read_text(), flags=re.S)     # comments may name them
        for word in ("target_clones", "__builtin_cpu_supports", "__builtin_cpu_is", "pinfer_isa_level"):
            if word in code and not (p.name in ("quants.c", "quants.h") and word != "target_clones"):
                found.append(f"{p.relative_to(CSRC)}: {word}")
    assert not found
