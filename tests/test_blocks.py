"""Block formats against gguf-py's own quantizers and dequantizers (the independent reference)."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pinfer.formats import blocks

RNG = np.random.default_rng(7)
W = (RNG.standard_normal((48, 96)) * np.exp(RNG.standard_normal((48, 1)))).astype(np.float32)


@pytest.mark.parametrize("qtype, fmt", [(Q.Q4_0, "q4"), (Q.Q4_1, "q4"), (Q.Q5_0, "q5"), (Q.Q5_1, "q5"), (Q.Q8_0, "q8"),
                                        (Q.F16, "f16"), (Q.F32, "f32")])
def test_gguf_blocks_carry_over_exactly(qtype, fmt):
    raw = quants.quantize(W, qtype) if qtype not in (Q.F32,) else W
    if qtype == Q.F16:
        raw = W.astype(np.float16).view(np.uint8)
    got_fmt, parts = blocks.from_gguf(qtype, raw, *W.shape)
    assert got_fmt == fmt
    ref = quants.dequantize(raw, qtype).reshape(W.shape) if qtype != Q.F32 else W
    np.testing.assert_array_equal(blocks.dequantize(fmt, parts), ref)


def test_types_without_a_pinf_format_are_left_to_the_caller():
    from fixtures import quantize_q6_k
    w = np.tile(W, (1, 8))[:, :512]
    assert blocks.from_gguf(Q.Q6_K, quantize_q6_k(w), *w.shape) is None
    # a 5-bit W_down has no row-grouped ("r") form: its transpose is left to the caller too
    assert blocks.from_gguf_transposed(Q.Q5_0, quants.quantize(W, Q.Q5_0), *W.shape) is None


@pytest.mark.parametrize("fmt, bound", [("q8", 1 / 254), ("q4", 1 / 30), ("q5", 1 / 62), ("f16", 1e-3)])
def test_quantize_error_is_within_half_a_step(fmt, bound):
    parts = blocks.quantize(fmt, W)
    err = np.abs(blocks.dequantize(fmt, parts) - W)
    scale = np.abs(W).reshape(48, -1, 32).max(-1).repeat(32, axis=1) * (2 if fmt in ("q4", "q5") else 1)
    assert (err <= scale * bound * 1.01 + 1e-7).all()


def test_q8_matches_gguf_q8_0_rule():
    ours = blocks.dequantize("q8", blocks.quantize("q8", W))
    ref = quants.dequantize(quants.quantize(W, Q.Q8_0), Q.Q8_0).reshape(W.shape)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=np.abs(W).max() / 127 * 1.01)


@pytest.mark.parametrize("without, with_", [(Q.Q4_0, Q.Q4_1), (Q.Q5_0, Q.Q5_1)])
def test_row_selection_and_mixing_blocks_with_and_without_min(without, with_):
    f0, p0 = blocks.from_gguf(without, quants.quantize(W, without), *W.shape)
    f1, p1 = blocks.from_gguf(with_, quants.quantize(W, with_), *W.shape)
    fmt, both = blocks.concat_rows([(f0, p0), (f1, p1)])
    full = np.concatenate([blocks.dequantize(f0, p0), blocks.dequantize(f1, p1)])
    np.testing.assert_array_equal(blocks.dequantize(fmt, both), full)
    rows = np.array([0, 47, 48, 95, 3])
    np.testing.assert_array_equal(blocks.dequantize(fmt, both, rows=rows), full[rows])


def test_q4_k_sub_blocks_carry_over_as_q4_groups():
    """Q4_K (tests/fixtures.py's encoder; gguf-py cannot quantize it) as q4 with a min per 32
    values, dequantized against gguf-py's own Q4_K dequantizer. The values differ only by the
    f16 rounding of each group's scale d*sc and min -dmin*m (half an f16 ulp, 2^-11 relative):
    at most (15 |scale| + |min|) 2^-11 per value."""
    from fixtures import quantize_q4_k
    w = (RNG.standard_normal((16, 512)) * np.exp(RNG.standard_normal((16, 1)))).astype(np.float32)
    raw = quantize_q4_k(w)
    fmt, parts = blocks.from_gguf(Q.Q4_K, raw, *w.shape)
    assert fmt == "q4" and set(parts) == {"q", "scale", "min"} and blocks.EXACT[Q.Q4_K] == ("q4", True)
    ref = quants.dequantize(raw, Q.Q4_K).reshape(w.shape)
    got = blocks.dequantize(fmt, parts)
    bound = (15 * np.abs(parts["scale"].astype(np.float32)) + np.abs(parts["min"].astype(np.float32))) * 2.0 ** -11
    assert (np.abs(got - ref) <= bound.repeat(32, axis=1) * 1.01 + 1e-6).all()
    # W^T as q4r: the same values, transposed (W_down's groups along n_ff become groups of rows)
    tfmt, tparts = blocks.from_gguf_transposed(Q.Q4_K, raw, *w.shape)
    assert tfmt == "q4r"
    np.testing.assert_array_equal(blocks.dequantize(tfmt, tparts), got.T)


def test_q5_k_sub_blocks_carry_over_as_q5_groups():
    """Q5_K (tests/fixtures.py's encoder) as q5 with a min per 32 values, against gguf-py's own Q5_K
    dequantizer: as for Q4_K, only the f16 rounding of each group's scale and min differs, at most
    (31 |scale| + |min|) 2^-11 per value. The fifth bits are checked by the Q5_0 carry-over above
    (exact) and here by the bound, which one wrong bit (16 |scale|) would exceed."""
    from fixtures import quantize_q5_k
    w = (RNG.standard_normal((16, 512)) * np.exp(RNG.standard_normal((16, 1)))).astype(np.float32)
    raw = quantize_q5_k(w)
    fmt, parts = blocks.from_gguf(Q.Q5_K, raw, *w.shape)
    assert fmt == "q5" and set(parts) == {"q", "qh", "scale", "min"} and blocks.EXACT[Q.Q5_K] == ("q5", True)
    ref = quants.dequantize(raw, Q.Q5_K).reshape(w.shape)
    got = blocks.dequantize(fmt, parts)
    bound = (31 * np.abs(parts["scale"].astype(np.float32)) + np.abs(parts["min"].astype(np.float32))) * 2.0 ** -11
    assert (np.abs(got - ref) <= bound.repeat(32, axis=1) * 1.01 + 1e-6).all()
    assert np.abs(got - w).max() < np.abs(w).max() / 20      # the encoder itself: about half a 5-bit step


def test_q5_planes_follow_the_nibble_order():
    """q5's fifth bits, per group: a u16 of the even elements' (bit j: element 2j), then the odd
    ones' (schema.py), the order the kernels read them in."""
    vals = np.zeros((1, 1, 32), np.uint8)
    vals[0, 0, [0, 5, 30, 31]] = [16, 17, 31, 16]       # elements 0, 30 even (bits 0, 15); 5, 31 odd (bits 2, 15)
    q, qh = blocks._pack5(vals)
    assert list(qh[0]) == [0x01, 0x80, 0x04, 0x80]
    assert blocks._unpack5(q, qh).tolist() == vals.reshape(1, 32).tolist()
