"""Chat templates: the Jinja2 programs shipped in model files, rendered as transformers does.

Templates come from untrusted model files, so they run in jinja2's immutable sandbox with only
the names HF templates expect: `raise_exception`, `strftime_now`, a JSON-faithful `tojson`
filter, a `namespace` that refuses underscore names, loop controls and the training-only
`{% generation %}` tag (rendered as its body).
"""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# ChatML, for models that ship no template (SmolLM2 and Qwen use this format).
CHATML_FALLBACK = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class TemplateError(ValueError):
    """A chat template that cannot be compiled or rendered, or that raised on purpose."""


class _RaisedByTemplate(Exception):
    """Carries a template's own `raise_exception` message out past jinja2."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training masks;
    for inference it is just its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace()`, refusing underscore-prefixed names (a route to internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja2's signature trick, so `self=` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str):
    raise _RaisedByTemplate(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson HTML-escapes <, >, & and ' which would corrupt prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# Resource limits for one render: templates come from strangers and must not hang or eat memory.
LIMITS = {"seconds": 2.0, "steps": 2_000_000, "output_chars": 4_000_000, "value_chars": 1_000_000}
_meter = threading.local()


def _tick(n=1):
    """Count work done by the template; raise TemplateError past a limit."""
    m = getattr(_meter, "state", None)
    if m is None:
        return
    m[0] += n
    if m[0] > LIMITS["steps"] or (m[0] & 1023) == 0 and time.monotonic() > m[1]:
        raise TemplateError("Chat template used too much time; it was stopped (a loop that does not end?)")


def _metered_range(*args):
    r = range(*args)
    if len(r) > LIMITS["steps"]:
        raise TemplateError(f"Chat template asked for range({', '.join(map(str, args))}), which is too long")
    for i in r:
        _tick()
        yield i


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a budget of steps and time per render and a size limit on
    strings and lists that the template builds with *, ** or +."""

    intercepted_binops = frozenset(["*", "**", "+"])

    def call(self, context, obj, *args, **kwargs):
        _tick()
        return super().call(context, obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
            raise TemplateError("Chat template raised a number to a huge power; it was stopped")
        if operator == "*":
            for a, b in ((left, right), (right, left)):
                if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > LIMITS["value_chars"]:
                    raise TemplateError("Chat template built a value that is too large; it was stopped")
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple)) and len(result) > LIMITS["value_chars"]:
            raise TemplateError("Chat template built a value that is too large; it was stopped")
        return result


def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals["range"] = _metered_range
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       namespace=_Namespace)
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    """Compiled once per source string; models reuse one template for every request."""
    try:
        return _ENV.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise TemplateError(f"Chat template does not compile: {err.message} (line {err.lineno}); "
                            "supply a corrected template.") from err


def render_chat(template: str, messages: list[dict], *, add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", extra: dict | None = None) -> str:
    """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]). `extra` adds
    template variables (tools, documents, enable_thinking, ...); it cannot override the core
    ones."""
    compiled = _compile(template)
    context = {**(extra or {}), "messages": messages,
               "add_generation_prompt": add_generation_prompt,
               "bos_token": bos_token, "eos_token": eos_token}
    _meter.state = [0, time.monotonic() + LIMITS["seconds"]]
    try:
        out, size = [], 0
        for chunk in compiled.generate(context):
            size += len(chunk)
            if size > LIMITS["output_chars"]:
                raise TemplateError("Chat template produced too much text; it was stopped")
            _tick()
            out.append(chunk)
        return "".join(out)
    except TemplateError:
        raise
    except _RaisedByTemplate as err:
        raise TemplateError(f"Chat template refused the conversation: {err}") from err
    except jinja2.exceptions.SecurityError as err:
        raise TemplateError(f"Chat template tried an unsafe operation and was stopped: {err}") from err
    except jinja2.TemplateError as err:
        raise TemplateError(f"Chat template failed while rendering: {err}") from err
    except Exception as err:  # a template is a program: TypeError, KeyError, ... surface as one type
        raise TemplateError(f"Chat template failed while rendering: "
                            f"{type(err).__name__}: {err}") from err
    finally:
        _meter.state = None
