"""`pinfer generate FILE -p PROMPT`: tokens to stdout as they come, stats to stderr."""

from pathlib import Path

import click

from .common import err, fail_cleanly, open_session, peak_rss_mb, runtime_options, sampler_config, sampling_options
from .common import verbose as is_verbose


@click.command("generate")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-p", "--prompt", default=None, help="Prompt text.")
@click.option("-f", "--file", "prompt_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Read the prompt from a file.")
@click.option("-n", "--n-predict", type=int, default=256, show_default=True,
              help="Tokens to generate (-1: until end of generation or a full context).")
@click.option("--chat", "as_chat", is_flag=True, help="Wrap the prompt as a user turn with the chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-generation tokens.")
@runtime_options
@sampling_options
@click.pass_context
def command(ctx, model, prompt, prompt_file, n_predict, as_chat, ignore_eos, **kw):
    """Generate text from a prompt."""
    from pinfer.runtime.generate import GenerateOptions

    if prompt is None and prompt_file is None:
        raise click.UsageError("give a prompt with -p TEXT or -f FILE")
    text = prompt if prompt is not None else Path(prompt_file).read_text()
    with fail_cleanly(is_verbose(ctx)):
        session = open_session(model, kw)
        if as_chat:
            from pinfer.runtime.chat import render_messages
            text = render_messages(session, [{"role": "user", "content": text}])
        ids = session.tokenizer.encode(text)
        opts = GenerateOptions(n_predict=n_predict, sampler=sampler_config(kw), ignore_eos=ignore_eos)
        if not as_chat:
            click.echo(text, nl=False)
        for step in session.generate(ids, opts):
            click.echo(step.text, nl=False)
        click.echo()
        print_stats(session, load=session.model.load_seconds)


def print_stats(session, load=None):
    s = session.stats
    if load is not None:
        err(f"load time      = {load * 1000:9.1f} ms")
    err(f"prompt eval    = {s.prompt_seconds * 1000:9.1f} ms / {s.prompt_tokens} tokens "
        f"({s.prompt_tps:.1f} tokens per second)")
    err(f"eval           = {s.decode_seconds * 1000:9.1f} ms / {max(s.decode_tokens - 1, 0)} tokens "
        f"({s.decode_tps:.1f} tokens per second)")
    m = session.model
    gu, down = m.counters.read_fractions()
    err(f"ffn            = {', '.join(m.sparsity_names)}: {gu:.1%} of gate/up rows and {down:.1%} of down rows "
        f"read, {m.weight_bytes_per_token() / 1e6:.1f} MB of weights per token")
    err(f"peak RSS       = {peak_rss_mb():9.1f} MB")
    err(f"seed           = {session.sampler.seed}")
