"""Hostile inputs, round 2: over 300 cases of what a hostile but realistic user sends or hands to
pinfer, each required to end in one clear sentence (a 4xx naming the field, a refusal naming
the problem): never a traceback, a 5xx or a hang.

- `pinfer serve`, a real process on loopback hit by raw HTTP: wrong types and lone surrogates in
  every field, deep JSON, long stop strings, the Bearer scheme's case, identical greedy requests,
  /health while a request renders a hostile template or generates, slow headers, a model that
  fails to load;
- chat templates that try to build huge values through every operator and filter;
- .pinf headers whose checksum is valid but whose content is not (types, bounds, graphs);
- flipped bytes in the ONNX graph sections; a FIFO named .pinf; an output file that appears
  while a conversion runs; a GGUF cut inside its tensor table.

`make test` runs every in-process case and a sample of the ones that start a process per case;
`make fuzz` (PINFER_FUZZ_EXAMPLES above 1000) runs those in full too."""

import contextlib
import hashlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from fixtures import make_tiny_llama_gguf
from test_server import free_port, start_server

from pinfer.converter.convert import ConvertError, ConvertOptions, convert
from pinfer.converter.frontend.gguf_check import GGUFCheckError, read_header
from pinfer.converter.passes import DENSE
from pinfer.formats import PinfFormatError, PinfReader
from pinfer.formats import schema as S
from pinfer.runtime.chat_template import TemplateError, render_chat

KEY = "hostile-key"
FULL = int(os.environ.get("PINFER_FUZZ_EXAMPLES", "0")) > 1000
# A hang guard, not a measurement: the client gives up on any single request after this long (each
# takes well under a second), so a server that hangs fails the test instead of stalling the run.
CASE_SECONDS = 15.0


@pytest.fixture(scope="module")
def pinf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile2")
    src = make_tiny_llama_gguf(d / "t.gguf", qtype="Q8_0")
    with contextlib.redirect_stderr(io.StringIO()):
        return convert(ConvertOptions(src, d / "t.pinf", passes=DENSE))


def _serve(pinf, *extra):
    return start_server(pinf, "-t", "1", "-c", "256", "--api-key", KEY, *extra)


@pytest.fixture(scope="module")
def server(pinf):
    proc, base = _serve(pinf, "--header-timeout", "1")
    yield base
    proc.terminate()
    proc.wait(10)


def _post(base, path, body, headers=None, raw=None):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})}
    return httpx.post(base + path, content=raw if raw is not None else json.dumps(body), headers=h,
                      timeout=CASE_SECONDS)


# -- the server: one field wrong at a time ----------------------------------------------------------

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "m", "prompt": "hi", "max_tokens": 2}
NOT_TEXT = [5, 5.5, True, None, [], {}, [5], ["x", "y"], {"a": 1}]
SURROGATES = ["x\udfffy", "\ud800", "a\udbff\udc00\udc00"]   # lone high, lone low, a pair then a lone one


def _chat_cases():
    cases = []
    for v in NOT_TEXT + SURROGATES:
        if v is not None and v != []:       # null content and no parts are an empty message
            cases.append((f"content={v!r}", {**CHAT, "messages": [{"role": "user", "content": v}]}, "content"))
        cases.append((f"role={v!r}", {**CHAT, "messages": [{"role": v, "content": "hi"}]}, "messages"))
    for v in [5, None, True, [], {}, "x\udfff"] + SURROGATES[1:]:
        part = [{"type": "text", "text": v}]
        cases.append((f"part text={v!r}", {**CHAT, "messages": [{"role": "user", "content": part}]}, "text"))
    for part in [5, "x", None, [], {"type": "image_url", "image_url": {"url": "x"}}, {"type": 5}]:
        cases.append((f"part={part!r}", {**CHAT, "messages": [{"role": "user", "content": [part]}]}, "content[0]"))
    for v in [None, [], {}, "hi", 5, [5], [None], [[]], [{"content": "hi"}]]:
        cases.append((f"messages={v!r}", {**CHAT, "messages": v}, "messages"))
    return cases


