"""Tokenizer specs from Hugging Face folders against the `tokenizers` library itself: same ids,
same decoded text, bos as the config says. Fixtures from tests/hf_tokenizers.py."""

import gzip
import json
import shutil
from importlib import resources

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from fixtures import CHATML_TEMPLATE
from hf_tokenizers import write_tokenizer
from pinfer.converter.frontend.hf_tokenizer import tokenizer_spec_from_hf
from pinfer.runtime.tokenizer import Tokenizer, TokenType

KINDS = ("bytelevel", "spm")
GGUF_KEYS = {"model", "pre", "tokens", "token_type", "scores", "merges", "bos_id", "eos_id",
             "eot_id", "eom_id", "unk_id", "pad_id", "add_bos", "add_eos", "add_space_prefix",
             "chat_template"}
CHAT = "<|im_start|>user\nHello there!<|im_end|>\n<|im_start|>assistant\n"
EDGE_TEXTS = [
    "", " ", "   ", "\n", "\n\n\n", "\t\tindented", "trailing   ", "   leading", "a  b   c    d",
    "12345 and 3.14159, 1,000,000 and 2024-01-31", "x1y22z333",
    "Emoji: 😀👍🏽 👨‍👩‍👧 🦙.cpp", "中文分词测试，日本語のテキスト、한국어 텍스트",
    "Ünïcödé façade naïve — “quotes” … €100", "def f(x):\n    return x ** 2\n\n\tprint(f'{x!r}')",
    "tabs\tand\r\nwindows\r\nline ends", "don't won't I'm you'll they've", CHAT,
    "<|im_start|><|im_start|>x<|im_end|>", "not<|im_end|>glued", "<|endoftext|>",
]


