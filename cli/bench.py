"""`pinfer bench FILE`: llama-bench's shape (-p 512 -n 128 -r 5, comma lists sweep)."""

import csv
import io
import json
from pathlib import Path

import click

from .common import fail_cleanly, placement_options, runtime_config, say_notes
from .common import verbose as is_verbose


def _ints(text):
    try:
        return [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@click.command("bench")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-p", "--n-prompt", default="512", show_default=True, help="Prefill lengths (comma list, 0: none).")
@click.option("-n", "--n-gen", default="128", show_default=True, help="Decode lengths (comma list, 0: none).")
@click.option("-t", "--threads", default="1", show_default=True, help="Thread counts (comma list).")
@click.option("-r", "--repetitions", type=int, default=5, show_default=True)
@click.option("-o", "--output", type=click.Choice(["md", "csv", "json"]), default="md", show_default=True)
@placement_options
@click.pass_context
def command(ctx, model, n_prompt, n_gen, threads, repetitions, output, **kw):
    """Measure prefill (pp) and decode (tg) speed, as llama-bench does."""
    from pinfer.formats import PinfReader
    from pinfer.runtime.bench import run_bench

    tests = [("pp", n) for n in _ints(n_prompt) if n > 0] + [("tg", n) for n in _ints(n_gen) if n > 0]
    if not tests:
        raise click.UsageError("nothing to measure: give -p or -n a positive length")
    with fail_cleanly(is_verbose(ctx)):
        header = PinfReader(model).header
        options = runtime_config(kw)
        results = run_bench(model, tests, _ints(threads), repetitions, options=options,
                            on_load=lambda m: say_notes(m, options.verbose))
    c = header["config"]
    size_mb = model.stat().st_size / 1e6
    sparsity = kw.get("sparsity") or ("dense" if kw.get("dense") else header["sparsity"].get("mode", "dense"))
    if kw.get("activation"):
        sparsity += f", activation {kw['activation']}"
    rows = [{"model": f"{c['arch']} {c['n_layer']}L d{c['d_model']}", "size_MB": round(size_mb, 1),
             "threads": r.threads, "test": r.test, "t/s": round(r.tps_mean, 2), "sd": round(r.tps_sd, 2),
             "sparsity": sparsity, "MB/token": round(r.bytes_per_token / 1e6, 1)} for r in results]
    if output == "json":
        click.echo(json.dumps(rows, indent=1))
    elif output == "csv":
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
        click.echo(buf.getvalue(), nl=False)
    else:
        click.echo("| model | size | threads | test | t/s | sparsity | MB read/token |")
        click.echo("| --- | ---: | ---: | ---: | ---: | --- | ---: |")
        for r in rows:
            click.echo(f"| {r['model']} | {r['size_MB']} MB | {r['threads']} | {r['test']} | "
                       f"{r['t/s']:.2f} ± {r['sd']:.2f} | {r['sparsity']} | {r['MB/token']} |")