def _field_cases(base, tag):
    cases = []
    for v in ["false", "true", 1, 0, [], {}, "yes"]:
        cases.append((f"{tag} stream={v!r}", {**base, "stream": v}, "stream"))
    for v in [1, "x", [], True, [1]]:
        cases.append((f"{tag} stream_options={v!r}", {**base, "stream": True, "stream_options": v}, "stream_options"))
    for v in ["yes", 1, [], {}]:
        cases.append((f"{tag} include_usage={v!r}", {**base, "stream": True, "stream_options": {"include_usage": v}},
                      "include_usage"))
    for v in [5, [5], ["a"] * 5, [None], {"a": 1}, True] + SURROGATES + [[SURROGATES[0]]]:
        cases.append((f"{tag} stop={v!r}", {**base, "stop": v}, "stop"))
    for key, values in {"temperature": [-1, 3, "1", [], {}, True, 1e999], "top_p": [-0.1, 2, "x"],
                        "max_tokens": [0, -1, 10 ** 9, "5", True, 2.5, []], "max_completion_tokens": [0, "x"],
                        "seed": ["x", 2 ** 70, -(2 ** 70), [], True]}.items():
        for v in values:
            cases.append((f"{tag} {key}={v!r}", {**base, key: v}, key))
    for key, v in [("n", 2), ("best_of", 3), ("logprobs", True), ("tools", [{"type": "function"}]),
                   ("response_format", {"type": "json_object"}), ("presence_penalty", 1), ("frequency_penalty", 1),
                   ("logit_bias", {"5": 1}), ("echo", True), ("suffix", "x")]:
        cases.append((f"{tag} {key}={v!r}", {**base, key: v}, key))
    return cases


def _prompt_cases():
    cases = []
    for v in [5, None, [], [5], ["a", "b"], {"a": 1}, True] + SURROGATES + [[SURROGATES[0]]]:
        cases.append((f"prompt={v!r}", {**COMPLETION, "prompt": v}, "prompt"))
    return cases


SERVER_CASES = ([("/v1/chat/completions",) + c for c in _chat_cases() + _field_cases(CHAT, "chat")]
                + [("/v1/completions",) + c for c in _prompt_cases() + _field_cases(COMPLETION, "completion")])


@pytest.mark.parametrize("path, name, body, field", SERVER_CASES, ids=[c[1] for c in SERVER_CASES])
def test_a_wrong_field_is_a_4xx_naming_it(server, path, name, body, field):
    r = _post(server, path, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    message = r.json()["error"]["message"]
    assert field in message or field.split("[")[0] in message, message
    assert "Traceback" not in message


RAW_BODIES = [("deep arrays", b"[" * 200_000 + b"]" * 200_000), ("deep objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
              ("not JSON", b"{'a': 1}"), ("invalid UTF-8", b'{"prompt": "\xff\xfe"}'), ("an array", b"[1, 2]"),
              ("a number", b"5"), ("empty", b""), ("null", b"null"), ("truncated", json.dumps(CHAT)[:-3].encode()),
              ("a NUL", b"\x00"), ("huge number", b'{"max_tokens": 1' + b"0" * 5000 + b"}")]


@pytest.mark.parametrize("name, raw", RAW_BODIES, ids=[n for n, _ in RAW_BODIES])
def test_a_body_that_is_not_a_request_is_a_4xx(server, name, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = _post(server, path, None, raw=raw)
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:200])
        assert r.json()["error"]["message"]


AUTH = [(f"Bearer {KEY}", 200), (f"bearer {KEY}", 200), (f"BEARER {KEY}", 200), (f"Bearer   {KEY}", 200),
        (f"Basic {KEY}", 401), ("Bearer wrong", 401), (KEY, 401), ("Bearer", 401), ("", 401), (f"Bearer {KEY}x", 401)]


@pytest.mark.parametrize("header, status", AUTH)
def test_the_bearer_scheme_is_case_insensitive(server, header, status):
    r = httpx.post(server + "/v1/completions", json=COMPLETION, headers={"Authorization": header}, timeout=30)
    assert r.status_code == status, r.text[:200]


@pytest.mark.parametrize("length", [1, 1000, 900_000])
def test_a_long_stop_string_changes_nothing_but_the_stop(server, length):
    """A stop string of any length is accepted, and the answer is the one without it, cut where the
    stop string occurs if it does (within CASE_SECONDS, the client's hang guard)."""
    greedy = {**COMPLETION, "max_tokens": 3, "temperature": 0}
    plain = _post(server, "/v1/completions", greedy)
    assert plain.status_code == 200, plain.text[:200]
    want = plain.json()["choices"][0]
    stop = "x" * length
    r = _post(server, "/v1/completions", {**greedy, "stop": stop})
    assert r.status_code == 200, (r.status_code, r.text[:200])
    got = r.json()["choices"][0]
    if stop in want["text"]:
        assert (got["text"], got["finish_reason"]) == (want["text"].split(stop)[0], "stop"), (got, want)
    else:
        assert (got["text"], got["finish_reason"]) == (want["text"], want["finish_reason"]), (got, want)


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)])
def test_identical_greedy_requests_give_identical_output(server, path, body):
    """Whatever came before: the server prefills every prompt afresh."""
    greedy = {**body, "temperature": 0, "max_tokens": 24}
    other = {**body, "temperature": 0, "max_tokens": 8}
    if "messages" in body:
        other["messages"] = [{"role": "user", "content": "hi there, how are you"}]
    else:
        other["prompt"] = "hi there, how are you"
    texts = []
    for warm in (None, other, greedy, other):
        if warm is not None:
            assert _post(server, path, warm).status_code == 200
        r = _post(server, path, greedy)
        choice = r.json()["choices"][0]
        texts.append(choice["message"]["content"] if "messages" in body else choice["text"])
    assert len(set(texts)) == 1, texts


