"""`pinfer serve FILE`: the OpenAI-compatible HTTP API on 127.0.0.1:8080."""

import os
from pathlib import Path

import click

from .common import err, runtime_config, runtime_options, say_notes


@click.command("serve")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--api-key", default=None, envvar="PINFER_API_KEY", help="Require 'Authorization: Bearer KEY'.")
@click.option("--max-tokens-limit", type=int, default=4096, show_default=True,
              help="Largest max_tokens a request may ask for.")
@click.option("--chat-template-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template to use instead of the model's.")
@click.option("--header-timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
              help="Seconds a connection may take to send a request's headers before it is closed.")
@runtime_options
def command(model, host, port, api_key, max_tokens_limit, chat_template_file, header_timeout, **kw):
    """Serve a model over an OpenAI-compatible HTTP API."""
    import uvicorn

    from pinfer.runtime.server import ServerOptions, make_app

    opts = ServerOptions(runtime=runtime_config(kw), api_key=api_key,
                         max_tokens_limit=max_tokens_limit,
                         chat_template=Path(chat_template_file).read_text() if chat_template_file else None)
    def load_failed(e):
        err(f"pinfer serve: {model.name} could not be loaded: {e}")
        os._exit(1)     # from the loading thread: uvicorn would otherwise keep answering
    app = make_app(model, opts, on_load_error=load_failed,
                   on_loaded=lambda m: say_notes(m, opts.runtime.verbose))
    err(f"pinfer serve: {model.name} on http://{host}:{port}/v1 (not meant for production serving)")
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", http=header_timeout_protocol(header_timeout),
                            timeout_graceful_shutdown=5)
    stopping_server(config, app.state.engine).run()
    err("pinfer serve: stopped")


def stopping_server(config, engine):
    """uvicorn's server, changed in two ways for Ctrl-C and SIGTERM. The generations stop at their
    next token (engine.close), so open streams end at once: uvicorn alone waits for every response
    to finish, which for a long one outlasts a service manager's patience. And the signal is not
    raised again after the graceful shutdown (uvicorn does, to end the process by it): a stop that
    was asked for is a clean exit, status 0."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.close()
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()
    return Server(config)


def header_timeout_protocol(seconds):
    """uvicorn's h11 protocol with a deadline of `seconds` for each request head: uvicorn has
    none, so a client sending its headers a byte at a time would hold a connection for ever."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._head_deadline = self.loop.call_later(seconds, self._head_late)

        def _head_late(self):
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self):
            super().on_response_complete()
            self._head_deadline.cancel()        # the next request's head gets its own deadline
            self._head_deadline = self.loop.call_later(seconds, self._head_late)

        def connection_lost(self, exc):
            self._head_deadline.cancel()
            super().connection_lost(exc)
    return HeaderTimeout
