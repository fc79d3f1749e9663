"""Tokenizer built from GGUF tokenizer metadata, matching llama.cpp's token ids.

The spec dict mirrors the GGUF `tokenizer.ggml.*` keys (see `Tokenizer.from_spec`). Encoding runs
on a HF `tokenizers.Tokenizer` assembled from that vocabulary, or on the model's own tokenizer.json
when the spec carries one ("hf_tokenizer"); decoding is our own byte table so that `decode`,
`token_bytes` and `StreamDecoder` agree byte for byte with llama.cpp's pieces.

Two vocabulary kinds, as llama.cpp names them:
  "gpt2"  byte-level BPE: tokens spell bytes through GPT-2's byte->unicode map, ranked merges, a
          regex pre-tokenizer chosen by the GGUF `pre` name.
  "llama" SentencePiece BPE: tokens spell text with "▁" for space, `<0xXX>` byte-fallback tokens,
          no pre-tokenizer (merges may cross words), merge priority = score of the merged token.
"""

from __future__ import annotations

import codecs
import enum
import json
from typing import Iterable, Sequence

from tokenizers import AddedToken, Regex
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, normalizers, pre_tokenizers


class TokenType(enum.IntEnum):
    """GGUF `tokenizer.ggml.token_type` values."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# Texts that end a turn in common chat formats (subset of llama.cpp's list in llama-vocab.cpp).
_EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<|eom_id|>", "<|return|>", "<|call|>", "<EOT>", "<end_of_utterance>",
})

# Pre-tokenizer regexes, as written in the models' own tokenizer.json files.
_GPT2_BYTELEVEL = dict(add_prefix_space=False, use_regex=True)
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(regex: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# GGUF `pre` name -> (pre-tokenizer factory, ignore_merges). ignore_merges: a pre-token that is
# itself in the vocabulary is emitted whole (llama.cpp sets it for the llama3 family).
# "default" is mapped to plain GPT-2; llama.cpp's own "default" adds extra punctuation/digit
# splits and warns that quality degrades, so a file carrying it is already suspect.
_PRE_TOKENIZERS = {
    "default": (lambda: pre_tokenizers.ByteLevel(**_GPT2_BYTELEVEL), False),
    "gpt2": (lambda: pre_tokenizers.ByteLevel(**_GPT2_BYTELEVEL), False),
    "gpt-2": (lambda: pre_tokenizers.ByteLevel(**_GPT2_BYTELEVEL), False),
    # llama.cpp: regexes `\p{N}` then the GPT-2 regex (shared by smollm, starcoder, refact).
    **{name: (lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(**_GPT2_BYTELEVEL),
    ]), False) for name in ("smollm", "starcoder", "refact")},
    **{name: (lambda: _split_then_bytes(_LLAMA3_REGEX), True)
       for name in ("llama3", "llama-bpe", "llama-v3")},
    "qwen2": (lambda: _split_then_bytes(_QWEN2_REGEX), False),
}


def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable stand-in character -> the byte it spells."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 256
    for b in range(256):
        if b not in printable:
            table[chr(extra)] = b
            extra += 1
    return table


def _spm_byte(text: str) -> int | None:
    """`<0x0A>` -> 10; None for anything else."""
    if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        try:
            return int(text[3:5], 16)
        except ValueError:
            return None
    return None


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp searches from index 1 so that a left part starting with a space still parses.
    pos = merge.find(" ", 1)
    if pos < 0:
        raise ValueError(f"Tokenizer merge {merge!r} has no space between its two parts; "
                         "re-convert the model.")
    return merge[:pos], merge[pos + 1:]


def _vocab_dict(tokens: Sequence[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        vocab.setdefault(text, i)  # a duplicated text keeps its first id, as llama.cpp does
    return vocab


def _spm_merges(tokens: Sequence[str], scores: Sequence[float],
                vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of every token whose halves are tokens, ranked by the merged
    token's score (highest first): llama.cpp's SPM merges the best-scoring adjacent pair."""
    ranked = []
    for i, text in enumerate(tokens):
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _gpt2_encoder(spec: dict) -> HFTokenizer:
    pre = spec.get("pre") or "default"
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"Tokenizer pre-tokenizer {pre!r} is not supported; supported ones are "
                         f"{', '.join(sorted(_PRE_TOKENIZERS))}.")
    make_pre, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = [_split_merge(m) for m in spec.get("merges") or []]
    hf = HFTokenizer(models.BPE(_vocab_dict(spec["tokens"]), merges, ignore_merges=ignore_merges))
    hf.pre_tokenizer = make_pre()
    return hf