def _health_during(base, request, n=6):
    """/health, called again and again while n copies of `request` (a thunk, itself bounded by
    CASE_SECONDS) run, queued one after another by the server: for each answer (each a 200 within
    its client timeout, a hang guard), how many of the n requests had finished when it came."""
    finished = []

    def run():
        request()
        finished.append(1)
    workers = [threading.Thread(target=run) for _ in range(n)]
    for w in workers:
        w.start()
    time.sleep(0.1)
    answers = []
    while any(w.is_alive() for w in workers):
        assert httpx.get(base + "/health", timeout=5).status_code == 200
        answers.append(len(finished))
        time.sleep(0.02)
    for w in workers:
        w.join(60)
    return answers


def test_health_answers_while_a_request_generates(server):
    """/health answers while six 250-token requests run one after another: several answers arrive
    before they are done. ignore_eos keeps every request at its full length whatever the random
    model samples."""
    answers = _health_during(server, lambda: _post(server, "/v1/completions", {**COMPLETION, "max_tokens": 250,
                                                                                "temperature": 0, "ignore_eos": True}))
    assert len(answers) >= 3, answers


# What stops a template: a fragment of the TemplateError, which names the limit that did it. Each is
# a count or a size checked as the template runs (chat_template.LIMITS, the sandbox's checks), so
# a template is stopped after a bounded amount of work whatever the machine's speed.
SIZE = "built a value that is too large"                # value_chars, checked before building where the arguments say the size
FORMATTED = "built a formatted string that is too large"  # the width or precision a format asks for
STEPS = "used too much time"        # the step budget (with no_time_budget, nothing else says this)
OUTPUT = "produced too much text"   # output_chars
UNSAFE = "tried an unsafe operation"                    # the sandbox

