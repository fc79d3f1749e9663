"""The benchmark harness (`python -m benchmarks run SUITE`, `python -m benchmarks render`): real
runs on the tiny model, in a process of their own as a user starts them; an engine that crashes
(a real process killed by SIGSEGV) is a row saying so; render is deterministic, places every
result file, and docs/benchmarks.md is what it makes of the committed ones."""

import hashlib
import json
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))     # the benchmarks' own idiom (benchmarks/__init__.py)
from harness import DOC, IMAGES, RESULTS, TEMPLATE, render  # noqa: E402
from harness.record import NOT_AVAILABLE  # noqa: E402

SEGV = "llama.cpp's worker exited with status -11 (a segmentation fault)"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(GGUF, its dense .pinf) of the tiny 2-layer Q4_1 model."""
    from fixtures import make_tiny_llama_gguf

    from pinfer.converter.convert import ConvertOptions, convert
    from pinfer.converter.passes import DENSE
    d = tmp_path_factory.mktemp("harness")
    gguf = make_tiny_llama_gguf(d / "tiny.gguf", qtype="Q4_1", n_layer=2, d_model=64, n_ff=128, seed=5)
    pinf = convert(ConvertOptions(gguf, d / "tiny.pinf", report=False, passes=DENSE))
    return Path(gguf), Path(pinf)


@pytest.fixture
def segv_python(tmp_path):
    """A "Python" that dies of a segmentation fault as llama.cpp's AMX build does: a real process
    ended by a real SIGSEGV."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nkill -SEGV $$\n")
    fake.chmod(0o755)
    return fake