def _gpt2_pieces(spec: dict) -> list[bytes]:
    decoder = _byte_decoder()

    def normal(text: str) -> bytes:
        if all(c in decoder for c in text):
            return bytes(decoder[c] for c in text)
        return text.encode()

    return _pieces(spec, normal)


def _spm_encoder(spec: dict) -> HFTokenizer:
    tokens = spec["tokens"]
    if "scores" not in spec:
        raise ValueError("Tokenizer spec for a 'llama' (SentencePiece) vocabulary has no 'scores'; "
                         "re-convert the model with tokenizer.ggml.scores.")
    vocab = _vocab_dict(tokens)
    unk_id = spec.get("unk_id")
    hf = HFTokenizer(models.BPE(
        vocab, _spm_merges(tokens, spec["scores"], vocab),
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=True))
    # llama.cpp prefixes a space to every run of raw text that follows a special token or the
    # start; HF applies normalizers per run between added tokens, so Prepend does the same.
    steps = [normalizers.Replace(" ", "▁")]
    if spec.get("add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    hf.normalizer = normalizers.Sequence(steps)
    return hf


def _spm_pieces(spec: dict) -> list[bytes]:
    return _pieces(spec, lambda text: text.replace("▁", " ").encode())


def _pieces(spec: dict, normal) -> list[bytes]:
    """(vocab_size,) bytes each id decodes to; `normal` spells a NORMAL token's text as bytes.
    Control and user-defined tokens are their raw text, byte tokens their byte, unused nothing."""
    pieces = []
    for text, kind in zip(spec["tokens"], spec["token_type"]):
        if kind == TokenType.NORMAL:
            pieces.append(normal(text))
        elif kind == TokenType.BYTE:
            pieces.append(bytes([_spm_byte(text) or 0]))
        else:
            pieces.append(b"" if kind == TokenType.UNUSED else text.encode())
    return pieces


# GGUF `tokenizer.ggml.model` -> (HF encoder from the GGUF keys, per-id byte pieces).
_BUILDERS = {"gpt2": (_gpt2_encoder, _gpt2_pieces), "llama": (_spm_encoder, _spm_pieces)}


def gguf_pre_name(tokenizer_json: dict) -> str:
    """The GGUF `pre` name whose pre-tokenizer (and ignore_merges) a parsed tokenizer.json has,
    "default" when none has; offset settings are left out of the comparison (ids ignore them)."""
    want = _without_offsets(tokenizer_json.get("pre_tokenizer"))
    ignore = bool((tokenizer_json.get("model") or {}).get("ignore_merges", False))
    for name, (make_pre, ignore_merges) in _PRE_TOKENIZERS.items():
        if name != "default" and ignore_merges == ignore and \
                _without_offsets(json.loads(make_pre().__getstate__())) == want:
            return name
    return "default"


def _without_offsets(step):
    if isinstance(step, dict):
        return {k: _without_offsets(v) for k, v in step.items() if k != "trim_offsets"}
    if isinstance(step, list):
        return [_without_offsets(v) for v in step]
    return step


class Tokenizer:
    """Text <-> token ids for one model; build with `Tokenizer.from_spec`."""

    def __init__(self, spec: dict, hf: HFTokenizer, pieces: list[bytes]):
        self._hf = hf                      # parses control tokens as single ids
        self._hf_plain: HFTokenizer | None = None  # same, control tokens as text; made on demand
        self._pieces = pieces              # (vocab_size,) bytes each id decodes to
        types = spec["token_type"]
        self._special = frozenset(
            i for i, t in enumerate(types) if t in (TokenType.CONTROL, TokenType.UNKNOWN))
        self.vocab_size = len(pieces)
        self.bos_id: int | None = spec.get("bos_id")
        self.eos_id: int | None = spec.get("eos_id")
        self.add_bos = bool(spec.get("add_bos", False))
        self.add_eos = bool(spec.get("add_eos", False))
        # llama.cpp drops the space it prefixed when decoding from the first token.
        self._strip_first_space = spec["model"] == "llama" and spec.get("add_space_prefix", True)
        # Stops generation: the declared ids plus control tokens named like a turn end.
        declared = {spec.get(k) for k in ("eos_id", "eot_id", "eom_id")} - {None}
        named = {i for i, (text, t) in enumerate(zip(spec["tokens"], types))
                 if text in _EOG_TEXTS and t in (TokenType.CONTROL, TokenType.USER_DEFINED)}
        self.eog_ids: frozenset[int] = frozenset(declared | named)

    @classmethod
    def from_spec(cls, spec: dict) -> "Tokenizer":
        """Build from GGUF-style metadata: model, pre, tokens, token_type, merges (gpt2) or
        scores (llama), bos_id/eos_id/eot_id/eom_id/unk_id/pad_id, add_bos, add_eos and, for
        llama, add_space_prefix (default true). A spec with "hf_tokenizer" (tokenizer.json
        text, from converter/frontend/hf_tokenizer.py) encodes with it instead of pre/merges/scores."""
        for key in ("model", "tokens"):
            if key not in spec:
                raise ValueError(f"Tokenizer spec has no {key!r}; expected GGUF tokenizer metadata.")
        model = spec["model"]
        if model not in _BUILDERS:
            raise ValueError(f"Tokenizer model {model!r} is not supported; supported ones are "
                             f"{', '.join(sorted(_BUILDERS))}.")
        spec = dict(spec)
        spec.setdefault("token_type", [TokenType.NORMAL] * len(spec["tokens"]))
        if len(spec["token_type"]) != len(spec["tokens"]):
            raise ValueError(f"Tokenizer spec has {len(spec['tokens'])} tokens but "
                             f"{len(spec['token_type'])} token types; re-convert the model.")
        make_encoder, make_pieces = _BUILDERS[model]
        if "hf_tokenizer" in spec:  # the model's own tokenizer.json: its ids are the truth
            try:
                hf = HFTokenizer.from_str(spec["hf_tokenizer"])
            except Exception as e:      # the tokenizers library raises plain Exception on bad JSON
                raise ValueError(f"the file's tokenizer.json cannot be read ({str(e)[:200]}); re-convert the "
                                 "model") from None
        else:
            hf = make_encoder(spec)
            _register_added_tokens(hf, spec["tokens"], spec["token_type"])
        return cls(spec, hf, make_pieces(spec))

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = True,
               add_eos: bool | None = None) -> list[int]:
        """Token ids for `text`. add_bos/add_eos None follow the model's metadata.
        parse_special=False leaves control tokens ("<|im_start|>") as plain text, as llama.cpp
        does; user-defined tokens are always matched."""
        ids = self._encoder(parse_special).encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if (self.add_eos if add_eos is None else add_eos) and self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for; may be part of a UTF-8 character."""
        return self._pieces[token_id]

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        ids = list(ids)
        data = b"".join(self._piece(i, skip_special) for i in ids)
        if self._strip_first_space and ids and self._pieces[ids[0]].startswith(b" "):
            data = data[1:]
        return data.decode("utf-8", errors="replace")

    def stream(self, skip_special: bool = False) -> "StreamDecoder":
        return StreamDecoder(self, skip_special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special

    def _piece(self, token_id: int, skip_special: bool) -> bytes:
        if skip_special and token_id in self._special:
            return b""
        return self._pieces[token_id]

    def _encoder(self, parse_special: bool) -> HFTokenizer:
        if parse_special:
            return self._hf
        if self._hf_plain is None:
            # A separate copy: toggling the flag on the shared one would race between threads.
            plain = HFTokenizer.from_str(self._hf.to_str())
            plain.encode_special_tokens = True
            self._hf_plain = plain
        return self._hf_plain


def _register_added_tokens(hf: HFTokenizer, tokens: Sequence[str], types: Sequence[int]) -> None:
    """Control/unknown tokens become HF special tokens (skipped when parse_special=False);
    user-defined ones are plain added tokens, matched in raw text before the model runs."""
    special, user = [], []
    for text, kind in zip(tokens, types):
        if kind in (TokenType.CONTROL, TokenType.UNKNOWN):
            special.append(AddedToken(text, special=True, normalized=False))
        elif kind == TokenType.USER_DEFINED:
            user.append(AddedToken(text, special=False, normalized=False))
    if special:
        hf.add_special_tokens(special)
    if user:
        hf.add_tokens(user)


class StreamDecoder:
    """Turns ids arriving one at a time into text, holding back an incomplete UTF-8 tail so a
    multi-byte character is never split. Continuation text: no leading space is stripped."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False):
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        """Text completed by this token ("" while a character is still partial)."""
        return self._utf8.decode(self._tokenizer._piece(token_id, self._skip_special))

    def flush(self) -> str:
        """Whatever is held back, with U+FFFD for a truncated character."""
        return self._utf8.decode(b"", final=True)
