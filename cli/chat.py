"""`pinfer chat FILE`: an interactive conversation. /exit, /reset, /system TEXT, /stats, /help.
Ctrl-C stops the reply being written, not the session; Ctrl-D or /exit ends it."""

from pathlib import Path

import click

from .common import err, fail_cleanly, open_session, runtime_options, sampler_config, sampling_options
from .common import verbose as is_verbose

HELP = ('/exit quit · /reset forget the conversation · /system TEXT set the system prompt · /stats last reply\'s '
        'speed · end a line with \\ to continue it, or wrap several lines in """')


def read_message(prompt="> "):
    """One message: a line, lines joined by a trailing backslash, or a block between two \"\"\" lines."""
    line = input(prompt)
    if line.strip() == '"""':
        lines = []
        while (more := input("... ")).strip() != '"""':
            lines.append(more)
        return "\n".join(lines)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = input("... ")
    return "\n".join(lines + [line])


@click.command("chat")
@click.argument("model", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--system", default=None, help="System prompt.")
@click.option("-n", "--n-predict", type=int, default=-1, show_default=True, help="Max tokens per reply (-1: no cap).")
@click.option("--chat-template-file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A Jinja chat template to use instead of the model's.")
@runtime_options
@sampling_options
@click.pass_context
def command(ctx, model, system, n_predict, chat_template_file, **kw):
    """Chat with a model."""
    from pinfer.runtime.chat import Conversation
    from pinfer.runtime.generate import GenerateOptions

    with fail_cleanly(is_verbose(ctx)):
        session = open_session(model, kw)
        template = Path(chat_template_file).read_text() if chat_template_file else None
        conv = Conversation(session, system=system, template=template)
        opts = GenerateOptions(n_predict=n_predict, sampler=sampler_config(kw))
    err(f"pinfer chat: {model.name} loaded in {session.model.load_seconds:.1f} s, context {session.n_ctx}. {HELP}")
    while True:
        try:
            line = read_message()
        except EOFError:
            click.echo()
            return
        except KeyboardInterrupt:
            click.echo()
            continue
        cmd = line.strip()
        if cmd in ("/exit", "/quit", "/bye"):
            return
        if not cmd or _slash_command(cmd, conv, session):
            continue
        conv.turns.append({"role": "user", "content": line})
        reply = []
        try:
            ids = conv.prompt_ids(notice=err)
            for step in session.generate(ids, opts):
                reply.append(step.text)
                click.echo(step.text, nl=False)
        except KeyboardInterrupt:
            err("\n[stopped]")
        except ValueError as e:   # a message larger than the context, a template refusing it
            err(f"[{e}]")
            conv.turns.pop()
            continue
        click.echo()
        conv.turns.append({"role": "assistant", "content": "".join(reply)})


def _slash_command(cmd, conv, session):
    """Carry out a /command of the chat (not /exit); False when cmd is a message to the model."""
    if cmd == "/reset":
        conv.reset()
        err("[conversation cleared]")
    elif cmd.startswith("/system"):
        conv.system = cmd[len("/system"):].strip() or None
        conv.reset()
        err(f"[system prompt {'set' if conv.system else 'cleared'}; conversation cleared]")
    elif cmd == "/stats":
        s, m = session.stats, session.model
        sparsity = ", ".join(m.sparsity_names)
        gu, down = m.counters.fractions()
        err(f"prompt {s.prompt_tokens} tokens at {s.prompt_tps:.1f} tok/s, "
            f"reply {s.decode_tokens} tokens at {s.decode_tps:.1f} tok/s, sparsity {sparsity}"
            f"{' (every FFN neuron computed)' if sparsity == 'dense' else ''}; "
            f"FFN rows kept {gu:.0%} gate/up, {down:.0%} down; {m.weight_bytes_per_token() / 1e6:.1f} MB "
            "of weights read per token")
    elif cmd in ("/help", "/?"):
        err(HELP)
    else:
        return False
    return True
