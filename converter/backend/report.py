"""What the converter tells the user: `--dry-run`'s plan, and `<out>.report.json` with PNG plots."""

import json
import os
import sys
from pathlib import Path

import numpy as np

from pinfer.converter.passes import CALIB_TOKENS_MAX
from pinfer.formats import blocks
from pinfer.formats.writer import create_new, partial_path
from pinfer.runtime.accounting import PROCESS_BYTES, kv_cache_bytes
from pinfer.runtime.options import DEFAULT_CTX


def _echo(msg):
    print(msg, file=sys.stderr, flush=True)


def dry_run(src, T, cfg, opts, out):
    """Print what the conversion would do (memory, disk, formats) and write nothing."""
    po = opts.passes
    fmts = {}
    total_src = 0
    for name in sorted(src.tensor_names()):
        t = src.tensor(name)
        total_src += t.raw.nbytes
        exact = blocks.from_gguf(t.ttype, t.raw[:1], 1, t.k) if t.rows > 1 else None
        fmts[name] = (t.ttype.name if hasattr(t.ttype, "name") else str(t.ttype),
                      exact[0] if exact else "q8 (re-quantized)" if t.rows > 1 else "f32")
    layer_f32 = 4 * sum(src.tensor(T[k].format(0)).rows * src.tensor(T[k].format(0)).k
                        for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
                        if k in T)
    calibrating = po.sparsity != "none"
    n_points = 8
    train = po.calib_tokens or CALIB_TOKENS_MAX
    hidden = 4 * cfg.d_model * (train + n_points * po.heldout_tokens)
    acts = train * (4 * cfg.d_model + 2 * cfg.n_ff + cfg.n_ff) + 3 * 4 * po.heldout_tokens * cfg.n_ff
    ram = layer_f32 + (hidden + acts if calibrating else 0)
    _echo(f"plan for {out}:")
    _echo(f"  sparsity {po.sparsity}, quant {opts.quant}, order {po.order}, target VRAM {opts.target_vram_gib} GiB")
    if calibrating:
        _echo(f"  calibration: {po.calib_tokens or f'up to {CALIB_TOKENS_MAX}'} train + {po.heldout_tokens} held-out tokens in sequences of "
              f"{po.seq_len} ({po.calib or 'built-in text'}), one layer at a time")
    _echo(f"  peak memory beyond the program: about {ram / 1e9:.2f} GB (one layer's weights in f32"
          f"{', hidden states and one layer of FFN activations' if calibrating else ''})")
    _echo(f"  output: about {total_src * 1.1 / 1e6:.0f} MB (source tensors {total_src / 1e6:.0f} MB, plus "
          f"predictors of at most {po.predictor_budget:.0%} of FFN bytes)")
    ctx = min(cfg.n_ctx_train, DEFAULT_CTX)
    kv = kv_cache_bytes(cfg, ctx)
    held = total_src - (0 if cfg.tied_embeddings else src.tensor(T["token_embd"]).raw.nbytes)
    _echo(f"  running it on the CPU (one copy of the weights: runtime/loading.py): about "
          f"{(held + kv + PROCESS_BYTES) / 1e9:.2f} GB (weights {held / 1e9:.2f} GB, a {ctx}-token KV cache "
          f"{kv / 1e9:.2f} GB)")
    for name, (ttype, fmt) in fmts.items():
        _echo(f"    {name:<32} {ttype:>6} -> {fmt}")


def _atomic_write(path, data):
    tmp = partial_path(path)
    with create_new(tmp) as f:
        f.write(data)
    os.replace(tmp, path)


def report_paths(out):
    out = Path(out)
    return {"json": out.with_name(out.name + ".report.json"),
            "frequency": out.with_name(out.name + ".frequency.png"),
            "modes": out.with_name(out.name + ".modes.png"),
            "predictors": out.with_name(out.name + ".predictors.png"),
            "placement": out.with_name(out.name + ".placement.png")}


def write_report(out, cfg, layout, header, checks, seconds):
    paths = report_paths(out)
    body = {
        "file": Path(out).name,
        "seconds": round(seconds, 1),
        "config": header["config"],
        "sparsity": header["sparsity"],
        "layers": header["layers"],
        "plan": header["plan"],
        "verification": checks,
        "conversion_error": header["provenance"]["conversion_error"],
    }
    _atomic_write(paths["json"], json.dumps(body, indent=1).encode())
    if not layout.calibration.layers:       # the early answer: no per-layer calibration to plot
        _echo(f"report: {paths['json']}")
        return {"json": paths["json"]}
    try:
        _plots(paths, cfg, layout, header)
    except ImportError:
        _echo("matplotlib is not installed: no plots (pip install matplotlib)")
        return paths
    _echo(f"report: {paths['json']} and plots {', '.join(p.name for k, p in paths.items() if k != 'json')}")
    return paths


