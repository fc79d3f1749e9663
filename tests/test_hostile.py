"""Broken and hostile files: damaged .pinf sections named by `pinfer verify`, a conversion killed at
any moment leaving no partial output, and GGUF headers whose counts lie."""

import contextlib
import io
import os
import signal
import struct
import subprocess
import sys
import time
import tracemalloc

import pytest
from fixtures import make_tiny_llama_gguf

from pinfer.converter.passes import DENSE
from pinfer.converter.convert import ConvertError, ConvertOptions, convert
from pinfer.formats import PinfFormatError, PinfReader
from pinfer.formats import schema as S
from pinfer.formats.writer import partial_path


@pytest.fixture(scope="module")
def pinf(tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    src = make_tiny_llama_gguf(d / "t.gguf", qtype="Q4_1")
    with contextlib.redirect_stderr(io.StringIO()):
        return convert(ConvertOptions(src, d / "t.pinf", passes=DENSE))


def flipped(path, offset, tmp_path):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    out = tmp_path / "damaged.pinf"
    out.write_bytes(bytes(data))
    return out


def test_verify_names_every_damaged_tensor_and_padding(pinf, tmp_path):
    r = PinfReader(pinf)
    entries = sorted(r.tensors.items(), key=lambda kv: kv[1]["offset"])
    for name, e in entries:
        if e["nbytes"]:
            assert PinfReader(flipped(pinf, e["offset"] + e["nbytes"] // 2, tmp_path)).verify() == [name]
    first_gap = next(e["offset"] + e["nbytes"] for _, e in entries if e["nbytes"] % S.ALIGNMENT)
    assert PinfReader(flipped(pinf, first_gap, tmp_path)).verify()[0].startswith("padding before")
    assert PinfReader(flipped(pinf, S.PREAMBLE.size + 1, tmp_path)).verify() == ["preamble padding"]


@pytest.mark.parametrize("where, words", [(0, "magic"), (8, "version"), ("header", "checksum")])
def test_damaged_preamble_or_header_is_named(pinf, tmp_path, where, words):
    if where == "header":
        where = S.PREAMBLE.unpack(pinf.read_bytes()[:S.PREAMBLE.size])[3] + 3
    with pytest.raises(PinfFormatError, match=words):
        PinfReader(flipped(pinf, where, tmp_path))


def test_verify_command_exit_codes(pinf, tmp_path):
    e = PinfReader(pinf).tensors["blk.0.ffn_down_t.q"]
    bad = flipped(pinf, e["offset"] + 5, tmp_path)
    run = lambda p: subprocess.run([sys.executable, "-m", "pinfer", "verify", str(p)],  # noqa: E731
                                   capture_output=True, text=True, timeout=120)
    ok, broken = run(pinf), run(bad)
    assert ok.returncode == 0 and "OK" in ok.stdout
    assert broken.returncode == 1 and "blk.0.ffn_down_t.q" in broken.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
@pytest.mark.slow
def test_interrupted_convert_leaves_no_partial_output(tmp_path, sig):
    src = make_tiny_llama_gguf(tmp_path / "big.gguf", qtype="F32", n_layer=8, d_model=256, n_ff=1024, n_head=4)
    dest = tmp_path / "big.pinf"
    cmd = [sys.executable, "-m", "pinfer", "convert", str(src), "-o", str(dest), "--sparsity", "none"]
    interrupted = 0
    for delay in (0.0, 0.02, 0.05, 0.1, 0.2):
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 60
        while not partial_path(dest).exists() and p.poll() is None and time.time() < deadline:
            time.sleep(0.002)
        time.sleep(delay)
        if p.poll() is None:
            interrupted += 1
            os.kill(p.pid, sig)
        p.wait(60)
        if dest.exists():        # it finished before the signal: then it must be whole
            assert PinfReader(dest).verify() == []
            dest.unlink()
        if sig != signal.SIGKILL:
            assert not partial_path(dest).exists()
    assert interrupted >= 2
    # after any of it, the next run succeeds and leaves no temporary file
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert PinfReader(dest).verify() == [] and not partial_path(dest).exists()


def _convert_cli(*args):
    return subprocess.run([sys.executable, "-m", "pinfer", "convert", *map(str, args), "--sparsity", "none"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("target", ["dangling", "existing file"])
def test_convert_never_follows_a_symlink_at_its_partial_name(tmp_path, target):
    src = make_tiny_llama_gguf(tmp_path / "t.gguf", qtype="Q8_0")
    dest, elsewhere = tmp_path / "out" / "t.pinf", tmp_path / "elsewhere.bin"
    dest.parent.mkdir()
    if target == "existing file":
        elsewhere.write_bytes(b"keep me")
    partial_path(dest).symlink_to(elsewhere)
    r = _convert_cli(src, "-o", dest)
    assert r.returncode == 0, r.stderr
    assert not dest.is_symlink() and PinfReader(dest).verify() == []
    assert not os.path.lexists(partial_path(dest))
    if target == "existing file":
        assert elsewhere.read_bytes() == b"keep me"
    else:
        assert not os.path.lexists(elsewhere)
    assert [p.name for p in dest.parent.iterdir() if not p.name.startswith("t.pinf.report")] == ["t.pinf"]


@pytest.mark.parametrize("how", ["same name", "symlink to the source", "hard link"])
def test_convert_refuses_to_write_over_its_source_even_with_force(tmp_path, how):
    src = make_tiny_llama_gguf(tmp_path / "t.gguf", qtype="Q8_0")
    before = src.read_bytes()
    out = src if how == "same name" else tmp_path / "o.pinf"
    if how == "symlink to the source":
        out.symlink_to(src)
    elif how == "hard link":
        os.link(src, out)
    r = _convert_cli(src, "-o", out, "--force")
    assert r.returncode == 1 and "is the source model itself" in r.stderr, r.stderr
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
    assert src.read_bytes() == before and not os.path.lexists(partial_path(out))


def header_with(tmp_path, **kw):
    src = make_tiny_llama_gguf(tmp_path / "h.gguf", qtype="Q8_0", **kw)
    return src, bytearray(src.read_bytes())


@pytest.mark.parametrize("patch, words", [
    (lambda b: b.__setitem__(slice(0, 4), b"GGML"), "magic"),
    (lambda b: b.__setitem__(slice(4, 8), struct.pack("<I", 99)), "version"),
    (lambda b: b.__setitem__(slice(16, 24), struct.pack("<Q", 10 ** 12)), "metadata keys"),
    (lambda b: b.__setitem__(slice(8, 16), struct.pack("<Q", 10 ** 12)), "tensors"),
    (lambda b: b.__delitem__(slice(len(b) // 2, None)), "outside the file"),
])
def test_lying_gguf_headers_get_one_sentence(tmp_path, patch, words):
    src, data = header_with(tmp_path)
    patch(data)
    src.write_bytes(bytes(data))
    with pytest.raises(ConvertError, match=words) as e:
        convert(ConvertOptions(src, tmp_path / "out.pinf", passes=DENSE))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "out.pinf").exists()


def test_huge_string_array_is_refused_before_it_is_read(tmp_path):
    """An array claiming 10^12 strings is refused on its count, checked against the file's size
    before a single item is read: the error names the count, and the refusal allocated next to
    nothing (tracemalloc's peak; reading even the count's worth of list slots would be terabytes)."""
    src, data = header_with(tmp_path)
    key = b"tokenizer.ggml.tokens"
    i = data.find(key) + len(key)
    # after the key: the value type (ARRAY), the item type (STRING), then the item count
    assert struct.unpack_from("<II", data, i) == (9, 8)
    data[i + 8:i + 16] = struct.pack("<Q", 10 ** 12)
    src.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        with pytest.raises(ConvertError, match="tokenizer.ggml.tokens") as e:
            convert(ConvertOptions(src, tmp_path / "out.pinf", passes=DENSE))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "claims 1000000000000 strings, more than the file holds" in str(e.value), str(e.value)
    assert peak < 16 << 20, peak


@pytest.mark.parametrize("template, limit", [
    # endless work: the step budget (the time budget is made endless, so only it says this)
    ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}", "used too much time"),
    # a huge string, refused before it is built
    ("{{ 'x' * 10**9 }}", "built a value that is too large"),
    # doubling: refused at the first value over the size limit
    ("{% set s = namespace(v='ab') %}{% for i in range(60) %}{% set s.v = s.v + s.v %}{% endfor %}{{ s.v }}",
     "built a value that is too large"),
    # endless recursion: Python's recursion limit, reported as the template's failure
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    # an escape attempt: the sandbox
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "tried an unsafe operation"),
])
def test_hostile_chat_templates_are_stopped_by_a_limit(template, limit, no_time_budget):
    from pinfer.runtime.chat_template import TemplateError, render_chat

    with pytest.raises(TemplateError) as e:
        render_chat(template, [{"role": "user", "content": "hi"}])
    assert limit in str(e.value), str(e.value)


def test_no_pickle_anywhere():
    """No unpickling of arbitrary objects: torch.load only as weights_only=True (PowerInfer's
    activation counts), never pickle itself."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    folders = [root / d for d in ("formats", "converter", "runtime", "cli")] + [root / "pinfer" / "kernels"]
    assert all(f.is_dir() for f in folders)
    code = "".join(p.read_text() for d in folders for p in d.rglob("*.py"))
    assert "import pickle" not in code and "pickle.load" not in code
    loads = re.findall(r"torch\.load\(([^)]*)\)", code)
    assert loads and all("weights_only=True" in args for args in loads), loads
