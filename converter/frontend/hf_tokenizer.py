"""Tokenizer spec from a Hugging Face model folder, filled the way llama.cpp's convert_hf_to_gguf
fills the GGUF `tokenizer.ggml.*` keys, plus the tokenizer.json text itself ("hf_tokenizer").

The runtime encodes with that tokenizer.json (so ids are exactly Hugging Face's) and decodes with
per-id byte pieces built from tokens/token_type, as it does for a GGUF spec. Reads tokenizer.json,
tokenizer_config.json, generation_config.json and chat_template.jinja only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from pinfer.runtime.tokenizer import TokenType, gguf_pre_name

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Where a Sequence normalizer / pre-tokenizer / decoder / post-processor lists its steps.
_SEQUENCE_KEYS = ("normalizers", "pretokenizers", "decoders", "processors")


def tokenizer_spec_from_hf(folder, vocab_size: int | None = None) -> dict:
    """The GGUFSource.tokenizer_spec() keys plus "hf_tokenizer" for the tokenizer in `folder`.
    vocab_size: the model's embedding rows, when more than the tokenizer's ids (padded with
    UNUSED "[PAD{i}]" tokens, as convert_hf_to_gguf does)."""
    folder = Path(folder)
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no tokenizer.json; pinfer reads Hugging Face fast "
                         "tokenizers only, so save one there with transformers' save_pretrained.")
    text = path.read_text(encoding="utf-8")
    data = _json(path, text)
    try:
        HFTokenizer.from_str(text)
    except Exception as e:  # tokenizers raises plain Exception for every parse failure
        raise ValueError(f"{path} does not load in the tokenizers library ({e}); re-save it with "
                         "a current transformers.") from None
    config = _json_file(folder / "tokenizer_config.json")
    generation = _json_file(folder / "generation_config.json")

    model = _vocab_model(path, data)
    tokens, types = _tokens(data, model, vocab_size)
    special = _special_ids(tokens, data, config, generation)
    bos_text, eos_text = (_content(config.get(k)) for k in ("bos_token", "eos_token"))
    template = _single_template(data)  # ["<s>", None] for "<s> $A"
    template_bos = bos_text is not None and template[:1] == [bos_text]
    template_eos = eos_text is not None and template[-1:] == [eos_text]
    return {
        "model": model,
        "pre": gguf_pre_name(data) if model == "gpt2" else "default",
        "tokens": tokens,
        "token_type": types,
        "scores": _merge_scores(tokens, data) if model == "llama" else None,
        "merges": [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]],
        **special,  # bos_id, eos_id, eot_id, eom_id, unk_id, pad_id
        "add_bos": _flag(config, "add_bos_token", template_bos),
        "add_eos": _flag(config, "add_eos_token", template_eos),
        "add_space_prefix": _adds_space_prefix(data),
        "chat_template": _chat_template(folder, config),
        "hf_tokenizer": text,
    }


def _json(path: Path, text: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-download it.") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} holds a {type(data).__name__}, expected a JSON object; "
                         "re-download it.")
    return data


def _json_file(path: Path) -> dict:
    return _json(path, path.read_text(encoding="utf-8")) if path.is_file() else {}


def _parts(component) -> list[dict]:
    """Every typed step of a normalizer/pre-tokenizer/decoder/post-processor, Sequences opened."""
    if not isinstance(component, dict):
        return []
    nested = [c for key in _SEQUENCE_KEYS for c in component.get(key) or []]
    return [component] + [p for c in nested for p in _parts(c)]


def _types(component) -> set[str]:
    return {p.get("type") for p in _parts(component)}


def _vocab_model(path: Path, data: dict) -> str:
    """"llama" for SentencePiece-style BPE (byte fallback, "▁" for space), "gpt2" for
    byte-level BPE; llama.cpp's own names for the two."""
    kind = (data.get("model") or {}).get("type")
    if kind != "BPE":
        raise ValueError(f"{path} holds a {kind} tokenizer model, expected BPE (byte-level or "
                         "SentencePiece-style); convert this model from a GGUF file instead.")
    spaces_as_marks = any(p.get("type") == "Metaspace" or (
        p.get("type") == "Replace" and p.get("pattern", {}).get("String") == "▁")
        for p in _parts(data.get("decoder")))
    if data["model"].get("byte_fallback") or spaces_as_marks:
        return "llama"
    if "ByteLevel" in _types(data.get("pre_tokenizer")) | _types(data.get("decoder")):
        return "gpt2"
    raise ValueError(f"{path} holds a BPE tokenizer that is neither byte-level nor SentencePiece-"
                     "style (no ByteLevel step, no byte fallback); convert from GGUF instead.")


