"""Reads a `.pinf` file through a memory map, validating everything before it is used."""

import hashlib
import json
import math
import mmap
import os
import stat
from pathlib import Path

import numpy as np

from . import schema as S
from .schema import PinfFormatError


class PinfReader:
    """schema: check the header as a model's (types, bounds: schema.header_problem); False
    reads the container alone, for the format's own tests. mapped: block(own=True) gives views of
    the map too, and release() of the whole map does nothing (the map's pages are the weights)."""

    def __init__(self, path, schema=True, mapped=False):
        self.path, self.schema, self.mapped = Path(path), schema, mapped
        try:
            if not stat.S_ISREG(self.path.stat().st_mode):     # a FIFO or device would block the read
                raise PinfFormatError(f"{self.path} is not a regular file; pass a .pinf file")
            f = open(self.path, "rb")
        except OSError as e:
            raise PinfFormatError(f"cannot open {self.path}: {e.strerror}; check the path") from None
        with f:
            self.size = self.path.stat().st_size
            if self.size < S.PREAMBLE_SIZE:
                raise PinfFormatError(f"{self.path} is {self.size} bytes, too short for a .pinf file; "
                                      "it is truncated or not a .pinf file")
            self._mm = _map(f.fileno())
            self._fd = os.dup(f.fileno())       # the same file as the map, for reads (_own)
        self.header = self._read_header()
        self.tensors = self.header["tensors"]
        self._check_directory()

    # -- validation -------------------------------------------------------------------------
    def _fail(self, what):
        raise PinfFormatError(f"{self.path}: {what}; re-run `pinfer convert` to make a new file")

    def _read_header(self):
        magic, version, _, off, length, digest = S.PREAMBLE.unpack_from(self._mm, 0)
        if magic != S.MAGIC:
            raise PinfFormatError(f"{self.path} does not start with the .pinf magic (found {magic[:8]!r}); "
                                  "pass a file written by `pinfer convert`")
        if version != S.FORMAT_VERSION:
            why = (" (version 1 files carry ONNX graphs, which this pinfer no longer runs: it builds its own)"
                   if version == 1 else "")
            raise PinfFormatError(f"{self.path} is .pinf format version {version}, this pinfer reads "
                                  f"version {S.FORMAT_VERSION}{why}; convert the model again with this pinfer")
        if not (S.PREAMBLE_SIZE <= off and length <= S.MAX_HEADER_BYTES and off + length <= self.size):
            self._fail(f"the header (offset {off}, {length} bytes) lies outside the {self.size}-byte file")
        blob = self._mm[off:off + length]
        if hashlib.sha256(blob).digest() != digest:
            self._fail("the header checksum does not match (the file is damaged)")
        try:
            header = json.loads(blob)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"the header is not valid JSON ({e})")
        except RecursionError:
            self._fail("the header is JSON nested too deeply")
        if not isinstance(header, dict) or any(k not in header for k in S.HEADER_KEYS):
            self._fail(f"the header lacks some of the keys {list(S.HEADER_KEYS)}")
        problem = S.header_problem(header) if self.schema else None
        if problem:
            self._fail(problem)
        self.data_end = off
        self.header_end = off + length
        return header

    def _check_directory(self):
        d = self.tensors
        if not isinstance(d, dict) or len(d) > S.MAX_TENSORS:
            self._fail("the tensor directory is malformed")
        spans = []
        for name, e in d.items():
            try:
                dtype = S.DTYPES[e["dtype"]]
                shape = e["shape"]
                off, nbytes = e["offset"], e["nbytes"]
                ok = (isinstance(shape, list) and len(shape) <= S.MAX_DIMS
                      and all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= S.MAX_DIM for n in shape)
                      and isinstance(off, int) and isinstance(nbytes, int) and 0 <= nbytes <= self.size
                      and isinstance(e["sha256"], str))
            except (KeyError, TypeError):
                ok = False
            if not ok:
                self._fail(f"tensor {name!r} has a malformed directory entry")
            if nbytes != math.prod(shape) * dtype.itemsize:      # exact: Python's integers do not wrap
                self._fail(f"tensor {name!r} claims {nbytes} bytes for shape {shape} {e['dtype']}")
            if off % S.ALIGNMENT or off < S.ALIGNMENT or off + nbytes > self.data_end:
                self._fail(f"tensor {name!r} at offset {off} (+{nbytes}) is misaligned or outside the data")
            spans.append((off, off + nbytes, name))
        spans.sort()
        for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
            if start < end:
                self._fail(f"tensors {a!r} and {b!r} overlap")

    # -- access ------------------------------------------------------------------------------
    def __contains__(self, name):
        return name in self.tensors

    def tensor(self, name):
        """A read-only NumPy view of the memory map (no copy)."""
        e = self.tensors.get(name)
        if e is None:
            self._fail(f"the tensor {name!r} is missing")
        a = np.frombuffer(self._mm, S.DTYPES[e["dtype"]], count=e["nbytes"] // S.DTYPES[e["dtype"]].itemsize,
                          offset=e["offset"])
        return a.reshape(e["shape"])

    def block(self, base, own=False):
        """The parts of a block-format weight `base` as a dict part -> array, plus its format.
        own: copies in the process's own memory instead of views of the map (see release())."""
        fmt = self.header["weights"].get(base)
        if fmt not in S.BLOCK_FORMATS:
            self._fail(f"the weight {base!r} has unknown block format {fmt!r}")
        get = self._own if own and not self.mapped else self.tensor
        return fmt, {p: get(S.part_name(base, p)) for p in S.BLOCK_FORMATS[fmt]
                     if S.part_name(base, p) in self.tensors}

    def _own(self, name):
        """A copy of tensor `name` in huge pages (huge_empty), read from the file straight into it:
        reading through the map instead faulted in every 4 KB page of it, then let them go."""
        e = self.tensors[name]
        out = huge_empty(e["shape"], S.DTYPES[e["dtype"]])
        view, done = memoryview(out.reshape(-1).view(np.uint8)), 0
        while done < e["nbytes"]:
            got = os.preadv(self._fd, [view[done:]], e["offset"] + done)
            if got <= 0:
                self._fail(f"the file ends inside tensor {name!r} (it changed since it was opened)")
            done += got
        return out

    def release(self, *names):
        """Let go of the map's pages this process has touched (madvise DONTNEED), or only those of
        the tensors `names`: they stay in the page cache, and a later read of a view faults them in
        again. After the runtime has copied what its kernels stream (block(own=True): read into huge
        pages, not through the map) and ONNX Runtime has packed its own, the copies do not count twice
        in the process's memory."""
        if not hasattr(mmap, "MADV_DONTNEED") or (self.mapped and not names):
            return
        if not names:
            self._mm.madvise(mmap.MADV_DONTNEED)
        for name in names:
            e, page = self.tensors[name], mmap.PAGESIZE     # the tensor's pages: S.ALIGNMENT keeps them its own
            start = -(-e["offset"] // page) * page
            end = min(-(-(e["offset"] + e["nbytes"]) // page) * page, len(self._mm))
            if end > start:
                self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def verify(self, progress=None):
        """Check every byte: each tensor against its checksum, and the padding around them (which
        the writer fills with zeros). Returns the names of the damaged sections; the header was
        already checked when the file was opened. `progress(nbytes)` is called as data is read."""
        def nonzero(a, b):
            return b > a and self._mm[a:b].count(0) != b - a

        bad = []
        if nonzero(S.PREAMBLE.size, S.ALIGNMENT):
            bad.append("preamble padding")
        pos = S.ALIGNMENT
        for name, e in sorted(self.tensors.items(), key=lambda kv: kv[1]["offset"]):
            if nonzero(pos, e["offset"]):
                bad.append(f"padding before {name}")
            h = hashlib.sha256(memoryview(self._mm)[e["offset"]:e["offset"] + e["nbytes"]]).hexdigest()
            if h != e["sha256"]:
                bad.append(name)
            pos = e["offset"] + e["nbytes"]
            if progress:
                progress(e["nbytes"])
        if nonzero(pos, self.data_end):
            bad.append("padding before the header")
        if self.header_end != self.size:
            bad.append("bytes after the header")
        return bad

    def _close_fd(self):
        if getattr(self, "_fd", -1) >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = _close_fd

    def close(self):
        self._close_fd()
        try:
            self._mm.close()
        except BufferError:
            pass  # NumPy views still alive; the map closes when they go


HUGE_PAGE = 2 << 20


def _map(fd):
    """The whole file mapped read-only. Private (MAP_PRIVATE; nothing writes through it): the C
    kernels read a shared map's pages more slowly (7B-shaped Q4_0 on 2 threads, Intel Xeon; the
    private map decodes as the copies do, docs/benchmarks.md). MADV_HUGEPAGE: where the kernel keeps a
    file's page cache in large folios (ext4 on Linux 6.18 does), the map's faults take whole 2 MB
    folios, as the kernels' copies in huge pages do, and reading a file not yet cached makes them."""
    mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass        # a kernel without transparent huge pages: 4 KB pages, as before
    return mm


def huge_empty(shape, dtype):
    """An uninitialized array in private anonymous memory that the kernel is asked to back with
    transparent huge pages (madvise HUGEPAGE, from a 2 MB boundary; systems set to "madvise", a
    common default, give them only when asked). Arrays under one huge page are plain ones."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(shape, dtype)
    mm = mmap.mmap(-1, nbytes + 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)          # before the first touch: faults then take huge pages
    raw = np.frombuffer(mm, np.uint8)
    start = -raw.ctypes.data % HUGE_PAGE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def huge_copy(a):
    """A copy of `a` in huge pages (huge_empty). pinfer's kernels stream weights:
    `benchmarks/row_dots.py` reads 96 MB of 4096-wide q4 rows at 21.9 GB/s from huge pages and 15.0
    GB/s from 4 KB pages (1 thread, 2-core EPYC; 11008-wide rows 26.0 against 16.0)."""
    a = np.asarray(a)
    out = huge_empty(a.shape, a.dtype)
    out[...] = a
    return out
