"""Chat templates: the Jinja2 programs shipped in model files, rendered as transformers does.

Templates come from untrusted model files, so they run in jinja2's immutable sandbox with only
the names HF templates expect: `raise_exception`, `strftime_now`, a JSON-faithful `tojson`
filter, a `namespace` that refuses underscore names, loop controls and the training-only
`{% generation %}` tag (rendered as its body).
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
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
    if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
        raise TemplateError("Chat template asked tojson for an indent of more than 64; it was stopped")
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


def _too_large(what="a value"):
    return TemplateError(f"Chat template built {what} that is too large; it was stopped")


def _size(value):
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


def _check_size(value):
    if _size(value) > LIMITS["value_chars"]:
        raise _too_large()
    return value


# The numbers of a format that size its output: %-style widths and precisions ("%0300000000d"),
# str.format's ("{:>300000000}"); an output that large would be built before any check could see it.
_PERCENT_SIZES = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_FORMAT_SIZES = re.compile(r"\{[^{}]*:[^{}]*?(\d+)(?:[,_])?(?:\.(\d+))?[^{}]*\}")


def _check_format(fmt, pattern, args=()):
    if not isinstance(fmt, str):
        return
    limit = LIMITS["value_chars"]
    for m in pattern.finditer(fmt):
        for g in m.groups():
            if g == "*":    # the width comes from the arguments
                if any(isinstance(a, int) and abs(a) > limit for a in args):
                    raise _too_large("a formatted string")
            elif g and (len(g) > 7 or int(g) > limit):
                raise _too_large("a formatted string")


# str methods whose first argument sizes the result, and jinja2 filters whose argument does
_WIDTH_METHODS = {"ljust", "rjust", "center", "zfill", "expandtabs"}


def _check_str_call(name, self_, args, kwargs):
    limit = LIMITS["value_chars"]
    if name in _WIDTH_METHODS:
        width = args[0] if args else next(iter(kwargs.values()), 0)
        if isinstance(width, int) and width * (len(self_) if name == "expandtabs" else 1) > limit:
            raise _too_large()
    elif name in ("format", "format_map"):
        _check_format(self_, _FORMAT_SIZES)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        times = len(self_) + 1 if args[0] == "" else self_.count(args[0])
        if len(self_) + times * max(0, len(args[1]) - len(args[0])) > limit:
            raise _too_large()
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        if sum(_size(a) for a in args[0]) + len(self_) * len(args[0]) > limit:
            raise _too_large()


def _sized_filter(name, width_at=None):
    """jinja2's filter `name`, refusing a width argument (position width_at after the value)
    or a result over the size limit."""
    base = jinja2.filters.FILTERS[name]

    def filt(*args, **kwargs):
        _tick()
        if width_at is not None:
            values = list(args[1:]) + list(kwargs.values())
            width = values[width_at] if len(values) > width_at else 0
            lines = args[0].count("\n") + 1 if args and isinstance(args[0], str) else 1
            if isinstance(width, int) and width * lines > LIMITS["value_chars"]:
                raise _too_large()
        if name == "format" and args:
            _check_format(args[0], _PERCENT_SIZES, args[1:])
        if name == "join":      # (eval context, items, separator): the joined size, before joining
            items = args[1] if len(args) > 1 else ()
            sep = args[2] if len(args) > 2 else kwargs.get("d", "")
            if isinstance(items, (list, tuple)) and \
                    sum(_size(i) for i in items) + _size(sep) * len(items) > LIMITS["value_chars"]:
                raise _too_large()
        return _check_size(base(*args, **kwargs))
    for attr in ("jinja_pass_arg",):       # pass_context / pass_eval_context markers
        if hasattr(base, attr):
            setattr(filt, attr, getattr(base, attr))
    return filt


class _MeteredCodeGenerator(jinja2.compiler.CodeGenerator):
    """Compiles `a ~ b` to the environment's checked concatenation, not a plain join."""

    def visit_Concat(self, node, frame):
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, plus a budget of steps and time per render and a size limit on
    every string and list the template builds: checked before building where the arguments say
    the size (*, +, ~, %, widths of str methods and filters), after it elsewhere."""

    intercepted_binops = frozenset(["*", "**", "+", "%", "//", "-", "/"])
    code_generator_class = _MeteredCodeGenerator

    def call(self, context, obj, *args, **kwargs):
        _tick()
        inner = getattr(obj, "__wrapped__", obj)     # the sandbox wraps str.format
        owner = getattr(inner, "__self__", None)
        if isinstance(owner, str):
            _check_str_call(getattr(inner, "__name__", ""), owner, args, kwargs)
        return _check_size(super().call(context, obj, *args, **kwargs))

    def concat(self, parts):
        _tick()
        texts = [p if isinstance(p, str) else str(p) for p in parts]
        if sum(map(len, texts)) > LIMITS["value_chars"]:
            raise _too_large()
        return "".join(texts)

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
                    raise _too_large()
        if operator == "+" and _size(left) + _size(right) > LIMITS["value_chars"]:
            raise _too_large()
        if operator == "%" and isinstance(left, str):
            _check_format(left, _PERCENT_SIZES, right if isinstance(right, tuple) else (right,))
        return _check_size(super().call_binop(context, operator, left, right))


def _environment() -> ImmutableSandboxedEnvironment:
    env = _LimitedSandbox(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals["range"] = _metered_range
    for name, width_at in (("center", 0), ("indent", 0), ("format", None), ("replace", None), ("join", None),
                           ("wordwrap", None), ("truncate", None), ("string", None), ("list", None)):
        env.filters[name] = _sized_filter(name, width_at)
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
