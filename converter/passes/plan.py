"""Bytes read per token, the `auto` sparsity choice, and the default GPU placement plan.

Bytes are modelled for batch-1 decode from the formats the file will hold and the read shares
measured on each operating point's own held-out stream (calibrate.LayerCalibration.read):
  gate_up  two rows per neuron read          (row formats: q4, q8, f16, f32)
  down_t   one row per surviving neuron; the "r" formats also read, per 32-neuron group with a
           survivor, the group's scale (and min) row
  predictor  its q8 or q4 weights, for the predicted and relu modes
"""

from dataclasses import dataclass

import numpy as np

from pinfer.formats import schema as S

from pinfer.runtime.placement import GIB  # noqa: F401  (one definition; callers use plan.GIB)


def row_bytes(fmt, d, has_min):
    """(bytes per row, bytes per 32-row group) of a (rows, d) weight in `fmt` (schema.block_parts):
    the parts with a row per row, and those with a row per group of rows (the "r" formats)."""
    per_row = per_group = 0
    for dtype, shape in S.block_parts(fmt, S.GROUP, d, has_min).values():
        nbytes = S.DTYPES[dtype].itemsize * int(np.prod(shape))
        if shape[0] == S.GROUP:
            per_row += nbytes // S.GROUP
        else:
            per_group += nbytes
    return per_row, per_group


def carries_down(quant, fmt, permuted):
    """Whether down_t keeps the source's `fmt` blocks: float rows move freely, row groups only in
    source order; int4 keeps 4-bit row groups (exact, and as small)."""
    return (quant == "auto" or quant == "int4" and fmt == "q4r") and (not permuted or fmt in ("f16", "f32"))


@dataclass(frozen=True)
class BundleFormats:
    """The FFN formats of one layer as it will be written."""
    gate_up: tuple      # (fmt, has_min)
    down: tuple         # (fmt, has_min)
    predictor_bytes: int = 0
    gate_up_carried: bool = False   # the source's own blocks, not re-quantized
    down_carried: bool = False      # the source's W_down blocks, transposed exactly


def bundle_formats(gate_up_types, down_type, quant, permuted, predictor_bytes=0, down_neuron_major=False):
    """The formats a layer's FFN bundles are written in, from the source's GGUF types of gate and
    up (up alone without a gate) and of down: the one decision the planner's byte model and the
    back end (convert._ffn_bundles) both take. gate/up carry over when both have one exact .pinf
    format (q4 or q5 with and without min meet with a min), else they are re-quantized to q8; fp16
    makes f16, int4 and mixed 4 bits (mixed: the cold rows' format). down carries over where
    carries_down says (or, where the source already holds down_t a row per neuron, as PowerInfer
    files do, in any order, as the row formats move freely); else f16, q4 (int4, mixed) or q8."""
    from pinfer.formats.blocks import EXACT, TRANSPOSED
    if quant == "fp16":
        return BundleFormats(("f16", False), ("f16", False), predictor_bytes)
    kinds = [EXACT.get(t) for t in gate_up_types]
    carried = None not in kinds and len({k[0] for k in kinds}) == 1
    gu = (kinds[0][0], any(k[1] for k in kinds)) if carried else ("q8", False)
    if quant == "mixed" or quant == "int4" and gu[0] != "q4":
        gu, carried = ("q4", True), False
    dn = EXACT.get(down_type)
    if dn is not None and dn[0] not in TRANSPOSED:     # q5: no row-grouped form, nor a down_t row the kernels read
        dn = None
    if dn is not None and down_neuron_major and quant != "mixed" and (quant == "auto" or dn[0] == "q4"):
        return BundleFormats(gu, dn, predictor_bytes, carried, True)
    if dn is not None and not down_neuron_major and carries_down(quant, TRANSPOSED[dn[0]], permuted):
        return BundleFormats(gu, (TRANSPOSED[dn[0]], dn[1]), predictor_bytes, carried, True)
    return BundleFormats(gu, ("q4", True) if quant in ("int4", "mixed") else ("q8", False), predictor_bytes, carried)


def ffn_bytes(cfg, fmts, point_mode, read):
    """Modelled FFN bytes per token of one layer; read = (gate/up, down rows, down groups) shares."""
    gu_row, _ = row_bytes(*fmts.gate_up[:1], cfg.d_model, fmts.gate_up[1])
    d_row, d_group = row_bytes(fmts.down[0], cfg.d_model, fmts.down[1])
    n, groups = cfg.n_ff, cfg.n_ff // S.GROUP
    gu_share, down_share, group_share = read
    total = n * gu_share * (2 if cfg.ffn_gated else 1) * gu_row + n * down_share * d_row + groups * group_share * d_group
    if S.MODES[point_mode].uses_predictor:
        total += fmts.predictor_bytes
    return float(total)


@dataclass(frozen=True)
class Choice:
    modes: list          # per layer: calibrate.Point
    reason: str
    table: list          # [{"point", "ppl", "increase", "ffn_bytes"}] for every measured point


def choose(result, points, bytes_of, budget, forced=None):
    """The `auto` choice: of the operating points whose held-out perplexity stays within `budget`
    (relative increase over dense), the one that reads the fewest FFN bytes, for every layer
    (measured as one point for the whole model); dense in layers where that point reads more.

    bytes_of(layer, point) -> modelled FFN bytes. `forced` (a Point) skips the choice."""
    n_layer = len(result.layers)
    base = result.ppl("dense")
    table = []
    for p in points:
        if p.name not in result.nll:
            continue
        total = sum(bytes_of(i, p) for i in range(n_layer))
        table.append({"point": p.name, "ppl": result.ppl(p.name), "increase": result.ppl(p.name) / base - 1,
                      "ffn_bytes": total})
    if forced is not None:
        return Choice([forced] * n_layer, f"forced by --sparsity {forced.name}", table)
    ok = {row["point"]: row["ffn_bytes"] for row in table if row["increase"] <= budget}
    uniform, total = min(((p, ok[p.name]) for p in points if p.name in ok), key=lambda pt: pt[1])
    dense = next(p for p in points if p.mode == "dense")
    modes = [uniform if bytes_of(i, uniform) < bytes_of(i, dense) else dense for i in range(n_layer)]
    n_dense = sum(m.mode == "dense" for m in modes)
    reason = (f"{uniform.name} reads the fewest FFN bytes ({total / 1e6:.2f} MB/token) among the operating "
              f"points within +{budget:.1%} held-out perplexity (measured +"
              f"{next(r['increase'] for r in table if r['point'] == uniform.name):.2%})")
    if uniform.mode != "dense" and n_dense:
        reason += f"; {n_dense} layers stay dense, where the mode would read more bytes than dense"
    return Choice(modes, reason, table)


def placement(cfg, freq, neuron_bytes, fixed_bytes, target_bytes, block=256):
    """Default hot/cold split for a VRAM budget: the largest per-layer prefixes (blocks of
    `block` neurons) by activation frequency per byte that fit after the dense part, ranked as the
    runtime ranks them at load (runtime/placement.py), here with the bundle's average bytes per
    neuron. freq (n_layer, n_ff) in file order; neuron_bytes (n_layer,). Returns per-layer hot
    neuron counts."""
    from pinfer.runtime.placement import plan_hot
    free = target_bytes - fixed_bytes
    if free <= 0:
        return np.zeros(len(freq), np.int64)
    return plan_hot(np.asarray(freq, np.float64), lambda layer, k: k * float(neuron_bytes[layer]), free, block)
