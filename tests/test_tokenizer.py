"""Tokenizer against independent references: llama.cpp's ids on the real model and on its own
tokenizer golden files, and transformers' GGUF tokenizer conversion."""

import json

import gguf
import pytest

from pinfer.runtime.tokenizer import Tokenizer
from models import (DATA, chat_template_from_gguf, gguf_tokenizer_spec, llamacpp_golden,
                    llamacpp_vocab, smollm2_gguf, tokenizer_spec_from_gguf)

# Strings that stress the pre-tokenizer, byte-level mapping and special-token splitting.
EDGE_TEXTS = [
    "", " ", "  ", "\n", "\n\n\n", "\t\tindented", "trailing   ", "   leading", " both ",
    "12345 and 3.14159, 1,000,000 and 2024-01-31", "x1y22z333",
    "Emoji: 😀👍🏽 👨‍👩‍👧 🦙.cpp", "中文分词测试，日本語のテキスト、한국어 텍스트",
    "Ünïcödé façade naïve — “quotes” … €100",
    "def f(x):\n    return x ** 2  # square\n\n\tprint(f'{x!r}')",
    "if (a != b && c <= d) { y = a->b; }  // C++",
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_start|>x<|im_end|>", "not<|im_end|>glued", "<|endoftext|>",
    "don't won't I'm you'll they've she'd it's", "ALL CAPS AND 'S 'T",
    "tabs\tand\r\nwindows\r\nline ends", "   \n  \n ", "a" * 300,
]


@pytest.fixture(scope="module")
def smollm_reader():
    return gguf.GGUFReader(smollm2_gguf())


@pytest.fixture(scope="module")
def smollm(smollm_reader):
    return Tokenizer.from_spec(tokenizer_spec_from_gguf(smollm_reader))


@pytest.fixture(scope="module")
def transformers_tokenizer():
    transformers = pytest.importorskip("transformers")
    path = smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _wikitext_lines(n: int) -> list[str]:
    path = DATA / "wikitext-2-raw-test.txt"
    if not path.exists():
        pytest.skip(f"{path} is missing (it ships in tests/data)")
    with path.open(encoding="utf-8") as f:
        return [next(f) for _ in range(n)]


def _llamacpp_reference() -> dict:
    path = DATA / "llamacpp-greedy-public.json"
    if not path.exists():
        pytest.skip(f"{path} is missing (it ships in tests/data)")
    return json.loads(path.read_text(encoding="utf-8"))


@pytest.mark.real_model
def test_prompt_ids_match_llamacpp(smollm):
    for case in _llamacpp_reference()["prompts"]:
        assert smollm.encode(case["prompt"]) == case["prompt_ids"], case["prompt"]


@pytest.mark.real_model
def test_generated_ids_decode_to_llamacpp_text(smollm):
    for case in _llamacpp_reference()["prompts"]:
        text = smollm.decode(case["generated_ids_new"])
        assert text == case["text_new"]
        assert smollm.encode(text) == case["generated_ids_new"]


@pytest.mark.real_model
def test_matches_transformers_gguf_tokenizer(smollm, transformers_tokenizer):
    lines = _wikitext_lines(200)
    samples = lines + EDGE_TEXTS + ["".join(lines[:50])]
    for text in samples:
        expected = transformers_tokenizer.encode(text, add_special_tokens=False)
        assert smollm.encode(text) == expected, text[:80]
        assert smollm.decode(expected) == text


@pytest.mark.real_model
def test_every_digit_is_its_own_pretoken(smollm):
    # llama.cpp's "smollm" pre-tokenizer splits on \p{N} before the GPT-2 regex (as SmolLM2's
    # tokenizer.json does with Digits). transformers' GGUF conversion omits that split, so it is
    # no reference here: it joins " ١٢" into other byte-level tokens.
    text = " ١٢ x٣"
    pieces = [" ", "١", "٢", " x", "٣"]
    assert smollm.encode(text) == [i for p in pieces for i in smollm.encode(p)]


