"""`pinfer perplexity FILE -f TEXT -c 512 --chunks N`: llama-perplexity's protocol."""

from pathlib import Path

import click

from .common import err, fail_cleanly, runtime_config, runtime_options, say_notes
from .common import verbose as is_verbose


@click.command("perplexity")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-f", "--file", "text_file", type=click.Path(exists=True, dir_okay=False), required=True,
              help="Text to score.")
@click.option("--chunks", type=int, default=-1, show_default=True, help="Chunks to score (-1: all).")
@runtime_options
@click.pass_context
def command(ctx, model, text_file, chunks, **kw):
    """Perplexity of a text, scored like llama.cpp's llama-perplexity."""
    from dataclasses import replace

    from pinfer.runtime.model import Model
    from pinfer.runtime.perplexity import perplexity
    from pinfer.runtime.tokenizer import Tokenizer

    n_ctx = kw["n_ctx"] or 512
    with fail_cleanly(is_verbose(ctx)):
        options = replace(runtime_config(kw), n_ctx=n_ctx)
        m = Model(model, options)
        say_notes(m, options.verbose)
        tok = Tokenizer.from_spec(m.tokenizer_spec)
        text = Path(text_file).read_text(encoding="utf-8")
        res = perplexity(m, tok, text, n_ctx=n_ctx, n_chunks=chunks,
                         on_chunk=lambda i, n, p: err(f"[{i}/{n}] {p:.4f}"))
    gu, down = m.counters.fractions()
    click.echo(f"PPL = {res.ppl:.4f} +/- {res.stderr:.4f} ({res.chunks} chunks of {n_ctx}, "
               f"{res.tokens_scored} tokens scored; sparsity {', '.join(m.sparsity_names)}: "
               f"the rules keep {gu:.1%} of gate/up rows and {down:.1%} of down rows; "
               f"{m.weight_bytes_per_token() / 1e6:.1f} MB of weights read per token)")
