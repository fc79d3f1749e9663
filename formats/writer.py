"""Writes a `.pinf` file: tensors stream out as they are made, the header goes last.

The writer is a small state machine (open -> tensors -> finished) that refuses calls in the wrong
order. It writes to `<dest>.partial` (created afresh: see create_new), fsyncs and renames, so the
destination either holds a complete file or is untouched.
"""

import hashlib
import json
import os
import stat
from pathlib import Path

import numpy as np

from . import schema as S


DROP_CACHE_MIN = 64 << 20     # bytes: smaller files are read again from the cache as written


def partial_path(dest):
    dest = Path(dest)
    return dest.with_name(dest.name + ".partial")


def create_new(path):
    """A file object writing a file that this call creates at `path`. Whatever sits at that name
    (a file left by a killed run, or a symlink someone planted there) is removed, never followed:
    unlink removes a link, not its target, and O_EXCL|O_NOFOLLOW refuses to open anything this
    call did not just create. A directory there is an error."""
    path = Path(path)
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise IsADirectoryError(f"{path} is a directory; remove it or write the output elsewhere")
        path.unlink()
    except FileNotFoundError:
        pass
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    return os.fdopen(os.open(path, flags, 0o644), "wb")


class PinfWriter:
    """replace: whether finish() may replace a file that exists at dest by then (False: it refuses,
    atomically, even if the file appeared while this one was being written)."""

    def __init__(self, dest, replace=True):
        self.dest, self.replace = Path(dest), replace
        self.tmp = partial_path(self.dest)
        self._f = create_new(self.tmp)
        self._f.write(b"\0" * S.ALIGNMENT)  # preamble slot, filled in by finish()
        self._dir = {}
        self._state = "open"

    def add_tensor(self, name, array):
        """Append one tensor; returns its directory entry."""
        self._require("open")
        if name in self._dir:
            raise ValueError(f"tensor {name!r} was already written")
        a = np.ascontiguousarray(array)
        code = S.DTYPE_CODES.get(a.dtype.newbyteorder("<") if a.dtype.byteorder == ">" else a.dtype)
        if code is None:
            raise ValueError(f"tensor {name!r} has dtype {a.dtype}, which .pinf does not store")
        a = a.astype(S.DTYPES[code], copy=False)
        offset = S.align(self._f.tell())
        self._f.write(b"\0" * (offset - self._f.tell()))
        data = memoryview(a.reshape(-1).view(np.uint8))
        self._f.write(data)
        entry = {
            "dtype": code,
            "shape": list(a.shape),
            "offset": offset,
            "nbytes": a.nbytes,
            "sha256": hashlib.sha256(data).hexdigest(),
        }
        self._dir[name] = entry
        return entry

    @property
    def directory(self):
        """name -> directory entry of every tensor written so far."""
        return self._dir

    def add_bytes(self, name, blob):
        return self.add_tensor(name, np.frombuffer(blob, np.uint8))

    def finish(self, header):
        """Write `header` (every key of schema.HEADER_KEYS but "tensors") and publish the file."""
        self._require("open")
        missing = [k for k in S.HEADER_KEYS if k != "tensors" and k not in header]
        unknown = [k for k in header if k not in S.HEADER_KEYS or k == "tensors"]
        if missing or unknown:
            raise ValueError(f"header keys missing {missing} / not allowed {unknown}")
        full = dict(header, tensors=self._dir)
        blob = json.dumps(full, separators=(",", ":"), ensure_ascii=False).encode()
        header_offset = S.align(self._f.tell(), 8)
        self._f.write(b"\0" * (header_offset - self._f.tell()))
        self._f.write(blob)
        size = self._f.tell()
        pre = S.PREAMBLE.pack(S.MAGIC, S.FORMAT_VERSION, 0, header_offset, len(blob),
                              hashlib.sha256(blob).digest())
        self._f.seek(0)
        self._f.write(pre.ljust(S.PREAMBLE_SIZE, b"\0"))
        self._f.flush()
        os.fsync(self._f.fileno())
        if size >= DROP_CACHE_MIN and hasattr(os, "posix_fadvise"):
            # The page cache keeps written data in 4 KB pages; dropped now (the data is on disk), the
            # first read (the verification's, a load's) caches it again in large folios where the
            # file system makes them, which the runtime's map then takes as 2 MB pages (reader._map).
            try:
                os.posix_fadvise(self._f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass        # advice only: the file is complete either way
        self._f.close()
        if self.replace:
            os.replace(self.tmp, self.dest)
        else:
            self._publish_new()
        self._state = "finished"
        return self.dest

    def _publish_new(self):
        """Give the finished file its name only if the name is free: a hard link fails when the
        destination exists (a check then a rename would leave a moment to lose a file)."""
        try:
            os.link(self.tmp, self.dest)
        except FileExistsError:
            self._state = "finished"
            self.tmp.unlink(missing_ok=True)
            raise FileExistsError(f"{self.dest} appeared while the file was being written; it was left as it is "
                                  "(pass --force to overwrite it)") from None
        except OSError:      # a file system without hard links
            if self.dest.exists():
                self.tmp.unlink(missing_ok=True)
                raise FileExistsError(f"{self.dest} appeared while the file was being written; it was left as "
                                      "it is (pass --force to overwrite it)") from None
            os.replace(self.tmp, self.dest)
            return
        self.tmp.unlink()

    def abort(self):
        if self._state == "open":
            self._f.close()
            self.tmp.unlink(missing_ok=True)
            self._state = "aborted"

    def _require(self, state):
        if self._state != state:
            raise RuntimeError(f"PinfWriter is {self._state}, expected {state}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.abort()  # no-op after finish(); removes the partial file on any error
        return False
