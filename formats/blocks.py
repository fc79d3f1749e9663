"""Block formats of `.pinf` weights (schema.BLOCK_FORMATS): conversion from GGUF blocks, quantization
from floats, and dequantization. Pure NumPy functions over arrays shaped (rows, K)."""

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from .schema import GROUP, NO_MIN_OFFSET

# GGUF block byte layouts (gguf-py / ggml-common.h): per block of 32 values
#   Q4_0: d f16 | qs u8[16]         value i = d*((qs[i] & 15) - 8), value i+16 = d*((qs[i] >> 4) - 8)
#   Q4_1: d f16 | m f16 | qs u8[16] value i = d*(qs[i] & 15) + m,  value i+16 = d*(qs[i] >> 4) + m
#   Q8_0: d f16 | qs i8[32]         value i = d*qs[i]
# and per super-block of 256 values, in 8 sub-blocks of 32:
#   Q4_K: d f16 | dmin f16 | scales u8[12] | qs u8[128]
#         sub-block j has a 6-bit scale sc[j] and min m[j] packed in `scales`: for j < 4, sc[j] is
#         the low 6 bits of byte j and m[j] those of byte j + 4; for j >= 4, sc[j] is the low nibble
#         of byte j + 4 with the top 2 bits of byte j - 4 above it, m[j] the high nibble of byte j + 4
#         with the top 2 bits of byte j above it. qs holds 4 runs of 32 bytes: run r gives sub-block
#         2r its low nibbles and sub-block 2r + 1 its high ones. value = d*sc[j]*q - dmin*m[j]
# and the 5-bit ones, whose fifth bits come apart from the low nibbles:
#   Q5_0: d f16 | qh u32 | qs u8[16]   value i = d*(q - 16) with q = (qs[i] & 15) | bit i of qh << 4,
#                                      value i+16 the same from qs[i] >> 4 and bit i+16 of qh
#   Q5_1: d f16 | m f16 | qh u32 | qs u8[16]   as Q5_0, value = d*q + m
#   Q5_K: d f16 | dmin f16 | scales u8[12] | qh u8[32] | qs u8[128]   as Q4_K, plus element l of
#         sub-block j has bit j of qh[l] as its fifth bit


def _pairs(nibbles):
    """(..., 32) values 0..15 -> (..., 16) bytes, element 2i low nibble, 2i+1 high nibble."""
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).astype(np.uint8)


