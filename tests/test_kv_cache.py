"""The KV cache in f16 (the default, as llama.cpp's) against f32 on the real model: half the memory,
and the perplexity of decoding the wikitext test text token by token (every position's attention
reads the cache) within the noise of f32's."""

import contextlib
import io

import numpy as np
import pytest
from models import DATA, smollm2_gguf

from pinfer.converter.convert import ConvertOptions, convert
from pinfer.converter.passes import DENSE
from pinfer.runtime.model import Model, RuntimeOptions
from pinfer.runtime.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

WINDOWS, LENGTH, SKIP = 2, 320, 32     # windows of the text, tokens each, the first ones not scored


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    out = tmp_path_factory.mktemp("kv") / "smollm2.pinf"
    with contextlib.redirect_stderr(io.StringIO()):
        convert(ConvertOptions(smollm2_gguf(), out, passes=DENSE))
    return out


def _decoded_perplexity(model, ids):
    """exp(mean NLL) of each window's tokens after the first SKIP, decoding one token at a time."""
    nll = []
    for w in range(WINDOWS):
        window = ids[w * LENGTH:(w + 1) * LENGTH]
        model.reset()
        for i, t in enumerate(window[:-1]):
            logits = model.forward([t])[-1].astype(np.float64)
            top = logits.max()
            if i >= SKIP:
                nll.append(top + np.log(np.exp(logits - top).sum()) - logits[window[i + 1]])
    return float(np.exp(np.mean(nll)))


def test_an_f16_cache_takes_half_the_memory_and_keeps_the_perplexity(smol):
    """f16 rounds each cached K and V to 11 significant bits. What that does to SmolLM2's decoded
    perplexity is noise around zero: each 500-token window moves by up to about 0.25% either way
    (8 windows of 512 tokens: -0.21% in all, per window -0.82% to +0.14%; 4 of 384: +0.02%; these
    2 of 320: +0.19%). Bound: 0.6%, three times the spread of a mean over 2 windows. (`pinfer
    perplexity` scores each chunk as one prompt, which reads none of the cache: there the two
    give the same figure, 26.9930 over 20 chunks of 512.)"""
    models = {kv: Model(smol, RuntimeOptions(threads=1, n_ctx=512, kv_type=kv)) for kv in ("f32", "f16")}
    assert models["f16"].attention.kv_bytes * 2 == models["f32"].attention.kv_bytes
    assert RuntimeOptions().kv_type == "f16"
    ids = Tokenizer.from_spec(models["f32"].tokenizer_spec).encode(
        (DATA / "wikitext-2-raw-test.txt").read_text(encoding="utf-8")[:20000], parse_special=False)
    ppl = {kv: _decoded_perplexity(m, ids) for kv, m in models.items()}
    print(ppl)
    assert abs(ppl["f16"] / ppl["f32"] - 1) <= 6e-3, ppl
