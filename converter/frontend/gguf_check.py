"""pinfer's reader of a GGUF file's header: a bounds-checking walk that returns the metadata and
the tensor directory.

gguf-py's GGUFReader trusts the counts and lengths it reads (a string array claiming 10^12 items
makes it loop for ever, a tensor claiming 10^12 elements makes NumPy try to map it) and builds a
NumPy view per field part: 10.3 s for a 41 MB GGUF with a 262k-token vocabulary (this walk, with
`pinfer inspect` around it: 0.5 s). This walk reads only
the header, checks every count, length, dimension, type and offset against the file size and sane
limits, raises one GGUFCheckError sentence naming what is wrong, and otherwise gives the values as
plain Python (strings decoded, arrays as lists) in one pass."""

import struct
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
POWERINFER_MAGIC = b"PWRI"      # PowerInfer's GGUF v3 files with predictors (frontend/powerinfer.py)
VERSIONS = (2, 3)
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 20
MAX_DIMS = 4                      # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 2
ALIGNMENT_KEY = "general.alignment"

# GGUF value type -> struct format of one scalar (string = 8, array = 9 handled apart)
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


class GGUFCheckError(ValueError):
    pass


class _Cursor:
    def __init__(self, f, size, path):
        self.f, self.size, self.path, self.pos = f, size, path, 0

    def fail(self, what):
        raise GGUFCheckError(f"{self.path} is not a valid GGUF file: {what} (at byte {self.pos}); "
                             "the file is damaged or not a GGUF model")

    def read(self, n):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"it needs {n} more bytes but the file ends at {self.size}: it is truncated")
        data = self.f.read(n)
        self.pos += n
        return data

    def skip(self, n):
        if n < 0 or self.pos + n > self.size:
            self.fail(f"a value of {n} bytes runs past the end of the file")
        self.f.seek(n, 1)
        self.pos += n

    def unpack(self, fmt):
        s = struct.Struct("<" + fmt)
        return s.unpack(self.read(s.size))[0]

    def string(self, what, keep=True, limit=1 << 20, strict=True):
        n = self.unpack("Q")
        if n > self.size - self.pos:
            self.fail(f"{what} claims {n} bytes, more than the file holds")
        if not keep or n > limit:
            self.skip(n)
            return None
        try:
            return self.read(n).decode("utf-8", errors="strict" if strict else "replace")
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")


