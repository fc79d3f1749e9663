"""GGUF front end: metadata and lazily dequantized tensors from a memory-mapped GGUF file."""

import hashlib
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFValueType

from pinfer.formats import blocks

from .gguf_check import GGUFCheckError, check_gguf


class SourceError(ValueError):
    pass


@dataclass(frozen=True)
class SourceTensor:
    name: str
    ttype: object        # gguf.GGMLQuantizationType
    rows: int            # numpy-order shape (rows, k); 1-D tensors have rows == 1
    k: int
    raw: np.ndarray      # view of the memory map


def _value(field):
    """A GGUF metadata field as a plain Python value (strings decoded, arrays as lists)."""
    t = field.types[0] if field.types else None
    if t == GGUFValueType.ARRAY:
        sub = field.types[1] if len(field.types) > 1 else None
        if sub == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if t == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    return field.parts[field.data[0]].tolist()[0]


class GGUFSource:
    """One GGUF model file. Nothing is read from the tensors until asked for."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            check_gguf(self.path)   # gguf-py trusts the counts it reads; check them first
            self._r = GGUFReader(self.path, "r")
        except GGUFCheckError as e:
            raise SourceError(str(e)) from None
        except (ValueError, OSError, IndexError, KeyError, TypeError, OverflowError) as e:
            raise SourceError(f"{self.path} could not be read as GGUF ({e}); "
                              "pass a .gguf model file") from None
        self.meta = {k: _value(f) for k, f in self._r.fields.items() if not k.startswith("GGUF.")}
        self._tensors = {t.name: t for t in self._r.tensors}

    @property
    def architecture(self):
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise SourceError(f"{self.path} has no general.architecture key; it is not a model GGUF")
        return arch

    def tensor_names(self):
        return set(self._tensors)

    def tensor(self, name):
        t = self._tensors.get(name)
        if t is None:
            raise SourceError(f"{self.path} lacks the tensor {name}")
        shape = [int(n) for n in t.shape]  # GGUF order: fastest axis first
        k = shape[0]
        rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        return SourceTensor(name, t.tensor_type, rows, k, t.data)

    def nbytes(self, name):
        return self.tensor(name).raw.nbytes

    def ttype(self, name):
        return self.tensor(name).ttype

    def block(self, name):
        """(format, parts) carried over exactly where a .pinf format matches the GGUF type."""
        t = self.tensor(name)
        return blocks.from_gguf(t.ttype, t.raw, t.rows, t.k)

    def floats(self, name):
        t = self.tensor(name)
        return blocks.dequantize_gguf(t.ttype, t.raw, t.rows, t.k)

    def release(self):
        """Drop the file's pages from this process's resident set (they are re-read on demand), so
        that streaming through the layers does not accumulate the whole file in RSS."""
        m = getattr(self._r.data, "_mmap", None)
        if m is not None and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)

    def sha256(self):
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        return h.hexdigest()

    def tokenizer_spec(self):
        """The tokenizer as GGUF metadata describes it (the runtime builds it with `tokenizers`)."""
        m = self.meta
        tokens = m.get("tokenizer.ggml.tokens")
        if not tokens:
            raise SourceError(f"{self.path} carries no tokenizer (tokenizer.ggml.tokens)")

        def opt(key):
            return m.get(f"tokenizer.ggml.{key}")

        return {
            "model": opt("model") or "gpt2",
            "pre": opt("pre") or "default",
            "tokens": tokens,
            "token_type": opt("token_type") or [1] * len(tokens),
            "scores": opt("scores"),
            "merges": opt("merges") or [],
            "bos_id": opt("bos_token_id"),
            "eos_id": opt("eos_token_id"),
            "eot_id": opt("eot_token_id"),
            "eom_id": opt("eom_token_id"),
            "unk_id": opt("unknown_token_id"),
            "pad_id": opt("padding_token_id"),
            "add_bos": bool(opt("add_bos_token")) if opt("add_bos_token") is not None else opt("model") == "llama",
            "add_eos": bool(opt("add_eos_token") or False),
            "add_space_prefix": opt("add_space_prefix"),
            "chat_template": m.get("tokenizer.chat_template"),
        }
