"""Calibration text: the default set shipped with pinfer, or the user's `--calib FILE`.

The default set (converter/passes/data/calibration.txt.gz) is public-domain prose: Lewis Carroll's
"Alice's Adventures in Wonderland" and Arthur Conan Doyle's "A Study in Scarlet" and "The Sign of
the Four", re-flowed into paragraphs. It is never the evaluation text (wikitext-2 test).

Token sequences are cut from the whole stream; every `heldout_every`-th sequence is held out,
so both splits sample the whole text.
"""

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np

DEFAULT_NAME = "builtin: Alice in Wonderland + A Study in Scarlet + The Sign of the Four (public domain)"


class CalibrationError(ValueError):
    pass


@dataclass(frozen=True)
class CalibrationSet:
    description: str
    train: np.ndarray     # (n_train, seq_len) token ids
    heldout: np.ndarray   # (n_heldout, seq_len) token ids


def default_text():
    data = resources.files("pinfer.converter.passes").joinpath("data/calibration.txt.gz").read_bytes()
    return gzip.decompress(data).decode("utf-8")


def read_texts(path):
    """A .jsonl file (one object per line with "text", or "messages" [{"content": ...}]) or plain
    UTF-8 text -> list of documents."""
    path = Path(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"cannot read calibration text {path}: {e}; pass a UTF-8 .txt or .jsonl file") from None
    if path.suffix != ".jsonl":
        return [raw]
    docs = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise CalibrationError(f"{path} line {n} is not JSON; a .jsonl calibration file needs one "
                                   "object per line with a \"text\" or \"messages\" field") from None
        if isinstance(obj, dict) and isinstance(obj.get("text"), str):
            docs.append(obj["text"])
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            docs.append("\n".join(str(m.get("content", "")) for m in obj["messages"] if isinstance(m, dict)))
        else:
            raise CalibrationError(f"{path} line {n} has neither a \"text\" string nor a \"messages\" list")
    return docs


def build(tokenizer, path, seq_len, n_train_tokens, n_heldout_tokens, heldout_every=4):
    """Tokenize and cut into (train, heldout) sequences of seq_len tokens; BOS starts each
    sequence when the model's tokenizer adds one."""
    texts = [default_text()] if path is None else read_texts(path)
    description = DEFAULT_NAME if path is None else f"file: {Path(path).name}"
    ids = []
    for t in texts:
        ids.extend(tokenizer.encode(t, add_bos=False, parse_special=False))
    bos = tokenizer.bos_id if tokenizer.add_bos and tokenizer.bos_id is not None else None
    body = seq_len - (bos is not None)
    n_seq = len(ids) // body
    want_train, want_held = -(-n_train_tokens // seq_len), -(-n_heldout_tokens // seq_len)
    if n_seq < 2:
        raise CalibrationError(f"the calibration text has {len(ids)} tokens, fewer than two sequences of "
                               f"{seq_len}; give a longer --calib file")
    seqs = np.asarray(ids[:n_seq * body], np.int64).reshape(n_seq, body)
    if bos is not None:
        seqs = np.concatenate([np.full((n_seq, 1), bos, np.int64), seqs], axis=1)
    held_mask = np.arange(n_seq) % heldout_every == heldout_every - 1
    train, held = seqs[~held_mask][:want_train], seqs[held_mask][:want_held]
    if len(held) == 0:
        held, train = train[-1:], train[:-1]
    return CalibrationSet(f"{description}; {train.size} train + {held.size} held-out tokens "
                          f"in sequences of {seq_len}", train, held)