def _plots(paths, cfg, layout, header):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = header["layers"]
    L = len(layers)
    cmap = plt.get_cmap("viridis")

    # 1. power-law plot: share of neurons (hottest first) vs share of activations
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for i, lay in enumerate(layout.layers):
        f = np.sort(lay.freq)[::-1]
        cum = np.cumsum(f) / max(f.sum(), 1e-12)
        ax.plot(np.arange(1, len(f) + 1) / len(f), cum, color=cmap(i / max(1, L - 1)), lw=0.8)
    ax.plot([0, 1], [0, 1], "k--", lw=0.6, label="no skew")
    ax.set_xlabel("share of neurons, hottest first")
    ax.set_ylabel("share of activations")
    ax.set_title(f"Activation skew per layer (colour: layer 0..{L - 1})")
    ax.legend(loc="lower right")
    _save(fig, paths["frequency"])

    # 2. chosen mode and measured read shares per layer
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(L)
    gu = [lay["read"].get(_point(lay), [1, 1, 1])[0] for lay in layers]
    dn = [lay["read"].get(_point(lay), [1, 1, 1])[1] for lay in layers]
    ax.bar(x - 0.2, gu, 0.4, label="gate/up rows read")
    ax.bar(x + 0.2, dn, 0.4, label="down rows read")
    for i, lay in enumerate(layers):
        ax.text(i, 1.02, _point(lay), rotation=90, ha="center", va="bottom", fontsize=6)
    ax.set_ylim(0, 1.35)
    ax.set_xlabel("layer")
    ax.set_ylabel("share of rows (held-out, measured)")
    ax.set_title(f"Chosen mode per layer: {header['sparsity']['mode']} -> {', '.join(header['sparsity']['chosen'])}")
    ax.legend(loc="lower right", fontsize=7)
    _save(fig, paths["modes"])

    # 3. predictor quality: candidate share at each recall target, and mass vs count recall
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    targets = sorted({t["recall_target"] for lay in layers for t in lay["predictor"]["thresholds"]})
    for k, target in enumerate(targets):
        row = [next(t for t in lay["predictor"]["thresholds"] if t["recall_target"] == target) for lay in layers]
        a1.plot(x, [t["candidate_fraction"] for t in row], marker="o", ms=3, label=f"mass recall {target}")
        a2.plot(x, [t["count_recall"] for t in row], marker="o", ms=3, label=f"target {target}")
    a1.set_xlabel("layer"), a1.set_ylabel("share of neurons selected"), a1.set_ylim(0, 1.02)
    a1.set_title("Predictor candidates (held-out)"), a1.legend(fontsize=7)
    a2.set_xlabel("layer"), a2.set_ylabel("count recall at the mass-recall threshold")
    a2.set_title("Count recall (held-out)"), a2.legend(fontsize=7)
    _save(fig, paths["predictors"])

    _placement_plot(plt, paths["placement"], cfg, header["plan"], x)


def _placement_plot(plt, path, cfg, plan, x):
    """The default placement for the target VRAM: each layer's hot and cold shares."""
    fig, ax = plt.subplots(figsize=(7, 3.5))
    hot = np.array(plan["hot_neurons"])
    ax.bar(x, hot / cfg.n_ff, label="hot (GPU)")
    ax.bar(x, 1 - hot / cfg.n_ff, bottom=hot / cfg.n_ff, label="cold (CPU)")
    ax.set_ylim(0, 1)
    ax.set_xlabel("layer"), ax.set_ylabel("share of FFN neurons")
    ax.set_title(f"Default placement for {plan['target_vram_gib']} GiB: {plan['hot_share']:.0%} of neurons hot")
    ax.legend(loc="lower right", fontsize=7)
    _save(fig, path)


def _point(lay):
    return lay["mode"] if lay["mode"] == "dense" else f"{lay['mode']}:{lay['value']:g}"


def _save(fig, path):
    import matplotlib.pyplot as plt
    fig.tight_layout()
    tmp = partial_path(path)
    with create_new(tmp) as f:
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