BAD_TEMPLATES = {
    "center": ("{{ 'x' | center(300000000) }}", SIZE),
    "percent width": ("{{ '%0300000000d' % 1 }}", FORMATTED),
    "percent star": ("{{ '%*d' % (300000000, 1) }}", FORMATTED),
    "format width": ("{{ '{:>300000000}'.format(1) }}", FORMATTED),
    "format filter": ("{{ '%0300000000d' | format(1) }}", FORMATTED),
    "ljust": ("{{ 'x'.ljust(300000000) }}", SIZE),
    "rjust": ("{{ 'x'.rjust(300000000) }}", SIZE),
    "zfill": ("{{ 'x'.zfill(300000000) }}", SIZE),
    "center method": ("{{ 'x'.center(300000000) }}", SIZE),
    "expandtabs": ("{{ ('\t' * 1000).expandtabs(1000000) }}", SIZE),
    "indent": ("{{ 'x' | indent(300000000) }}", SIZE),
    "indent lines": ("{{ ('a\n' * 100000) | indent(100) }}", SIZE),
    "tilde doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                       SIZE),
    "plus doubling": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                      SIZE),
    "recursive macro": ("{% macro d(s, n) %}{% if n > 0 %}{{ d(s ~ s, n - 1) }}{% else %}{{ s }}{% endif %}{% endmacro %}"
                        "{{ d('x', 40) }}", SIZE),
    "times": ("{{ 'x' * 300000000 }}", SIZE),
    "list times": ("{{ ([1] * 300000000) | length }}", SIZE),
    "power": ("{{ 10 ** 100000 }}", "raised a number to a huge power"),
    "replace empty": ("{{ 'abc'.replace('', 'x' * 1000000) }}", SIZE),
    "replace filter": ("{{ ('a' * 1000) | replace('a', 'b' * 10000) }}", SIZE),
    # (a filter binds tighter than *: without the parentheses the join would be of the number 10)
    "join": ("{{ (['x' * 900000] * 10) | join(',') }}", SIZE),
    "join method": ("{{ ','.join(['x' * 900000] * 10) }}", SIZE),
    "tojson indent": ("{{ messages | tojson(indent=100000000) }}", "indent of more than 64"),
    "endless loop": ("{% for i in range(100000000) %}{% endfor %}", "range(100000000), which is too long"),
    "nested loops": ("{% for i in range(10000) %}{% for j in range(10000) %}{% endfor %}{% endfor %}", STEPS),
    "output": ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", OUTPUT),
    "wordwrap": ("{{ ('x ' * 600000) | wordwrap(1) }}", SIZE),
    "format map": ("{{ '{a:>300000000}'.format_map({'a': 1}) }}", FORMATTED),
    "dunder": ("{{ ''.__class__.__mro__ }}", UNSAFE),
    "namespace dunder": ("{% set ns = namespace(__init__=1) %}", UNSAFE),
}


@pytest.mark.parametrize("name", list(BAD_TEMPLATES))
def test_a_hostile_template_is_stopped_by_a_limit(name, no_time_budget):
    """Each template is stopped by the limit it runs into, which its error names: by a size checked
    before the value is built, or by the step budget; never by the clock (made endless here)."""
    template, limit = BAD_TEMPLATES[name]
    with pytest.raises(TemplateError) as e:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert limit in str(e.value), str(e.value)


