"""Fuzzing the three parsers of untrusted input: the GGUF front end, the .pinf reader and the chat
template renderer. Each may only fail with its documented error type (a ValueError subclass
carrying one sentence); anything else (IndexError, MemoryError, a hang, a crash) is a bug.

`make test` runs PINFER_FUZZ_EXAMPLES (default 1,000) cases per target; `make fuzz` runs 20,000."""

import contextlib
import hashlib
import io
import json
import os
import struct

import pytest
from fixtures import make_tiny_llama_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pinfer.converter.passes import DENSE
from pinfer.converter.convert import ConvertOptions, convert
from pinfer.converter.frontend.gguf_source import GGUFSource, SourceError
from pinfer.formats import PinfFormatError, PinfReader
from pinfer.formats import schema as S
from pinfer.formats.config import ModelConfig
from pinfer.runtime.chat_template import TemplateError, render_chat

EXAMPLES = int(os.environ.get("PINFER_FUZZ_EXAMPLES", "1000"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    src = make_tiny_llama_gguf(d / "seed.gguf", qtype="Q4_1", n_layer=1, vocab=320)
    with contextlib.redirect_stderr(io.StringIO()):
        out = convert(ConvertOptions(src, d / "seed.pinf", passes=DENSE))
    return d, src.read_bytes(), out.read_bytes()


# A mutation: (kind, position fraction, value)
MUTATION = st.tuples(st.sampled_from(["byte", "u32", "u64", "truncate", "huge"]),
                     st.floats(0, 1, allow_nan=False), st.integers(0, 2 ** 64 - 1))


def mutate(data, mutations, lo=0):
    b = bytearray(data)
    for kind, frac, value in mutations:
        pos = lo + int(frac * max(len(b) - lo - 8, 1))
        if pos >= len(b):
            continue
        if kind == "byte":
            b[pos] = value & 0xFF
        elif kind == "u32":
            b[pos:pos + 4] = struct.pack("<I", value & 0xFFFFFFFF)
        elif kind in ("u64", "huge"):
            b[pos:pos + 8] = struct.pack("<Q", value if kind == "u64" else (1 << 40) + (value & 0xFFFF))
        else:
            del b[pos:]
    return bytes(b)


def read_gguf_fully(path):
    src = GGUFSource(path)
    _ = src.architecture, src.tokenizer_spec()
    for name in src.tensor_names():
        src.floats(name)


@FUZZ
@given(st.lists(MUTATION, min_size=1, max_size=4))
@pytest.mark.slow
def test_fuzz_gguf_front_end(seeds, mutations):
    d, gguf, _ = seeds
    path = d / "case.gguf"
    # most mutations go to the metadata or the tensor directory, where the counts and offsets live
    where = mutations[0][2] % 3
    if where == 0:
        data = mutate(gguf, mutations)
    elif where == 1:
        data = mutate(gguf[:4096], mutations) + gguf[4096:]
    else:
        lo = gguf.find(b"token_embd.weight") - 8       # the tensor directory starts near here
        hi = lo + 2048
        data = gguf[:lo] + mutate(gguf[lo:hi], mutations) + gguf[hi:]
    path.write_bytes(data)
    try:
        read_gguf_fully(path)
    except SourceError:
        pass


def rewrite_header(data, edit):
    """An adversary that rewrites the JSON header and fixes its checksum."""
    magic, ver, res, off, length, _ = S.PREAMBLE.unpack(data[:S.PREAMBLE.size])
    blob = edit(data[off:off + length])
    out = bytearray(data[:off] + blob)
    out[:S.PREAMBLE.size] = S.PREAMBLE.pack(magic, ver, res, off, len(blob), hashlib.sha256(blob).digest())
    return bytes(out)


JSON_EDITS = st.tuples(st.floats(0, 1, allow_nan=False),
                       st.sampled_from(['-1', '1e300', '"x"', 'null', '[]', '{}', '999999999999', '0', 'true',
                                        '[1,2,3]', '"u8"', '"f32"', '4096', '-4096']))


def edit_json(blob, edits):
    s = blob.decode()
    for frac, token in edits:
        # replace one JSON scalar value (after a ':' or '[' or ',') with the token
        spots = [i for i, ch in enumerate(s) if ch in ":[,"]
        if not spots:
            break
        i = spots[int(frac * (len(spots) - 1))] + 1
        j = i
        while j < len(s) and s[j] not in ",]}":
            if s[j] in "[{":
                break
            j += 1
        s = s[:i] + token + s[j:]
    return s.encode()


@FUZZ
@given(st.lists(MUTATION, max_size=3), st.lists(JSON_EDITS, max_size=3))
@pytest.mark.slow
def test_fuzz_pinf_reader(seeds, mutations, edits):
    d, _, pinf = seeds
    data = pinf
    if edits:
        data = rewrite_header(data, lambda b: edit_json(b, edits))
    if mutations:
        data = mutate(data, mutations)
    path = d / "case.pinf"
    path.write_bytes(data)
    try:
        r = PinfReader(path)
        ModelConfig.from_dict(r.header["config"]) if isinstance(r.header["config"], dict) else None
        for name in r.tensors:
            r.tensor(name).sum()
        r.verify()
    except (PinfFormatError, ValueError, TypeError):
        # ModelConfig raises ValueError/TypeError for a mangled config, after the reader accepted
        # the container; the runtime turns those into its own sentence.
        pass


SNIPPETS = st.sampled_from([
    "{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.role }}{% endfor %}", "{{ 'x' * 7 }}",
    "{% for i in range(5) %}{{ i }}{% endfor %}", "{{ raise_exception('no') }}", "{{ bos_token }}",
    "{% if add_generation_prompt %}<|im_start|>{% endif %}", "{{ messages | tojson }}", "{{ ''.__class__ }}",
    "{% set ns = namespace(a=1) %}{% set ns.a = ns.a + 1 %}{{ ns.a }}", "{{ 10 ** 100 }}", "{{ x.y.z }}",
    "{% for i in range(10**9) %}{% endfor %}", "{{ 'a' * 10**8 }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ strftime_now('%Y') }}", "{% generation %}g{% endgeneration %}", "{{", "{% for %}", "{{ messages[99] }}",
    "{{ cycler }}", "{{ self }}", "{{ lipsum }}", "{{ range(3) | list }}", "{{ [1,2] + [3] }}",
])


@FUZZ
@given(st.lists(SNIPPETS, min_size=1, max_size=5), st.text(max_size=50))
@pytest.mark.slow
def test_fuzz_chat_templates(parts, content):
    try:
        out = render_chat("".join(parts), [{"role": "user", "content": content}])
        assert isinstance(out, str)
    except TemplateError:
        pass