def harness(*args, out):
    """`python -m benchmarks ARGS --out OUT` from the checkout's root; (its record, its stdout)."""
    r = subprocess.run([sys.executable, "-m", "benchmarks", *map(str, args), "--out", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    files = sorted(Path(out).glob("*.json"))
    assert len(files) == 1, files
    return json.loads(files[0].read_text()), r.stdout


def test_a_decode_run_writes_the_whole_record(tiny, tmp_path):
    """No --pinf (a dense conversion made on the spot) and no --llama-python: the record has every
    part, pinfer's figures are the medians and ranges of its runs, and llama.cpp is a row that
    says it was not available. render then gives its table and a plot with its commit."""
    gguf, _ = tiny
    rec, stdout = harness("run", "decode", "--model", gguf, "--threads", "1", "--tokens", "4", "--settle", "0",
                          out=tmp_path / "results")
    assert rec["schema"] == 1 and rec["suite"] == "decode" and rec["origin"] == "measured"
    assert rec["command"].startswith("python -m benchmarks run decode --model ")
    c = rec["commit"]
    assert len(c["commit"]) == 40 and c["short"] == c["commit"][:7] and isinstance(c["dirty"], bool)
    m = rec["machine"]
    assert m["cores"] >= 1 and m["ram_bytes"] > 0 and m["cpu"] and m["kernel"].startswith("Linux")
    assert set(m["flags"]) <= {"avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
                               "avx512_bf16", "amx_tile", "amx_int8", "amx_bf16"}
    v = rec["versions"]
    assert v["pinfer"] and v["python"] and v["numpy"] and v["onnxruntime"]
    assert v["llama_cpp_python"] is None and v["llama_cpp_failed"] == NOT_AVAILABLE
    f = rec["flags"]
    assert f["threads"] == [1] and f["tokens"] == 4 and f["repeats"] == 5
    assert f["pinfer_isa"] in ("portable", "avx2", "avx512") and f["isa_forced"] is None
    assert f["llama_n_ubatch"] == 512 and f["llama_n_ubatch_default"] is True
    (model,) = rec["models"]
    assert model["gguf"] == {"name": "tiny.gguf", "bytes": gguf.stat().st_size,
                             "sha256": hashlib.sha256(gguf.read_bytes()).hexdigest()[:16]}
    assert model["pinf"]["how"] == "converted on the spot (--sparsity none)"
    (row,) = rec["rows"]
    ours = row["pinfer"]
    assert row["threads"] == 1 and ours["n"] == len(ours["runs"]) == 5
    assert ours["median"] == statistics.median(ours["runs"]) and ours["min"] == min(ours["runs"]) > 0
    assert row["llama.cpp"] == {"failed": NOT_AVAILABLE} and row["ratio"] is None
    assert row["mb_per_token"] > 0 and row["rows_read"] == [1.0, 1.0]
    assert rec["failures"] == [{"engine": "llama.cpp", "model": "tiny.gguf", "threads": 1, "reason": NOT_AVAILABLE}]
    assert NOT_AVAILABLE in stdout

    template = tmp_path / "t.md"
    template.write_text("# t\n\n{{results decode}}\n")
    page = render.render(results=tmp_path / "results", template=template, images=tmp_path / "img")
    assert f"at `{c['short']}`" in page and m["summary"] in page and f"llama.cpp: {NOT_AVAILABLE}" in page
    (png,) = (tmp_path / "img").glob("*.png")
    assert f"](img/benchmarks/{png.name})" in page and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("suite, args, said", [
    ("decode", ["--tokens", "4", "--settle", "0"], SEGV),
    ("prompt", ["--tokens", "8", "--settle", "0"], SEGV),
    ("quality", ["--chunks", "1", "--ctx", "64"], "llama.cpp's perplexity exited with status -11 (a segmentation fault)"),
    ("memory", ["--loads", "1", "--tokens", "2"], "llama.cpp's load exited with status -11 (a segmentation fault)"),
])
def test_an_engine_that_crashes_is_a_row(tiny, tmp_path, segv_python, suite, args, said):
    """llama.cpp's process killed by SIGSEGV at every step: the run ends normally, pinfer's figures
    are there, and llama.cpp's row and the failures say how it ended."""
    gguf, pinf = tiny
    rec, _ = harness("run", suite, "--model", gguf, "--pinf", pinf, "--threads", "1", "--llama-python", segv_python,
                     *args, out=tmp_path)
    assert rec["versions"]["llama_cpp_failed"] == "llama.cpp's info exited with status -11 (a segmentation fault)"
    assert [x["reason"] for x in rec["failures"] if x["engine"] == "llama.cpp"] == [said]
    assert not [x for x in rec["failures"] if x["engine"] == "pinfer"]
    if suite in ("decode", "prompt"):
        (row,) = rec["rows"]
        assert row["llama.cpp"] == {"failed": said} and row["pinfer"]["n"] == 5
    else:
        theirs = [r for r in rec["rows"] if r["engine"] == "llama.cpp"]
        ours = [r for r in rec["rows"] if r["engine"] == "pinfer"]
        assert [r["failed"] for r in theirs] == [said] and "failed" not in ours[0]
        assert ours[0]["ppl"] > 1 if suite == "quality" else ours[0]["load_s"]["n"] == 1


def test_the_committed_page_is_what_render_makes(tmp_path):
    """docs/benchmarks.md is render's output for the committed template and result files, byte for
    byte (a hand edit fails here: `python -m benchmarks render` rewrites it), render gives the same
    page and the same plots twice, and every plot the page links is committed."""
    first = render.render(images=tmp_path / "a")
    again = render.render(images=tmp_path / "b")
    assert first == again
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(p.name for p in (tmp_path / "b").iterdir())
    for png in (tmp_path / "a").iterdir():
        assert png.read_bytes() == (tmp_path / "b" / png.name).read_bytes(), png.name
    assert DOC.read_text() == first, "docs/benchmarks.md is not what `python -m benchmarks render` makes"
    linked = set(re.findall(r"\]\(img/benchmarks/([^)]+\.png)\)", first))
    assert linked == {p.name for p in (tmp_path / "a").iterdir()}
    assert linked <= {p.name for p in IMAGES.glob("*.png")}


def test_render_places_every_record_and_shows_its_cells(tmp_path):
    """A result file the template does not place, or a placeholder without its record, stops
    render; a changed cell changes the page (so the comparison above can fail); transcribed
    tables say that their raw runs were not kept, with their machine and commit."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    page = render.render(results=results, template=TEMPLATE, images=tmp_path / "img")
    rec = json.loads((results / "transcribed" / "decode-families.json").read_text())
    assert f"*Transcribed from the hand-written page (the raw runs were not kept). Machine: {rec['machine']}. " \
           f"Commit: {rec['commit']}.*" in page
    rec["rows"][0][2] = "32.8 (32.5-33.6)"
    (results / "transcribed" / "decode-families.json").write_text(json.dumps(rec))
    changed = render.render(results=results, template=TEMPLATE, images=tmp_path / "img")
    assert changed != page and "| 32.8 (32.5-33.6) |" in changed
    (results / "transcribed" / "extra.json").write_text(json.dumps({**rec, "id": "extra"}))
    with pytest.raises(ValueError, match="does not place: benchmarks/results/transcribed/extra.json|extra.json"):
        render.render(results=results, template=TEMPLATE, images=tmp_path / "img")
    template = tmp_path / "t.md"
    template.write_text("{{transcribed no-such-table}}\n")
    with pytest.raises(ValueError, match="no-such-table"):
        render.render(results=results, template=template, images=tmp_path / "img")


def test_the_decode_loop_is_greedy_or_fed(tiny):
    """pinfer.runtime.bench.decode_rate, the loop of `pinfer bench` and of the harness: the prompt
    one token a call, then each step takes the argmax of the step before, or the fed token."""
    import numpy as np

    from pinfer.runtime.bench import decode_rate
    from pinfer.runtime.model import Model, RuntimeOptions
    m = Model(tiny[1], RuntimeOptions(threads=1, n_ctx=64, device="cpu"))
    calls, forward = [], m.forward

    def spy(ids, **kw):
        out = forward(ids, **kw)
        calls.append((list(ids), int(np.argmax(out[-1]))))
        return out
    m.forward = spy
    assert decode_rate(m, 4, [5, 6, 7]) > 0
    assert [ids for ids, _ in calls[:3]] == [[5], [6], [7]] and len(calls) == 7
    assert all(calls[i][0] == [calls[i - 1][1]] for i in range(3, 7))
    calls.clear()
    decode_rate(m, 3, feed=[9, 10, 11, 12])
    assert [ids for ids, _ in calls] == [[9], [10], [11]]
    with pytest.raises(ValueError, match="fewer than the 5 steps"):
        decode_rate(m, 5, feed=[1, 2])
    with pytest.raises(ValueError, match="needs a prompt"):
        decode_rate(m, 2)
