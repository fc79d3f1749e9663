"""The objects of a layer's FFN paths, which the planner (plan.py) chooses: the fused kernel
(pinfer's CPU kernel, or the hybrid of the placement's hot neurons on the GPU and the rest on the
CPU), the columns of activation sparsity, and the down projection the ONNX path uses (MatMulNBits,
pinfer's DownProjection, or a --quant mixed split)."""

import numpy as np

from pinfer.formats import schema as S
from pinfer.formats.reader import huge_empty
from pinfer.kernels import ColumnFFN, DownProjection, transpose_gate_up, untranspose_r

from . import hybrid
from .ort import MatMulDown, SplitDown
from .sparse import LayerFfn, input_threshold


def column_ffn(model, i, levels):
    """Layer i's FFN by columns at activation sparsity `levels` ({projection: level}, as
    sparse.activation_levels gives them): its gate/up rows transposed into their own copy (the map's
    pages let go), down_t read as it is (plan.decide checks the options). Raises ValueError, one
    sentence, where the file has no thresholds."""
    r, cfg = model.reader, model.cfg
    tx, th = (input_threshold(r.header, i, p, levels[p]) for p in ("gate_up", "down"))
    base = S.FFN_GATE_UP.format(i)
    fmt, parts = r.block(base)
    gate_up_t = transpose_gate_up(fmt, parts, cfg.n_ff, cfg.d_model, empty=huge_empty)
    r.release(*(S.part_name(base, p) for p in parts))
    down = r.block(S.FFN_DOWN_T.format(i), own=True)
    kernel = ColumnFFN(gate_up_t, down, cfg.n_ff, cfg.d_model, cfg.ffn_act, model.threads, tx)
    return LayerFfn(kernel, "down", np.float32(th))


# Timing a dense layer's kernel needs the attention-only sessions, a second copy of the attention
# weights in ONNX Runtime's memory (2.7 GB at LLaMA-7B's 32 layers: peak RSS 13.8 GB against 11.1 GB).
# Dense layers are timed where that copy is small (SmolLM2: 17 MB, where the kernel's dense mode
# took 0.6x of the graph's time), or where the graph's down projection has no MatMulNBits form (a
# hot-first file's 8-bit down rows: the kernel 2.7x as fast at 7B shapes).
DENSE_TIMING_MAX_ATTN_BYTES = 256 << 20


def times_dense(model, layer, native_attention):
    """Whether --ffn-kernel auto times a dense layer's kernel (plan.Layer) against the graph (see
    above; where the C kernels take the attention, native_attention, there is no second copy)."""
    if native_attention or not isinstance(layer.down, MatMulDown):
        return True
    tensors = model.reader.header["tensors"]
    attn = sum(e["nbytes"] for name, e in tensors.items() if name.startswith("blk.") and ".attn_" in name)
    return attn <= DENSE_TIMING_MAX_ATTN_BYTES


def layer_kernel(model, i, mode):
    """Layer i's fused FFN for `mode`: the CPU kernel, or the hybrid of the plan's hot neurons
    on the GPU (or a second CPU kernel with device cpu-split) and the rest on the CPU, over the
    file's map where the reader is mapped (RuntimeOptions.mmap), else over copies of the weights in
    the process's memory (PinfReader.release says why)."""
    r, cfg, dv = model.reader, model.cfg, model.devices
    k = model.plan.hot[i] if model.plan else 0
    down, rows = S.FFN_DOWN_T.format(i), None
    if model.one_copy and mode == "dense" and r.header["weights"].get(down) == "q4r" \
            and model.options.mmap is not True:
        # dense: every token's down projection is row dots over W_down (SparseFFN's rows_from), so the
        # kernel holds W_down and leaves down_t in the file's map, never read
        fmt, parts = r.block(down)      # the map's pages of down_t, let go once W_down is made from them
        rows = untranspose_r(fmt, parts, empty=huge_empty)
        r.release(*(S.part_name(down, p) for p in parts))
    else:
        rows = getattr(model.layers[i].down, "rows", None)    # W_down, shared with MatMulNBits
    unread = model.one_copy and rows is not None     # down_t stays in the map: the row dots read W_down
    # split at k: the map's pages, the cold rows copied by hybrid.build and the hot ones uploaded, so
    # that host memory holds the cold rows alone (a copy of the whole layer kept the hot rows beside VRAM's)
    split = k > 0
    parts = (r.block(S.FFN_GATE_UP.format(i), own=not split), r.block(down, own=not (unread or split)), None)
    if S.MODES[mode].uses_predictor:
        parts = parts[:2] + ((r.block(S.FFN_PRED_W1.format(i), own=True),
                              r.block(S.FFN_PRED_W2.format(i), own=True),
                              r.tensor(S.FFN_PRED_B2.format(i))),)
    if dv.ffn == "gpu":
        from pinfer.kernels.gpu import HotFFN
        spec = dv.specs[i][0]
        make = lambda gu, dn, pred: HotFFN(dv.gpu, spec, k, gu, dn, pred, cfg.ffn_act,   # noqa: E731
                                           model.options.deterministic)
    else:
        make = hybrid.cpu_hot_factory(k, cfg.d_model, cfg.ffn_act, model.threads, dv.copier)
    ffn = hybrid.build(parts, k, cfg.n_ff, cfg.d_model, cfg.ffn_act, model.threads, make,
                       rows if rows and rows[0] == "q4" else None)
    if split:       # what the cut read of the map (a cpu-split hot half reads it again as it needs)
        r.release(*(S.part_name(base, p) for base, (_, ps) in zip((S.FFN_GATE_UP.format(i), down), parts[:2])
                    for p in ps))
    return ffn


def down_projection(reader, cfg, i, threads):
    """Layer i's down projection for the ONNX path (bind(h, y) -> run)."""
    hot_fmt, hot_parts = reader.block(S.FFN_DOWN_T.format(i))
    cold = S.FFN_DOWN_T_COLD.format(i)
    if cold not in reader.header["weights"]:
        down = MatMulDown if hot_fmt in MatMulDown.FORMATS else DownProjection
        return down(hot_fmt, hot_parts, threads, cfg.n_ff, cfg.d_model)
    hot = (reader.header.get("ffn", {}).get("hot_rows") or [None] * cfg.n_layer)[i:i + 1]
    if not hot or not isinstance(hot[0], int) or not 0 < hot[0] < cfg.n_ff:
        raise ValueError(f"layer {i}'s FFN is split in hot and cold rows but the header's ffn.hot_rows does "
                         f"not say where (found {hot[0] if hot else None!r}, expected 1..{cfg.n_ff - 1}); "
                         "convert the model again")
    hot = hot[0]
    return SplitDown(DownProjection(hot_fmt, hot_parts, threads, hot, cfg.d_model),
                     DownProjection(*reader.block(cold), threads, cfg.n_ff - hot, cfg.d_model))
