"""A conversation over a Session: the chat template, history kept inside the context window, and
KV-cache reuse between turns (only the new turn's tokens are computed)."""

import sys

from .chat_template import CHATML_FALLBACK, render_chat


def template_of(session, override=None):
    if override:
        return override
    t = session.model.tokenizer_spec.get("chat_template")
    if not t:
        print("warning: the model has no chat template; using ChatML", file=sys.stderr)
        return CHATML_FALLBACK
    return t


def render_messages(session, messages, template=None, add_generation_prompt=True):
    tok = session.tokenizer
    piece = lambda i: tok.decode([i]) if i is not None else ""  # noqa: E731
    return render_chat(template_of(session, template), messages, add_generation_prompt=add_generation_prompt,
                       bos_token=piece(tok.bos_id), eos_token=piece(tok.eos_id))


class Conversation:
    def __init__(self, session, system=None, template=None, reserve=256):
        self.session = session
        self.template = template_of(session, template)
        self.system = system
        self.turns = []          # [{"role", "content"}, ...] without the system message
        self.reserve = reserve   # tokens kept free for the reply

    def messages(self):
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns

    def prompt_ids(self, notice=lambda msg: None):
        """Token ids of the conversation ready for the reply, dropping the oldest turns (with a
        notice) until it fits in the context with `reserve` tokens to spare."""
        while True:
            text = render_messages(self.session, self.messages(), self.template)
            ids = self.session.tokenizer.encode(text, parse_special=True)
            limit = self.session.n_ctx - min(self.reserve, self.session.n_ctx // 4)
            if len(ids) <= limit or len(self.turns) <= 1:
                if len(ids) > self.session.n_ctx - 1:
                    raise ValueError(f"the message is {len(ids)} tokens, more than the context of "
                                     f"{self.session.n_ctx}; raise -c or shorten it")
                return ids
            dropped = 2 if len(self.turns) > 2 else 1
            self.turns = self.turns[dropped:]
            notice(f"[context full: dropped the oldest {dropped} message(s)]")

    def reset(self):
        self.turns = []
        self.session.reset()