def _tokens(data: dict, model: str, vocab_size: int | None) -> tuple[list[str], list[int]]:
    """(tokens, token_type) listed by id: the model vocabulary, then added tokens over it."""
    vocab: dict[str, int] = data["model"]["vocab"]
    added = {t["id"]: t for t in data.get("added_tokens") or []}
    n = max([*vocab.values(), *added, -1]) + 1
    if vocab_size is not None and vocab_size < n:
        raise ValueError(f"The tokenizer has ids up to {n - 1} but the model has {vocab_size} "
                         "embedding rows; check that tokenizer.json belongs to this model.")
    n = max(n, vocab_size or 0)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [int(TokenType.UNUSED)] * n
    byte_fallback = model == "llama" and data["model"].get("byte_fallback", False)
    for text, i in vocab.items():
        tokens[i] = text
        byte = byte_fallback and _BYTE_TOKEN.fullmatch(text)
        types[i] = int(TokenType.BYTE if byte else TokenType.NORMAL)
    for i, t in added.items():
        if t.get("special"):
            tokens[i], types[i] = t["content"], int(TokenType.CONTROL)
        else:  # llama.cpp matches user-defined tokens in raw text: spaces, not "▁" (Gemma)
            tokens[i], types[i] = t["content"].replace("▁", " "), int(TokenType.USER_DEFINED)
    return tokens, types


def _ids_by_text(tokens: list[str], data: dict) -> dict[str, int]:
    """Token text -> id, added tokens' own ids winning over a vocabulary entry with that text."""
    ids = {t["content"]: t["id"] for t in data.get("added_tokens") or []}
    for i, text in enumerate(tokens):
        ids.setdefault(text, i)
    return ids


def _special_ids(tokens: list[str], data: dict, config: dict, generation: dict) -> dict:
    """bos/eos/unk/pad ids from tokenizer_config's token texts, else generation_config's ids;
    generation_config's further eos ids become eot_id and eom_id (Llama 3.1 lists three)."""
    ids = _ids_by_text(tokens, data)

    def config_id(key: str) -> int | None:
        # A missing bos/eos is an error; a missing pad/unk is left out (transformers adds it).
        name = _content(config.get(key))
        if name is not None and name not in ids and key in ("bos_token", "eos_token"):
            raise ValueError(f"tokenizer_config.json names {key} {name!r} but tokenizer.json has "
                             "no such token; fix the config or the tokenizer.")
        return ids.get(name)

    def generation_ids(key: str) -> list[int]:
        value = generation.get(key)
        values = [value] if isinstance(value, int) else list(value or [])
        for i in values:
            if not isinstance(i, int) or not 0 <= i < len(tokens):
                raise ValueError(f"generation_config.json has {key} {i!r}, expected an id below "
                                 f"the tokenizer's {len(tokens)} tokens; fix the file.")
        return values

    eos = generation_ids("eos_token_id")
    eos_id = _first(config_id("eos_token"), *eos)
    extra = [i for i in dict.fromkeys(eos) if i != eos_id] + [None, None]
    return {
        "bos_id": _first(config_id("bos_token"), *generation_ids("bos_token_id")),
        "eos_id": eos_id,
        "eot_id": extra[0],
        "eom_id": extra[1],
        "unk_id": _first(config_id("unk_token"), ids.get(data["model"].get("unk_token"))),
        "pad_id": _first(config_id("pad_token"), *generation_ids("pad_token_id")),
    }


def _merge_scores(tokens: list[str], data: dict) -> list[float]:
    """SentencePiece-style scores: the earlier the merge that makes a token, the higher; tokens
    no merge makes come after every merge, in id order."""
    rank: dict[str, int] = {}
    for r, m in enumerate(data["model"]["merges"]):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        rank.setdefault(left + right, r)
    n_merges = len(data["model"]["merges"])
    return [-float(rank.get(text, n_merges + i)) for i, text in enumerate(tokens)]


def _single_template(data: dict) -> list[str | None]:
    """The post-processor's single-text template as special-token texts, None for the text."""
    for p in _parts(data.get("post_processor")):
        if p.get("type") == "TemplateProcessing":
            return [(item.get("SpecialToken") or {}).get("id") for item in p.get("single") or []]
    return []


def _adds_space_prefix(data: dict) -> bool:
    """Whether "▁" is put before the text: a Prepend("▁") normalizer or a Metaspace that
    prepends (prepend_scheme "first"/"always", or the older add_prefix_space)."""
    if any(p.get("type") == "Prepend" and p.get("prepend") == "▁"
           for p in _parts(data.get("normalizer"))):
        return True
    return any(p.get("type") == "Metaspace" and (
        p.get("prepend_scheme", "always" if p.get("add_prefix_space") else "never") != "never")
        for p in _parts(data.get("pre_tokenizer")))


def _chat_template(folder: Path, config: dict) -> str | None:
    """chat_template.jinja if present (transformers gives it priority), else tokenizer_config's
    template: a string, or a list of {name, template} of which "default" is the chat one."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _content(token) -> str | None:
    """A tokenizer_config special token: a string, or an AddedToken dict with "content"."""
    if isinstance(token, dict):
        return token.get("content")
    return token if isinstance(token, str) else None


def _first(*values):
    return next((v for v in values if v is not None), None)


def _flag(config: dict, key: str, default: bool) -> bool:
    value = config.get(key)
    return value if isinstance(value, bool) else default
