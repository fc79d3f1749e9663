"""pinfer's C down-projection kernel against NumPy on the same block-format weights."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants

from pinfer.formats import blocks
from pinfer.kernels import DownProjection

RNG = np.random.default_rng(3)


def down_weights(fmt, n, d):
    """(parts, dense W (n, d)) for a neuron-major down_t in `fmt`."""
    w = RNG.standard_normal((d, n)).astype(np.float32)  # W_down as GGUF stores it, groups along n
    if fmt in ("q4r", "q8r", "q4r-nomin"):
        qt = {"q4r": Q.Q4_1, "q8r": Q.Q8_0, "q4r-nomin": Q.Q4_0}[fmt]
        f, parts = blocks.from_gguf_transposed(qt, quants.quantize(w, qt), d, n)
        ref = quants.dequantize(quants.quantize(w, qt), qt).reshape(d, n).T
        return f, parts, np.ascontiguousarray(ref)
    parts = blocks.quantize(fmt, w.T.copy())
    return fmt, parts, blocks.dequantize(fmt, parts)


@pytest.mark.parametrize("fmt", ["q8", "q4", "q8r", "q4r", "q4r-nomin", "f16", "f32"])
@pytest.mark.parametrize("S", [1, 3, 4, 9])
@pytest.mark.parametrize("n, d", [(64, 96), (96, 1088)])
def test_down_matches_numpy_and_is_thread_independent(fmt, S, n, d):
    f, parts, W = down_weights(fmt, n, d)
    h = RNG.standard_normal((S, n)).astype(np.float32)
    ref = h.astype(np.float64) @ W.astype(np.float64)
    outs = []
    for threads in (1, 2, 3):
        y = np.full((S, d), np.nan, np.float32)
        DownProjection(f, parts, threads, n, d).bind(h, y)()
        outs.append(y)
    np.testing.assert_allclose(outs[0], ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    for y in outs[1:]:
        np.testing.assert_array_equal(y, outs[0])


def test_zero_activations_give_zero():
    f, parts, _ = down_weights("q4r", 64, 64)
    y = np.ones((1, 64), np.float32)
    DownProjection(f, parts, 1, 64, 64).bind(np.zeros((1, 64), np.float32), y)()
    assert not y.any()


def test_boundary_checks():
    f, parts, _ = down_weights("q8r", 64, 64)
    with pytest.raises(ValueError):
        DownProjection(f, parts, 1, 64, 96)
    k = DownProjection(f, parts, 1, 64, 64)
    with pytest.raises(ValueError):
        k.bind(np.zeros((1, 64), np.float64), np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="not q3"):
        DownProjection("q3", {}, 1, 64, 64)
    with pytest.raises(ValueError, match="scale missing"):
        DownProjection("q4", {"q": np.zeros((64, 32), np.uint8)}, 1, 64, 64)


@pytest.mark.parametrize("fmt", ["q8r", "q4r", "q4r-nomin"])
@pytest.mark.parametrize("S", [1, 5])
def test_matmul_down_matches_numpy_within_int8_activations(fmt, S):
    """The runtime's MatMulNBits down projection, rebuilt from down_t: the same product, with h
    quantized to int8 per block of 32 (one step is 1/127 of the block's largest |h|)."""
    from pinfer.runtime.ort import MatMulDown
    n, d = 96, 160
    f, parts, W = down_weights(fmt, n, d)
    h = RNG.standard_normal((S, n)).astype(np.float32)
    ref = h.astype(np.float64) @ W.astype(np.float64)
    y = np.full((S, d), np.nan, np.float32)
    MatMulDown(f, parts, 1, n, d).bind(h, y)()
    err = np.abs(y - ref).max() / np.abs(ref).max()
    print(f"{fmt} S={S}: max |y - ref| / max |ref| = {err:.1e}")
    assert err <= 2e-2
    assert np.corrcoef(y.ravel(), ref.ravel())[0, 1] > 0.9999


def test_matmul_down_refuses_formats_without_groups_along_n():
    from pinfer.runtime.ort import MatMulDown
    f, parts, _ = down_weights("q8", 64, 96)
    with pytest.raises(ValueError, match="not a transposed"):
        MatMulDown(f, parts, 1, 64, 96)


@pytest.mark.parametrize("fmt", ["q8r", "q4r", "q4r-nomin"])
@pytest.mark.parametrize("n, d", [(96, 160), (160, 96), (64, 64), (32, 288), (224, 32)])
def test_untranspose_in_c_is_the_numpy_transpose_exactly(fmt, n, d):
    """MatMulDown and one-copy loads rebuild W_down (d, n_ff) from down_t in C (kernels.untranspose_r):
    byte for byte what formats.blocks.from_transposed_r gives, over shapes that are and are not whole
    tiles (16 input rows by 128 values: UNT_J, UNT_I in ffn_down.c), into the arrays the `empty`
    argument makes (huge pages in the runtime)."""
    from pinfer.formats import blocks
    from pinfer.formats.reader import huge_empty
    from pinfer.kernels import untranspose_r
    f, parts, _ = down_weights(fmt, n, d)
    parts = {k: a for k, a in parts.items()}
    parts["q"] = RNG.integers(0, 256, parts["q"].shape, dtype=np.uint8)   # every nibble pattern
    want_fmt, want = blocks.from_transposed_r(f, parts)
    got_fmt, got = untranspose_r(f, parts, empty=huge_empty)
    assert got_fmt == want_fmt and got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].flags.c_contiguous
        np.testing.assert_array_equal(got[k], want[k])


