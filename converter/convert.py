"""`pinfer convert`: the compiler driver. Front end -> passes -> back end -> one `.pinf` file."""

import os
import shutil
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from pinfer.formats import PinfWriter, blocks
from pinfer.formats import schema as S
from pinfer.formats.writer import partial_path

from . import passes
from .frontend import arch
from .frontend.gguf_source import GGUFSource, SourceError
from .frontend.hf_source import HFSource
from .passes import PassOptions
from .passes import plan as PL

QUANT_CHOICES = ("auto", "int4", "fp16", "mixed")


@dataclass(frozen=True)
class ConvertOptions:
    source: Path                 # a .gguf file or a Hugging Face model folder
    output: Path | None = None   # default: the source path with the suffix .pinf
    force: bool = False          # overwrite an existing output
    passes: PassOptions = PassOptions()
    # FFN bundles: auto carries source blocks over exactly where the layout allows (re-quantized
    # rows stay 4-bit for 4-bit sources, else q8); int4 and fp16 force those formats; mixed keeps
    # in fp16 the hot prefix of each layer that the placement plan puts in --target-vram, the rest int4.
    quant: str = "auto"
    target_vram_gib: float = 11.0   # the default placement plan's budget (an RTX 2080 Ti)
    dry_run: bool = False
    report: bool = True             # <out>.report.json and plots
    verify: bool = True             # reload the file and compare with the source model


class ConvertError(ValueError):
    pass


def pinfer_version():
    try:
        return version("pinfer")
    except PackageNotFoundError:
        return "0+unknown"


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


class _Emitter:
    """Writes block-format weights and remembers their formats and conversion errors."""

    def __init__(self, writer):
        self.w = writer
        self.formats = {}
        self.errors = {}   # base -> max |converted - source| / max |source|

    def put(self, base, fmt, parts, source=None):
        for p, a in parts.items():
            self.w.add_tensor(S.part_name(base, p), a)
        self.formats[base] = fmt
        if source is not None:
            rows = source.shape[0]
            err = np.abs(blocks.dequantize(fmt, {p: a.reshape(rows, -1) for p, a in parts.items()}) - source).max()
            self.errors[base] = float(err / max(np.abs(source).max(), 1e-30))


def _linear(src, name):
    """(format, parts, floats-or-None): exact carry-over where possible, else q8 re-quantization."""
    exact = src.block(name)
    if exact is not None:
        return exact[0], exact[1], None
    w = src.floats(name)
    return "q8", blocks.quantize("q8", w), w


def _same_format(items):
    """Give a list of (format, parts, floats) one format, re-quantizing to q8 if they differ."""
    if len({f for f, _, _ in items}) == 1:
        return items
    out = []
    for f, parts, w in items:
        w = blocks.dequantize(f, parts) if w is None else w
        out.append(("q8", blocks.quantize("q8", w), w))
    return out


def convert(opts):
    """The conversion: front end (the source, checked), passes (the layout), back end (tensors
    and header through PinfWriter), verification and report. Returns the output path, or
    None after a dry run."""
    t0 = time.perf_counter()
    fe = _front_end(opts)
    src, T, cfg, out = fe.src, fe.roles, fe.cfg, fe.out
    _log(f"pinfer convert: {fe.path.name}: {cfg.arch}, {cfg.n_layer} layers, d_model {cfg.d_model}, "
         f"n_ff {cfg.n_ff}, heads {cfg.n_head}/{cfg.n_head_kv}, vocab {cfg.vocab}, FFN {cfg.ffn_act}")
    if opts.dry_run:
        from .backend.report import dry_run
        dry_run(src, T, cfg, opts, out)
        return None
    _check_disk(src, out)
    layout = passes.run(src, T, cfg, fe.tokenizer, opts.passes, opts.quant)
    hot_rows = passes.mixed_split(src, T, cfg, layout, opts.target_vram_gib, _plan_ctx(cfg)) \
        if opts.quant == "mixed" else None
    if hot_rows is not None:
        _log(f"mixed: fp16 for the hottest {sum(hot_rows)} of {cfg.n_layer * cfg.n_ff} neurons "
             f"(the plan for {opts.target_vram_gib:g} GiB), int4 for the rest")
    t_write = time.perf_counter()
    with PinfWriter(out, replace=opts.force) as w:     # without --force it never replaces a file
        em = _emit(w, fe, layout, opts.quant, hot_rows, t0)
        header = _header(fe, layout, em, w.directory, opts, hot_rows)
        try:
            w.finish(header)
        except FileExistsError as e:
            raise ConvertError(str(e)) from None
    worst = max(em.errors.values(), default=0.0)
    _log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t_write:.1f} s; "
         f"{len(em.errors)} tensors re-quantized, worst relative error {worst:.2e}")
    from pinfer.runtime.loading import trim_heap
    fe.src.release()
    trim_heap()         # the writer's temporaries: the verification's load comes on top of what is left
    _verify_and_report(out, cfg, layout, header, opts, t0)
    _log(f"done in {time.perf_counter() - t0:.1f} s")
    return out


