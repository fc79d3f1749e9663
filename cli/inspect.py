"""`pinfer inspect FILE`: what a .pinf or .gguf file holds (header or metadata, tensors, sizes)."""

import json
from pathlib import Path

import click

from .common import fail_cleanly
from .common import verbose as is_verbose


def summary(reader):
    h = reader.header
    tok = h["tokenizer"]
    return {
        "file": str(reader.path),
        "size_bytes": reader.size,
        "config": h["config"],
        "tokenizer": {"model": tok.get("model"), "pre": tok.get("pre"), "vocab": len(tok.get("tokens", [])),
                      "bos_id": tok.get("bos_id"), "eos_id": tok.get("eos_id"),
                      "chat_template": bool(tok.get("chat_template"))},
        "weights": h["weights"],
        "ffn": h["ffn"],
        "sparsity": h["sparsity"],
        "provenance": h["provenance"],
        "tensors": {n: {k: e[k] for k in ("dtype", "shape", "nbytes")} for n, e in h["tensors"].items()},
    }


def gguf_summary(path):
    from pinfer.converter.frontend.gguf_source import GGUFSource

    src = GGUFSource(path)
    meta = {k: (f"[{len(v)} items]" if isinstance(v, list) and len(v) > 16 else v) for k, v in src.meta.items()}
    if isinstance(meta.get("tokenizer.chat_template"), str):
        meta["tokenizer.chat_template"] = f"[{len(src.meta['tokenizer.chat_template'])} characters]"
    tensors = {}
    for name in sorted(src.tensor_names()):
        t = src.tensor(name)
        tensors[name] = {"type": t.ttype.name, "shape": [t.rows, t.k], "nbytes": int(t.raw.nbytes)}
    return {"file": str(path), "size_bytes": path.stat().st_size, "format": "gguf", "powerinfer": src.powerinfer,
            "metadata": meta,
            "tensors": tensors}


def _print_gguf(s, tensors):
    kind = "PowerInfer GGUF (PWRI: predictors fc1/fc2, ffn_down_t)" if s.get("powerinfer") else "GGUF"
    click.echo(f"{s['file']}: {s['size_bytes'] / 1e6:.1f} MB, {kind}, {len(s['tensors'])} tensors")
    for k, v in s["metadata"].items():
        click.echo(f"  {k:45s} {v}")
    types = {}
    for e in s["tensors"].values():
        types[e["type"]] = types.get(e["type"], 0) + 1
    click.echo(f"  tensor types: {', '.join(f'{n} {t}' for t, n in sorted(types.items()))}")
    if tensors:
        for n, e in s["tensors"].items():
            click.echo(f"    {n:40s} {e['type']:6s} {str(tuple(e['shape'])):20s} {e['nbytes'] / 1e6:9.3f} MB")


@click.command("inspect")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print everything as JSON.")
@click.option("--tensors/--no-tensors", default=False, help="List every tensor.")
@click.pass_context
def command(ctx, path, as_json, tensors):
    """Show what a .pinf or .gguf file holds."""
    from pinfer.formats import PinfReader

    with fail_cleanly(is_verbose(ctx)):
        if not path.is_file():      # a FIFO or device: reading its magic would block
            raise ValueError(f"{path} is not a regular file; pass a .pinf or .gguf file")
        with open(path, "rb") as f:
            is_gguf = f.read(4) in (b"GGUF", b"PWRI")     # PWRI: PowerInfer's GGUF files
        s = gguf_summary(path) if is_gguf else summary(PinfReader(path))
    if is_gguf and not as_json:
        _print_gguf(s, tensors)
        return
    if as_json:
        click.echo(json.dumps(s, indent=1))
        return
    c = s["config"]
    click.echo(f"{s['file']}: {s['size_bytes'] / 1e6:.1f} MB, .pinf from {s['provenance'].get('source')} "
               f"(pinfer {s['provenance'].get('pinfer_version')})")
    click.echo(f"  model      {c['arch']}: {c['n_layer']} layers, d_model {c['d_model']}, n_ff {c['n_ff']}, "
               f"heads {c['n_head']}/{c['n_head_kv']} x {c['head_dim']}, vocab {c['vocab']}, ctx {c['n_ctx_train']}")
    t = s["tokenizer"]
    click.echo(f"  tokenizer  {t['model']}/{t['pre']}, {t['vocab']} tokens, bos {t['bos_id']}, eos {t['eos_id']}, "
               f"chat template {'yes' if t['chat_template'] else 'no'}")
    fmts = {}
    for base, f in s["weights"].items():
        fmts[f] = fmts.get(f, 0) + 1
    click.echo(f"  weights    {', '.join(f'{n} {f}' for f, n in sorted(fmts.items()))}")
    sp = s["sparsity"]
    click.echo(f"  sparsity   {sp.get('mode')}: {', '.join(sp.get('chosen', [])) or 'dense (not calibrated)'}")
    if sp.get("reason"):
        click.echo(f"             {sp['reason']}")
    for row in sp.get("heldout", {}).get("points", []):
        click.echo(f"             {row['point']:<16} held-out PPL {row['ppl']:.3f} ({row['increase']:+.2%}), "
                   f"FFN {row['ffn_bytes'] / 1e6:.2f} MB/token")
    _activation(sp.get("activation"))
    total = sum(e["nbytes"] for e in s["tensors"].values())
    click.echo(f"  tensors    {len(s['tensors'])}, {total / 1e6:.1f} MB")
    if tensors:
        for n, e in s["tensors"].items():
            click.echo(f"    {n:40s} {e['dtype']:4s} {str(tuple(e['shape'])):20s} {e['nbytes'] / 1e6:9.3f} MB")


def _activation(rec):
    """The activation sparsity levels convert --activation-thresholds chose, and what it measured
    (a stranger's file may say anything there: one line saying so, nothing half printed)."""
    if rec is None:
        return
    try:
        levels = ", ".join(f"{p} {float(v):g}" for p, v in rec["chosen"].items())
        lines = [f"  activation {levels} (--activation-sparsity auto), within +{float(rec['max_ppl_increase']):.1%} "
                 f"of held-out PPL {float(rec['dense_ppl']):.3f}"]
        if rec.get("curve"):
            lines.append("             measured (levels of qkv, o, gate_up, down):")
        for row in rec.get("curve", []):
            lv = " ".join(f"{float(v):g}" for v in row["levels"].values())
            lines.append(f"             levels {lv:<16} held-out PPL {float(row['ppl_increase']):+.2%}")
    except (AttributeError, KeyError, TypeError, ValueError, OverflowError):
        lines = ["  activation (the file's record of it is malformed)"]
    for line in lines:
        click.echo(line)