def _unpairs(packed):
    out = np.empty(packed.shape[:-1] + (packed.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = packed & 15
    out[..., 1::2] = packed >> 4
    return out


def _pack5(vals):
    """(rows, groups, 32) values 0..31 -> q5's (q, qh) (schema: the low nibbles as q4; per group the
    even elements' fifth bits as a little-endian u16, then the odd elements')."""
    rows, nb, _ = vals.shape
    high = (vals >> 4).astype(np.uint8)
    planes = np.concatenate([high[..., 0::2], high[..., 1::2]], axis=-1).reshape(rows, nb, 4, 8)
    qh = np.packbits(planes, axis=-1, bitorder="little").reshape(rows, nb * 4)
    return _pairs(vals & 15).reshape(rows, nb * 16), qh


def _unpack5(q, qh):
    """q5's (q (n, K/2), qh (n, K/8)) -> (n, K) values 0..31."""
    n = q.shape[0]
    bits = np.unpackbits(qh.reshape(n, -1, 4, 1), axis=-1, bitorder="little").reshape(n, -1, 32)
    high = np.empty_like(bits)
    high[..., 0::2], high[..., 1::2] = bits[..., :16], bits[..., 16:]
    return _unpairs(q) | (high.reshape(n, -1) << 4)


# GGUF type -> (.pinf format, has a min) of from_gguf's exact carry-over; from_gguf_transposed
# gives the "r" form of the quantized ones (TRANSPOSED)
# (Q4_K: its sub-blocks of 32 carry over as q4 groups, scale d*sc and min -dmin*m rounded to f16)
# (Q5_0, Q5_1, Q5_K: q5 groups likewise, Q5_K's scale and min as Q4_K's; q5 has no "r" form, so a
# 5-bit W_down whose groups run along n_ff is re-quantized)
EXACT = {Q.F32: ("f32", False), Q.F16: ("f16", False), Q.Q4_0: ("q4", False), Q.Q4_1: ("q4", True),
         Q.Q8_0: ("q8", False), Q.Q4_K: ("q4", True), Q.Q5_0: ("q5", False), Q.Q5_1: ("q5", True),
         Q.Q5_K: ("q5", True)}
TRANSPOSED = {"f32": "f32", "f16": "f16", "q4": "q4r", "q8": "q8r"}


def from_gguf(ttype, raw, rows, k):
    """GGUF raw bytes (rows, bytes per row) -> (format, parts) carried over exactly, or None when
    the GGUF type has no exact .pinf block format (the caller then dequantizes and re-quantizes)."""
    nb = k // GROUP
    if ttype == Q.F32:
        return "f32", {"w": np.asarray(raw, np.float32).reshape(rows, k)}
    if ttype == Q.F16:
        return "f16", {"w": np.asarray(raw).view(np.float16).reshape(rows, k)}
    raw = np.asarray(raw, np.uint8)
    if ttype in (Q.Q4_0, Q.Q4_1):
        has_min = ttype == Q.Q4_1
        blocks = raw.reshape(rows, nb, 20 if has_min else 18)
        qs = blocks[..., -16:]
        vals = np.concatenate([qs & 15, qs >> 4], axis=-1)  # (rows, nb, 32) in element order
        parts = {"q": _pairs(vals).reshape(rows, k // 2),
                 "scale": blocks[..., 0:2].copy().view(np.float16).reshape(rows, nb)}
        if has_min:
            parts["min"] = blocks[..., 2:4].copy().view(np.float16).reshape(rows, nb)
        return "q4", parts
    if ttype == Q.Q4_K:
        return "q4", _from_q4_k(raw, rows, k)
    if ttype in (Q.Q5_0, Q.Q5_1):
        has_min = ttype == Q.Q5_1
        blocks = raw.reshape(rows, nb, 24 if has_min else 22)
        qs = blocks[..., -16:]
        qh = np.unpackbits(blocks[..., -20:-16], axis=-1, bitorder="little")   # bit i of the u32
        vals = np.concatenate([qs & 15, qs >> 4], axis=-1) | (qh << 4)
        q, h = _pack5(vals)
        parts = {"q": q, "qh": h, "scale": blocks[..., 0:2].copy().view(np.float16).reshape(rows, nb)}
        if has_min:
            parts["min"] = blocks[..., 2:4].copy().view(np.float16).reshape(rows, nb)
        return "q5", parts
    if ttype == Q.Q5_K:
        return "q5", _from_q5_k(raw, rows, k)
    if ttype == Q.Q8_0:
        blocks = raw.reshape(rows, nb, 34)
        q = blocks[..., 2:].view(np.int8).reshape(rows, k)
        return "q8", {"q": (q.view(np.uint8) ^ 0x80).astype(np.uint8),
                      "scale": blocks[..., 0:2].copy().view(np.float16).reshape(rows, nb)}
    return None


def _k_scales(blocks, rows, k):
    """A K-quant super-block's per-sub-block scale d*sc and min -dmin*m (Q4_K's and Q5_K's packing
    of 6-bit sc and m), rounded to f16, (rows, k/32)."""
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)        # (rows, n, 1)
    dmin = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    s = blocks[..., 4:16].astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return {"scale": (d * sc).astype(np.float16).reshape(rows, k // GROUP),
            "min": (-(dmin * mn)).astype(np.float16).reshape(rows, k // GROUP)}


def _k_nibbles(qs, rows, k):
    """A K-quant's 4 runs of 32 bytes -> (rows, k/256, 8, 32) low nibbles, sub-blocks in order."""
    qs = qs.reshape(rows, k // 256, 4, 32)
    return np.stack([qs & 15, qs >> 4], axis=3).reshape(rows, k // 256, 8, 32)


def _from_q4_k(raw, rows, k):
    """Q4_K blocks -> q4 parts with a min: each 32-value sub-block is one q4 group."""
    blocks = raw.reshape(rows, k // 256, 144)
    return {"q": _pairs(_k_nibbles(blocks[..., 16:], rows, k)).reshape(rows, k // 2), **_k_scales(blocks, rows, k)}


def _from_q5_k(raw, rows, k):
    """Q5_K blocks -> q5 parts with a min: each 32-value sub-block is one q5 group."""
    blocks = raw.reshape(rows, k // 256, 176)
    high = np.unpackbits(blocks[..., 16:48, None], axis=-1, bitorder="little")     # (rows, n, 32 l, 8 j)
    vals = _k_nibbles(blocks[..., 48:], rows, k) | (np.swapaxes(high, -1, -2) << 4)
    q, qh = _pack5(vals.reshape(rows, k // GROUP, GROUP))
    return {"q": q, "qh": qh, **_k_scales(blocks, rows, k)}


def from_gguf_transposed(ttype, raw, rows, k):
    """GGUF W (rows, k) -> the exact parts of W^T (k, rows) in an "r" format (groups of GGUF's k
    axis become groups of rows), or None when there is none for this type."""
    t = from_gguf(ttype, raw, rows, k)
    if t is None:
        return None
    fmt, parts = t
    if fmt not in TRANSPOSED:       # q5: no row-grouped form
        return None
    if fmt in ("f32", "f16"):
        return fmt, {"w": np.ascontiguousarray(parts["w"].T)}
    if fmt == "q4":
        vals = _unpairs(parts["q"])                     # (rows, k)
        out = {"q": _pairs(np.ascontiguousarray(vals.T)), "scale": np.ascontiguousarray(parts["scale"].T)}
        if "min" in parts:
            out["min"] = np.ascontiguousarray(parts["min"].T)
        return "q4r", out
    if fmt == "q8":
        return "q8r", {"q": np.ascontiguousarray(parts["q"].T), "scale": np.ascontiguousarray(parts["scale"].T)}
    raise AssertionError(fmt)


def from_transposed_r(fmt, parts):
    """The inverse of from_gguf_transposed: the parts of an "r" format W^T (rows, k) back as W
    (k, rows) in the plain format (q4r -> q4, q8r -> q8), groups running along W's rows, exactly."""
    if fmt == "q4r":
        out = {"q": _pairs(np.ascontiguousarray(_unpairs(parts["q"]).T)),
               "scale": np.ascontiguousarray(parts["scale"].T)}
        if "min" in parts:
            out["min"] = np.ascontiguousarray(parts["min"].T)
        return "q4", out
    if fmt == "q8r":
        return "q8", {"q": np.ascontiguousarray(parts["q"].T), "scale": np.ascontiguousarray(parts["scale"].T)}
    raise ValueError(f"{fmt} is not a transposed (r) block format")


def quantize(fmt, w):
    """Float (rows, K) -> parts of `fmt`. q8 is symmetric (Q8_0's rule), q4 asymmetric with a min."""
    w = np.asarray(w, np.float32)
    rows, k = w.shape
    if fmt == "f32":
        return {"w": w.copy()}
    if fmt == "f16":
        return {"w": w.astype(np.float16)}
    g = w.reshape(rows, k // GROUP, GROUP)
    if fmt == "q8":
        amax = np.abs(g).max(axis=-1)
        scale = (amax / 127).astype(np.float16)
        inv = np.divide(1.0, scale.astype(np.float32), out=np.zeros_like(amax), where=scale != 0)
        q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8)
        return {"q": (q.view(np.uint8) ^ 0x80).reshape(rows, k), "scale": scale}
    if fmt in ("q4", "q5"):
        top = 15 if fmt == "q4" else 31
        lo, hi = g.min(axis=-1), g.max(axis=-1)
        scale = ((hi - lo) / top).astype(np.float16)
        mn = lo.astype(np.float16)
        s32 = scale.astype(np.float32)
        inv = np.divide(1.0, s32, out=np.zeros_like(s32), where=s32 != 0)
        q = np.clip(np.rint((g - mn.astype(np.float32)[..., None]) * inv[..., None]), 0, top).astype(np.uint8)
        if fmt == "q5":
            q5, qh = _pack5(q)
            return {"q": q5, "qh": qh, "scale": scale, "min": mn}
        return {"q": _pairs(q).reshape(rows, k // 2), "scale": scale, "min": mn}
    raise ValueError(f"unknown block format {fmt!r}")


def dequantize(fmt, parts, rows=None):
    """Parts of `fmt` -> float32 (n, K); `rows` (an index array) selects rows before the work."""
    sel = (lambda a: a) if rows is None else (lambda a: a[rows])
    if fmt in ("q4r", "q8r"):
        n = parts["q"].shape[0]
        groups = np.arange(n) // GROUP if rows is None else np.asarray(rows) // GROUP
        scale = parts["scale"].astype(np.float32)[groups]
        if fmt == "q8r":
            return ((sel(parts["q"]).astype(np.float32) - 128) * scale)
        q = _unpairs(sel(parts["q"])).astype(np.float32)
        if "min" in parts:
            return q * scale + parts["min"].astype(np.float32)[groups]
        return (q - NO_MIN_OFFSET[fmt]) * scale
    if fmt in ("f32", "f16"):
        return sel(parts["w"]).astype(np.float32)
    scale = sel(parts["scale"]).astype(np.float32)
    n, nb = scale.shape
    if fmt == "q8":
        q = (sel(parts["q"]) ^ 0x80).view(np.int8).astype(np.float32).reshape(n, nb, GROUP)
        return (q * scale[..., None]).reshape(n, nb * GROUP)
    if fmt in ("q4", "q5"):
        q = (_unpairs(sel(parts["q"])) if fmt == "q4" else _unpack5(sel(parts["q"]), sel(parts["qh"])))
        q = q.astype(np.float32).reshape(n, nb, GROUP)
        if "min" in parts:
            w = q * scale[..., None] + sel(parts["min"]).astype(np.float32)[..., None]
        else:
            w = (q - NO_MIN_OFFSET[fmt]) * scale[..., None]
        return w.reshape(n, nb * GROUP)
    raise ValueError(f"unknown block format {fmt!r}")


def dequantize_gguf(ttype, raw, rows, k):
    return quants.dequantize(np.asarray(raw), ttype).reshape(rows, k).astype(np.float32, copy=False)


def with_min(parts, fmt="q4"):
    """q4 (or q5) parts with an explicit min: a min-less block's value scale*(q - 8) (q5: - 16) has
    min = -8*scale (-16*scale; exact in f16: a power-of-two multiple)."""
    if "min" in parts:
        return parts
    return dict(parts, min=(parts["scale"].astype(np.float32) * -NO_MIN_OFFSET[fmt]).astype(np.float16))


def concat_rows(blocks):
    """Stack [(fmt, parts), ...] with equal K along rows; q4 (q5) with and without min mix by giving
    the min-less ones min = -8*scale (-16*scale; exact in f16: a power-of-two multiple)."""
    fmts = {f for f, _ in blocks}
    if len(fmts) != 1:
        raise ValueError(f"cannot concatenate block formats {sorted(fmts)}")
    fmt = fmts.pop()
    names = set().union(*(p.keys() for _, p in blocks))
    if fmt in ("q4", "q5") and "min" in names:
        blocks = [(f, with_min(p, f)) for f, p in blocks]
    return fmt, {n: np.concatenate([p[n] for _, p in blocks], axis=0) for n in names}


def row_slice(fmt, parts, start, stop):
    """Rows [start, stop) of a weight's parts (leading axis: rows); the "r" formats' scale and min,
    one row per group of 32 rows, by groups (start and stop multiples of 32 there)."""
    if fmt in ("q4r", "q8r"):
        if start % GROUP or stop % GROUP:
            raise ValueError(f"rows {start}:{stop} of a {fmt} weight must start and stop on groups of {GROUP}")
        return {k: v[start:stop] if k == "q" else v[start // GROUP:stop // GROUP] for k, v in parts.items()}
    return {k: v[start:stop] for k, v in parts.items()}