@dataclass
class _FrontEnd:
    path: Path           # the source as given
    out: Path            # the output to write
    src: object          # GGUFSource or HFSource
    cfg: object          # ModelConfig
    roles: dict          # arch.roles: role -> tensor name template
    tokenizer: dict      # the tokenizer spec


def _front_end(opts):
    """The source opened and checked before any tensor is read: the output name is free (or
    --force), the architecture is supported, the options fit the model, every tensor is there."""
    src_path = Path(opts.source)
    out = Path(opts.output) if opts.output else (
        src_path.parent / f"{src_path.name}.pinf" if src_path.is_dir() else src_path.with_suffix(".pinf"))
    if out.exists() and _same_file(out, src_path):
        raise ConvertError(f"{out} is the source model itself; choose another output name with -o")
    if out.exists() and not opts.force:
        raise ConvertError(f"{out} already exists; pass --force to overwrite it or -o to choose another name")
    try:
        if src_path.is_dir():
            src = HFSource(src_path)
            mod = src.module()                  # before any tensor is read
            cfg = src.configure(mod)
        else:
            src = GGUFSource(src_path)
            mod = arch.get(src.architecture)    # before any tensor is read
            cfg = mod.config_from_gguf(src.meta, src.tensor_names())
            src.split_rows(mod.gguf_row_splits(cfg))
        names = src.tensor_names()
        tokenizer = src.tokenizer_spec()
    except (SourceError, arch.UnsupportedArchitecture, ValueError) as e:
        raise ConvertError(f"{src_path.name}: {e}") from None
    T = arch.roles(mod.TENSORS, names, cfg)
    if cfg.positions == "rope" and (cfg.rotary_dim // 2) % 8:
        # ONNX Runtime's GroupQueryAttention takes RoPE tables of a multiple of 8 columns
        raise ConvertError(f"{src_path.name}: RoPE over {cfg.rotary_dim} of each head's {cfg.head_dim} values is not "
                           "supported (the attention kernel pinfer runs needs a multiple of 16)")
    if opts.quant not in QUANT_CHOICES:
        raise ConvertError(f"--quant {opts.quant!r} is not one of {', '.join(QUANT_CHOICES)}")
    try:
        passes.parse_sparsity(opts.passes.sparsity, cfg)
    except ValueError as e:
        raise ConvertError(str(e)) from None
    missing = [n for key, n in T.items() if "{}" not in n and key not in ("output", "rope_freqs") and n not in names]
    missing += [T[k].format(i) for i in range(cfg.n_layer) for k in T if "{}" in T[k] and T[k].format(i) not in names]
    if missing:
        raise ConvertError(f"{src_path} lacks tensors a {cfg.arch} model needs: {', '.join(missing[:5])}"
                           f"{' ...' if len(missing) > 5 else ''}")
    return _FrontEnd(src_path, out, src, cfg, T, tokenizer)


def _emit(w, fe, layout, quant, hot_rows, t0):
    """Every tensor of the file, in order; returns the emitter (formats, errors). The file holds
    no graphs: the runtime builds them from the header (runtime/graphs.py)."""
    src, T, cfg = fe.src, fe.roles, fe.cfg
    em = _Emitter(w)
    em.put(S.TOKEN_EMBD, *_linear(src, T["token_embd"]))
    if not cfg.tied_embeddings:
        em.put(S.OUTPUT, *_linear(src, T["output"]))
    w.add_tensor(S.OUTPUT_NORM, src.floats(T["output_norm"]).reshape(-1))
    for role, name, flat in (("output_norm_bias", S.OUTPUT_NORM_BIAS, True), ("pos_embd", S.POS_EMBD, False),
                             ("rope_freqs", S.ROPE_FREQS, True)):
        if role in T:
            a = src.floats(T[role])
            w.add_tensor(name, a.reshape(-1) if flat else a)
    for i in range(cfg.n_layer):
        _layer(src, T, cfg, i, w, em, layout.layers[i], quant, hot_rows and hot_rows[i])
        src.release()       # the source's pages this layer read: they would add up to the whole file in RSS
        _log(f"  layer {i + 1}/{cfg.n_layer} written ({time.perf_counter() - t0:.1f} s)")
    if all(lay.freq is not None for lay in layout.layers):
        w.add_tensor(S.FFN_FREQ, np.stack([lay.freq for lay in layout.layers]).astype(np.float32))
    return em


def _header(fe, layout, em, directory, opts, hot_rows):
    cfg = fe.cfg
    reordered = any(lay.perm is not None for lay in layout.layers)
    return {
        "config": cfg.to_dict(),
        "tokenizer": fe.tokenizer,
        "weights": em.formats,
        "ffn": {"layout": "bundles", "neuron_order": "hot-first" if reordered else "source",
                "quant": opts.quant} | ({"hot_rows": hot_rows} if hot_rows is not None else {}),
        "sparsity": layout.sparsity,
        "layers": [lay.info or {"mode": lay.mode, "value": lay.value, "order": "source"}
                   for lay in layout.layers],
        "plan": passes.placement_plan(cfg, layout, directory, opts.target_vram_gib, _plan_ctx(cfg), hot_rows),
        "provenance": {
            "source": fe.path.name,
            "source_sha256": fe.src.sha256(),
            "source_name": fe.src.meta.get("general.name"),
            "pinfer_version": pinfer_version(),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "calibration": layout.sparsity.get("calibration"),
            "conversion_error": em.errors,
        },
    }


def _verify_and_report(out, cfg, layout, header, opts, t0):
    """The output's checks (unless opts.verify is off), then the report, which says "verification":
    null when they were skipped: calibration's figures stand without them."""
    checks = None
    if opts.verify:
        from .backend.verify import verify_output
        try:
            checks = verify_output(out, layout)
        except Exception as e:
            out.unlink()        # a file that fails its own checks is not left behind
            raise ConvertError(f"{out.name} was written but failed verification and was removed: {e}") from e
    if opts.report and layout.calibration is not None:
        from .backend.report import write_report
        write_report(out, cfg, layout, header, checks, time.perf_counter() - t0)


def _plan_ctx(cfg):
    """The context the default placement plan reserves KV cache for: the runtime's default."""
    from pinfer.runtime.options import DEFAULT_CTX
    return min(cfg.n_ctx_train, DEFAULT_CTX)


def _same_file(out, src):
    """Whether the existing output `out` is the source once links are resolved: the GGUF file
    itself, or, for a folder, one of its files that is not a .pinf."""
    try:
        if Path(src).is_dir():
            return Path(out).suffix != ".pinf" and Path(out).resolve().parent == Path(src).resolve()
        return os.path.samefile(out, src)
    except OSError:
        return False


def _check_disk(src, out):
    """Remove a partial file left by a killed run, and refuse to start without room for the output."""
    stale = partial_path(out)
    if os.path.lexists(stale):    # a symlink there is removed, never followed (PinfWriter: create_new)
        _log(f"removing {stale.name}, left by an interrupted conversion")
        stale.unlink()
    # Formats are carried over or re-quantized to at most 8.5 bits, so the output is at most about
    # twice the source's 4-bit tensors; the header adds a few MB.
    planned = 2 * sum(src.nbytes(n) for n in src.tensor_names()) + (16 << 20)
    free = shutil.disk_usage(out.resolve().parent).free
    if free < planned:
        raise ConvertError(f"{out.parent} has {free / 1e9:.2f} GB free and the output may need up to "
                           f"{planned / 1e9:.2f} GB; free some space or write elsewhere with -o")


def _layer(src, T, cfg, i, w, em, lay, quant, hot=None):
    """One layer's norms, attention weights, FFN bundles and predictor."""
    n = lambda key: T[key].format(i)  # noqa: E731
    vec = lambda key: src.floats(n(key)).reshape(-1)  # noqa: E731
    w.add_tensor(S.ATTN_NORM.format(i), vec("attn_norm"))
    w.add_tensor(S.FFN_NORM.format(i), vec("ffn_norm"))
    for role, name in (("attn_norm_bias", S.ATTN_NORM_BIAS), ("ffn_norm_bias", S.FFN_NORM_BIAS),
                       ("attn_output_bias", S.ATTN_OUT_BIAS), ("ffn_down_bias", S.FFN_DOWN_BIAS),
                       ("attn_q_norm", S.ATTN_Q_NORM), ("attn_k_norm", S.ATTN_K_NORM),
                       ("attn_post_norm", S.ATTN_POST_NORM), ("ffn_post_norm", S.FFN_POST_NORM)):
        if role in T:
            w.add_tensor(name.format(i), vec(role))
    _biases(src, T, cfg, i, w, lay.perm)

    qkv = _same_format([_linear(src, n(k)) for k in ("attn_q", "attn_k", "attn_v")])
    f, parts = blocks.concat_rows([(f, p) for f, p, _ in qkv])
    fl = None if all(x is None for _, _, x in qkv) else np.concatenate(
        [blocks.dequantize(f_, p) if x is None else x for f_, p, x in qkv])
    em.put(S.ATTN_QKV.format(i), f, parts, fl)
    f, parts, fl = _linear(src, n("attn_output"))
    em.put(S.ATTN_OUT.format(i), f, parts, fl)
    gu_roles = [n(k) for k in ("ffn_gate", "ffn_up") if k in T]
    if quant == "mixed":
        _mixed_bundles(src, n, gu_roles, cfg, i, em, lay.perm, hot)
    else:
        _ffn_bundles(src, n, gu_roles, cfg, i, em, lay.perm, quant)
    if lay.predictor is not None:
        em.put(S.FFN_PRED_W1.format(i), lay.predictor.fmt, lay.predictor.parts1)
        em.put(S.FFN_PRED_W2.format(i), lay.predictor.fmt, lay.predictor.parts2)
        w.add_tensor(S.FFN_PRED_B2.format(i), lay.predictor.b2)


def _biases(src, T, cfg, i, w, perm):
    """The q/k/v bias as one vector, zeros for the parts the model lacks, and the gate/up biases in
    the bundle's row order."""
    n = lambda key: T[key].format(i)  # noqa: E731
    qkv = [("attn_q_bias", cfg.n_head), ("attn_k_bias", cfg.n_head_kv), ("attn_v_bias", cfg.n_head_kv)]
    if any(role in T for role, _ in qkv):
        w.add_tensor(S.ATTN_QKV_BIAS.format(i), np.concatenate(
            [src.floats(n(role)).reshape(-1) if role in T else np.zeros(heads * cfg.head_dim, np.float32)
             for role, heads in qkv]))
    roles = ("ffn_gate_bias", "ffn_up_bias") if cfg.ffn_gated else ("ffn_up_bias",)
    if any(role in T for role in roles):
        b = np.stack([src.floats(n(role)).reshape(-1) if role in T else np.zeros(cfg.n_ff, np.float32)
                      for role in roles], axis=1)
        w.add_tensor(S.FFN_GATE_UP_BIAS.format(i), np.ascontiguousarray(b if perm is None else b[perm]))


def _ffn_bundles(src, n, gu_names, cfg, i, em, perm, quant):
    """gate_up (n_ff, 2, d_model) (one row per neuron without a gate) and down_t (n_ff, d_model)
    (docs/design.md §3), rows in file order: source order when perm is None, else row k holds source
    neuron perm[k]."""
    sel = (lambda a: a) if perm is None else (lambda a: a[perm])  # noqa: E731
    neuron_major = src.down_neuron_major
    fm = PL.bundle_formats([src.ttype(name) for name in gu_names], src.ttype(n("ffn_down")), quant, perm is not None,
                           down_neuron_major=neuron_major)
    fg, floats = fm.gate_up[0], None
    if fm.gate_up_carried:
        parts = [src.block(name)[1] for name in gu_names]
        parts = [blocks.with_min(p, fg) for p in parts] if fm.gate_up[1] else parts
    else:
        floats = [src.floats(name) for name in gu_names]
        parts = [blocks.quantize(fg, x) for x in floats]
    gate_up = {p: sel(np.stack([q[p] for q in parts], axis=1)) for p in parts[0]}
    em.put(S.FFN_GATE_UP.format(i), fg, gate_up,
           None if floats is None else sel(np.stack(floats, axis=1)).reshape(len(parts) * cfg.n_ff, -1))
    # down_t (n_ff, d_model): column j of W_down as row j. GGUF's groups run along n_ff, so the
    # exact carry-over uses the row-grouped formats, which only source order keeps (float rows
    # move freely); otherwise rows are re-quantized along d_model (4-bit stays 4-bit).
    if fm.down_carried:
        t = src.tensor(n("ffn_down"))
        fmt, exact = (src.down_t_block(n("ffn_down")) if neuron_major
                      else blocks.from_gguf_transposed(t.ttype, t.raw, t.rows, t.k))
        em.put(S.FFN_DOWN_T.format(i), fmt, {p: sel(a) for p, a in exact.items()})
        return
    # Re-quantizing 4-bit values to 4 bits along the other axis compounds two rounding errors
    # (SmolLM2 reordered: top-1 agreement with the source fell to 74%); auto keeps 8 bits.
    down_t = sel(src.floats(n("ffn_down")).T)
    em.put(S.FFN_DOWN_T.format(i), fm.down[0], blocks.quantize(fm.down[0], down_t), down_t)


def _mixed_bundles(src, n, gu_names, cfg, i, em, perm, hot):
    """--quant mixed: neurons [0, hot) of the file order in f16, [hot, n_ff) in q4 (schema
    FFN_*_COLD). Source blocks carry over exactly where their layout allows: gate/up q4 rows
    always, down_t row groups when the neuron order is the source's."""
    sel = (lambda a: a) if perm is None else (lambda a: a[perm])  # noqa: E731
    items = _same_format([_linear(src, name) for name in gu_names])
    fg = items[0][0]
    gate_up = np.stack([sel(blocks.dequantize(f, p) if x is None else x) for f, p, x in items],
                       axis=1)                                 # (n_ff, 2 or 1, d) file order
    t = src.tensor(n("ffn_down"))
    exact = None if src.down_neuron_major else blocks.from_gguf_transposed(t.ttype, t.raw, t.rows, t.k)
    down_t = sel(src.floats(n("ffn_down")).T)
    parts = []
    if hot:
        parts.append((S.FFN_GATE_UP, S.FFN_DOWN_T, "f16", slice(0, hot)))
    if hot < cfg.n_ff:
        parts.append((S.FFN_GATE_UP_COLD if hot else S.FFN_GATE_UP,
                      S.FFN_DOWN_T_COLD if hot else S.FFN_DOWN_T, "q4", slice(hot, cfg.n_ff)))
    for gu_name, down_name, fmt, rows in parts:
        if fmt == "q4" and fg == "q4":          # the source's own 4-bit rows, permuted
            own = [blocks.with_min(p) for _, p, _ in items]
            em.put(gu_name.format(i), "q4", {p: sel(np.stack([q[p] for q in own], axis=1))[rows] for p in own[0]})
        else:
            flat = gate_up[rows].reshape(-1, cfg.d_model)
            em.put(gu_name.format(i), fmt, {p: a.reshape(len(gate_up[rows]), len(items), -1)
                                            for p, a in blocks.quantize(fmt, flat).items()}, flat)
        carried = (exact is not None and fmt == "q4" and perm is None and exact[0] in ("q4r", "q8r")
                   and rows.start % S.GROUP == 0)
        if carried:
            g = slice(rows.start // S.GROUP, rows.stop // S.GROUP)
            em.put(down_name.format(i), exact[0], {p: a[rows] if p == "q" else a[g] for p, a in exact[1].items()})
        else:
            em.put(down_name.format(i), fmt, blocks.quantize(fmt, down_t[rows]), down_t[rows])