@pytest.fixture(scope="module")
def template_server(pinf, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "bad.jinja"
    # about a second of work within the step budget, then a value far too large
    path.write_text("{% for i in range(1500000) %}{% endfor %}{{ 'x' | center(300000000) }}")
    proc, base = _serve(pinf, "--chat-template-file", str(path))
    yield base
    proc.terminate()
    proc.wait(10)


def test_health_answers_while_a_hostile_template_renders(template_server):
    """The renders run off the event loop: /health answers again and again while one and the same
    render is under way (between two renders' ends), not once after each. A render that held the
    loop would let at most one waiting /health call through per render."""
    results = []
    answers = _health_during(template_server, lambda: results.append(_post(template_server, "/v1/chat/completions", CHAT)))
    for r in results:
        assert r.status_code == 400 and "too large" in r.json()["error"]["message"], r.text
    during_one = Counter(a for a in answers if a < len(results))
    assert len(results) == 6 and during_one and max(during_one.values()) >= 3, answers


def test_slow_headers_are_cut_off(server):
    """A client that keeps sending header lines and never ends its request head: the server (here
    --header-timeout 1) closes the connection without answering. The lines sent stay far below
    h11's limit on a head's size, so what closes it is the deadline, not a refusal of a large head
    (that would be answered with a status line). The loop is bounded (about 9 s): a hang guard."""
    host, port = server.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        s.sendall(head)
        closed, received = False, b""
        for _ in range(30):
            try:
                line = b"X-Slow: 1\r\n"
                s.sendall(line)
                head += line
                data = s.recv(4096, socket.MSG_DONTWAIT)
                if data == b"":
                    closed = True
                    break
                received += data
            except BlockingIOError:
                pass
            except OSError:
                closed = True
                break
            time.sleep(0.3)
    assert closed and received == b"", (closed, received[:200])
    assert len(head) < 1024     # h11's max_incomplete_event_size is 16 KiB


def test_a_model_that_fails_to_load_stops_the_server(pinf, tmp_path):
    bad = _rewrite(pinf, tmp_path, lambda h: h["tensors"].pop("blk.1.attn_output.scale"))
    proc = subprocess.run([sys.executable, "-m", "pinfer", "serve", str(bad), "--port", str(free_port()), "-t", "1"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "could not be loaded" in proc.stderr and "missing" in proc.stderr
    assert "Traceback" not in proc.stderr


# -- .pinf headers with a valid checksum --------------------------------------------------------

def _rewrite(pinf, tmp_path, edit, name="bad.pinf"):
    data = bytearray(pinf.read_bytes())
    magic, ver, res, off, length, _ = S.PREAMBLE.unpack(bytes(data[:S.PREAMBLE.size]))
    header = json.loads(bytes(data[off:off + length]))
    edit(header)
    blob = json.dumps(header).encode()
    data = data[:off] + blob
    data[:S.PREAMBLE.size] = S.PREAMBLE.pack(magic, ver, res, off, len(blob), hashlib.sha256(blob).digest())
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return out


def _set(path, value):
    def edit(h):
        *keys, last = path
        d = h
        for k in keys:
            d = d[k]
        d[last] = value
    return edit


def _first_weight(h):
    return next(n for n in h["tensors"] if n.startswith("blk.0.attn_qkv"))


CONFIG_BAD = {"n_layer": [0, -1, 10 ** 6, "2", 2.0, True, None], "d_model": [0, "576", 10 ** 9, 64.5],
              "n_ff": [0, "x", 2 ** 40], "n_head": [0, -4, "4"], "n_head_kv": [0, 3, "2"], "head_dim": [0, 10 ** 6],
              "vocab": [0, "320", 2 ** 40], "n_ctx_train": [0, "x"], "norm_eps": [0, -1, "x", None, True],
              "rope_base": [0, -1, "x"], "rotary_dim": [-1, 10 ** 6], "rope_interleaved": ["yes", 1],
              "ffn_act": ["swish", 5], "norm": ["batch"], "positions": ["alibi"], "sliding_window": [-1, "x"]}
HEADER_EDITS = (
    [(f"config.{k}={v!r}", _set(["config", k], v)) for k, vs in CONFIG_BAD.items() for v in vs]
    + [(f"{k}={v!r}", _set([k], v)) for k in ("config", "tokenizer", "weights", "ffn", "sparsity", "layers", "plan",
                                               "provenance") for v in (None, [], "x", 5)
       if not (k == "layers" and v == [])]
    + [("config={}", _set(["config"], {})), ("rotary_dim odd", _set(["config", "rotary_dim"], 15)),
       ("rotary_dim over head_dim", _set(["config", "rotary_dim"], 4096)),
       ("layers=['x']", _set(["layers"], ["x"])), ("layers=[{mode: odd}]", _set(["layers"], [{"mode": "odd"}] * 2)),
       ("tokenizer.tokens=null", _set(["tokenizer", "tokens"], None)),
       ("tokenizer.tokens=[5]", _set(["tokenizer", "tokens"], [5])),
       ("tokenizer.tokens too many", lambda h: h["tokenizer"].update(tokens=["a"] * 10_000)),
       ("tokenizer.model=5", _set(["tokenizer", "model"], 5)),
       ("weights=[]", _set(["weights"], [])), ("weight format odd", lambda h: h["weights"].update(token_embd="q3")),
       ("ffn.hot_rows='x'", _set(["ffn", "hot_rows"], "x")),
       ("shape 2**70", lambda h: h["tensors"]["token_embd.q"].update(shape=[2 ** 70])),
       ("shape 2**32 x 2**32, 0 bytes", lambda h: h["tensors"]["token_embd.q"].update(shape=[2 ** 32, 2 ** 32],
                                                                                    nbytes=0)),
       ("shape nested", lambda h: h["tensors"]["token_embd.q"].update(shape=[[[[1]]]])),
       ("shape negative", lambda h: h["tensors"]["token_embd.q"].update(shape=[-1, 5])),
       ("shape bool", lambda h: h["tensors"]["token_embd.q"].update(shape=[True, 5])),
       ("nbytes huge", lambda h: h["tensors"]["token_embd.q"].update(nbytes=2 ** 63)),
       ("offset string", lambda h: h["tensors"]["token_embd.q"].update(offset="4096")),
       ("tensors=[]", _set(["tensors"], [])), ("entry=null", lambda h: h["tensors"].update({"token_embd.q": None}))]
)


@pytest.mark.parametrize("name, edit", HEADER_EDITS, ids=[n for n, _ in HEADER_EDITS])
def test_a_damaged_header_with_a_valid_checksum_is_one_sentence(pinf, tmp_path, name, edit):
    bad = _rewrite(pinf, tmp_path, edit)
    with pytest.raises(PinfFormatError) as e:
        PinfReader(bad)
    assert str(e.value).count("\n") == 0 and "re-run `pinfer convert`" in str(e.value)


def test_very_deep_nesting_in_a_header_is_refused(pinf, tmp_path):
    def deep(h):
        h["provenance"]["deep"] = "@@"
    bad = _rewrite(pinf, tmp_path, deep)
    data = bad.read_bytes().replace(b'"@@"', b"[" * 200_000 + b"]" * 200_000)
    magic, ver, res, off, length, _ = S.PREAMBLE.unpack(data[:S.PREAMBLE.size])
    blob = data[off:]
    bad.write_bytes(S.PREAMBLE.pack(magic, ver, res, off, len(blob), hashlib.sha256(blob).digest())
                    + data[S.PREAMBLE.size:])
    with pytest.raises(PinfFormatError, match="nested too deeply"):
        PinfReader(bad)


CLI_HEADER_CASES = HEADER_EDITS if FULL else HEADER_EDITS[::12]


@pytest.mark.parametrize("verb", ["inspect", "generate"])
@pytest.mark.parametrize("name, edit", CLI_HEADER_CASES, ids=[n for n, _ in CLI_HEADER_CASES])
def test_the_cli_says_one_sentence_for_a_damaged_header(pinf, tmp_path, verb, name, edit):
    bad = _rewrite(pinf, tmp_path, edit)
    args = [str(bad)] + (["-p", "hi", "-n", "2"] if verb == "generate" else [])
    r = subprocess.run([sys.executable, "-m", "pinfer", verb, *args], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "Traceback" not in r.stderr and r.stderr.strip().count("\n") == 0, r.stderr


# -- crafted files: every checksum valid, the header edited ------------------------------------------
# A .pinf holds no graphs (format version 2): the runtime builds each one from the header, and the
# header's claims about the weights are checked against the config when the file is opened. The
# cases come from a generator (tests/craft.py), seeded, so a failure replays; `make fuzz` runs more.

CRAFTED = int(os.environ.get("PINFER_FUZZ_EXAMPLES", "0")) or 300


@pytest.fixture(scope="module")
def sparse_pinf(tmp_path_factory):
    from fixtures import QUICK_PASSES
    from pinfer.converter.passes import PassOptions
    d = tmp_path_factory.mktemp("crafted")
    src = make_tiny_llama_gguf(d / "silu.gguf", qtype="Q4_1", seed=5)
    with contextlib.redirect_stderr(io.StringIO()):
        return convert(ConvertOptions(src, d / "silu.pinf", report=False, quant="mixed", target_vram_gib=1e-4,
                                      passes=PassOptions(**{**QUICK_PASSES, "sparsity": "predicted:0.99"})))


def _crafted(source, tmp_path, seeds, timeout):
    """Outcome rows of the worker over `seeds`; the worker dying is a finding that names its case."""
    craft = Path(__file__).parent / "craft.py"
    r = subprocess.run([sys.executable, str(craft), str(source), str(tmp_path), ",".join(map(str, seeds))],
                       capture_output=True, text=True, timeout=timeout)
    rows = [json.loads(line) for line in r.stdout.splitlines()]
    done = [x for x in rows if x["outcome"] != "started"]
    last = rows[-1] if rows else None
    assert r.returncode == 0 and len(done) == len(seeds), f"the worker died (rc {r.returncode}) in {last}: {r.stderr[-800:]}"
    return done


@pytest.mark.parametrize("which", ["dense q8", "predicted mixed"])
@pytest.mark.slow
def test_crafted_files_load_or_end_in_one_sentence(pinf, sparse_pinf, tmp_path, which):
    source = pinf if which == "dense q8" else sparse_pinf
    seeds = range(1000 * (which != "dense q8"), 1000 * (which != "dense q8") + CRAFTED)
    done = _crafted(source, tmp_path, list(seeds), timeout=60 + CRAFTED)
    bad = [x for x in done if x["outcome"] == "traceback"
           or (x["outcome"] == "refused" and ("\n" in x["message"].strip() or not x["message"].strip()))]
    assert not bad, "\n".join(f"seed {x['seed']} ({x['what']}): {x['message'][-400:]}" for x in bad[:5])
    outcomes = {x["outcome"] for x in done}
    assert outcomes == {"ok", "refused"}, outcomes      # the generator makes both kinds of file
    assert list(tmp_path.glob("*.pinf")) == []


@pytest.mark.slow
def test_crafted_files_through_the_cli_end_in_one_line(pinf, tmp_path):
    """A sample of refused cases through `pinfer generate`: exit 1, stdout empty, one line on stderr."""
    from craft import craft
    for seed in range(5000, 5000 + (40 if FULL else 8)):
        bad = tmp_path / f"c{seed}.pinf"
        what = craft(pinf, seed, bad)
        r = subprocess.run([sys.executable, "-m", "pinfer", "generate", str(bad), "-p", "hi", "-n", "2", "-t", "1"],
                           capture_output=True, text=True, timeout=60)
        if r.returncode == 0:
            continue
        assert r.returncode == 1 and r.stdout == "" and "Traceback" not in r.stderr, (what, r.stderr)
        assert r.stderr.strip().count("\n") == 0, (what, r.stderr)


def test_a_version_1_file_says_convert_again(pinf, tmp_path):
    data = bytearray(pinf.read_bytes())
    magic, _, res, off, length, digest = S.PREAMBLE.unpack(bytes(data[:S.PREAMBLE.size]))
    data[:S.PREAMBLE.size] = S.PREAMBLE.pack(magic, 1, res, off, length, digest)
    old = tmp_path / "v1.pinf"
    old.write_bytes(bytes(data))
    with pytest.raises(PinfFormatError, match="version 1 .*convert the model again"):
        PinfReader(old)
    r = subprocess.run([sys.executable, "-m", "pinfer", "generate", str(old), "-p", "hi", "-n", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0 and "convert the model again" in r.stderr


# -- files that are not what they claim ------------------------------------------------------------

@pytest.mark.parametrize("verb", ["inspect", "verify"])
def test_a_fifo_named_pinf_does_not_hang(tmp_path, verb):
    fifo = tmp_path / "x.pinf"
    os.mkfifo(fifo)
    r = subprocess.run([sys.executable, "-m", "pinfer", verb, str(fifo)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a regular file" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_output_that_appears_during_conversion_is_left_alone(tmp_path, monkeypatch):
    from pinfer.formats import writer
    src = make_tiny_llama_gguf(tmp_path / "t.gguf", qtype="Q8_0")
    out = tmp_path / "t.pinf"
    finish = writer.PinfWriter.finish

    def someone_writes_first(self, header):
        out.write_text("someone else's file")
        return finish(self, header)
    monkeypatch.setattr(writer.PinfWriter, "finish", someone_writes_first)
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(ConvertError, match="appeared while"):
        convert(ConvertOptions(src, out, passes=DENSE))
    assert out.read_text() == "someone else's file" and not writer.partial_path(out).exists()
    with contextlib.redirect_stderr(io.StringIO()):
        assert convert(ConvertOptions(src, out, passes=DENSE, force=True)) == out     # --force replaces it
    assert PinfReader(out).header["config"]["n_layer"] > 0


@pytest.mark.parametrize("cut", [0.25, 0.5, 0.75, 0.95])
def test_a_gguf_cut_inside_its_tensor_table_says_truncated(tmp_path, cut):
    import gguf
    src = make_tiny_llama_gguf(tmp_path / "t.gguf", qtype="Q8_0")
    r = gguf.GGUFReader(str(src))
    start, end = min(t.field.offset for t in r.tensors), r.data_offset     # the tensor table, then padding
    data = src.read_bytes()
    short = tmp_path / "short.gguf"
    short.write_bytes(data[:int(start + cut * (end - start))])
    with pytest.raises(GGUFCheckError, match="truncated"):
        read_header(short)


def test_the_battery_holds_300_cases():
    n = (len(SERVER_CASES) + 2 * len(RAW_BODIES) + len(AUTH) + 3 + 2 + 1 + len(BAD_TEMPLATES) + 2 + 1
         + len(HEADER_EDITS) + 1 + 2 * CRAFTED + 1 + 1 + 4)
    print(f"{n} hostile cases in process, plus {2 * len(CLI_HEADER_CASES)} header and some crafted cases through the CLI")
    assert n >= 300
