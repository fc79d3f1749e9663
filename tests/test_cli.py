"""The `pinfer` command, run as a real process on a tiny model made here."""

import json
import subprocess
import sys

import pytest
from fixtures import make_tiny_llama_gguf

# The fixture's conversion runs the default passes (calibration, predictors): 15 to 30 s on a 2-core
# machine. The quick run (`pytest -m "not slow"`) still drives the CLI through test_hostile,
# test_server, test_serve_signals, test_chat_pty and test_hf_models.
pytestmark = pytest.mark.slow


def pinfer(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "pinfer", *map(str, args)], input=stdin, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    src = make_tiny_llama_gguf(d / "tiny.gguf", qtype="Q8_0")
    r = pinfer("convert", src, "-o", d / "tiny.pinf")
    assert r.returncode == 0, r.stderr
    return d / "tiny.pinf"


def test_generate_streams_text_to_stdout_and_stats_to_stderr(tiny):
    r = pinfer("generate", tiny, "-p", "hello", "-n", "12", "-s", "3", "-t", "1", "--ignore-eos")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("hello")
    for key in ("load time", "prompt eval", "eval", "ffn            = ", "MB of weights per token", "peak RSS",
                "seed           = 3"):
        assert key in r.stderr
    again = pinfer("generate", tiny, "-p", "hello", "-n", "12", "-s", "3", "-t", "1", "--ignore-eos")
    assert again.stdout == r.stdout  # same seed, same text


def test_inspect_json(tiny):
    r = pinfer("inspect", tiny, "--json")
    info = json.loads(r.stdout)
    assert info["config"]["arch"] == "llama" and info["config"]["n_layer"] == 2
    assert info["weights"]["blk.0.ffn_gate_up"] == "q8"
    assert "blk.0.ffn_down_t.q" in info["tensors"]


def test_chat_commands(tiny):
    r = pinfer("chat", tiny, "-n", "8", "--temp", "0", "-t", "1",
               stdin="/system be brief\nhi there\n/stats\n/reset\nagain\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "[system prompt set" in r.stderr and "[conversation cleared]" in r.stderr
    assert "reply" in r.stderr  # /stats


def test_perplexity_runs(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 60)
    r = pinfer("perplexity", tiny, "-f", text, "-c", "64", "--chunks", "2", "-t", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("PPL = ")


@pytest.mark.parametrize("args, words", [
    (["inspect", "{gguf}"], ["GGUF"]),
    (["convert", "{other}"], ["mamba", "llama"]),
    (["generate", "{pinf}"], ["-p"]),
])
def test_bad_input_is_one_sentence(tiny, tmp_path, args, words):
    other = make_tiny_llama_gguf(tmp_path / "mamba.gguf", arch_name="mamba")
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 200)
    args = [a.format(gguf=gguf, other=other, pinf=tiny) for a in args]
    r = pinfer(*args)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    assert all(w in r.stderr for w in words), r.stderr