@pytest.mark.real_model
def test_special_tokens_parse_as_single_ids(smollm):
    ids = smollm.encode("<|im_start|>user\nHi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    plain = smollm.encode("<|im_start|>user", parse_special=False)
    assert 1 not in plain and smollm.decode(plain) == "<|im_start|>user"


@pytest.mark.real_model
def test_bos_eos_follow_metadata_unless_asked(smollm):
    # SmolLM2's GGUF sets add_bos_token = false.
    assert smollm.encode("hi")[0] != smollm.bos_id
    assert smollm.encode("hi", add_bos=True)[0] == smollm.bos_id
    assert smollm.encode("hi", add_eos=True)[-1] == smollm.eos_id


@pytest.mark.real_model
def test_metadata(smollm):
    assert smollm.vocab_size == 49152
    assert (smollm.bos_id, smollm.eos_id) == (1, 2)
    # eos "<|im_end|>" plus the control token "<|endoftext|>", as llama.cpp counts them.
    assert smollm.eog_ids == frozenset({0, 2})
    assert smollm.token_bytes(2) == b"<|im_end|>"
    assert smollm.decode([1, 2], skip_special=True) == ""


@pytest.mark.real_model
def test_stream_decoder_never_splits_characters(smollm):
    text = "Llamas 🦙 and 中文字符 with 👨‍👩‍👧 end"
    ids = smollm.encode(text)
    assert b"".join(smollm.token_bytes(i) for i in ids) == text.encode()
    stream = smollm.stream()
    pieces = [stream.add(i) for i in ids]
    assert "" in pieces, "expected some token to end inside a multi-byte character"
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == smollm.decode(ids) == text


@pytest.mark.real_model
def test_stream_decoder_flushes_truncated_character(smollm):
    ids = smollm.encode("🦙")
    stream = smollm.stream()
    assert "".join(stream.add(i) for i in ids[:-1]) == ""
    assert stream.flush() == "\ufffd"


@pytest.mark.real_model
def test_chat_template_is_in_the_file(smollm_reader):
    assert "<|im_start|>" in chat_template_from_gguf(smollm_reader)


@pytest.mark.parametrize("name", ["gpt-2", "llama-bpe", "llama-spm", "phi-3", "qwen2", "refact",
                                  "starcoder"])
@pytest.mark.real_model
def test_llamacpp_golden_vocab(name):
    """llama.cpp's test-tokenizer-0 cases: add_special and parse_special off."""
    path = llamacpp_vocab(name)
    tok = Tokenizer.from_spec(gguf_tokenizer_spec(path))
    for text, ids in llamacpp_golden(path):
        assert tok.encode(text, add_bos=False, add_eos=False, parse_special=False) == ids, text
        assert tok.decode(ids) == text


@pytest.mark.real_model
def test_spm_marks_and_bytes():
    path = llamacpp_vocab("llama-spm")
    tok = Tokenizer.from_spec(gguf_tokenizer_spec(path))
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_id == 1  # SentencePiece vocabularies add BOS by default
    assert tok.decode(ids) == "<s> Hello"  # llama.cpp strips the prefix space from token 0 only
    assert tok.decode(ids[1:]) == "Hello"
    # A character outside the vocabulary falls back to <0xXX> byte tokens.
    assert [tok.token_bytes(i) for i in tok.encode("𒀀", add_bos=False)][-4:] == [
        bytes([b]) for b in "𒀀".encode()]


def _tiny_spec(**over):
    spec = {"model": "gpt2", "pre": "gpt2", "tokens": ["a", "b", "ab"], "token_type": [1, 1, 1],
            "merges": ["a b"], "bos_id": None, "eos_id": None, "add_bos": False, "add_eos": False}
    return {**spec, **over}


def test_tiny_vocab_merges():
    tok = Tokenizer.from_spec(_tiny_spec())
    assert tok.encode("ababa") == [2, 2, 0]
    assert tok.decode([2, 0]) == "aba"


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(ValueError, match="'mystery'.*smollm"):
        Tokenizer.from_spec(_tiny_spec(pre="mystery"))


def test_unknown_model_is_named():
    with pytest.raises(ValueError, match="'bert'.*gpt2"):
        Tokenizer.from_spec(_tiny_spec(model="bert"))


def test_mismatched_token_types_are_reported():
    with pytest.raises(ValueError, match="3 tokens but 2 token types"):
        Tokenizer.from_spec(_tiny_spec(token_type=[1, 1]))
