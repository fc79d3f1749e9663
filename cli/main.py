"""The `pinfer` command: a click group whose verbs live one per module in this package."""

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks and more detail.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=lambda c, p, v: _version(c, v),
              help="Show pinfer's version and its dependencies', then exit.")
@click.pass_context
def cli(ctx, verbose):
    """pinfer: convert a model once into a .pinf file, then run it on CPU (and GPU)."""
    ctx.obj = {"verbose": verbose}


DEPENDENCIES = ("onnxruntime", "onnx", "numpy", "gguf", "tokenizers", "jinja2", "click", "starlette", "uvicorn",
                "torch")


def _version(ctx, value):
    if not value or ctx.resilient_parsing:
        return
    from importlib.metadata import PackageNotFoundError, version

    def v(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    click.echo(f"pinfer {v('pinfer')}")
    for name in DEPENDENCIES:
        click.echo(f"  {name} {v(name)}")
    ctx.exit()


def _register():
    from . import bench, chat, convert, generate, inspect, perplexity, serve, verify  # noqa: F401 (each adds its verb)

    for mod in (convert, generate, chat, perplexity, inspect, serve, bench, verify):
        cli.add_command(mod.command)


_register()


def main():
    # Each verb turns pinfer's errors into one sentence itself (common.fail_cleanly).
    cli()
