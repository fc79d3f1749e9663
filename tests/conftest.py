import os
import sys
from pathlib import Path

import pytest

# `python -m pytest` puts the working directory on sys.path. From the repository root that makes
# its top-level folders (runtime/, formats/, cli/, ...) importable under those bare names, which
# could hide an installed package of the same name (the kernels once sat in a top-level kernels/
# and hid Hugging Face's `kernels` package from transformers; they live in pinfer/kernels/ now).
# pinfer itself is imported through its installed (editable) package.
ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != ROOT]
sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def silu_file(tmp_path_factory):
    """The tiny 2-layer Q4_1 SiLU model of fixtures.convert_tiny_silu, converted once for the whole
    run: the tests only read it (a Model, a PinfReader, a conversion of its GGUF into tmp_path).
    Its source GGUF is `silu_gguf`."""
    from fixtures import convert_tiny_silu
    return convert_tiny_silu(tmp_path_factory.mktemp("silu"))


@pytest.fixture(scope="session")
def silu_gguf(silu_file):
    """The GGUF that `silu_file` was converted from (convert_tiny_silu writes it beside the .pinf)."""
    src = silu_file.with_name("silu.gguf")
    assert src.is_file(), src
    return src


@pytest.fixture
def no_time_budget(monkeypatch):
    """Chat templates rendered with only the limits that count work (steps, sizes, ranges, output):
    the per-render time budget (chat_template.LIMITS["seconds"]) made endless, so which limit stops
    a hostile template, and so what its error says, does not depend on how busy the machine is."""
    from pinfer.runtime import chat_template
    monkeypatch.setitem(chat_template.LIMITS, "seconds", float("inf"))


@pytest.fixture
def refuse_layer(monkeypatch):
    """refuse_layer(i, why): pinfer's FFN kernel refuses layer i when built (a ValueError saying
    `why`, as for a format it lacks), and builds the others as it does."""
    from pinfer.runtime import ffn
    real = ffn.layer_kernel

    def refuse(layer, why):
        def layer_kernel(model, i, mode):
            if i == layer:
                raise ValueError(why)
            return real(model, i, mode)
        monkeypatch.setattr(ffn, "layer_kernel", layer_kernel)
    return refuse


def map_rss(reader):
    """Resident bytes of a PinfReader's map of its file: its entry in /proc/self/smaps (Linux)."""
    import numpy as np
    start, inside, total = f"{np.frombuffer(reader._mm, np.uint8).ctypes.data:x}-", False, 0
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:       # a mapping's first line
            inside = head[0].startswith(start)
        elif inside and head[0] == "Rss:":
            total += int(head[1]) * 1024
    return total
