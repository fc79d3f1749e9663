"""The benchmarks' handling of the other engine: a llama.cpp process that dies is a result, not a
dead benchmark (llama-cpp-python's AMX build segfaults on batched evaluation)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import engines  # noqa: E402


@pytest.mark.parametrize("script, said", [("kill -SEGV $$", "status -11 (a segmentation fault)"),
                                          ("exit 3", "status 3")])
def test_a_llama_worker_that_dies_is_an_engine_failure(tmp_path, script, said):
    """A worker process that ends before it is ready (a real process, ended by a real signal or
    exit status) raises EngineFailed with that status, which the benchmarks print in the row."""
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{script}\n")
    fake.chmod(0o755)
    with pytest.raises(engines.EngineFailed, match=said.replace("(", r"\(").replace(")", r"\)")):
        engines.LlamaWorker(fake, tmp_path / "m.gguf", 1)


def test_a_worker_that_dies_mid_run_says_so(tmp_path):
    """Ready, then gone at the first request: the request raises EngineFailed, not a JSON error."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/sh\necho \'{"ready": true}\'\nread line\nkill -SEGV $$\n')
    fake.chmod(0o755)
    w = engines.LlamaWorker(fake, tmp_path / "m.gguf", 1)
    with pytest.raises(engines.EngineFailed, match="segmentation fault"):
        w.decode(4)
    w.close()