def test_importing_pinfer_leaves_the_environment_as_it_was():
    """Children (llama.cpp in the benchmarks) inherit the environment: pinfer must not change it. The
    kernels run on their own thread pool (csrc/pool.c), so no OpenMP runtime is loaded, whose
    settings could only be made through the environment."""
    import subprocess
    import sys
    code = ("import os; before = dict(os.environ); import numpy as np, pinfer.kernels as k, pinfer.runtime.model, "
            "pinfer.cli.main; k.sparse_isa(); "
            "h, y, w = np.ones((1, 64), np.float32), np.empty((1, 96), np.float32), np.ones((64, 96), np.float32); "
            "k.DownProjection('f32', {'w': w}, 2, 64, 96).bind(h, y)(); assert (y == 64).all(); "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "assert 'libgomp' not in open('/proc/self/maps').read()")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_thread_pool_serves_concurrent_callers_and_forked_children():
    """ctypes releases the GIL, so Python threads (the server's) may call the kernels at once: each
    call takes the pool in turn and gets its own result, the bits of a one-thread call (every output
    element is one thread's sum in a fixed order). A child forked after the pool started has none
    of its workers; its first call on two threads starts its own instead of waiting on the parent's
    (the child is a process with a time limit, so a hang fails the test)."""
    import subprocess
    import sys
    import threading
    n, d = 256, 2048
    f, parts, _ = down_weights("q4r", n, d)
    hs = [RNG.standard_normal((3, n)).astype(np.float32) for _ in range(4)]
    want = []
    for h in hs:
        y = np.empty((3, d), np.float32)
        DownProjection(f, parts, 1, n, d).bind(h, y)()
        want.append(y)
    errors = []

    def caller(i):
        y = np.empty((3, d), np.float32)
        run = DownProjection(f, parts, 2, n, d).bind(hs[i], y)
        for _ in range(200):
            y[:] = np.nan
            run()
            if not np.array_equal(y, want[i]):
                errors.append(i)
                return
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    code = ("import os, numpy as np, pinfer.kernels as k\n"
            "w = np.ones((64, 96), np.float32); h = np.ones((1, 64), np.float32); y = np.zeros((1, 96), np.float32)\n"
            "k.DownProjection('f32', {'w': w}, 2, 64, 96).bind(h, y)()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    y[:] = 0; k.DownProjection('f32', {'w': w}, 2, 64, 96).bind(h, y)(); os._exit(0 if (y == 64).all() else 3)\n"
            "_, status = os.waitpid(pid, 0); assert os.waitstatus_to_exitcode(status) == 0, status\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