def _texts() -> list[str]:
    data = resources.files("pinfer.converter.passes").joinpath("data/calibration.txt.gz").read_bytes()
    lines = [line for line in gzip.decompress(data).decode("utf-8").splitlines() if line.strip()]
    return lines[::len(lines) // 30][:30] + EDGE_TEXTS  # sampled over the whole text: mostly unseen


TEXTS = _texts()


@pytest.fixture(scope="module", params=KINDS)
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    write_tokenizer(path, request.param)
    return path


@pytest.fixture(scope="module")
def hf(folder):
    return HFTokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def spec(folder):
    return tokenizer_spec_from_hf(folder)


@pytest.fixture(scope="module")
def tok(spec):
    return Tokenizer.from_spec(spec)


def _hf_ids(hf: HFTokenizer, text: str) -> list[int]:
    return hf.encode(text, add_special_tokens=False).ids


def test_ids_match_hf(tok, hf):
    for text in TEXTS:
        assert tok.encode(text, add_bos=False) == _hf_ids(hf, text), text


def test_gguf_keys_alone_encode_the_same(spec, hf):
    """Without tokenizer.json the GGUF-style keys (tokens, merges, pre, scores) still rebuild the
    same tokenizer: the keys are filled right, not just carried along."""
    gguf_only = Tokenizer.from_spec({k: v for k, v in spec.items() if k != "hf_tokenizer"})
    for text in TEXTS:
        assert gguf_only.encode(text, add_bos=False) == _hf_ids(hf, text), text


def test_unknown_pre_tokenizer_still_encodes_exactly(tmp_path):
    """A pre-tokenizer with no GGUF `pre` name (here: a space put before the text) is used as
    tokenizer.json has it, not replaced by GPT-2's."""
    write_tokenizer(tmp_path, "bytelevel")
    hf = HFTokenizer.from_file(str(tmp_path / "tokenizer.json"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    hf.save(str(tmp_path / "tokenizer.json"))
    spec = tokenizer_spec_from_hf(tmp_path)
    assert spec["pre"] == "default"
    tok = Tokenizer.from_spec(spec)
    for text in TEXTS:
        assert tok.encode(text) == _hf_ids(hf, text), text


def test_decode_matches_hf_and_round_trips(tok, hf, spec):
    for text in TEXTS:
        ids = _hf_ids(hf, text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=False), text
        # SentencePiece-style tokenizers prefix "▁" to the text after each special token.
        if spec["model"] == "gpt2" or "<|" not in text:
            assert tok.decode(ids) == text


def test_bos_follows_config(tok, hf, spec):
    if spec["model"] == "llama":  # add_bos_token true, "<s>" as bos
        assert tok.encode("hi") == hf.encode("hi").ids == [1, *_hf_ids(hf, "hi")]
        assert tok.bos_id == 1
    else:  # add_bos_token false
        assert tok.encode("hi") == _hf_ids(hf, "hi")
        assert tok.encode("hi", add_bos=True)[0] == tok.bos_id == 0


def test_parse_special_false_keeps_control_tokens_as_text(tok, hf):
    plain = HFTokenizer.from_str(hf.to_str())
    plain.encode_special_tokens = True
    ids = tok.encode(CHAT, add_bos=False, parse_special=False)
    assert ids == plain.encode(CHAT, add_special_tokens=False).ids
    assert not any(tok.is_special(i) for i in ids)
    assert tok.decode(ids) == hf.decode(ids)


def test_spec_keys(spec):
    assert set(spec) == GGUF_KEYS | {"hf_tokenizer"}
    tokens, types = spec["tokens"], spec["token_type"]
    assert len(tokens) == len(types) == 320
    for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[tokens.index(name)] == TokenType.CONTROL
    n_bytes = sum(t == TokenType.BYTE for t in types)
    assert n_bytes == (256 if spec["model"] == "llama" else 0)
    assert spec["chat_template"] == CHATML_TEMPLATE
    assert tokens[spec["eos_id"]] == ("</s>" if spec["model"] == "llama" else "<|im_end|>")
    assert json.loads(spec["hf_tokenizer"])["model"]["type"] == "BPE"


def test_generation_config_and_template_variants(tmp_path):
    write_tokenizer(tmp_path, "bytelevel")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0, 2]}))
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": "<|im_end|>", "special": True}
    config["chat_template"] = [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    spec = tokenizer_spec_from_hf(tmp_path)
    assert (spec["eos_id"], spec["eot_id"], spec["eom_id"]) == (2, 0, None)
    assert spec["chat_template"] == "D"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert tokenizer_spec_from_hf(tmp_path)["chat_template"] == "J"  # as transformers prefers


def test_vocab_padded_to_model_rows(tmp_path):
    write_tokenizer(tmp_path, "bytelevel")
    spec = tokenizer_spec_from_hf(tmp_path, vocab_size=324)
    assert spec["tokens"][320:] == [f"[PAD{i}]" for i in range(320, 324)]
    assert Tokenizer.from_spec(spec).decode([320, 74]) == Tokenizer.from_spec(spec).decode([74])
    with pytest.raises(ValueError, match="ids up to 319 but the model has 100 embedding rows"):
        tokenizer_spec_from_hf(tmp_path, vocab_size=100)


def test_missing_tokenizer_json_is_one_sentence(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ValueError) as e:
        tokenizer_spec_from_hf(tmp_path)
    message = str(e.value)
    assert message.startswith(f"{tmp_path} has no tokenizer.json;") and message.endswith(".")
    assert "\n" not in message and message.count(". ") == 0


@pytest.mark.parametrize("model, name", [
    (models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]"), "WordPiece"),
    (models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False), "Unigram"),
])
def test_unsupported_model_is_named(tmp_path, model, name):
    HFTokenizer(model).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ValueError, match=f"holds a {name} tokenizer model, expected BPE"):
        tokenizer_spec_from_hf(tmp_path)


def test_folder_written_by_transformers(tmp_path):
    """GPT-2's slow files (vocab.json + merges.txt) through transformers' own conversion and
    save_pretrained, then read back: ids as transformers encodes them, bos included."""
    transformers = pytest.importorskip("transformers")
    write_tokenizer(tmp_path / "src", "bytelevel")
    model = json.loads((tmp_path / "src" / "tokenizer.json").read_text())["model"]
    (tmp_path / "vocab.json").write_text(json.dumps(model["vocab"]))
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    slow = transformers.GPT2TokenizerFast(
        str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"), bos_token="<|endoftext|>",
        eos_token="<|im_end|>", unk_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"])
    slow.chat_template = CHATML_TEMPLATE
    slow.save_pretrained(tmp_path / "saved")
    shutil.rmtree(tmp_path / "src")

    reference = transformers.AutoTokenizer.from_pretrained(tmp_path / "saved")
    spec = tokenizer_spec_from_hf(tmp_path / "saved")
    tok = Tokenizer.from_spec(spec)
    assert (spec["model"], spec["pre"], spec["chat_template"]) == ("gpt2", "gpt2", CHATML_TEMPLATE)
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text), text
        assert tok.decode(tok.encode(text)) == text
