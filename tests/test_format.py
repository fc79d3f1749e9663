"""The .pinf container: round trip, atomic writing, strict validation, integrity checks."""

import json
import struct

from pathlib import Path

import numpy as np
import pytest
from conftest import map_rss

from pinfer.formats import PinfFormatError, PinfReader, PinfWriter
from pinfer.formats import schema as S
from pinfer.formats.writer import partial_path

HEADER = {k: {} for k in S.HEADER_KEYS if k != "tensors"}


def write_sample(path):
    rng = np.random.default_rng(0)
    arrays = {
        "a": rng.standard_normal((3, 5)).astype(np.float32),
        "b": rng.integers(0, 255, 1000, dtype=np.uint8),
        "c": rng.standard_normal(7).astype(np.float16),
        "empty": np.zeros((0, 4), np.float32),
    }
    with PinfWriter(path) as w:
        for n, a in arrays.items():
            w.add_tensor(n, a)
        w.finish(dict(HEADER, config={"hello": "wörld"}))
    return arrays


def test_round_trip_is_zero_copy_and_aligned(tmp_path):
    p = tmp_path / "m.pinf"
    arrays = write_sample(p)
    r = PinfReader(p, schema=False)
    assert r.header["config"] == {"hello": "wörld"}
    for n, a in arrays.items():
        t = r.tensor(n)
        np.testing.assert_array_equal(t, a)
        assert t.dtype == a.dtype and not t.flags.writeable
        assert r.tensors[n]["offset"] % S.ALIGNMENT == 0
    assert r.verify() == []
    assert not partial_path(p).exists()


def test_own_copies_and_release(tmp_path):
    """block(own=True) copies out of the map (what the kernels stream); release() lets go of the
    map's touched pages, and views read the same bytes again afterwards."""
    p = tmp_path / "m.pinf"
    rng = np.random.default_rng(1)
    parts = {"q": rng.integers(0, 255, (64, 16), dtype=np.uint8), "scale": rng.standard_normal((64, 1)).astype(np.float16)}
    with PinfWriter(p) as w:
        for name, a in parts.items():
            w.add_tensor(S.part_name("w", name), a)
        w.finish(dict(HEADER, weights={"w": "q4"}))
    r = PinfReader(p, schema=False)
    view = r.block("w")[1]
    fmt, own = r.block("w", own=True)
    assert fmt == "q4" and set(own) == {"q", "scale"}
    for name, a in parts.items():
        assert own[name].flags.owndata and own[name].flags.writeable and not np.shares_memory(own[name], view[name])
        np.testing.assert_array_equal(own[name], a)
    r.release()
    for name, a in parts.items():
        np.testing.assert_array_equal(view[name], a)
        np.testing.assert_array_equal(own[name], a)


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps (Linux)")
def test_release_of_one_tensor_lets_go_of_its_pages_only(tmp_path):
    """release(name): the pages of that tensor leave the process (a one-copy load lets go of down_t
    once W_down is made from it), its neighbours' stay, and both still read the same bytes."""
    p = tmp_path / "m.pinf"
    rng = np.random.default_rng(2)
    big = {"q": rng.integers(0, 255, (2048, 512), dtype=np.uint8), "scale": rng.standard_normal((2048, 16)).astype(np.float16)}
    small = {"q": rng.integers(0, 255, (64, 512), dtype=np.uint8), "scale": rng.standard_normal((64, 16)).astype(np.float16)}
    with PinfWriter(p) as w:
        for base, parts in (("a", big), ("b", small)):
            for name, a in parts.items():
                w.add_tensor(S.part_name(base, name), a)
        w.finish(dict(HEADER, weights={"a": "q4", "b": "q4"}))
    r = PinfReader(p, schema=False)
    a, b = r.block("a")[1], r.block("b")[1]
    assert int(a["q"].sum()) and int(b["q"].sum())      # touch every page of both
    before = map_rss(r)
    r.release(*(S.part_name("a", k) for k in a))
    after = map_rss(r)
    assert before - after >= a["q"].nbytes              # a's pages went (1 MB, page-aligned)
    assert after >= b["q"].nbytes                       # b's stayed
    for parts, want in ((a, big), (b, small)):
        for k in want:
            np.testing.assert_array_equal(parts[k], want[k])


