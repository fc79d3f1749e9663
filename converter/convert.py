"""`pinfer convert`: the compiler driver. Front end -> passes -> back end -> one `.pinf` file."""

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

from . import arch, graphs
from .gguf_source import GGUFSource, SourceError


@dataclass(frozen=True)
class ConvertOptions:
    source: Path
    output: Path | None = None   # default: the source path with the suffix .pinf
    force: bool = False          # overwrite an existing output


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
    t0 = time.perf_counter()
    src_path = Path(opts.source)
    out = Path(opts.output) if opts.output else src_path.with_suffix(".pinf")
    if out.exists() and not opts.force:
        raise ConvertError(f"{out} already exists; pass --force to overwrite it or -o to choose another name")
    try:
        src = GGUFSource(src_path)
        mod = arch.get(src.architecture)        # before any tensor is read
        names = src.tensor_names()
        cfg = mod.config_from_gguf(src.meta, names)
        tokenizer = src.tokenizer_spec()
    except (SourceError, arch.UnsupportedArchitecture, ValueError) as e:
        raise ConvertError(f"{src_path.name}: {e}") from None
    T = mod.TENSORS
    _check_disk(src, out)
    _log(f"pinfer convert: {src_path.name}: {cfg.arch}, {cfg.n_layer} layers, d_model {cfg.d_model}, "
         f"n_ff {cfg.n_ff}, heads {cfg.n_head}/{cfg.n_head_kv}, vocab {cfg.vocab}")
    missing = [n for key, n in T.items() if "{}" not in n and key not in ("output", "rope_freqs") and n not in names]
    missing += [T[k].format(i) for i in range(cfg.n_layer) for k in T if "{}" in T[k] and T[k].format(i) not in names]
    if missing:
        raise ConvertError(f"{src_path} lacks tensors a {cfg.arch} model needs: {', '.join(missing[:5])}"
                           f"{' ...' if len(missing) > 5 else ''}")

    with PinfWriter(out) as w:
        em = _Emitter(w)
        f, parts, fl = _linear(src, T["token_embd"])
        em.put(S.TOKEN_EMBD, f, parts, fl)
        if not cfg.tied_embeddings:
            f, parts, fl = _linear(src, T["output"])
            em.put(S.OUTPUT, f, parts, fl)
        w.add_tensor(S.OUTPUT_NORM, src.floats(T["output_norm"]).reshape(-1))
        if T["rope_freqs"] in names:
            w.add_tensor(S.ROPE_FREQS, src.floats(T["rope_freqs"]).reshape(-1))
        for i in range(cfg.n_layer):
            _layer(src, T, cfg, i, w, em)
            _log(f"  layer {i + 1}/{cfg.n_layer} written ({time.perf_counter() - t0:.1f} s)")
        graph_names = {}
        directory = w.directory
        for i in range(cfg.n_layer):
            name = S.LAYER_GRAPH.format(i)
            w.add_bytes(S.GRAPH.format(name), graphs.serialize(graphs.layer_graph(cfg, i, em.formats, directory)))
            graph_names[name] = S.GRAPH.format(name)
        w.add_bytes(S.GRAPH.format(S.HEAD_GRAPH), graphs.serialize(graphs.head_graph(cfg, em.formats, directory)))
        graph_names[S.HEAD_GRAPH] = S.GRAPH.format(S.HEAD_GRAPH)
        header = {
            "config": cfg.to_dict(),
            "tokenizer": tokenizer,
            "weights": em.formats,
            "ffn": {"layout": "bundles", "neuron_order": "source"},
            "sparsity": {"mode": "dense"},
            "layers": [],
            "plan": {},
            "graphs": graph_names,
            "provenance": {
                "source": src_path.name,
                "source_sha256": src.sha256(),
                "source_name": src.meta.get("general.name"),
                "pinfer_version": pinfer_version(),
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "conversion_error": em.errors,
            },
        }
        w.finish(header)
    worst = max(em.errors.values(), default=0.0)
    _log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s; "
         f"{len(em.errors)} tensors re-quantized, worst relative error {worst:.2e}")
    return out


def _check_disk(src, out):
    """Remove a partial file left by a killed run, and refuse to start without room for the output."""
    stale = partial_path(out)
    if stale.exists():
        _log(f"removing {stale.name}, left by an interrupted conversion")
        stale.unlink()
    # Formats are carried over or re-quantized to at most 8.5 bits, so the output is at most about
    # twice the source's 4-bit tensors; graphs and header add a few MB.
    planned = 2 * sum(src.tensor(n).raw.nbytes for n in src.tensor_names()) + (16 << 20)
    free = shutil.disk_usage(out.resolve().parent).free
    if free < planned:
        raise ConvertError(f"{out.parent} has {free / 1e9:.2f} GB free and the output may need up to "
                           f"{planned / 1e9:.2f} GB; free some space or write elsewhere with -o")


def _layer(src, T, cfg, i, w, em):
    """One layer's norms, attention weights and FFN bundles."""
    n = lambda key: T[key].format(i)  # noqa: E731
    w.add_tensor(S.ATTN_NORM.format(i), src.floats(n("attn_norm")).reshape(-1))
    w.add_tensor(S.FFN_NORM.format(i), src.floats(n("ffn_norm")).reshape(-1))

    qkv = _same_format([_linear(src, n(k)) for k in ("attn_q", "attn_k", "attn_v")])
    f, parts = blocks.concat_rows([(f, p) for f, p, _ in qkv])
    fl = None if all(x is None for _, _, x in qkv) else np.concatenate(
        [blocks.dequantize(f_, p) if x is None else x for f_, p, x in qkv])
    em.put(S.ATTN_QKV.format(i), f, parts, fl)
    f, parts, fl = _linear(src, n("attn_output"))
    em.put(S.ATTN_OUT.format(i), f, parts, fl)

    # FFN bundles (DESIGN.md §3): gate_up (n_ff, 2, d_model), down_t (n_ff, d_model)
    (fg, pg, wg), (fu, pu, wu) = _same_format([_linear(src, n("ffn_gate")), _linear(src, n("ffn_up"))])
    if fg == "q4" and ("min" in pg or "min" in pu):
        pg, pu = blocks.with_min(pg), blocks.with_min(pu)
    gate_up = {p: np.stack([pg[p], pu[p]], axis=1) for p in pg}
    em.put(S.FFN_GATE_UP.format(i), fg, gate_up,
           None if wg is None else np.stack([wg, wu], axis=1).reshape(2 * cfg.n_ff, -1))
    # down_t (n_ff, d_model): column j of W_down as row j. GGUF's groups run along n_ff, so the
    # exact carry-over uses the row-grouped formats; other types are re-quantized to q8.
    t = src.tensor(n("ffn_down"))
    exact = blocks.from_gguf_transposed(t.ttype, t.raw, t.rows, t.k)
    if exact is not None:
        em.put(S.FFN_DOWN_T.format(i), *exact)
    else:
        down_t = src.floats(n("ffn_down")).T.copy()
        em.put(S.FFN_DOWN_T.format(i), "q8", blocks.quantize("q8", down_t), down_t)
