"""The `pinfer` command: a click group whose verbs live one per module in this package."""

import sys
import traceback

import click

from .common import fail_cleanly


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and more detail.")
@click.version_option(package_name="pinfer", message="pinfer %(version)s")
@click.pass_context
def cli(ctx, verbose):
    """pinfer: convert a model once into a .pinf file, then run it on CPU (and GPU)."""
    ctx.obj = {"verbose": verbose}


def _register():
    from . import chat, convert, generate, inspect, perplexity, serve  # noqa: F401 (each adds its verb)

    for mod in (convert, generate, chat, perplexity, inspect, serve):
        cli.add_command(mod.command)


_register()


def main():
    with fail_cleanly("-v" in sys.argv or "--verbose" in sys.argv):
        cli(standalone_mode=True)


__all__ = ["cli", "main", "traceback"]
