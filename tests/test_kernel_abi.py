"""The numbers Python and the C kernels share (issue 41): the codes of pinfer/kernels/csrc/codes.h and
the sizes of the structs pinfer/kernels mirrors with ctypes agree, and loading a library built from
other sources fails with one sentence."""

import ctypes
import re

import pytest

from pinfer import kernels
from pinfer.formats import schema as S
from pinfer.kernels import decode

STALE = "pinfer's C library was built from other sources than this Python code: "


def test_the_codes_and_struct_sizes_agree_with_the_library():
    lib = kernels._load()           # checks them itself; compared here once more, name by name
    expected = kernels.abi()
    assert set(kernels.FORMAT_CODES) == set(S.BLOCK_FORMATS)
    assert {f"mode.{m}" for m in S.MODES} | {"sizeof.ffn_call_t", "sizeof.attn_call_t"} <= set(expected)
    there = {name: lib.pinfer_abi(name.encode()) for name in expected}
    assert there == expected
    assert lib.pinfer_abi(b"fmt.nothing") == -1


def test_a_changed_code_fails_the_load(monkeypatch):
    monkeypatch.setitem(kernels.FORMAT_CODES, "q4", 6)
    with pytest.raises(ImportError, match=re.escape(STALE + "fmt.q4 is 5 there and 6 here; reinstall pinfer")):
        kernels._load()
    monkeypatch.setattr(kernels, "ACTIVATIONS", ("relu", "silu", "gelu"))
    with pytest.raises(ImportError) as e:
        kernels._load()
    assert str(e.value) == (STALE + "fmt.q4 is 5 there and 6 here, act.relu is 1 there and 0 here, "
                            "act.silu is 0 there and 1 here; reinstall pinfer")


def test_a_changed_struct_fails_the_load(monkeypatch):
    lib = kernels._load()
    call, linear = (lib.pinfer_abi(f"sizeof.{t}".encode()) for t in ("ffn_call_t", "linear_t"))

    class Call(ctypes.Structure):       # ffn_call_t without its last field (rows_t wd)
        _fields_ = kernels._Call._fields_[:-1]

    class Linear(ctypes.Structure):     # linear_t with a field too many
        _fields_ = decode._Linear._fields_ + [("extra", ctypes.c_int64)]
    monkeypatch.setattr(kernels, "_Call", Call)
    monkeypatch.setattr(decode, "_Linear", Linear)
    with pytest.raises(ImportError) as e:
        kernels.check_abi(lib)
    assert str(e.value) == (STALE + f"sizeof.ffn_call_t is {call} there and {call - 40} here, "
                            f"sizeof.linear_t is {linear} there and {linear + 8} here; reinstall pinfer")


def test_a_library_without_the_abi_function_is_stale():
    class Old:      # a library built before pinfer_abi
        pass
    with pytest.raises(ImportError, match=re.escape(STALE + "it has no pinfer_abi; reinstall pinfer")):
        kernels.check_abi(Old())


def test_the_gpu_cache_key_follows_the_codes(tmp_path, monkeypatch):
    pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed (pip install '.[test]')")
    gpu = pytest.importorskip("pinfer.kernels.gpu")
    first = gpu.compile_kernels(75, cache=tmp_path)
    changed = tmp_path / "codes.h"
    changed.write_bytes(gpu.HEADER.read_bytes() + b"\n/* changed */\n")
    monkeypatch.setattr(gpu, "HEADER", changed)
    second = gpu.compile_kernels(75, cache=tmp_path)
    assert not second.cached and second.path != first.path and second.image == first.image
