"""`pinfer convert MODEL.gguf`: one .pinf file from a GGUF model."""

from pathlib import Path

import click

from .common import fail_cleanly, verbose


@click.command("convert")
@click.argument("source", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Output file (default: SOURCE with the suffix .pinf).")
@click.option("--force", is_flag=True, help="Overwrite an existing output file.")
@click.pass_context
def command(ctx, source, output, force):
    """Convert a GGUF model into a .pinf file."""
    import signal

    from pinfer.converter.convert import ConvertOptions, convert

    # SIGTERM unwinds like Ctrl-C, so the partial output is removed on the way out.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with fail_cleanly(verbose(ctx)):
        out = convert(ConvertOptions(source=source, output=output, force=force))
    click.echo(str(out))