def _value(c, vtype, key, depth=0):
    if vtype in SCALARS:
        return c.unpack(SCALARS[vtype])
    if vtype == STRING:
        return c.string(f"the value of {key!r}")
    if vtype == ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            c.fail(f"{key!r} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        itype, count = c.unpack("I"), c.unpack("Q")
        if itype in SCALARS:
            size = struct.calcsize("<" + SCALARS[itype])
            if count * size > c.size - c.pos:
                c.fail(f"the array {key!r} claims {count} items, more than the file holds")
            return list(struct.unpack(f"<{count}{SCALARS[itype]}", c.read(count * size)))
        if itype == STRING:
            if count * 8 > c.size - c.pos:
                c.fail(f"the array {key!r} claims {count} strings, more than the file holds")
            # a vocabulary's tokens: gguf-py decodes them leniently too (byte tokens of some files)
            return [c.string(f"an item of {key!r}", strict=False) for _ in range(count)]
        if itype == ARRAY:
            if count * 12 > c.size - c.pos:
                c.fail(f"the array {key!r} claims {count} arrays, more than the file holds")
            return [_value(c, ARRAY, key, depth + 1) for _ in range(count)]
        c.fail(f"the array {key!r} has unknown item type {itype}")
    c.fail(f"{key!r} has unknown value type {vtype}")


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    meta: dict              # key -> str, int, float, bool or a list of them
    tensors: dict           # name -> TensorEntry, in file order
    data_start: int         # where the tensor data begins (aligned)
    powerinfer: bool = False    # the PWRI magic


@dataclass(frozen=True)
class TensorEntry:
    dims: tuple             # GGUF order: fastest axis first
    ttype: GGMLQuantizationType
    offset: int             # from data_start
    nbytes: int


def read_header(path):
    """The GGUFHeader of `path`, every count, length and offset checked; or GGUFCheckError."""
    import os

    if not os.path.isfile(path):     # a FIFO or device would block the reads below
        raise GGUFCheckError(f"{path} is not a regular file; pass a GGUF model file")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        c = _Cursor(f, size, path)
        magic = c.read(4)
        if magic not in (MAGIC, POWERINFER_MAGIC):
            c.pos = 0
            c.fail("it does not start with the GGUF magic")
        version = c.unpack("I")
        if version not in VERSIONS:
            c.fail(f"version {version} is not one of {VERSIONS}")
        n_tensors, n_kv = c.unpack("Q"), c.unpack("Q")
        if n_tensors > MAX_TENSORS or n_kv > MAX_KV:
            c.fail(f"it claims {n_tensors} tensors and {n_kv} metadata keys")
        alignment, meta = 32, {}
        for _ in range(n_kv):
            key = c.string("a metadata key", limit=1 << 16)
            if not key:
                c.fail("a metadata key is empty or too long")
            meta[key] = v = _value(c, c.unpack("I"), key)
            if key == ALIGNMENT_KEY:
                if not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v & (v - 1) or v > 1 << 20:
                    c.fail(f"general.alignment is {v}, not a power of two")
                alignment = v
        names = set()
        tensors = [_tensor_entry(c, size, names) for _ in range(n_tensors)]
        data_start = (c.pos + alignment - 1) // alignment * alignment
        _check_spans(c, [(n, e.offset, e.nbytes) for n, e in tensors], data_start, alignment, size)
    return GGUFHeader(version, meta, dict(tensors), data_start, magic == POWERINFER_MAGIC)


def _tensor_entry(c, size, names):
    """(name, TensorEntry) of the next entry of the tensor table, checked."""
    name = c.string("a tensor name", limit=1 << 12)
    if not name or name in names:
        c.fail(f"tensor name {name!r} is empty, too long or repeated")
    names.add(name)
    n_dims = c.unpack("I")
    if not 1 <= n_dims <= MAX_DIMS:
        c.fail(f"tensor {name!r} has {n_dims} dimensions")
    dims = [c.unpack("Q") for _ in range(n_dims)]
    ttype, offset = c.unpack("I"), c.unpack("Q")
    try:
        block, nbytes_block = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
    except (ValueError, KeyError):
        c.fail(f"tensor {name!r} has unknown type {ttype}")
    n = 1
    for d in dims:
        if d == 0 or d > size * 8:
            c.fail(f"tensor {name!r} has dimension {d}")
        n *= d
    if dims[0] % block:
        c.fail(f"tensor {name!r} of shape {dims} does not fit type {GGMLQuantizationType(ttype).name}")
    nbytes = n // block * nbytes_block
    if nbytes > size:
        c.fail(f"tensor {name!r} needs {nbytes:,} bytes, more than the whole {size:,}-byte file: the file "
               "is truncated (an interrupted download?) or damaged")
    return name, TensorEntry(tuple(dims), GGMLQuantizationType(ttype), offset, nbytes)


def _check_spans(c, tensors, data_start, alignment, size):
    """Every tensor's data aligned, inside the file, and apart from the others."""
    spans = []
    for name, offset, nbytes in tensors:
        start = data_start + offset
        if offset % alignment or start + nbytes > size:
            c.pos = start
            c.fail(f"tensor {name!r} ({nbytes} bytes at offset {offset}) lies outside the file"
                   + (": it is truncated" if offset % alignment == 0 else ""))
        spans.append((start, start + nbytes, name))
    spans.sort()
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:
            c.fail(f"tensors {a!r} and {b!r} overlap")
