"""`pinfer serve FILE`: the OpenAI-compatible HTTP API on 127.0.0.1:8080."""

from pathlib import Path

import click

from .common import err, runtime_config, runtime_options


@click.command("serve")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--api-key", default=None, envvar="PINFER_API_KEY", help="Require 'Authorization: Bearer KEY'.")
@click.option("--max-tokens-limit", type=int, default=4096, show_default=True,
              help="Largest max_tokens a request may ask for.")
@click.option("--chat-template-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template to use instead of the model's.")
@runtime_options
def command(model, host, port, api_key, max_tokens_limit, chat_template_file, **kw):
    """Serve a model over an OpenAI-compatible HTTP API."""
    import uvicorn

    from pinfer.runtime.server import ServerOptions, make_app

    opts = ServerOptions(runtime=runtime_config(kw), api_key=api_key,
                         max_tokens_limit=max_tokens_limit,
                         chat_template=Path(chat_template_file).read_text() if chat_template_file else None)
    err(f"pinfer serve: {model.name} on http://{host}:{port}/v1 (not meant for production serving)")
    uvicorn.run(make_app(model, opts), host=host, port=port, log_level="warning")
