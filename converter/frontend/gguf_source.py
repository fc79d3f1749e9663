"""GGUF front end: metadata and lazily dequantized tensors from a memory-mapped GGUF file."""

import hashlib
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from pinfer.formats import blocks

from .gguf_check import GGUFCheckError, read_header


class SourceError(ValueError):
    pass


@dataclass(frozen=True)
class SourceTensor:
    name: str
    ttype: object        # gguf.GGMLQuantizationType
    rows: int            # numpy-order shape (rows, k); 1-D tensors have rows == 1
    k: int
    raw: np.ndarray      # view of the memory map


# GGUF types gguf-py maps as typed arrays (the others are blocks of bytes, (rows, bytes per row))
_TYPED = {Q.F32: np.float32, Q.F16: np.float16, Q.F64: np.float64, Q.I8: np.int8, Q.I16: np.int16,
          Q.I32: np.int32, Q.I64: np.int64}


class GGUFSource:
    """One GGUF model file: its header through pinfer's own checked walk (gguf_check.read_header),
    its tensors as views of one memory map. Nothing is read from the tensors until asked for."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            h = read_header(self.path)
        except GGUFCheckError as e:
            raise SourceError(str(e)) from None
        except OSError as e:
            raise SourceError(f"{self.path} could not be read ({e.strerror or e}); pass a .gguf model file") from None
        self.meta, self._tensors, self._start = h.meta, h.tensors, h.data_start
        self._map = None
        # PowerInfer files hold W_down transposed (blk.N.ffn_down_t: a row per neuron, groups along
        # d_model), which is pinfer's down_t: it is offered under the ffn_down role's name, floats()
        # transposes it back, and the back end carries its blocks over as down_t (down_t_block)
        self.powerinfer = h.powerinfer
        self.down_neuron_major = h.powerinfer   # the ffn_down role holds down_t, a row per neuron
        self._rows = {}           # name -> (stored name, first row, end row): split_rows
        self._down_t = {}
        if h.powerinfer:
            for name in list(self._tensors):
                if name.endswith(".ffn_down_t.weight"):
                    self._down_t[name.replace(".ffn_down_t.", ".ffn_down.")] = name

    def _data(self):
        if self._map is None:
            self._map = np.memmap(self.path, np.uint8, "r")
        return self._map

    @property
    def architecture(self):
        arch = self.meta.get("general.architecture")
        if not isinstance(arch, str):
            raise SourceError(f"{self.path} has no general.architecture key; it is not a model GGUF")
        return arch

    def tensor_names(self):
        return set(self._tensors) | set(self._down_t) | set(self._rows)

    def split_rows(self, splits):
        """Offer row ranges of stored tensors under names of their own (phi3's fused projections):
        {name: (stored name, first row, end row)}; a range that is not inside its tensor is refused."""
        for name, (stored, r0, r1) in splits.items():
            t = self._tensors.get(stored)
            if t is None:
                raise SourceError(f"{self.path} lacks the tensor {stored}")
            rows = int(np.prod(t.dims[1:])) if len(t.dims) > 1 else 1
            if not 0 <= r0 < r1 <= rows:
                raise SourceError(f"{self.path}: {stored} has {rows} rows, not the {r1} the model's "
                                  f"configuration implies; the file is inconsistent")
        self._rows = dict(splits)

    def down_t_block(self, name):
        """(format, parts) of down_t (n_ff, d_model), exactly, from a PowerInfer file's ffn_down_t
        offered as `name`; None where its type has no exact .pinf format."""
        t = self.tensor(self._down_t[name])
        return blocks.from_gguf(t.ttype, t.raw, t.rows, t.k)

    def tensor(self, name):
        """The stored tensor (a PowerInfer file's ffn_down role: its ffn_down_t, a row per neuron)."""
        stored, t, r0, r1 = self._resolve(name)
        k = t.dims[0]          # GGUF order: fastest axis first
        rows = int(np.prod(t.dims[1:])) if len(t.dims) > 1 else 1
        raw = self._data()[self._start + t.offset:self._start + t.offset + t.nbytes]
        raw = raw.view(_TYPED[t.ttype]).reshape(rows, k) if t.ttype in _TYPED else raw.reshape(rows, -1)
        if r1 is None:
            return SourceTensor(stored, t.ttype, rows, k, raw)
        return SourceTensor(name, t.ttype, r1 - r0, k, raw[r0:r1])

    def _resolve(self, name):
        """(stored name, its header entry, first row, end row) of `name`; rows None: all of it."""
        stored, r0, r1 = self._rows.get(name, (self._down_t.get(name, name), 0, None))
        t = self._tensors.get(stored)
        if t is None:
            raise SourceError(f"{self.path} lacks the tensor {stored}")
        return stored, t, r0, r1

    def nbytes(self, name):
        _, t, r0, r1 = self._resolve(name)
        return t.nbytes if r1 is None else t.nbytes * (r1 - r0) // int(np.prod(t.dims[1:]))

    def ttype(self, name):
        return self._resolve(name)[1].ttype

    def block(self, name):
        """(format, parts) carried over exactly where a .pinf format matches the GGUF type."""
        t = self.tensor(name)
        return blocks.from_gguf(t.ttype, t.raw, t.rows, t.k)

    def floats(self, name):
        t = self.tensor(name)
        w = blocks.dequantize_gguf(t.ttype, t.raw, t.rows, t.k)
        return np.ascontiguousarray(w.T) if name in self._down_t else w

    def release(self):
        """Drop the file's pages from this process's resident set (they are re-read on demand), so
        that streaming through the layers does not accumulate the whole file in RSS."""
        m = getattr(self._map, "_mmap", None)
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
