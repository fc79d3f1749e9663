"""Tiny Hugging Face tokenizer folders (tokenizer.json + tokenizer_config.json) for tests.

Built with the `tokenizers` library alone, trained on the start of pinfer's calibration text so
the merges are real and the result is the same on every run. Two kinds, as HF ships them:
  "bytelevel"  GPT-2-style byte-level BPE (SmolLM2, Qwen2 and Llama 3 tokenizers look like this).
  "spm"        Llama-2-style BPE converted from SentencePiece: "▁" for space via normalizers,
               `<0x00>`..`<0xFF>` byte-fallback tokens at ids 3..258, no pre-tokenizer.
"""

from __future__ import annotations

import gzip
import json
from importlib import resources
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from tokenizers import processors, trainers

from fixtures import CHATML_TEMPLATE, CONTROL_TOKENS

_TRAINING_CHARS = 60_000  # ~0.1 s of training; enough text for a few thousand merges
_SPM_SPECIALS = ("<unk>", "<s>", "</s>")


def training_lines() -> list[str]:
    """The opening lines of converter/passes/data/calibration.txt.gz that the merges are learned from."""
    data = resources.files("pinfer.converter.passes").joinpath("data/calibration.txt.gz").read_bytes()
    text = gzip.decompress(data).decode("utf-8")[:_TRAINING_CHARS]
    return text.splitlines()


def write_tokenizer(folder, kind: str = "bytelevel", vocab_size: int = 320) -> int:
    """Write tokenizer.json and tokenizer_config.json of a `kind` tokenizer into `folder` and
    return its vocabulary size (use it as the model's vocab_size)."""
    builders = {"bytelevel": _bytelevel, "spm": _spm}
    if kind not in builders:
        raise ValueError(f"Tokenizer kind {kind!r} is not one of {', '.join(builders)}.")
    tok, config = builders[kind](vocab_size)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config["chat_template"] = CHATML_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return tok.get_vocab_size()


def _bytelevel(vocab_size: int) -> tuple[Tokenizer, dict]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # ids 0..2 the control tokens, then the 256 byte characters, then one token per merge.
    tok.train_from_iterator(training_lines(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(CONTROL_TOKENS), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    config = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
              "unk_token": "<|endoftext|>", "add_bos_token": False,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    return tok, config


def _spm(vocab_size: int) -> tuple[Tokenizer, dict]:
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    n_trained = vocab_size - len(byte_tokens)  # specials + characters + merges
    n_specials = len(_SPM_SPECIALS) + len(CONTROL_TOKENS)
    if n_trained < n_specials + 16:
        raise ValueError(f"vocab_size {vocab_size} leaves no room for characters and merges next "
                         f"to 256 byte tokens; use at least {256 + n_specials + 16}.")
    # Train on SentencePiece-style words ("▁word"), keeping the most common characters only:
    # the rest fall back to byte tokens, as in Llama 2.
    trainer_tok = Tokenizer(models.BPE())
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    trainer_tok.train_from_iterator(training_lines(), trainers.BpeTrainer(
        vocab_size=n_trained, special_tokens=[*_SPM_SPECIALS, *CONTROL_TOKENS],
        limit_alphabet=(n_trained - n_specials) // 2, show_progress=False))
    trained = json.loads(trainer_tok.to_str())["model"]
    # Renumber as Llama 2 does: <unk> <s> </s>, the byte tokens, then everything else.
    order = sorted(trained["vocab"], key=trained["vocab"].get)
    texts = [*_SPM_SPECIALS, *byte_tokens, *(t for t in order if t not in _SPM_SPECIALS)]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(texts)}, merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in (*_SPM_SPECIALS, *CONTROL_TOKENS)])
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "add_bos_token": True, "add_eos_token": False,
              "tokenizer_class": "LlamaTokenizerFast"}
    return tok, config