def test_huge_copies_are_aligned_copies():
    """huge_copy: a writable copy, on a 2 MB boundary from one huge page up (where the kernel is
    asked for transparent huge pages), a plain copy below."""
    from pinfer.formats.reader import HUGE_PAGE, huge_copy
    a = np.arange(HUGE_PAGE // 2 + 5, dtype=np.float32).reshape(-1, 1)
    big = huge_copy(a)
    assert big.ctypes.data % HUGE_PAGE == 0 and not np.shares_memory(big, a)
    np.testing.assert_array_equal(big, a)
    small = huge_copy(a[:10])
    assert small.flags.owndata
    np.testing.assert_array_equal(small, a[:10])


def test_error_inside_writer_leaves_nothing(tmp_path):
    p = tmp_path / "m.pinf"
    with pytest.raises(RuntimeError):
        with PinfWriter(p) as w:
            w.add_tensor("a", np.zeros(10, np.float32))
            raise RuntimeError("boom")
    assert not p.exists() and not partial_path(p).exists()


def test_writer_refuses_wrong_order_and_bad_input(tmp_path):
    w = PinfWriter(tmp_path / "m.pinf")
    w.add_tensor("a", np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        w.add_tensor("a", np.zeros(2, np.float32))
    with pytest.raises(ValueError):
        w.add_tensor("f64", np.zeros(2, np.float64))
    with pytest.raises(ValueError):
        w.finish({"config": {}})
    w.finish(HEADER)
    with pytest.raises(RuntimeError):
        w.add_tensor("late", np.zeros(2, np.float32))


def _damage(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("what", ["magic", "version", "header_bounds", "header_checksum", "truncated", "empty"])
def test_damaged_preamble_and_header_give_one_error(tmp_path, what):
    p = tmp_path / "m.pinf"
    write_sample(p)
    if what == "magic":
        _damage(p, 0, b"GGUF")
    elif what == "version":
        _damage(p, 8, struct.pack("<I", 99))
    elif what == "header_bounds":
        _damage(p, 16, struct.pack("<Q", 1 << 40))
    elif what == "header_checksum":
        _, _, _, off, _, _ = S.PREAMBLE.unpack(p.read_bytes()[:S.PREAMBLE.size])
        _damage(p, off + 2, b"#")
    elif what == "truncated":
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2])
    else:
        p.write_bytes(b"")
    with pytest.raises(PinfFormatError) as e:
        PinfReader(p, schema=False)
    msg = str(e.value)
    assert "\n" not in msg and str(p.name) in msg


def _rewrite_header(path, edit):
    """Re-write the header after `edit(header)` with a valid checksum, to reach directory checks."""
    data = bytearray(path.read_bytes())
    magic, ver, res, off, length, _ = S.PREAMBLE.unpack(bytes(data[:S.PREAMBLE.size]))
    header = json.loads(bytes(data[off:off + length]))
    edit(header)
    blob = json.dumps(header).encode()
    import hashlib
    data = data[:off] + blob
    data[:S.PREAMBLE.size] = S.PREAMBLE.pack(magic, ver, res, off, len(blob), hashlib.sha256(blob).digest())
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("edit", [
    lambda h: h["tensors"]["a"].update(offset=h["tensors"]["b"]["offset"]),           # overlap
    lambda h: h["tensors"]["a"].update(offset=-4096),                                  # negative
    lambda h: h["tensors"]["a"].update(offset=4097),                                   # misaligned
    lambda h: h["tensors"]["b"].update(shape=[10 ** 12], nbytes=10 ** 12),             # huge
    lambda h: h["tensors"]["a"].update(dtype="q3"),                                    # unknown dtype
    lambda h: h["tensors"]["a"].update(shape=[3, 6]),                                  # size mismatch
    lambda h: h.pop("config"),                                                          # missing key
])
def test_bad_directory_entries_are_refused(tmp_path, edit):
    p = tmp_path / "m.pinf"
    write_sample(p)
    _rewrite_header(p, edit)
    with pytest.raises(PinfFormatError):
        PinfReader(p, schema=False)


def test_verify_names_the_damaged_tensor(tmp_path):
    p = tmp_path / "m.pinf"
    write_sample(p)
    r = PinfReader(p, schema=False)
    off = r.tensors["b"]["offset"] + 17
    r.close()
    _damage(p, off, b"\xff" if p.read_bytes()[off] != 0xFF else b"\x00")
    assert PinfReader(p, schema=False).verify() == ["b"]


def _resident_share(path):
    """The share of a file's pages in the page cache (mincore(2) over a map of it)."""
    import ctypes
    import mmap
    import os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                             ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        libc.munmap(ctypes.c_void_p(addr), size)
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec) / pages


def _fs_type(path):
    best, kind = "", ""
    for line in open("/proc/mounts"):
        mount, fs = line.split()[1], line.split()[2]
        if str(path).startswith(mount) and len(mount) > len(best):
            best, kind = mount, fs
    return kind


@pytest.mark.skipif(not Path("/proc/mounts").exists(), reason="reads /proc/mounts and calls mincore (Linux)")
def test_finish_drops_a_large_file_from_the_page_cache(tmp_path, monkeypatch):
    """A finished file of at least writer.DROP_CACHE_MIN bytes leaves the page cache (it is on disk
    after the fsync), so that its first read caches it again in large folios (the runtime's map
    then takes 2 MB pages); a smaller one stays cached as written."""
    from pinfer.formats import writer
    if _fs_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("the test's directory is on a file system in memory, whose pages cannot be dropped")
    a = np.random.default_rng(0).integers(0, 255, 8 << 20, dtype=np.uint8)
    for floor, name in ((1 << 40, "kept.pinf"), (0, "dropped.pinf")):
        monkeypatch.setattr(writer, "DROP_CACHE_MIN", floor)
        with PinfWriter(tmp_path / name) as w:
            w.add_tensor("a", a)
            w.finish(dict(HEADER))
    assert _resident_share(tmp_path / "kept.pinf") > 0.9
    assert _resident_share(tmp_path / "dropped.pinf") < 0.1
    np.testing.assert_array_equal(PinfReader(tmp_path / "dropped.pinf", schema=False).tensor("a"), a)


def test_a_file_cut_short_after_open_is_one_sentence_when_copied(tmp_path):
    """--no-mmap reads each weight into the process's memory with preadv: a file truncated after it
    was opened (and checked) gives one sentence there, not the SIGBUS that reading its map would."""
    p = tmp_path / "m.pinf"
    write_sample(p)
    r = PinfReader(p, schema=False)
    offset = r.tensors["b"]["offset"]
    with open(p, "r+b") as f:
        f.truncate(offset + 10)
    with pytest.raises(PinfFormatError, match="the file ends inside tensor 'b'"):
        r._own("b")
